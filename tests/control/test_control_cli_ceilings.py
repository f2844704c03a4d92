"""``output-rate-ctl`` and ceilings: ``--ceiling N`` / ``--no-ceiling`` set and
clear a holder's ``ceiling_tokens_per_second`` (user entries, tiers, the
default through ``update-default``; not teams), every output shows it
(``CEIL/S``), bad values are usage errors in the rate rule's words, a ceiling
below the rate is refused by the server naming the ceiling, export and import
carry it, and ``state`` shows the ceiling and the tokens borrowed while any
user has a ceiling."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.cli_harness import entry

RULE = "must be an integer in 1..1000000 (tokens per second), got"


def ceilings(rig) -> dict[str, int]:
    """What the ceilings' table holds: the default's, alice's, a member of
    tier free's (m)."""
    shared = rig.shared
    with shared.lock:
        table = shared.ceilings.table
        return {user: table.rate_of(user) for user in ("nobody", "alice", "m")}


def test_update_sets_and_clears_a_users_ceiling(ctl, rig):
    status, out, _ = ctl("--json", "update", "alice", "--ceiling", "50")
    assert (status, json.loads(out)) == (0, entry("alice", 5, ceiling=50))
    assert ceilings(rig)["alice"] == 50
    assert rig.limiter.rate_of("alice") == 5  # the rate is its own
    assert ctl("get", "alice")[1].splitlines() == [
        "USER   TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  TEAM",
        "alice         5     -      no       -         -      50     -     -",
    ]
    status, out, _ = ctl("--json", "update", "alice", "--no-ceiling")
    assert (status, json.loads(out)) == (0, entry("alice", 5))
    assert ceilings(rig)["alice"] == 0


def test_a_ceiling_alone_makes_a_user_entry(ctl, rig):
    status, out, _ = ctl(
        "--json", "update", "carol", "--ceiling", "50", "--allow-missing"
    )
    assert (status, json.loads(out)) == (0, entry("carol", None, ceiling=50))
    assert ctl("update", "carol", "--no-ceiling")[:2] == (
        0,
        "carol has no entry left (the default applies)\n",
    )


def test_tiers_take_a_ceiling_on_create_and_update(ctl, rig):
    status, out, _ = ctl("--json", "create-tier", "free", "5", "--ceiling", "20")
    assert status == 0
    assert json.loads(out)["ceiling_tokens_per_second"] == 20
    ctl("assign", "m", "free")
    assert ceilings(rig)["m"] == 20
    status, out, _ = ctl("update-tier", "free", "--ceiling", "30")
    assert status == 0
    assert out.splitlines() == [
        "TIER  TOKENS/S  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  MEMBERS",
        "free         5      no       -         -      30     -        1",
    ]
    assert ceilings(rig)["m"] == 30
    status, out, _ = ctl("--json", "update-tier", "free", "--no-ceiling")
    assert (status, json.loads(out)["tokens_per_second"]) == (0, 5)  # the tier stays
    assert json.loads(out)["ceiling_tokens_per_second"] is None
    assert ceilings(rig)["m"] == 0


def test_a_ceiling_alone_does_not_make_a_tier(ctl, rig):
    status, out, err = ctl("create-tier", "free", "--ceiling", "20")
    assert (status, out) == (2, "")
    assert "create-tier needs a RATE, --exempt or both" in err
    assert rig.shared.policy.groups["tier"] == {}


def test_teams_create_update_and_clear_a_ceiling(ctl, rig):
    status, out, _ = ctl("--json", "teams", "create", "acme", "60", "--ceiling", "100")
    assert (status, json.loads(out)["ceiling_tokens_per_second"]) == (0, 100)
    assert rig.shared.ceilings.team_ceilings == {"acme": 100}
    status, out, _ = ctl("--json", "teams", "update", "acme", "--ceiling", "120")
    assert (status, json.loads(out)["ceiling_tokens_per_second"]) == (0, 120)
    assert rig.shared.ceilings.team_ceilings == {"acme": 120}
    status, out, _ = ctl("--json", "teams", "update", "acme", "--no-ceiling")
    assert (status, json.loads(out)["ceiling_tokens_per_second"]) == (0, None)
    assert json.loads(out)["tokens_per_second"] == 60  # the team stays
    assert rig.shared.ceilings.team_ceilings == {}


