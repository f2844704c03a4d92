"""RPC counts for the metrics: each call of a method the server implements,
by full method name and the status code it ended with; the ``method`` label
stays bounded."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from control.rpc_counts import MAX_METHODS, OTHER_METHOD, RpcCounts
from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

CONTROL = "/outputrate.v1.OutputRateControl/"


def test_method_names_beyond_the_cap_count_under_one_label():
    counts = RpcCounts(max_methods=2)
    for name in ["GetLimit", "ListLimits", "Probe1", "Probe2"]:
        counts.add(CONTROL + name, "OK")
    counts.add(CONTROL + "GetLimit", "NOT_FOUND")  # counted before: keeps its name
    counts.add(CONTROL + "Probe1", "UNIMPLEMENTED")
    assert counts.snapshot() == {
        (CONTROL + "GetLimit", "OK"): 1,
        (CONTROL + "GetLimit", "NOT_FOUND"): 1,
        (CONTROL + "ListLimits", "OK"): 1,
        (OTHER_METHOD, "OK"): 2,
        (OTHER_METHOD, "UNIMPLEMENTED"): 1,
    }


def test_the_cap_leaves_every_method_the_server_serves_its_own_label():
    services = [
        pb.DESCRIPTOR.services_by_name["OutputRateControl"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    ]
    served = [f"/{s.full_name}/{m.name}" for s in services for m in s.methods]
    counts = RpcCounts()
    for method in served:
        counts.add(method, "OK")
    assert len(served) <= MAX_METHODS
    assert {method for method, _ in counts.snapshot()} == set(served)


@pytest.fixture
def served():
    with serving(LimitsService(make_rig(10).shared)) as served:
        yield served


def test_the_server_counts_each_call_by_full_name_and_final_code(served):
    served.stub.GetDefaultLimit(pb.GetDefaultLimitRequest())
    with pytest.raises(grpc.RpcError):
        served.stub.GetLimit(pb.GetLimitRequest(name="limits/nobody"))
    probe = served.channel.unary_unary("/evil.Service/Probe")
    with pytest.raises(grpc.RpcError) as error:
        probe(b"")
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    stream = served.stub.WatchUserStates(pb.WatchUserStatesRequest())
    next(stream)
    stream.cancel()
    served.server.stop(5).wait()
    watch = CONTROL + "WatchUserStates"
    # A stream is counted when its handler's generator returns, in grpc's
    # handler thread, which may be after the server reports itself stopped.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        method == watch for method, _ in served.server.rpc_counts.snapshot()
    ):
        time.sleep(0.01)
    counts = served.server.rpc_counts.snapshot()
    assert sum(n for (method, _), n in counts.items() if method == watch) == 1
    assert {k: n for k, n in counts.items() if k[0] != watch} == {
        (CONTROL + "GetDefaultLimit", "OK"): 1,
        (CONTROL + "GetLimit", "NOT_FOUND"): 1,
    }
