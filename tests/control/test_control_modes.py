"""The pacing mode through the control plane: read and switched live over a
real gRPC server, guarded by its etag, persisted in the limits file, applied
from file edits, and started from the settings."""

from __future__ import annotations

import json
import os
import threading

import grpc
import pytest

from control.persistence import ConfigFile, ConfigWatcher, load_at_start
from control.runner import attach, serve
from control.service.operations import LimitsService
from pacing.modes import Mode
from pacing.settings.model import ControlSettings, OutputRateSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc
from tests.control_harness import make_rig, serving, table

CONTROL = "/outputrate.v1.OutputRateControl/"
FLAGS = table(default_rate=10, user_rates={"alice": 5}, mode=Mode.ENFORCE)


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5})


@pytest.fixture
def served(rig):
    with serving(LimitsService(rig.shared)) as served:
        yield served


def set_mode(served, mode: int, etag: str = "") -> pb.PacingMode:
    return served.stub.UpdatePacingMode(
        pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(mode=mode, etag=etag))
    )


def get_mode(served) -> pb.PacingMode:
    return served.stub.GetPacingMode(pb.GetPacingModeRequest())


def table_etag(served) -> str:
    return served.stub.GetLimitsTable(pb.GetLimitsTableRequest()).etag


# -- over gRPC -----------------------------------------------------------------


def test_the_mode_starts_as_the_shared_limiters(served):
    got = get_mode(served)
    assert (got.name, got.mode) == ("pacingMode", pb.PacingMode.ENFORCE)
    assert got.etag


@pytest.mark.parametrize(
    ("number", "mode"),
    [
        (pb.PacingMode.SHADOW, Mode.SHADOW),
        (pb.PacingMode.OFF, Mode.OFF),
        (pb.PacingMode.ENFORCE, Mode.ENFORCE),
    ],
    ids=["shadow", "off", "enforce"],
)
def test_switching_the_mode_sets_the_shared_limiters_and_wakes_the_engine(
    served, rig, number, mode
):
    etag = table_etag(served)
    got = set_mode(served, number)
    assert (got.mode, rig.shared.mode) == (number, mode)
    assert get_mode(served) == got
    assert len(rig.wakes) == 1  # an idle engine re-plans at once
    assert table_etag(served) == etag  # the mode is not part of the table


def test_a_mode_change_waits_for_the_step_holding_the_lock(rig):
    service = LimitsService(rig.shared)
    applied = threading.Event()

    def change() -> None:
        service.update_pacing_mode("", Mode.OFF, [])
        applied.set()

    with rig.shared.lock:  # the scheduler is inside schedule()
        writer = threading.Thread(target=change)
        writer.start()
        assert not applied.wait(0.2)
        assert rig.shared.mode is Mode.ENFORCE
    assert applied.wait(5)
    writer.join()
    assert rig.shared.mode is Mode.OFF


def test_the_modes_etag_guards_its_update(served, rig):
    read = get_mode(served)
    set_mode(served, pb.PacingMode.OFF)  # the kill switch, by someone else
    with pytest.raises(grpc.RpcError) as info:
        set_mode(served, pb.PacingMode.SHADOW, etag=read.etag)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "'pacingMode' changed since it was read" in info.value.details()
    assert rig.shared.mode is Mode.OFF
    assert set_mode(served, pb.PacingMode.SHADOW, get_mode(served).etag).mode == (
        pb.PacingMode.SHADOW
    )


def test_a_mode_change_does_not_count_as_a_limit_change(rig):
    service = LimitsService(rig.shared)
    service.update_pacing_mode("", Mode.SHADOW, ["mode"])
    assert service.limit_changes == 0


def test_user_state_carries_the_mode_it_was_read_in(served, rig):
    set_mode(served, pb.PacingMode.SHADOW)
    rig.step("alice")
    rig.accounting.record("alice", "shadow_skips", 3)
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/alice"))
    assert (state.pacing_mode, state.shadow_skips) == (pb.PacingMode.SHADOW, 3)