def test_update_default_sets_and_clears_the_default_ceiling(ctl, rig):
    status, out, _ = ctl("update-default", "--ceiling", "40")
    assert (status, out) == (0, "default: 10 tokens/s\ndefault ceiling: 40 tokens/s\n")
    assert ceilings(rig)["nobody"] == 40
    status, out, _ = ctl("--json", "get-default")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 10,
        "default_prompt_tokens_per_second": None,
        "default_ceiling_tokens_per_second": 40,
        "default_band": None,
    }
    # set-default changes the rate alone; the ceiling stays.
    status, out, _ = ctl("--json", "set-default", "20")
    assert status == 0
    assert json.loads(out)["default_ceiling_tokens_per_second"] == 40
    status, out, _ = ctl("--json", "update-default", "--rate", "30", "--no-ceiling")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 30,
        "default_prompt_tokens_per_second": None,
        "default_ceiling_tokens_per_second": None,
        "default_band": None,
    }
    assert (rig.limiter.default_rate, ceilings(rig)["nobody"]) == (30, 0)
    assert ctl("get-default")[1] == "default: 30 tokens/s\n"


def test_the_ceiling_and_its_clear_are_exclusive(ctl, rig):
    status, out, err = ctl("update", "alice", "--ceiling", "50", "--no-ceiling")
    assert (status, out) == (2, "")
    assert "not allowed with argument --ceiling" in err
    assert ceilings(rig)["alice"] == 0


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["update", "alice", "--ceiling", "3"],
            "limit.ceiling_tokens_per_second: must be at least tokens_per_second "
            "(5), got 3",
        ),
        (
            ["update", "bob", "--rate", "30", "--ceiling", "25"],
            "limit.ceiling_tokens_per_second: must be at least tokens_per_second "
            "(30), got 25",
        ),
        (
            ["create-tier", "free", "50", "--ceiling", "40"],
            "tier.ceiling_tokens_per_second: must be at least tokens_per_second "
            "(50), got 40",
        ),
        (
            ["update-default", "--ceiling", "9"],
            "default_limit.ceiling_tokens_per_second: must be at least "
            "tokens_per_second (10), got 9",
        ),
    ],
    ids=["user", "user-rate-and-ceiling", "tier", "default"],
)
def test_a_ceiling_below_the_rate_exits_1_invalid_argument_naming_it(
    ctl, rig, command, message
):
    status, out, err = ctl(*command)
    assert (status, out) == (1, "")
    assert err == f"error: INVALID_ARGUMENT: {message}\n"
    assert ceilings(rig) == {"nobody": 0, "alice": 0, "m": 0}
    assert rig.limiter.user_rates == {"alice": 5, "bob": 20}


def test_raising_a_rate_above_its_ceiling_is_refused(ctl, rig):
    ctl("update-default", "--ceiling", "40")
    status, _, err = ctl("set-default", "50")
    assert status == 1
    assert err == (
        "error: INVALID_ARGUMENT: default_limit.ceiling_tokens_per_second: must "
        "be at least tokens_per_second (50), got 40\n"
    )
    assert rig.limiter.default_rate == 10


