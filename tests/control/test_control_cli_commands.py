"""``output-rate-ctl``'s commands (``control.cli.commands``) against a real
in-process server."""

from __future__ import annotations

import json

import pytest

from control.cli.main import main
from control.service.operations import LimitsService
from pacing.modes import Mode
from tests.cli_harness import entry
from tests.control_harness import make_rig, serving


def test_set_get_list_delete_as_json(ctl, rig):
    assert ctl("--json", "set", "carol", "7")[:2] == (
        0,
        json.dumps(entry("carol", 7), indent=2) + "\n",
    )
    status, out, _ = ctl("--json", "get", "carol")
    assert (status, json.loads(out)) == (0, entry("carol", 7))
    status, out, _ = ctl("--json", "list", "--page-size", "2")  # pages through
    assert status == 0
    assert json.loads(out) == [
        entry("alice", 5),
        entry("bob", 20),
        entry("carol", 7),
    ]
    status, out, _ = ctl("--json", "delete", "carol")
    assert (status, json.loads(out)) == (0, {"deleted": "carol"})
    assert rig.limiter.rate_of("carol") == 10


def test_default_get_and_set(ctl, rig):
    assert ctl("get-default")[:2] == (0, "default: 10 tokens/s\n")
    status, out, _ = ctl("--json", "set-default", "30")
    assert (status, json.loads(out)) == (
        0,
        {
            "default_tokens_per_second": 30,
            "default_prompt_tokens_per_second": None,
            "default_ceiling_tokens_per_second": None,
            "default_band": None,
        },
    )
    assert rig.limiter.default_rate == 30


def test_state_of_one_user_and_of_all_sorted_by_throttled_skips(ctl, rig):
    rig.step("alice", 3)  # 5/s: 1 granted, 2 skipped
    rig.step("dave", 7)  # 10/s: 2 granted, 5 skipped
    rig.counts.value = {"dave": (4, 3)}
    status, out, _ = ctl("--json", "state", "dave")
    assert status == 0
    state = json.loads(out)
    assert state["throttled_skips"] == 5
    assert (state["running_requests"], state["throttled_requests"]) == (4, 3)
    assert state["tat_lead_s"] == pytest.approx(0.2)
    assert state["next_token_in_s"] == pytest.approx(0.1)
    status, out, _ = ctl("--json", "state")
    assert [(s["user"], s["throttled_skips"]) for s in json.loads(out)] == [
        ("dave", 5),
        ("alice", 2),
        ("bob", 0),
    ]
    status, out, _ = ctl("state", "--top", "1")
    lines = out.splitlines()
    assert lines[0] == "pacing mode: enforce"
    assert lines[1].split()[:5] == ["USER", "LIMIT/S", "SOURCE", "TIER", "RECENT/S"]
    assert lines[2].split()[:6] == ["dave", "10", "default", "-", "0.0", "100ms"]
    assert len(lines) == 3


def test_watch_streams_updates_as_json_lines(ctl, rig):
    rig.step("alice", 3)
    status, out, _ = ctl(
        "--json", "watch", "alice", "--interval", "0.1", "--count", "2"
    )
    assert status == 0
    updates = [json.loads(line) for line in out.splitlines()]
    assert len(updates) == 2
    assert [s["user"] for s in updates[0]["user_states"]] == ["alice"]


# -- mode, tiers, memberships, exemptions --------------------------------------


def test_get_and_set_the_pacing_mode(ctl, rig):
    assert ctl("get-mode")[:2] == (0, "pacing mode: enforce\nfair share: off\n")
    status, out, _ = ctl("--json", "set-mode", "shadow")
    assert (status, json.loads(out)) == (
        0,
        {"pacing_mode": "shadow", "fair_share": False},
    )
    assert rig.shared.mode is Mode.SHADOW
    assert ctl("set-mode", "off")[:2] == (0, "pacing mode: off\nfair share: off\n")
    assert rig.shared.mode is Mode.OFF


