"""What ``grpcurl`` sees with no proto file: server reflection and health."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from control.server import create_server
from control.service.operations import LimitsService
from tests.control_harness import make_rig, serving

SERVICE = "outputrate.v1.OutputRateControl"
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def service():
    return LimitsService(make_rig(10).shared)


def test_reflection_lists_the_service_and_health(service):
    with serving(service) as served:
        database = ProtoReflectionDescriptorDatabase(served.channel)
        services = set(database.get_services())
    assert {SERVICE, HEALTH} <= services


def test_reflection_describes_methods_and_messages(service):
    with serving(service) as served:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(served.channel))
        described = pool.FindServiceByName(SERVICE)
        methods = {m.name: m for m in described.methods}
        state = pool.FindMessageTypeByName("outputrate.v1.UserState")
    assert set(methods) == {
        "GetDefaultLimit",
        "UpdateDefaultLimit",
        "GetLimit",
        "ListLimits",
        "CreateLimit",
        "UpdateLimit",
        "DeleteLimit",
        "GetTier",
        "ListTiers",
        "CreateTier",
        "UpdateTier",
        "DeleteTier",
        "GetTeam",
        "ListTeams",
        "CreateTeam",
        "UpdateTeam",
        "DeleteTeam",
        "GetLimitsTable",
        "ReplaceLimitsTable",
        "GetPacingMode",
        "UpdatePacingMode",
        "GetUserState",
        "ListUserStates",
        "WatchUserStates",
        "GetTeamState",
        "ListTeamStates",
    }
    assert methods["WatchUserStates"].server_streaming
    assert methods["ListUserStates"].output_type.name == "ListUserStatesResponse"
    # Durations on the wire, never raw clock values.
    assert state.fields_by_name["tat_lead"].message_type.full_name == (
        "google.protobuf.Duration"
    )
    assert state.fields_by_name["next_token_in"].message_type.full_name == (
        "google.protobuf.Duration"
    )


def test_reflection_needs_the_token_when_one_is_set(service):
    with serving(service, auth_token="t") as served:
        database = ProtoReflectionDescriptorDatabase(served.channel)
        with pytest.raises(grpc.RpcError) as info:
            database.get_services()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_is_serving_only_once_marked_and_not_serving_when_stopping(service):
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)

    def status(name: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=name)).status

    try:
        assert status() == NOT_SERVING
        assert status(SERVICE) == NOT_SERVING
        server.set_serving()
        assert status() == SERVING
        assert status(SERVICE) == SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert next(watch).status == SERVING
        stopped = server.stop(grace_s=5)
        # The health change reaches watchers before the server goes away.
        assert next(watch).status == NOT_SERVING
        watch.cancel()
        assert stopped.wait(10)
    finally:
        channel.close()
        server.stop(0)
