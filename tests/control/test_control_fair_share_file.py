"""Fair share in the limits file (``--user-output-rate-config``): the switch and
the weights are written after every change, loaded at start over the flags,
applied from edits, and refused, keeping the last good table, when they are
wrong or the engine cannot run fair share."""

from __future__ import annotations

import json

import grpc
import pytest

from control.errors import FailedPrecondition, InvalidArgument
from control.kinds import TIERS, USERS
from control.persistence import ConfigFile, ConfigWatcher, load_at_start
from control.runner import serve
from control.service.operations import LimitsService
from pacing.modes import Mode
from pacing.settings.model import ControlSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc
from tests.control_harness import make_rig, pieces, table

FLAGS = table(
    default_rate=10,
    user_rates={"alice": 5},
    tier_rates={"free": 2},
    mode=Mode.ENFORCE,
    user_weights={"alice": 2.0},
    tier_weights={"free": 3.0},
    fair_share=False,
)
REFUSAL = "not under priority scheduling"


@pytest.fixture(params=["json", "yaml"])
def path(request, tmp_path):
    return tmp_path / f"limits.{request.param}"


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5})


def started(path, rig) -> tuple[LimitsService, ConfigWatcher]:
    file = ConfigFile(path)
    service = LimitsService(rig.shared, persist=file.write)
    doc = load_at_start(file, FLAGS)
    service.reload(lambda: doc.policy)
    return service, ConfigWatcher(file, service, FLAGS)


def write(path, tree: dict) -> None:
    path.write_text(json.dumps(tree))  # JSON is YAML, too


def test_the_flags_weights_and_switch_start_a_new_file(path, rig):
    started(path, rig)
    doc = ConfigFile(path).load()
    assert (
        pieces(doc).user_weights,
        pieces(doc).tier_weights,
        pieces(doc).fair_share,
    ) == (
        {"alice": 2.0},
        {"free": 3.0},
        False,
    )
    weights = rig.shared.fair_share.weights
    assert (weights.users, weights.tiers) == ({"alice": 2.0}, {"free": 3.0})


def test_the_files_weights_and_switch_win_over_the_flags(path, rig):
    write(
        path,
        {
            "fair_share": True,
            "tiers": {"free": {"tokens_per_second": 2}, "pro": {"exempt": True}},
            "weights": {"users": {"alice": 7, "dave": 0.5}, "tiers": {"pro": 9}},
        },
    )
    started(path, rig)
    weights = rig.shared.fair_share.weights
    assert weights.users == {"alice": 7.0, "dave": 0.5}
    assert weights.tiers == {"free": 3.0, "pro": 9.0}  # the flag's free stays
    assert rig.shared.fair_share.enabled is True


def test_every_change_of_weights_or_switch_is_written(path, rig):
    service, _ = started(path, rig)
    service.update(USERS, "limits/dave", {"weight": 4}, ["weight"], allow_missing=True)
    service.update(TIERS, "tiers/free", {}, ["weight"])
    service.update_pacing_mode("", None, ["fair_share"], fair_share=True)
    doc = ConfigFile(path).load()
    assert pieces(doc).user_weights == {"alice": 2.0, "dave": 4.0}
    assert pieces(doc).tier_weights == {}
    assert pieces(doc).fair_share is True
    assert pieces(doc).users == {"alice", "dave"}  # dave's entry is his weight


def test_an_edit_of_the_weights_and_switch_applies_live(path, rig):
    service, watcher = started(path, rig)
    etag = service.get_limits_table("").etag
    write(
        path,
        {
            "fair_share": True,
            "users": {"alice": 5},
            "weights": {"users": {"bob": 6}},
        },
    )
    assert watcher.poll() is True
    ledger = rig.shared.fair_share
    assert ledger.enabled is True
    # Flags overlaid by the file: the flags' weights stay unless the file
    # names the same user or tier.
    assert ledger.weights.users == {"alice": 2.0, "bob": 6.0}
    assert service.get_limits_table("").etag != etag  # weights are the table's
    write(path, {"users": {"alice": 5}})  # the switch removed: the flags' again
    assert watcher.poll() is True
    assert (ledger.enabled, ledger.weights.users) == (False, {"alice": 2.0})


