"""Rebuilding an ``RpcMethodHandler`` around a wrapped behaviour."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

#: A servicer method: ``(request or request iterator, context) -> response``.
Behavior = Callable[[Any, grpc.ServicerContext], Any]
#: A servicer method returning an iterator of responses (server streaming).
StreamBehavior = Callable[[Any, grpc.ServicerContext], Iterator[Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    *,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[StreamBehavior], StreamBehavior],
) -> grpc.RpcMethodHandler:
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
    return grpc.stream_stream_rpc_method_handler(
        streaming(handler.stream_stream), **codec
    )