BAD_INPUT = [
    # (id, method, request, message part)
    (
        "unspecified mode",
        "UpdatePacingMode",
        pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode()),
        "pacing_mode.mode must be ENFORCE, SHADOW or OFF",
    ),
    (
        "unknown mode number",
        "UpdatePacingMode",
        pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(mode=7)),
        "pacing_mode.mode must be ENFORCE, SHADOW or OFF",
    ),
    (
        "bad mask",
        "UpdatePacingMode",
        pb.UpdatePacingModeRequest(
            pacing_mode=pb.PacingMode(mode=pb.PacingMode.OFF),
            update_mask={"paths": ["etag"]},
        ),
        "update_mask: cannot update 'etag'; mutable: mode",
    ),
    (
        "wrong name on update",
        "UpdatePacingMode",
        pb.UpdatePacingModeRequest(
            pacing_mode=pb.PacingMode(name="mode", mode=pb.PacingMode.OFF)
        ),
        "pacing_mode.name must be 'pacingMode' or empty",
    ),
    (
        "wrong name on get",
        "GetPacingMode",
        pb.GetPacingModeRequest(name="limitsTable"),
        "name must be 'pacingMode' or empty",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "message"),
    [row[1:] for row in BAD_INPUT],
    ids=[row[0] for row in BAD_INPUT],
)
def test_bad_input_is_invalid_argument_and_changes_nothing(
    served, rig, method, request_, message
):
    with pytest.raises(grpc.RpcError) as info:
        getattr(served.stub, method)(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert rig.shared.mode is Mode.ENFORCE
    assert rig.wakes == []
    counts = served.server.rpc_counts.snapshot()
    assert counts[(CONTROL + method, "INVALID_ARGUMENT")] == 1


# -- the limits file -------------------------------------------------------------


@pytest.fixture(params=["json", "yaml"])
def path(request, tmp_path):
    return tmp_path / f"limits.{request.param}"


def started(path, rig) -> tuple[LimitsService, ConfigWatcher]:
    file = ConfigFile(path)
    service = LimitsService(rig.shared, persist=file.write)
    doc = load_at_start(file, FLAGS)
    service.reload(lambda: doc.policy)
    return service, ConfigWatcher(file, service, FLAGS)


def test_a_mode_change_is_written_to_the_file(path, rig):
    service, _ = started(path, rig)
    service.update_pacing_mode("", Mode.SHADOW, [])
    assert ConfigFile(path).load().policy.mode is Mode.SHADOW


def test_a_failed_write_leaves_the_mode_as_it_was(path, rig, monkeypatch):
    service, _ = started(path, rig)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with serving(service) as served, pytest.raises(grpc.RpcError) as info:
        set_mode(served, pb.PacingMode.OFF)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert rig.shared.mode is Mode.ENFORCE


def test_a_mode_edited_in_the_file_is_applied(path, rig):
    service, watcher = started(path, rig)
    etag = service.get_limits_table("").etag
    path.write_text(json.dumps({"mode": "off", "users": {"alice": 5}}))
    assert watcher.poll() is True
    assert rig.shared.mode is Mode.OFF
    assert len(rig.wakes) == 1
    assert service.get_limits_table("").etag == etag  # the table did not change
    assert watcher.poll() is False


def test_an_edit_removing_the_mode_brings_back_the_flags_mode(path, rig):
    service, watcher = started(path, rig)
    service.update_pacing_mode("", Mode.SHADOW, [])
    path.write_text(json.dumps({"users": {"alice": 5}}))
    assert watcher.poll() is True
    assert rig.shared.mode is Mode.ENFORCE


def test_an_unquoted_yaml_off_means_off(tmp_path, rig):
    path = tmp_path / "limits.yaml"
    path.write_text("mode: off\n")  # YAML 1.1 reads this as false
    started(path, rig)
    assert rig.shared.mode is Mode.OFF


def test_a_bad_mode_in_the_file_is_refused_and_the_mode_kept(path, rig):
    _, watcher = started(path, rig)
    path.write_text(json.dumps({"mode": "loud"}))
    assert watcher.poll() is False
    assert watcher.failures == 1
    assert watcher.last_error == (
        f"{path}: mode: must be one of enforce, shadow, off, got 'loud'"
    )
    assert rig.shared.mode is Mode.ENFORCE


def test_the_files_mode_wins_over_the_flags_at_start(path, rig):
    path.write_text(json.dumps({"mode": "shadow"}))
    started(path, rig)
    assert rig.shared.mode is Mode.SHADOW


def test_the_mode_survives_a_restart(path):
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    first = make_rig(10)
    plane = serve(first.shared, settings)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{plane.port}")
        stub = output_rate_pb2_grpc.OutputRateControlStub(channel)
        stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(mode="OFF"))
        )
        channel.close()
    finally:
        plane.stop(0)
    second = make_rig(10)  # a new engine process, started in enforce
    plane = serve(second.shared, settings, mode=Mode.ENFORCE)
    try:
        assert second.shared.mode is Mode.OFF
    finally:
        plane.stop(0)


def test_the_start_up_mode_comes_from_the_settings():
    rig = make_rig(10)
    config = {
        "output_rate": {
            "default_rate": 10,
            "mode": "shadow",
            "control": {"address": "127.0.0.1:0"},
        }
    }
    plane = attach(rig.shared, OutputRateSettings.from_additional_config(config))
    assert plane is not None
    try:
        assert rig.shared.mode is Mode.SHADOW
        assert plane.service.get_pacing_mode("").mode is Mode.SHADOW
    finally:
        plane.stop(0)
