"""Wiring: flags, ``additional_config`` and starting the control plane the way
the engine-core process does."""

from __future__ import annotations

import argparse
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control.errors import InvalidArgument
from control.runner import serve, serve_from_additional_config
from control.server import BindRefused
from control.settings import ControlSettings, ControlSettingsError, add_cli_args
from tests.control_harness import make_rig


def test_flags_round_trip_through_additional_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--output-rate-control-address",
            "127.0.0.1:0",
            "--user-output-rate-config",
            str(tmp_path / "limits.yaml"),
            "--output-rate-control-token-file",
            "/run/secrets/token",
        ]
    )
    settings = ControlSettings.from_cli_args(args)
    additional = {"output_rate_control": settings.to_additional_config()}
    json.dumps(additional)  # must survive vLLM's serialisation
    assert ControlSettings.from_additional_config(additional) == settings
    assert settings.token_file == "/run/secrets/token"


def test_defaults_listen_on_loopback():
    settings = ControlSettings.from_additional_config({})
    assert settings.address == "127.0.0.1:50151"
    assert settings.enabled


def test_unknown_settings_are_refused():
    with pytest.raises(ControlSettingsError, match="unknown keys"):
        ControlSettings.from_additional_config({"output_rate_control": {"adress": "x"}})


def test_off_runs_nothing():
    rig = make_rig(10)
    config = {"output_rate_control": {"address": "off"}}
    assert serve_from_additional_config(rig.shared, config) is None


def test_serve_from_additional_config_is_serving(tmp_path):
    rig = make_rig(10, {"alice": 5})
    path = tmp_path / "limits.json"
    path.write_text('{"users": {"alice": 50}}')
    config = {
        "output_rate_control": {"address": "127.0.0.1:0", "config_path": str(path)}
    }
    plane = serve_from_additional_config(rig.shared, config)
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
        service.update_limit("limits/alice", file_rate, [], allow_missing=False)
        assert service.limit_changes == at_start + 1  # committed, though unchanged
        service.delete_limit("limits/nobody", allow_missing=True)
        assert service.limit_changes == at_start + 1  # nothing to delete: no commit
    finally:
        plane.stop(0)


def test_a_bad_config_file_stops_the_start(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text('{"users": {"alice": 0}}')
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    with pytest.raises(InvalidArgument, match=r"users\['alice'\] must be between"):
        serve(make_rig(10).shared, settings)


def test_a_public_address_without_auth_stops_the_start():
    with pytest.raises(BindRefused):
        serve(make_rig(10).shared, ControlSettings(address="0.0.0.0:0"))
