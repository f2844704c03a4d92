"""The one place where errors become gRPC status codes, and where RPCs are
counted per method and code."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from control.errors import ControlError
from control.interceptors._handlers import Behavior, StreamBehavior, wrap_handler
from control.stats import RpcCounts

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
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED; not counted (unbounded keys)
        method = handler_call_details.method
        counts = self._counts

        def unary(behavior: Behavior) -> Behavior:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return behavior(request, context)
                except Exception as exc:
                    _abort(method, exc, context)
                finally:
                    counts.add(method, _code_name(context))

            return call

        def streaming(behavior: StreamBehavior) -> StreamBehavior:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                code = None
                try:
                    yield from behavior(request, context)
                except GeneratorExit:  # the client went away mid-stream
                    code = grpc.StatusCode.CANCELLED.name
                    raise
                except Exception as exc:
                    _abort(method, exc, context)
                finally:
                    counts.add(method, code or _code_name(context))

            return call

        return wrap_handler(handler, unary=unary, streaming=streaming)


def _abort(method: str, exc: Exception, context: grpc.ServicerContext) -> NoReturn:
    """Ends the call with the status ``exc`` maps to (``context.abort`` raises)."""
    if isinstance(exc, ControlError):
        status, details = grpc.StatusCode[exc.code], str(exc)
    elif _code_name(context) != grpc.StatusCode.OK.name:
        raise exc  # the servicer aborted the call itself: keep its status
    else:
        logger.exception("%s failed", method)
        status, details = grpc.StatusCode.INTERNAL, "internal error (logged by server)"
    context.abort(status, details)


def _code_name(context: grpc.ServicerContext) -> str:
    """The name of the status the call ends with so far (OK unless set)."""
    code = context.code()
    return (code or grpc.StatusCode.OK).name
