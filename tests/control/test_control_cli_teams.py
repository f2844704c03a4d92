"""``output-rate-ctl teams …``, ``join`` and ``leave``, and teams in export
and import, against a real in-process server."""

from __future__ import annotations

import json

import yaml

from tests.cli_harness import entry


def test_teams_are_created_shown_listed_updated_and_deleted(ctl, rig):
    status, out, _ = ctl("--json", "teams", "create", "acme", "60", "--weight", "2")
    assert (status, json.loads(out)) == (
        0,
        {
            "team": "acme",
            "tokens_per_second": 60,
            "weight": 2.0,
            "prompt_tokens_per_second": None,
            "ceiling_tokens_per_second": None,
            "band": None,
            "member_count": 0,
        },
    )
    assert rig.shared.teams.table.rate_of("acme") == 60
    ctl("teams", "create", "beta", "20")
    assert ctl("teams", "list")[1].splitlines() == [
        "TEAM  TOKENS/S  WEIGHT  PROMPT/S  CEIL/S  BAND  MEMBERS",
        "acme        60     2.0         -       -     -        0",
        "beta        20       -         -       -     -        0",
    ]
    status, out, _ = ctl("--json", "teams", "update", "acme", "--rate", "90")
    assert (status, json.loads(out)["tokens_per_second"]) == (0, 90)
    assert json.loads(out)["weight"] == 2.0  # the weight stays
    ctl("teams", "update", "acme", "--no-weight")
    assert rig.shared.fair_share.weights.teams == {}
    status, out, _ = ctl("--json", "teams", "get", "acme")
    assert json.loads(out)["tokens_per_second"] == 90
    assert ctl("teams", "delete", "beta")[:2] == (0, "deleted team beta\n")
    assert rig.shared.teams.table.rates == {"acme": 90}


def test_join_and_leave_move_a_user_in_and_out_of_a_team(ctl, rig):
    ctl("teams", "create", "acme", "60")
    status, out, _ = ctl("--json", "join", "alice", "acme")
    assert (status, json.loads(out)) == (0, entry("alice", 5, team="acme"))
    assert rig.shared.teams.table.team_of("alice") == "acme"
    status, out, _ = ctl("--json", "join", "carol", "acme")  # no entry before
    assert json.loads(out) == entry("carol", None, team="acme")
    assert json.loads(ctl("--json", "teams", "get", "acme")[1])["member_count"] == 2
    assert ctl("leave", "carol")[:2] == (
        0,
        "carol has no entry left (the default applies)\n",
    )
    assert rig.shared.teams.table.memberships == {"alice": "acme"}


def test_deleting_a_team_with_members_exits_1_failed_precondition(ctl, rig):
    ctl("teams", "create", "acme", "60")
    ctl("join", "alice", "acme")
    status, out, err = ctl("teams", "delete", "acme")
    assert (status, out) == (1, "")
    assert err.startswith("error: FAILED_PRECONDITION: 'teams/acme' has 1 member(s)")
    assert rig.shared.teams.table.rate_of("acme") == 60


def test_update_team_without_a_change_is_a_usage_error(ctl):
    status, _, err = ctl("teams", "update", "acme")
    assert status == 2
    assert (
        "teams update needs --rate, --weight, --no-weight, --prompt-rate, "
        "--no-prompt-rate, --ceiling, --no-ceiling, --band or --no-band" in err
    )


def test_teams_state_shows_budget_and_throttled_members(ctl, rig):
    ctl("set-default", "1000")
    ctl("teams", "create", "acme", "100")
    ctl("join", "carol", "acme")
    ctl("join", "dave", "acme")
    with rig.shared.lock:
        rig.shared.budget.take_team("acme", {"carol": 30, "dave": 30}, rig.clock())
    rig.counts.value = {"carol": (3, 2), "dave": (1, 0)}
    status, out, _ = ctl("--json", "teams", "state", "acme")
    state = json.loads(out)
    assert status == 0
    assert (state["budget_tokens"], state["tokens_charged"]) == (0, 11)
    assert (state["running_members"], state["throttled_members"]) == (2, 1)
    assert state["throttled_steps"] == 1
    lines = ctl("teams", "state")[1].splitlines()
    assert lines[0].split()[:4] == ["TEAM", "TOKENS/S", "BUDGET", "NEXT_IN"]
    assert lines[1].split()[:4] == ["acme", "100", "0", "10ms"]
    assert len(lines) == 2


def test_teams_round_trip_through_export_and_import(ctl, rig, tmp_path):
    ctl("teams", "create", "acme", "60", "--weight", "3")
    ctl("join", "alice", "acme")
    exported = tmp_path / "table.yaml"
    assert ctl("export", str(exported))[0] == 0
    tree = yaml.safe_load(exported.read_text())
    assert tree["teams"] == {"acme": {"tokens_per_second": 60}}
    assert tree["team_members"] == {"alice": "acme"}
    assert tree["weights"]["teams"] == {"acme": 3.0}
    # Another table in between, then the export back, without its etag.
    ctl("leave", "alice")
    ctl("teams", "delete", "acme")
    del tree["etag"]
    exported.write_text(yaml.safe_dump(tree))
    status, out, _ = ctl("import", str(exported))
    assert status == 0
    assert out.startswith("imported 2 entries, 0 tiers and 1 teams; etag ")
    table = rig.shared.teams.table
    assert (table.rates, table.memberships) == ({"acme": 60}, {"alice": "acme"})
    assert rig.shared.fair_share.weights.teams == {"acme": 3.0}


def test_an_import_naming_an_unknown_team_is_refused_locally(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"team_members": {"alice": "ghost"}}))
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith(
        f"error: INVALID_ARGUMENT: {path}: team_members.alice: unknown team 'ghost'"
    )
    assert not rig.shared.teams.table
