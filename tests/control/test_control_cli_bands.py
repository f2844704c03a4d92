"""``output-rate-ctl`` and priority bands: ``--band NAME`` / ``--no-band`` set
and clear a holder's ``band`` (user entries, tiers, teams, the default through
``update-default``), every output shows it (``BAND``), a bad name is a usage
error in the band rule's words, a band that is not one of the table's bands is
refused by the server naming the field, export and import carry the bands,
the objectives and every holder's band, and ``state`` shows the band of each
user while there are bands."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from tests.cli_harness import entry

BANDS = ("interactive", "standard", "batch")
UNKNOWN = "unknown band 'gold' (bands: interactive, standard, batch)"


@pytest.fixture
def banded(rig):
    """The rig's table with ``BANDS``, the default in ``standard``."""
    shared = rig.shared
    with shared.lock:
        policy = shared.policy
        shared.policy = dataclasses.replace(
            policy,
            default=dataclasses.replace(policy.default, band="standard"),
            bands=BANDS,
        )
    return rig


def band_of(rig, user: str) -> str:
    """The band the band table puts ``user`` in ("": no bands)."""
    shared = rig.shared
    with shared.lock:
        bands = shared.bands
        tier, team = shared.limiter.tier_of(user), shared.teams.team_of(user)
        return bands.name_of(bands.index_of(user, tier, team))


def test_update_sets_and_clears_a_users_band(ctl, banded):
    status, out, _ = ctl("--json", "update", "alice", "--band", "batch")
    assert (status, json.loads(out)) == (0, entry("alice", 5, band="batch"))
    assert band_of(banded, "alice") == "batch"
    assert banded.limiter.rate_of("alice") == 5  # the rate is its own
    assert ctl("get", "alice")[1].splitlines() == [
        "USER   TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S   BAND  TEAM",
        "alice         5     -      no       -         -       -  batch     -",
    ]
    status, out, _ = ctl("--json", "update", "alice", "--no-band")
    assert (status, json.loads(out)) == (0, entry("alice", 5))
    assert band_of(banded, "alice") == "standard"


def test_a_band_alone_makes_a_user_entry(ctl, banded):
    status, out, _ = ctl(
        "--json", "update", "carol", "--band", "interactive", "--allow-missing"
    )
    assert (status, json.loads(out)) == (0, entry("carol", None, band="interactive"))
    assert ctl("update", "carol", "--no-band")[:2] == (
        0,
        "carol has no entry left (the default applies)\n",
    )


@pytest.mark.parametrize(
    ("create", "update", "get"),
    [
        (["create-tier", "free", "5"], ["update-tier", "free"], ["get-tier", "free"]),
        (
            ["teams", "create", "free", "60"],
            ["teams", "update", "free"],
            ["teams", "get", "free"],
        ),
    ],
    ids=["tiers", "teams"],
)
def test_groups_take_a_band_on_create_and_update(ctl, banded, create, update, get):
    status, out, _ = ctl("--json", *create, "--band", "batch")
    assert status == 0
    assert json.loads(out)["band"] == "batch"
    membership = "--tier" if create[0] == "create-tier" else "--team"
    ctl("update", "m", membership, "free", "--allow-missing")
    assert band_of(banded, "m") == "batch"
    status, out, _ = ctl(*update, "--band", "interactive")
    assert status == 0
    header, row = out.splitlines()
    assert header.split()[-2:] == ["BAND", "MEMBERS"]
    assert row.split()[-2:] == ["interactive", "1"]
    assert band_of(banded, "m") == "interactive"
    status, out, _ = ctl("--json", *update, "--no-band")
    assert status == 0
    assert json.loads(out)["band"] is None  # the group stays
    assert json.loads(ctl("--json", *get)[1])["tokens_per_second"] in (5, 60)
    assert band_of(banded, "m") == "standard"


def test_a_band_alone_does_not_make_a_tier(ctl, banded):
    status, out, err = ctl("create-tier", "free", "--band", "batch")
    assert (status, out) == (2, "")
    assert "create-tier needs a RATE, --exempt or both" in err
    assert banded.shared.policy.groups["tier"] == {}


