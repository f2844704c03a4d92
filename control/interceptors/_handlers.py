"""Rebuilding an ``RpcMethodHandler`` around a wrapped behaviour."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

#: A method handler of any message types (grpc's class is generic only in its stubs).
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
#: A servicer method: ``(request or request iterator, context) -> response``.
Behavior = Callable[[Any, grpc.ServicerContext], Any]
#: A servicer method returning an iterator of responses (server streaming).
StreamBehavior = Callable[[Any, grpc.ServicerContext], Iterator[Any]]


@dataclass
class Call:
    """One call as an interceptor's ``around`` sees it."""

    context: grpc.ServicerContext
    streaming: bool  #: whether the method streams its responses
    cancelled: bool = False  #: the client went away mid-stream

    def code(self) -> grpc.StatusCode:
        """The status the call ends with so far (OK unless set)."""
        if self.cancelled:
            return grpc.StatusCode.CANCELLED
        # ServicerContext.code() exists since grpcio 1.38; the stubs lack it.
        code = self.context.code()  # type: ignore[attr-defined]
        return code or grpc.StatusCode.OK


def around_calls(
    handler: Handler,
    around: Callable[[Call], AbstractContextManager[object]],
) -> Handler:
    """A copy of ``handler`` that runs each call of the servicer method inside
    ``around(call)``: entered before the method runs, left when the call ends,
    with the method's exception if it raised."""

    def unary(behavior: Behavior) -> Behavior:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            with around(Call(context, streaming=False)):
                return behavior(request, context)

        return run

    def streaming(behavior: StreamBehavior) -> StreamBehavior:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call = Call(context, streaming=True)
            with around(call):
                try:
                    yield from behavior(request, context)
                except GeneratorExit:  # grpc closes the generator
                    call.cancelled = True
                    raise

        return run

    return wrap_handler(handler, unary=unary, streaming=streaming)


def wrap_handler(
    handler: Handler,
    *,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[StreamBehavior], StreamBehavior],
) -> Handler:
    """A copy of ``handler`` whose behaviour is wrapped by ``unary`` (single
    response) or ``streaming`` (response stream), whichever kind it is."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            streaming(handler.unary_stream), **codec
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary(handler.stream_unary), **codec
        )
    assert handler.stream_stream is not None  # the only kind left
    return grpc.stream_stream_rpc_method_handler(
        streaming(handler.stream_stream), **codec
    )
