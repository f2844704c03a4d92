"""One OpenTelemetry span per RPC (semantic conventions for gRPC servers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from control.interceptors._handlers import Call, Handler, around_calls

#: Codes that mean the server failed (OTel marks only these server spans as
#: errors; INVALID_ARGUMENT and the like are the client's).
_SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


class TracingInterceptor(grpc.ServerInterceptor):
    """Wraps each call of an implemented method in a SERVER span named
    ``package.Service/Method``, a child of the caller's ``traceparent`` when sent,
    with ``rpc.*`` attributes and the final ``rpc.grpc.status_code``."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        name = handler_call_details.method.lstrip("/")
        service, _, method = name.partition("/")
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
        }
        parent = propagate.extract(dict(handler_call_details.invocation_metadata or ()))
        tracer = self._tracer

        @contextlib.contextmanager
        def traced(call: Call) -> Iterator[None]:
            span = tracer.start_span(
                name, context=parent, kind=SpanKind.SERVER, attributes=attributes
            )
            try:
                if call.streaming:
                    # Not made current: a generator suspends between responses,
                    # and a context attached across a yield would leak into
                    # grpc's thread.
                    yield
                else:
                    with trace.use_span(
                        span, record_exception=False, set_status_on_exception=False
                    ):
                        yield
            finally:
                _end(span, call.code())

        return around_calls(handler, traced)


def _end(span: trace.Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()