def test_update_default_sets_the_default_band_and_keeps_it_while_there_are_bands(
    ctl, banded
):
    status, out, _ = ctl("update-default", "--band", "batch")
    assert (status, out) == (0, "default: 10 tokens/s\ndefault band: batch\n")
    assert band_of(banded, "nobody") == "batch"
    status, out, _ = ctl("--json", "get-default")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 10,
        "default_prompt_tokens_per_second": None,
        "default_ceiling_tokens_per_second": None,
        "default_band": "batch",
    }
    # set-default changes the rate alone; the band stays.
    status, out, _ = ctl("--json", "set-default", "20")
    assert (status, json.loads(out)["default_band"]) == (0, "batch")
    status, out, err = ctl("update-default", "--no-band")
    assert (status, out) == (1, "")
    assert err == (
        "error: INVALID_ARGUMENT: default_limit.band: needs band (one of bands: "
        "the band of users no holder puts in one)\n"
    )
    assert band_of(banded, "nobody") == "batch"


def test_without_bands_the_default_shows_none_and_no_band_may_be_named(ctl, rig):
    assert ctl("get-default")[1] == "default: 10 tokens/s\n"
    assert json.loads(ctl("--json", "get-default")[1])["default_band"] is None
    status, out, err = ctl("update-default", "--band", "batch")
    assert (status, out) == (1, "")
    assert err == (
        "error: INVALID_ARGUMENT: default_limit.band: unknown band 'batch' "
        "(bands: none are set)\n"
    )
    assert ctl("update-default", "--no-band")[:2] == (0, "default: 10 tokens/s\n")


def test_the_band_and_its_clear_are_exclusive(ctl, banded):
    status, out, err = ctl("update", "alice", "--band", "batch", "--no-band")
    assert (status, out) == (2, "")
    assert "not allowed with argument --band" in err


@pytest.mark.parametrize(
    ("command", "field"),
    [
        (["update", "alice"], "limit.band"),
        (["create-tier", "free", "5"], "tier.band"),
        (["teams", "create", "acme", "60"], "team.band"),
        (["update-default"], "default_limit.band"),
    ],
    ids=["user", "tier", "team", "default"],
)
def test_a_band_not_in_the_bands_exits_1_invalid_argument_naming_it(
    ctl, banded, command, field
):
    status, out, err = ctl(*command, "--band", "gold")
    assert (status, out) == (1, "")
    assert err == f"error: INVALID_ARGUMENT: {field}: {UNKNOWN}\n"
    assert band_of(banded, "alice") == "standard"
    assert banded.shared.policy.groups == {"tier": {}, "team": {}}


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("", "band name must not be empty"),
        ("a\x01", "band name must not contain control characters"),
    ],
    ids=["empty", "control-character"],
)
@pytest.mark.parametrize(
    "command",
    [
        ["update", "alice"],
        ["create-tier", "free", "5"],
        ["teams", "update", "acme"],
        ["update-default"],
    ],
    ids=" ".join,
)
def test_a_bad_band_name_is_a_usage_error_in_the_rules_words(
    ctl, banded, command, value, said
):
    status, out, err = ctl(*command, "--band", value)
    assert (status, out) == (2, "")
    prog = " ".join(["output-rate-ctl", *command[: 2 if command[0] == "teams" else 1]])
    assert err == f"{prog}: error: argument --band: {said} (see {prog} --help)\n"


