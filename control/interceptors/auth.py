"""Bearer-token authentication of every call except health checks."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from control.errors import Unauthenticated
from control.interceptors._handlers import (
    Behavior,
    Handler,
    StreamBehavior,
    wrap_handler,
)

#: Health checks stay open: probes (kubelet, load balancers) carry no token.
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls whose ``authorization`` metadata is not ``Bearer <token>``
    with UNAUTHENTICATED (raised as ``Unauthenticated`` for the error mapping)."""

    def __init__(
        self, token: str, *, exempt_prefixes: Sequence[str] = (HEALTH_PREFIX,)
    ):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = _digest(f"Bearer {token}".encode())
        self._exempt = tuple(exempt_prefixes)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if (
            handler is None
            or handler_call_details.method.startswith(self._exempt)
            or self._authorized(handler_call_details.invocation_metadata)
        ):
            return handler
        return wrap_handler(handler, unary=_refuse, streaming=_refuse)

    def _authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        values = [v for k, v in metadata or () if k == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        # Digests have one length, so the comparison time reveals nothing about
        # the token, not even its length.
        return hmac.compare_digest(_digest(values[0].encode()), self._expected)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


_MESSAGE = (
    "missing or invalid credentials: send metadata 'authorization: Bearer <token>'"
)


def _refuse(_behavior: Behavior | StreamBehavior) -> Behavior:
    """A behaviour raising Unauthenticated when called; for a streaming method
    the error mapping's generator calls it, so it serves both kinds."""

    def refuse(_request: Any, _context: grpc.ServicerContext) -> Any:
        raise Unauthenticated(_MESSAGE)

    return refuse
