"""``output-rate-ctl`` and prompt budgets: ``--prompt-rate N`` / ``--no-prompt-rate``
set and clear a holder's ``prompt_tokens_per_second`` (user entries, tiers,
teams, the default through ``update-default``), every output shows it
(``PROMPT/S``), bad values are usage errors in the rate rule's words, export
and import carry it, and ``state`` shows the prompt budget beside the output
budget."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.cli_harness import entry

RULE = "must be an integer in 1..1000000 (tokens per second), got"


def prompt_rates(rig) -> dict[str, object]:
    """What the prompt tables hold: the default's, alice's, a member of tier
    free's (m), team acme's."""
    shared = rig.shared
    with shared.lock:
        limiter = shared.prompt.limiter
        return {
            "default": limiter.rate_of("nobody"),
            "alice": limiter.rate_of("alice"),
            "m": limiter.rate_of("m"),
            "acme": shared.prompt.teams.table.rate_of("acme"),
        }


def test_update_sets_and_clears_a_users_prompt_rate(ctl, rig):
    status, out, _ = ctl("--json", "update", "alice", "--prompt-rate", "1500")
    assert (status, json.loads(out)) == (0, entry("alice", 5, prompt_rate=1500))
    assert rig.shared.prompt.limiter.rate_of("alice") == 1500
    assert rig.limiter.rate_of("alice") == 5  # the output rate is its own
    assert ctl("get", "alice")[1].splitlines() == [
        "USER   TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  TEAM",
        "alice         5     -      no       -      1500       -     -     -",
    ]
    status, out, _ = ctl("--json", "update", "alice", "--no-prompt-rate")
    assert (status, json.loads(out)) == (0, entry("alice", 5))
    assert rig.shared.prompt.limiter.rate_of("alice") == 0


def test_a_prompt_rate_alone_makes_a_user_entry(ctl, rig):
    status, out, _ = ctl(
        "--json", "update", "carol", "--prompt-rate", "1500", "--allow-missing"
    )
    assert (status, json.loads(out)) == (0, entry("carol", None, prompt_rate=1500))
    assert ctl("update", "carol", "--no-prompt-rate")[:2] == (
        0,
        "carol has no entry left (the default applies)\n",
    )


def test_tiers_and_teams_take_a_prompt_rate_on_create_and_update(ctl, rig):
    status, out, _ = ctl("--json", "create-tier", "free", "5", "--prompt-rate", "200")
    assert status == 0
    assert json.loads(out)["prompt_tokens_per_second"] == 200
    ctl("assign", "m", "free")
    assert prompt_rates(rig)["m"] == 200
    ctl("update-tier", "free", "--prompt-rate", "300")
    assert prompt_rates(rig)["m"] == 300
    status, out, _ = ctl("teams", "create", "acme", "600", "--prompt-rate", "4000")
    assert status == 0
    assert out.splitlines() == [
        "TEAM  TOKENS/S  WEIGHT  PROMPT/S  CEIL/S  BAND  MEMBERS",
        "acme       600       -      4000       -     -        0",
    ]
    assert prompt_rates(rig)["acme"] == 4000
    status, out, _ = ctl("--json", "teams", "update", "acme", "--no-prompt-rate")
    assert (status, json.loads(out)["prompt_tokens_per_second"]) == (0, None)
    assert json.loads(out)["tokens_per_second"] == 600
    assert prompt_rates(rig)["acme"] is None
    status, out, _ = ctl("--json", "update-tier", "free", "--no-prompt-rate")
    assert (status, json.loads(out)["tokens_per_second"]) == (0, 5)  # the tier stays
    assert prompt_rates(rig)["m"] == 0


def test_update_default_sets_and_clears_the_default_prompt_rate(ctl, rig):
    status, out, _ = ctl("update-default", "--prompt-rate", "3000")
    assert (status, out) == (
        0,
        "default: 10 tokens/s\ndefault prompt rate: 3000 prompt tokens/s\n",
    )
    assert prompt_rates(rig)["default"] == 3000
    status, out, _ = ctl("--json", "get-default")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 10,
        "default_prompt_tokens_per_second": 3000,
        "default_ceiling_tokens_per_second": None,
        "default_band": None,
    }
    # set-default changes the rate alone; the prompt rate stays.
    status, out, _ = ctl("--json", "set-default", "20")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 20,
        "default_prompt_tokens_per_second": 3000,
        "default_ceiling_tokens_per_second": None,
        "default_band": None,
    }
    status, out, _ = ctl("--json", "update-default", "--rate", "30", "--no-prompt-rate")
    assert status == 0
    assert json.loads(out) == {
        "default_tokens_per_second": 30,
        "default_prompt_tokens_per_second": None,
        "default_ceiling_tokens_per_second": None,
        "default_band": None,
    }
    assert (rig.limiter.default_rate, prompt_rates(rig)["default"]) == (30, 0)
    assert ctl("get-default")[1] == "default: 30 tokens/s\n"


def test_update_default_without_an_option_is_a_usage_error_and_sends_nothing(ctl, rig):
    status, out, err = ctl("update-default")
    assert (status, out) == (2, "")
    assert err == (
        "output-rate-ctl: error: update-default needs --rate, --prompt-rate, "
        "--no-prompt-rate, --ceiling, --no-ceiling, --band or --no-band\n"
    )
    status, _, err = ctl("update-default", "--no-rate")
    assert status == 2
    assert "unrecognized arguments: --no-rate" in err  # the rate stays: pacing on
    assert rig.limiter.default_rate == 10


@pytest.mark.parametrize("value", ["0", "-1", "1000001", "fast"])
@pytest.mark.parametrize(
    "command",
    [
        ["update", "alice"],
        ["create-tier", "free", "5"],
        ["update-tier", "free"],
        ["teams", "create", "acme", "60"],
        ["teams", "update", "acme"],
        ["update-default"],
    ],
    ids=" ".join,
)
def test_a_bad_prompt_rate_is_a_usage_error_in_the_rules_words(
    ctl, rig, command, value
):
    status, out, err = ctl(*command, "--prompt-rate", value)
    assert (status, out) == (2, "")
    shown = repr(value) if value == "fast" else value
    prog = " ".join(["output-rate-ctl", *command[: 2 if command[0] == "teams" else 1]])
    assert err == (
        f"{prog}: error: argument --prompt-rate: {RULE} {shown} (see {prog} --help)\n"
    )
    assert prompt_rates(rig) == {"default": 0, "alice": 0, "m": 0, "acme": None}


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_export_then_import_carries_every_prompt_rate(ctl, rig, tmp_path, fmt):
    ctl("update-default", "--prompt-rate", "3000")
    ctl("update", "alice", "--prompt-rate", "1500")
    ctl("create-tier", "free", "5", "--prompt-rate", "200")
    ctl("teams", "create", "acme", "600", "--prompt-rate", "4000")
    ctl("update", "m", "--tier", "free", "--team", "acme", "--allow-missing")
    exported = tmp_path / f"table.{fmt}"
    assert ctl("export", str(exported))[0] == 0
    doc = (json.loads if fmt == "json" else yaml.safe_load)(exported.read_text())
    assert doc["default"] == {"prompt_tokens_per_second": 3000}
    assert doc["users"]["alice"] == {
        "tokens_per_second": 5,
        "prompt_tokens_per_second": 1500,
    }
    assert doc["users"]["bob"] == 20  # the number form, as before
    assert doc["tiers"]["free"] == {
        "tokens_per_second": 5,
        "prompt_tokens_per_second": 200,
    }
    assert doc["teams"]["acme"] == {
        "tokens_per_second": 600,
        "prompt_tokens_per_second": 4000,
    }
    expected = {"default": 3000, "alice": 1500, "m": 200, "acme": 4000}
    assert prompt_rates(rig) == expected
    # Changed since: the import puts back what was exported.
    ctl("update-default", "--no-prompt-rate")
    ctl("update", "alice", "--no-prompt-rate")
    ctl("update-tier", "free", "--prompt-rate", "9")
    ctl("teams", "update", "acme", "--no-prompt-rate")
    status, _, err = ctl("import", "--force", str(exported))
    assert (status, err) == (0, "")
    assert prompt_rates(rig) == expected
    again = tmp_path / f"again.{fmt}"
    ctl("export", str(again))
    reread = (json.loads if fmt == "json" else yaml.safe_load)(again.read_text())
    assert {k: v for k, v in reread.items() if k != "etag"} == {
        k: v for k, v in doc.items() if k != "etag"
    }


def test_import_of_a_file_without_a_default_rate_keeps_the_default_but_its_prompt_rate(
    ctl, rig, tmp_path
):
    ctl("update-default", "--prompt-rate", "3000")
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"users": {"alice": 5}}))
    assert ctl("import", str(path))[0] == 0
    assert (rig.limiter.default_rate, prompt_rates(rig)["default"]) == (10, 3000)
    path.write_text(
        json.dumps({"default": {"prompt_tokens_per_second": 50}, "users": {"alice": 5}})
    )
    assert ctl("import", str(path))[0] == 0
    assert (rig.limiter.default_rate, prompt_rates(rig)["default"]) == (10, 50)


def test_state_shows_the_prompt_budget_while_any_user_has_one(ctl, rig):
    rig.step("alice")
    lines = ctl("state")[1].splitlines()
    assert "PROMPT/S" not in lines[1]  # no prompt budget: the table as before
    status, out, _ = ctl("--json", "state", "alice")
    assert status == 0
    assert {k: v for k, v in json.loads(out).items() if k.startswith("prompt_")} == {
        "prompt_limit_tokens_per_second": 0,
        "prompt_tat_lead_s": 0.0,
        "prompt_next_token_in_s": 0.0,
        "prompt_tokens_charged": 0,
        "prompt_held_skips": 0,
        "prompt_shadow_holds": 0,
        "prompt_wait_s": 0.0,
    }
    ctl("update", "alice", "--prompt-rate", "100")
    shared = rig.shared
    with shared.lock:
        shared.prompt.limiter.take_up_to("alice", 101, rig.clock())
        rig.accounting.record("alice", "prompt_tokens_charged", 101)
        rig.accounting.record("alice", "prompt_held_skips", 4)
        rig.accounting.record("alice", "prompt_wait_ns", 1_500_000_000)
    status, out, _ = ctl("state")
    assert status == 0
    lines = out.splitlines()
    header = lines[1].split()
    assert header[header.index("LATE") + 1 :] == [
        "PROMPT/S",
        "P_NEXT_IN",
        "P_TAT_LEAD",
        "P_CHARGED",
        "P_HELD",
        "P_SHADOW",
        "P_WAIT",
    ]
    rows = {
        line.split()[0]: dict(zip(header, line.split(), strict=True))
        for line in lines[2:]
    }
    assert [rows["alice"][title] for title in header[-7:]] == [
        "100",
        "10ms",
        "1010ms",
        "101",
        "4",
        "0",
        "1500ms",
    ]
    assert [rows["bob"][title] for title in header[-7:]] == [
        "0",
        "0ms",
        "0ms",
        "0",
        "0",
        "0",
        "0ms",
    ]
    status, out, _ = ctl("--json", "state", "alice")
    assert status == 0
    got = json.loads(out)
    assert (got["prompt_limit_tokens_per_second"], got["limit_tokens_per_second"]) == (
        100,
        5,
    )
    assert got["prompt_tat_lead_s"] == pytest.approx(1.01)
    assert got["prompt_next_token_in_s"] == pytest.approx(0.01)
    assert (got["prompt_tokens_charged"], got["prompt_held_skips"]) == (101, 4)
    assert got["prompt_wait_s"] == pytest.approx(1.5)


def test_teams_state_shows_the_teams_prompt_rate(ctl, rig):
    ctl("teams", "create", "acme", "100", "--prompt-rate", "4000")
    ctl("teams", "create", "beta", "50")
    status, out, _ = ctl("--json", "teams", "state")
    assert status == 0
    assert [(s["team"], s["prompt_tokens_per_second"]) for s in json.loads(out)] == [
        ("acme", 4000),
        ("beta", None),
    ]
    lines = ctl("teams", "state", "acme")[1].splitlines()
    header, row = lines[0].split(), lines[1].split()
    assert dict(zip(header, row, strict=True))["PROMPT/S"] == "4000"