def test_create_list_update_and_delete_tiers(ctl, rig):
    assert ctl("create-tier", "free", "20")[0] == 0
    assert ctl("create-tier", "staff", "--exempt")[0] == 0
    assert ctl("assign", "bob", "free")[0] == 0
    status, out, _ = ctl("list-tiers")
    assert (status, out.splitlines()) == (
        0,
        [
            "TIER   TOKENS/S  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  MEMBERS",
            "free         20      no       -         -       -     -        1",
            "staff         -     yes       -         -       -     -        0",
        ],
    )
    status, out, _ = ctl("--json", "update-tier", "free", "--rate", "30", "--exempt")
    assert json.loads(out) == {
        "tier": "free",
        "tokens_per_second": 30,
        "exempt": True,
        "weight": None,
        "prompt_tokens_per_second": None,
        "ceiling_tokens_per_second": None,
        "band": None,
        "member_count": 1,
    }
    assert (rig.limiter.tier_rates, rig.limiter.exempt_tiers) == (
        {"free": 30},
        {"free", "staff"},
    )
    status, out, _ = ctl("--json", "get-tier", "free")
    assert json.loads(out)["tokens_per_second"] == 30
    # The exemption was staff's last rule: lifting it removes the tier.
    assert ctl("update-tier", "staff", "--no-exempt")[:2] == (
        0,
        "tier staff has neither rate nor exemption left: deleted\n",
    )
    assert ctl("delete-tier", "free")[0] == 1  # bob is a member
    assert ctl("unassign", "bob")[0] == 0
    assert ctl("delete-tier", "free")[:2] == (0, "deleted tier free\n")
    assert rig.limiter.tier_rates == {}


def test_deleting_a_tier_with_members_exits_1_failed_precondition(ctl, rig):
    ctl("create-tier", "free", "20")
    ctl("assign", "carol", "free")
    status, out, err = ctl("delete-tier", "free")
    assert (status, out) == (1, "")
    assert err.startswith("error: FAILED_PRECONDITION: 'tiers/free' has 1 member(s)")
    assert rig.limiter.tier_rates == {"free": 20}


def test_assigning_a_tier_that_does_not_exist_exits_1(ctl, rig):
    status, _, err = ctl("assign", "carol", "gold")
    assert status == 1
    assert err.startswith("error: FAILED_PRECONDITION: limit.tier: unknown tier 'gold'")
    assert rig.limiter.memberships == {}


def test_membership_exemption_and_own_limit_are_separate_fields(ctl, rig):
    ctl("create-tier", "free", "2")
    assigned = json.loads(ctl("--json", "assign", "alice", "free")[1])
    assert assigned == entry("alice", 5, "free")  # her own limit stays
    exempted = json.loads(ctl("--json", "exempt", "alice")[1])
    assert exempted == entry("alice", 5, "free", exempt=True)
    assert rig.limiter.rate_of("alice") == 0
    ctl("unexempt", "alice")
    ctl("unset", "alice")
    assert rig.limiter.rate_of("alice") == 2  # now the tier's
    assert ctl("unassign", "alice")[:2] == (
        0,
        "alice has no entry left (the default applies)\n",
    )
    assert rig.limiter.rate_of("alice") == 10
    out = ctl("--json", "exempt", "dora")[1]  # no entry before
    assert json.loads(out) == entry("dora", None, exempt=True)
    assert ctl("list")[1].splitlines() == [
        "USER  TOKENS/S  TIER  EXEMPT  WEIGHT  PROMPT/S  CEIL/S  BAND  TEAM",
        "bob         20     -      no       -         -       -     -     -",
        "dora         -     -     yes       -         -       -     -     -",
    ]


def test_delete_removes_the_whole_entry(ctl, rig):
    ctl("create-tier", "free", "2")
    ctl("assign", "alice", "free")
    assert ctl("delete", "alice")[:2] == (
        0,
        "deleted the entry of alice: limit, tier, team and exemption "
        "(the default applies)\n",
    )
    assert rig.limiter.rate_of("alice") == 10
    assert rig.limiter.memberships == {}


def test_state_shows_the_limit_source_the_tier_and_the_mode(ctl, rig):
    ctl("create-tier", "free", "2")
    ctl("assign", "carol", "free")
    ctl("set-mode", "shadow")
    rig.step("carol", 3)
    state = json.loads(ctl("--json", "state", "carol")[1])
    assert (state["limit_source"], state["tier"], state["pacing_mode"]) == (
        "tier",
        "free",
        "shadow",
    )
    assert state["shadow_skips"] == 0  # the rig acts as enforce
    lines = ctl("state", "carol")[1].splitlines()
    assert lines[0] == "pacing mode: shadow"
    assert lines[2].split()[:4] == ["carol", "2", "tier", "free"]


def test_state_without_users_still_shows_the_mode(capsys):
    rig = make_rig(10)
    with serving(LimitsService(rig.shared)) as served:
        status = main(["--address", served.address, "state"])
    out = capsys.readouterr().out
    assert (status, out.splitlines()[0]) == (0, "pacing mode: enforce")
    assert out.splitlines()[1].startswith("USER")