@pytest.mark.parametrize("value", ["0", "-1", "1000001", "fast"])
@pytest.mark.parametrize(
    "command",
    [
        ["update", "alice"],
        ["create-tier", "free", "5"],
        ["update-tier", "free"],
        ["update-default"],
    ],
    ids=" ".join,
)
def test_a_bad_ceiling_is_a_usage_error_in_the_rules_words(ctl, rig, command, value):
    status, out, err = ctl(*command, "--ceiling", value)
    assert (status, out) == (2, "")
    shown = repr(value) if value == "fast" else value
    prog = f"output-rate-ctl {command[0]}"
    assert err == (
        f"{prog}: error: argument --ceiling: {RULE} {shown} (see {prog} --help)\n"
    )
    assert ceilings(rig) == {"nobody": 0, "alice": 0, "m": 0}


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_export_then_import_carries_every_ceiling(ctl, rig, tmp_path, fmt):
    ctl("update-default", "--ceiling", "40")
    ctl("update", "alice", "--ceiling", "50")
    ctl("create-tier", "free", "5", "--ceiling", "20")
    ctl("update", "m", "--tier", "free", "--allow-missing")
    exported = tmp_path / f"table.{fmt}"
    assert ctl("export", str(exported))[0] == 0
    doc = (json.loads if fmt == "json" else yaml.safe_load)(exported.read_text())
    assert doc["default"] == {"ceiling_tokens_per_second": 40}
    assert doc["users"]["alice"] == {
        "tokens_per_second": 5,
        "ceiling_tokens_per_second": 50,
    }
    assert doc["users"]["bob"] == 20  # the number form, as before
    assert doc["tiers"]["free"] == {
        "tokens_per_second": 5,
        "ceiling_tokens_per_second": 20,
    }
    expected = {"nobody": 40, "alice": 50, "m": 20}
    assert ceilings(rig) == expected
    # Changed since: the import puts back what was exported.
    ctl("update-default", "--no-ceiling")
    ctl("update", "alice", "--no-ceiling")
    ctl("update-tier", "free", "--ceiling", "9")
    status, _, err = ctl("import", "--force", str(exported))
    assert (status, err) == (0, "")
    assert ceilings(rig) == expected
    again = tmp_path / f"again.{fmt}"
    ctl("export", str(again))
    reread = (json.loads if fmt == "json" else yaml.safe_load)(again.read_text())
    assert {k: v for k, v in reread.items() if k != "etag"} == {
        k: v for k, v in doc.items() if k != "etag"
    }


def test_import_of_a_file_without_a_default_rate_keeps_the_default_but_its_ceiling(
    ctl, rig, tmp_path
):
    ctl("update-default", "--ceiling", "40")
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"users": {"alice": 5}}))
    assert ctl("import", str(path))[0] == 0
    assert (rig.limiter.default_rate, ceilings(rig)["nobody"]) == (10, 40)
    path.write_text(
        json.dumps(
            {"default": {"ceiling_tokens_per_second": 60}, "users": {"alice": 5}}
        )
    )
    assert ctl("import", str(path))[0] == 0
    assert (rig.limiter.default_rate, ceilings(rig)["nobody"]) == (10, 60)


def test_an_import_with_a_ceiling_below_its_rate_is_refused(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text(
        json.dumps(
            {
                "users": {
                    "alice": {"tokens_per_second": 5, "ceiling_tokens_per_second": 4}
                }
            }
        )
    )
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert "users.alice.ceiling_tokens_per_second: must be at least" in err
    assert ceilings(rig)["alice"] == 0


def test_state_shows_the_ceiling_while_any_user_has_one(ctl, rig):
    rig.step("alice")
    lines = ctl("state")[1].splitlines()
    assert "CEIL/S" not in lines[1]  # no ceiling: the table as before
    status, out, _ = ctl("--json", "state", "alice")
    assert status == 0
    got = json.loads(out)
    assert (
        got["ceiling_tokens_per_second"],
        got["borrowed_tokens"],
        got["may_borrow"],
    ) == (0, 0, False)
    ctl("update", "alice", "--ceiling", "25")
    shared = rig.shared
    with shared.lock:
        now = rig.clock()
        shared.limiter.take_up_to("alice", 100, now)  # her own budget spent
        borrowed, _ = shared.budget.take_up_to("alice", 100, now)
        assert borrowed > 0
        shared.ceilings.borrowing.lend_to({"bob"})  # bob waits within his rate
    status, out, _ = ctl("state")
    assert status == 0
    lines = out.splitlines()
    header = lines[1].split()
    assert header[header.index("LATE") + 1 :] == ["CEIL/S", "BORROWED", "MAY_BORROW"]
    rows = {
        line.split()[0]: dict(zip(header, line.split(), strict=True))
        for line in lines[2:]
    }
    assert [rows["alice"][title] for title in header[-3:]] == [
        "25",
        str(borrowed),
        "no",
    ]
    assert [rows["bob"][title] for title in header[-3:]] == ["0", "0", "yes"]
    status, out, _ = ctl("--json", "state", "alice")
    got = json.loads(out)
    assert (got["limit_tokens_per_second"], got["ceiling_tokens_per_second"]) == (5, 25)
    assert (got["borrowed_tokens"], got["may_borrow"]) == (borrowed, False)