def test_a_numeric_band_name_is_a_name(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text(
        json.dumps(
            {"default_tokens_per_second": 10, "default": {"band": "1"}, "bands": ["1"]}
        )
    )
    assert ctl("import", "--force", str(path))[0] == 0
    status, out, _ = ctl("--json", "update", "alice", "--band", "1", "--allow-missing")
    assert (status, json.loads(out)["band"]) == (0, "1")


def test_the_help_names_the_band_options(ctl):
    status, out, _ = ctl("update", "--help")
    assert status == 0
    assert "--band NAME" in out
    assert "--no-band" in out


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_export_then_import_carries_the_bands_objectives_and_every_band(
    ctl, rig, tmp_path, fmt
):
    source = tmp_path / "source.json"
    source.write_text(
        json.dumps(
            {
                "default_tokens_per_second": 10,
                "default": {"band": "standard"},
                "bands": list(BANDS),
                "objectives": {"chat": "interactive", "bulk": "batch"},
                "tiers": {"free": {"tokens_per_second": 5, "band": "batch"}},
                "teams": {"acme": {"tokens_per_second": 60, "band": "interactive"}},
                "users": {
                    "alice": {"tokens_per_second": 5, "band": "interactive"},
                    "bob": 20,
                    "m": {"tier": "free", "team": "acme"},
                },
            }
        )
    )
    status, _, err = ctl("import", "--force", str(source))
    assert (status, err) == (0, "")
    expected = {"alice": "interactive", "bob": "standard", "m": "batch"}
    assert {user: band_of(rig, user) for user in expected} == expected
    exported = tmp_path / f"table.{fmt}"
    assert ctl("export", str(exported))[0] == 0
    doc = (json.loads if fmt == "json" else yaml.safe_load)(exported.read_text())
    assert doc["bands"] == list(BANDS)
    assert doc["objectives"] == {"bulk": "batch", "chat": "interactive"}
    assert doc["default"] == {"band": "standard"}
    assert doc["users"]["alice"] == {"tokens_per_second": 5, "band": "interactive"}
    assert doc["users"]["bob"] == 20  # the number form, as before
    assert doc["tiers"]["free"] == {"tokens_per_second": 5, "band": "batch"}
    assert doc["teams"]["acme"] == {"tokens_per_second": 60, "band": "interactive"}
    # Changed since: the import puts back what was exported.
    ctl("update", "alice", "--no-band")
    ctl("update-tier", "free", "--band", "interactive")
    status, _, err = ctl("import", "--force", str(exported))
    assert (status, err) == (0, "")
    assert {user: band_of(rig, user) for user in expected} == expected
    with rig.shared.lock:
        assert dict(rig.shared.bands.objectives) == {"chat": 0, "bulk": 2}
    again = tmp_path / f"again.{fmt}"
    ctl("export", str(again))
    reread = (json.loads if fmt == "json" else yaml.safe_load)(again.read_text())
    assert {k: v for k, v in reread.items() if k != "etag"} == {
        k: v for k, v in doc.items() if k != "etag"
    }


def test_an_import_naming_an_unknown_band_is_refused(ctl, banded, tmp_path):
    path = tmp_path / "table.json"
    path.write_text(
        json.dumps(
            {
                "default_tokens_per_second": 10,
                "default": {"band": "standard"},
                "bands": list(BANDS),
                "users": {"alice": {"band": "gold"}},
            }
        )
    )
    status, _, err = ctl("import", str(path))
    assert (status, err) == (
        1,
        f"error: INVALID_ARGUMENT: {path}: users.alice.band: {UNKNOWN}\n",
    )
    assert band_of(banded, "alice") == "standard"


def test_state_shows_the_band_while_there_are_bands(ctl, rig):
    rig.step("alice")
    lines = ctl("state")[1].splitlines()
    assert "BAND" not in lines[1]  # no bands: the table as before
    assert json.loads(ctl("--json", "state", "alice")[1])["band"] is None
    with rig.shared.lock:
        policy = rig.shared.policy
        rig.shared.policy = dataclasses.replace(
            policy,
            default=dataclasses.replace(policy.default, band="standard"),
            bands=BANDS,
        )
    ctl("update", "alice", "--band", "interactive")
    status, out, _ = ctl("state")
    assert status == 0
    lines = out.splitlines()
    header = lines[1].split()
    assert header[header.index("LATE") + 1] == "BAND"
    rows = {
        line.split()[0]: dict(zip(header, line.split(), strict=True))
        for line in lines[2:]
    }
    assert {user: row["BAND"] for user, row in rows.items()} == {
        "alice": "interactive",
        "bob": "standard",
    }
    got = json.loads(ctl("--json", "state", "alice")[1])
    assert got["band"] == "interactive"
