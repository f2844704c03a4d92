"""ASGI middleware that rejects, with HTTP 400, requests the engine must not see:
an invalid ``output_rate_user`` and beam search, on every vLLM endpoint whose
body can name a user (``GUARDED_PATHS``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

# The function Starlette's router matches paths with: the guard must see the
# same path as the router, with or without ``--root-path``. Private, so a
# Starlette that moved it fails at import, not silently.
from starlette._utils import get_route_path

from pacing.identity import USER_FIELD, validate_user

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(f"vllm.{__name__}")


class BodyShape(NamedTuple):
    """Where a guarded endpoint's JSON body carries what the guard checks."""

    #: Keys from the body's top level to the dict vLLM hands the engine as
    #: ``SamplingParams.extra_args``.
    xargs: tuple[str, ...]
    #: Whether the body's top-level ``use_beam_search`` is honoured.
    beam_search: bool
    #: Whether vLLM answers this endpoint's errors in Anthropic's format.
    anthropic_errors: bool = False


_OPENAI = BodyShape(("vllm_xargs",), beam_search=True)
_NO_BEAM = BodyShape(("vllm_xargs",), beam_search=False)

#: Every vLLM 0.32 endpoint whose body can carry a user id (checked against
#: vLLM's own routes by tests/test_http_guard.py), and its body's shape.
GUARDED_PATHS: Mapping[str, BodyShape] = MappingProxyType(
    {
        "/v1/completions": _OPENAI,
        "/v1/chat/completions": _OPENAI,
        # Not a declared field, but vLLM copies extra fields into each
        # conversation's ChatCompletionRequest.
        "/v1/chat/completions/batch": _OPENAI,
        "/v1/responses": _NO_BEAM,
        "/v1/messages": BodyShape(
            ("vllm_xargs",), beam_search=False, anthropic_errors=True
        ),
        # SageMaker: dispatches a completion or chat body to those handlers.
        "/invocations": _OPENAI,
        # Scale-out (--enable-scale-out, --tokens-only): render only builds the
        # engine input, generate submits it.
        "/v1/completions/render": _OPENAI,
        "/v1/chat/completions/render": _OPENAI,
        "/v1/responses/render": _NO_BEAM,
        "/v1/messages/render": _NO_BEAM,
        "/inference/v1/generate": BodyShape(
            ("sampling_params", "extra_args"), beam_search=False
        ),
    }
)

#: vLLM reads ``use_beam_search`` as a pydantic ``bool`` (lax: "true", "on", 1...).
_PYDANTIC_BOOL = TypeAdapter(bool)


class Rejection(NamedTuple):
    """Why a body is answered with 400, and the body field to blame (if any)."""

    message: str
    param: str | None


def check_request_body(body: bytes, shape: BodyShape) -> Rejection | None:
    """The reason to reject a guarded endpoint's ``body``, or None to pass it on.

    A body that ``json.loads`` cannot parse (invalid JSON or UTF-8, an integer
    beyond Python's digit limit) is passed on: vLLM parses the same bytes with the
    same function in the same process, so it fails the same way and answers 400
    itself. A body nested too deep for the parser's recursion limit is rejected
    here: that limit depends on the stack depth, so vLLM, parsing it elsewhere,
    might read a user this guard never checked. There is no size limit beyond
    vLLM's own (none): the body is buffered once and replayed.
    """
    try:
        payload = json.loads(body)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, too many digits
        return None
    except RecursionError:
        return Rejection(
            "request body is nested too deeply to check "
            f"{'.'.join(shape.xargs)}.{USER_FIELD}",
            None,
        )
    if not isinstance(payload, dict):
        return None
    if shape.beam_search and _asks_for_beam_search(payload):
        return Rejection(
            "beam search is not supported with per-user output pacing",
            "use_beam_search",
        )
    xargs: Any = payload
    for key in shape.xargs:
        if not isinstance(xargs, dict):
            return None  # not the shape vLLM accepts: vLLM answers 400
        xargs = xargs.get(key)
    if isinstance(xargs, dict) and USER_FIELD in xargs:
        field = f"{'.'.join(shape.xargs)}.{USER_FIELD}"
        try:
            validate_user(xargs[USER_FIELD], field=field)
        except ValueError as exc:
            return Rejection(str(exc), field)
    return None


def _asks_for_beam_search(payload: dict[str, Any]) -> bool:
    try:
        return _PYDANTIC_BOOL.validate_python(payload.get("use_beam_search", False))
    except ValidationError:
        return False  # vLLM rejects the value itself


class OutputRateRequestGuard:
    """Buffers the body of POSTs to ``GUARDED_PATHS``, answers 400 for a bad one,
    and replays the body unchanged to the app otherwise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        shape = (
            GUARDED_PATHS.get(get_route_path(scope))
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if shape is None:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            rejection = check_request_body(body, shape)
        except Exception:
            # Fail closed: a request whose user was not checked must not reach
            # the engine, and a bug here must not become a 500.
            logger.exception("output-rate guard failed on a %s body", scope["path"])
            rejection = Rejection("request body could not be checked", None)
        if rejection is not None:
            await _send_bad_request(send, rejection, shape)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _send_bad_request(send: Send, rejection: Rejection, shape: BodyShape) -> None:
    """Answers 400 in the error format vLLM uses on that endpoint."""
    if shape.anthropic_errors:
        error: dict[str, Any] = {
            "type": "error",
            "error": {"type": "BadRequestError", "message": rejection.message},
        }
    else:
        error = {
            "error": {
                "message": rejection.message,
                "type": "BadRequestError",
                "param": rejection.param,
                "code": 400,
            }
        }
    payload = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