BAD_EDITS = [
    # (id, file, a part of the error)
    (
        "zero weight",
        {"weights": {"users": {"bob": 0}}},
        "weights.users.bob: must be a number in (0, 1e+06]",
    ),
    (
        "text weight",
        {"weights": {"users": {"bob": "2"}}},
        "weights.users.bob: must be a number in (0, 1e+06], got '2'",
    ),
    (
        "huge weight",
        {"weights": {"tiers": {"free": 2e6}}},
        "weights.tiers.free: must be a number in (0, 1e+06]",
    ),
    (
        "weight of an unknown tier",
        {"weights": {"tiers": {"gold": 2}}},
        "weights.tiers.gold: unknown tier 'gold'",
    ),
    ("unknown key", {"weights": {"groups": {}}}, "unknown field(s) 'groups'"),
    (
        "switch not a boolean",
        {"fair_share": "yes"},
        "fair_share: must be true or false",
    ),
]


@pytest.mark.parametrize(
    ("tree", "part"), [row[1:] for row in BAD_EDITS], ids=[row[0] for row in BAD_EDITS]
)
def test_a_bad_edit_is_refused_naming_the_field_and_the_table_kept(
    path, rig, tree, part
):
    _, watcher = started(path, rig)
    write(path, {"tiers": {"free": {"tokens_per_second": 2}}, **tree})
    assert watcher.poll() is False
    assert watcher.failures == 1
    assert part in watcher.last_error
    assert rig.shared.fair_share.weights.users == {"alice": 2.0}
    assert rig.shared.fair_share.enabled is False


def test_an_edit_switching_fair_share_on_where_refused_is_rejected(path, rig):
    rig.shared.fair_share.refusal = REFUSAL
    _, watcher = started(path, rig)
    write(path, {"fair_share": True, "weights": {"users": {"bob": 3}}})
    watcher._tick()  # one poll, as the watcher's thread runs it
    assert watcher.failures == 1
    assert watcher.last_error == (
        f"{path}: fair_share: fair share cannot run here: {REFUSAL}"
    )
    assert rig.shared.fair_share.enabled is False
    assert rig.shared.fair_share.weights.users == {"alice": 2.0}  # all kept


def test_a_file_switching_fair_share_on_where_refused_stops_the_start(path, rig):
    rig.shared.fair_share.refusal = REFUSAL
    write(path, {"fair_share": True})
    with pytest.raises(FailedPrecondition, match=REFUSAL):
        started(path, rig)


def test_a_bad_weight_in_the_file_stops_the_start(path, rig):
    write(path, {"weights": {"users": {"bob": -1}}})
    with pytest.raises(
        InvalidArgument, match=r"weights\.users\.bob: must be a number in \(0, 1e\+06\]"
    ):
        started(path, rig)


def test_weights_and_switch_survive_a_restart(tmp_path):
    settings = ControlSettings(
        address="127.0.0.1:0", config_path=str(tmp_path / "limits.yaml")
    )
    first = make_rig(10)
    plane = serve(first.shared, settings)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{plane.port}")
        stub = output_rate_pb2_grpc.OutputRateControlStub(channel)
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/dave", weight=3.0), allow_missing=True
            )
        )
        stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(fair_share=True))
        )
        channel.close()
    finally:
        plane.stop(0)
    second = make_rig(10)  # a new engine process, started with fair share off
    plane = serve(second.shared, settings)
    try:
        ledger = second.shared.fair_share
        assert (ledger.enabled, ledger.weights.users) == (True, {"dave": 3.0})
    finally:
        plane.stop(0)
