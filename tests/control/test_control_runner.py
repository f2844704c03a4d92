"""Wiring: starting the control plane from the settings the way the engine-core
process does."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control.errors import InvalidArgument
from control.kinds import USERS
from control.runner import attach, serve
from control.server import BindRefused
from pacing.settings.model import ControlSettings, OutputRateSettings
from tests.control_harness import make_rig


def test_off_runs_nothing():
    rig = make_rig(10)
    config = {"output_rate": {"default_rate": 10, "control": {"address": "off"}}}
    assert attach(rig.shared, OutputRateSettings.from_additional_config(config)) is None


def test_without_a_control_section_nothing_runs():
    # The offline LLM(additional_config=...) form gets a control plane only if
    # it asks for one; the flags always ask (address "off" declines).
    rig = make_rig(10)
    config = {"output_rate": {"default_rate": 10}}
    assert attach(rig.shared, OutputRateSettings.from_additional_config(config)) is None


def test_only_data_parallel_rank_0_serves_the_control_plane():
    # One control plane per server: every rank has the same address, and the
    # other ranks follow rank 0's changes through the store.
    rig = make_rig(10)
    rig.shared.engine_index = 1
    config = {
        "output_rate": {"default_rate": 10, "control": {"address": "127.0.0.1:0"}}
    }
    assert attach(rig.shared, OutputRateSettings.from_additional_config(config)) is None


def test_attach_from_additional_config_is_serving(tmp_path):
    rig = make_rig(10, {"alice": 5})
    path = tmp_path / "limits.json"
    path.write_text('{"users": {"alice": 50}}')
    config = {
        "output_rate": {
            "default_rate": 10,
            "control": {"address": "127.0.0.1:0", "config_path": str(path)},
        }
    }
    plane = attach(rig.shared, OutputRateSettings.from_additional_config(config))
    assert plane is not None
    try:
        assert rig.limiter.rate_of("alice") == 50  # the file won
        channel = grpc.insecure_channel(f"127.0.0.1:{plane.port}")
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    finally:
        plane.stop(0)


@pytest.mark.parametrize(
    ("file_rate", "at_start"), [(50, 1), (5, 0)], ids=["file-differs", "file-equal"]
)
def test_limit_changes_counts_committed_tables_the_start_up_load_included(
    tmp_path, file_rate, at_start
):
    rig = make_rig(10, {"alice": 5})
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"users": {"alice": file_rate}}))
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    plane = serve(rig.shared, settings)
    try:
        service = plane.service
        assert service.limit_changes == at_start
        service.update(USERS, "limits/alice", {"tokens_per_second": file_rate})
        assert service.limit_changes == at_start + 1  # committed, though unchanged
        service.delete(USERS, "limits/nobody", allow_missing=True)
        assert service.limit_changes == at_start + 1  # nothing to delete: no commit
    finally:
        plane.stop(0)


def test_a_bad_config_file_stops_the_start(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text('{"users": {"alice": 0}}')
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    with pytest.raises(
        InvalidArgument, match=r"users\.alice: must be an integer in 1\.\.1000000"
    ):
        serve(make_rig(10).shared, settings)


def test_a_public_address_without_auth_stops_the_start():
    with pytest.raises(BindRefused):
        serve(make_rig(10).shared, ControlSettings(address="0.0.0.0:0"))
