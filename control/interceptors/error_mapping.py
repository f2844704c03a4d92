"""The one place where errors become gRPC status codes, and where RPCs are
counted per method and code."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from control.errors import ControlError
from control.interceptors._handlers import Call, Handler, around_calls
from control.rpc_counts import RpcCounts

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Ends a call that raised ``ControlError`` with its status code and message,
    any other exception with INTERNAL (details logged, not sent), and counts
    every call of an implemented method in ``counts`` by (method, code)."""

    def __init__(self, counts: RpcCounts) -> None:
        self._counts = counts

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED; not counted (unbounded keys)
        method = handler_call_details.method
        counts = self._counts

        @contextlib.contextmanager
        def mapped(call: Call) -> Iterator[None]:
            try:
                yield
            except Exception as exc:
                _abort(method, exc, call)
            finally:
                counts.add(method, call.code().name)

        return around_calls(handler, mapped)


def _abort(method: str, exc: Exception, call: Call) -> NoReturn:
    """Ends the call with the status ``exc`` maps to (``context.abort`` raises)."""
    if isinstance(exc, ControlError):
        status, details = grpc.StatusCode[exc.code], str(exc)
    elif call.code() != grpc.StatusCode.OK:
        raise exc  # the servicer aborted the call itself: keep its status
    else:
        logger.exception("%s failed", method)
        status, details = grpc.StatusCode.INTERNAL, "internal error (logged by server)"
    call.context.abort(status, details)
