"""``output-rate-ctl``'s fair-share commands against a real in-process server:
the switch, users' and tiers' weights, the fair-share columns of ``state``,
and weights through export and import."""

from __future__ import annotations

import json

from tests.cli_harness import entry


def test_set_fair_share_switches_it_and_get_mode_shows_it(ctl, rig):
    assert ctl("set-fair-share", "on")[:2] == (
        0,
        "pacing mode: enforce\nfair share: on\n",
    )
    assert rig.shared.fair_share.enabled is True
    status, out, _ = ctl("--json", "get-mode")
    assert (status, json.loads(out)) == (
        0,
        {"pacing_mode": "enforce", "fair_share": True},
    )
    ctl("set-mode", "shadow")  # the mode alone: fair share stays on
    assert rig.shared.fair_share.enabled is True
    ctl("set-fair-share", "off")
    assert rig.shared.fair_share.enabled is False


def test_set_fair_share_on_where_refused_exits_1_with_the_reason(ctl, rig):
    rig.shared.fair_share.refusal = "run it with the fcfs policy"
    status, out, err = ctl("set-fair-share", "on")
    assert (status, out) == (1, "")
    assert err == (
        "error: FAILED_PRECONDITION: pacing_mode.fair_share: fair share cannot "
        "run here: run it with the fcfs policy\n"
    )


def test_set_and_unset_a_users_weight(ctl, rig):
    status, out, _ = ctl("--json", "set-weight", "dave", "2.5")
    assert (status, json.loads(out)) == (0, entry("dave", None, weight=2.5))
    status, out, _ = ctl("--json", "set-weight", "alice", "3")
    assert json.loads(out) == entry("alice", 5, weight=3.0)  # her limit stays
    assert rig.shared.fair_share.weights.users == {"dave": 2.5, "alice": 3.0}
    assert ctl("unset-weight", "dave")[:2] == (
        0,
        "dave has no entry left (the default applies)\n",
    )
    assert ctl("unset-weight", "nobody")[0] == 1  # NOT_FOUND
    assert rig.shared.fair_share.weights.users == {"alice": 3.0}


def test_tier_weights_are_set_created_and_removed(ctl, rig):
    assert ctl("create-tier", "pro", "50", "--weight", "4")[0] == 0
    status, out, _ = ctl("--json", "update-tier", "pro", "--weight", "6")
    assert json.loads(out)["weight"] == 6.0
    assert rig.shared.fair_share.weights.tiers == {"pro": 6.0}
    status, out, _ = ctl("--json", "update-tier", "pro", "--no-weight")
    assert (status, json.loads(out)["weight"]) == (0, None)
    assert rig.shared.fair_share.weights.tiers == {}


def test_state_shows_the_fair_share_columns_while_it_is_on(ctl, rig):
    rig.step("alice")
    lines = ctl("state")[1].splitlines()
    assert lines[0] == "pacing mode: enforce"
    assert "SERVICE" not in lines[1]
    ctl("set-fair-share", "on")
    ctl("set-weight", "alice", "2")
    ledger = rig.shared.fair_share
    ledger.counter.update({"alice": 40.0, "bob": 1064.0})
    ledger.backlogged = frozenset({"alice", "bob"})
    rig.accounting.record("bob", "fair_share_service", 1064.0)
    rig.accounting.record("bob", "fair_share_preemptions", 3)
    status, out, _ = ctl("state", "--order-by", "fair_share_service desc")
    lines = out.splitlines()
    assert lines[0] == "pacing mode: enforce, fair share on"
    header = lines[1].split()
    rows = {
        line.split()[0]: dict(zip(header, line.split(), strict=True))
        for line in lines[2:]
    }
    assert list(rows) == ["bob", "alice"]
    assert (rows["bob"]["SERVICE"], rows["bob"]["AHEAD"]) == ("1064.0", "1024.0")
    assert (rows["bob"]["FS_PREEMPT"], rows["alice"]["WEIGHT"]) == ("3", "2.0")
    assert rows["alice"]["AHEAD"] == "0.0"
    status, out, _ = ctl("--json", "state", "bob")
    got = json.loads(out)
    assert status == 0
    assert (got["fair_share"], got["weight"], got["fair_share_lead"]) == (
        True,
        1.0,
        1024.0,
    )


def test_export_and_import_carry_weights(ctl, rig, tmp_path):
    ctl("create-tier", "pro", "50", "--weight", "4")
    ctl("set-weight", "dave", "2")
    path = tmp_path / "table.yaml"
    assert ctl("export", str(path))[0] == 0
    exported = path.read_text()
    assert "dave: 2.0" in exported and "pro: 4.0" in exported
    ctl("unset-weight", "dave")
    ctl("update-tier", "pro", "--no-weight")
    # Weights are the table's: changing them moved the etag the export holds.
    status, _, err = ctl("import", str(path))
    assert (status, err.split(":")[:2]) == (1, ["error", " ABORTED"])
    status, _, err = ctl("import", "--force", str(path))
    assert (status, err) == (0, "")
    weights = rig.shared.fair_share.weights
    assert (weights.users, weights.tiers) == ({"dave": 2.0}, {"pro": 4.0})
