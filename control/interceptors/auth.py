"""Bearer-token authentication of every call except health checks.

A call without the token is refused from its metadata alone, before any of
its request is read: grpc reads a unary call's request whole (up to
``MAX_MESSAGE_BYTES``) and parses it before the servicer method runs, and
while a request is still to come the call holds a worker thread. So the
refusal is served as a request-streaming method, which grpc runs at once and
which never reads. A health check without a token does read its request:
at most ``MAX_OPEN_CHECKS`` at once, each of at most
``MAX_CHECK_REQUEST_BYTES`` parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import grpc

from control.errors import (
    Cancelled,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
)
from control.interceptors._handlers import Handler

#: Health checks stay open: probes (kubelet, load balancers) carry no token.
#: Only ``Check``: a ``Watch`` would stay open as long as its caller likes.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: Health checks without a token served at once: each holds a worker thread
#: until its request arrives, so more are refused (RESOURCE_EXHAUSTED) at once.
MAX_OPEN_CHECKS = 4
#: A health check's request names one service; a bigger one is refused unparsed.
MAX_CHECK_REQUEST_BYTES = 1024


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls whose ``authorization`` metadata is not ``Bearer <token>``
    with UNAUTHENTICATED (raised as ``Unauthenticated`` for the error mapping)
    without reading their request, except calls of ``open_methods`` (unary
    methods), served without the token ``max_open_calls`` at a time."""

    def __init__(
        self,
        token: str,
        *,
        open_methods: Collection[str] = (HEALTH_CHECK,),
        max_open_calls: int = MAX_OPEN_CHECKS,
    ):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = _digest(f"Bearer {token}".encode())
        self._open = frozenset(open_methods)
        self._max_open_calls = max_open_calls
        self._open_calls = threading.BoundedSemaphore(max_open_calls)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return handler
        if handler_call_details.method in self._open and handler.unary_unary:
            return self._open_call(handler)
        return _REFUSAL

    def _authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        values = [v for k, v in metadata or () if k == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        # Digests have one length, so the comparison time reveals nothing about
        # the token, not even its length.
        return hmac.compare_digest(_digest(values[0].encode()), self._expected)

    def _open_call(self, handler: Handler) -> Handler:
        """``handler`` (unary) served as a request-streaming method that takes
        one of the open slots before it reads the request, and frees it when
        the call ends."""
        behavior = handler.unary_unary
        assert behavior is not None  # the caller checked
        parse = handler.request_deserializer
        slots = self._open_calls
        limit = self._max_open_calls

        def serve(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            if not slots.acquire(blocking=False):
                raise ResourceExhausted(
                    f"at most {limit} calls without credentials are served at once"
                )
            try:
                request = _one_request(requests)
                return behavior(request if parse is None else parse(request), context)
            finally:
                slots.release()

        return grpc.stream_unary_rpc_method_handler(
            serve, response_serializer=handler.response_serializer
        )


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _one_request(requests: Iterator[bytes]) -> bytes:
    """The call's one request message, unparsed; refused when it is bigger
    than ``MAX_CHECK_REQUEST_BYTES``."""
    try:
        request = next(requests, None)
    except grpc.RpcError:  # grpc's request iterator: the client went away
        raise Cancelled("the client cancelled the call") from None
    if request is None:
        raise InvalidArgument("the call carries no request message")
    if len(request) > MAX_CHECK_REQUEST_BYTES:
        raise ResourceExhausted(
            f"request of {len(request)} bytes; at most {MAX_CHECK_REQUEST_BYTES} "
            "are parsed without credentials"
        )
    return request


_MESSAGE = (
    "missing or invalid credentials: send metadata 'authorization: Bearer <token>'"
)


def _refuse(_requests: Iterator[Any], _context: grpc.ServicerContext) -> Any:
    raise Unauthenticated(_MESSAGE)


#: Any method's refusal: request-streaming, so grpc calls it at once and no
#: request is read or parsed.
_REFUSAL: Handler = grpc.stream_unary_rpc_method_handler(_refuse)
