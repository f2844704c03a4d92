"""One OpenTelemetry span per control-plane RPC."""

from __future__ import annotations

import time

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rig = make_rig(10, {"alice": 5})
    with serving(LimitsService(rig.shared), tracer_provider=provider) as served:
        yield served, exporter, rig


def test_a_successful_call_is_one_server_span(traced):
    served, exporter, _ = traced
    served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    (span,) = exporter.get_finished_spans()
    assert span.name == "outputrate.v1.OutputRateControl/GetLimit"
    assert span.kind == SpanKind.SERVER
    assert dict(span.attributes) == {
        "rpc.system": "grpc",
        "rpc.service": "outputrate.v1.OutputRateControl",
        "rpc.method": "GetLimit",
        "rpc.grpc.status_code": 0,
    }
    assert span.status.status_code == StatusCode.UNSET


def test_a_client_error_is_recorded_but_not_a_server_error(traced):
    served, exporter, _ = traced
    with pytest.raises(grpc.RpcError):
        served.stub.GetLimit(pb.GetLimitRequest(name="limits/nobody"))
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert span.status.status_code == StatusCode.UNSET


def test_an_internal_error_marks_the_span_as_failed(traced):
    served, exporter, rig = traced

    def broken():
        raise RuntimeError("boom")

    rig.shared._request_counts = broken
    with pytest.raises(grpc.RpcError):
        served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/alice"))
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert span.status.status_code == StatusCode.ERROR


def test_the_span_continues_the_callers_trace(traced):
    served, exporter, _ = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    served.stub.GetDefaultLimit(
        pb.GetDefaultLimitRequest(),
        metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),),
    )
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent_id


def test_a_stream_is_one_span_ended_with_the_stream(traced):
    served, exporter, _ = traced
    stream = served.stub.WatchUserStates(pb.WatchUserStatesRequest())
    next(stream)
    assert exporter.get_finished_spans() == ()
    stream.cancel()
    served.server.stop(5).wait()
    (span,) = spans_once_ended(exporter, 1)
    assert span.name == "outputrate.v1.OutputRateControl/WatchUserStates"


def spans_once_ended(exporter: InMemorySpanExporter, count: int) -> tuple:
    """The finished spans once ``count`` have ended. A streaming call's span ends
    when its handler's generator returns, in grpc's handler thread, which may be
    after the server reports itself stopped; so wait for that event (10 s at
    most) instead of assuming an order."""
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return exporter.get_finished_spans()
