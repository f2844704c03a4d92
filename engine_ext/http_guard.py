"""ASGI middleware that rejects, with HTTP 400, requests the engine must not see:
an invalid ``vllm_xargs.output_rate_user`` and beam search."""

from __future__ import annotations

import json
from typing import Any

from engine_ext.identity import USER_FIELD, validate_user

#: Endpoints whose body can carry ``vllm_xargs``.
GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def check_request_body(body: bytes) -> str | None:
    """The reason to reject a completion/chat request body, or None to pass it on.

    Bodies that are not a JSON object are passed on: vLLM reports those itself.
    """
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    if payload.get("use_beam_search"):
        return "beam search is not supported with per-user output pacing"
    xargs = payload.get("vllm_xargs")
    if isinstance(xargs, dict) and USER_FIELD in xargs:
        try:
            validate_user(xargs[USER_FIELD])
        except ValueError as exc:
            return str(exc)
    return None


class OutputRateRequestGuard:
    """Buffers the body of guarded POSTs, answers 400 for a bad one, and replays
    the body unchanged to the app otherwise."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if not (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GUARDED_PATHS
        ):
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
        reason = check_request_body(body)
        if reason is not None:
            await _send_bad_request(send, reason)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _send_bad_request(send: Any, message: str) -> None:
    payload = json.dumps(
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": f"vllm_xargs.{USER_FIELD}"
                if "vllm_xargs" in message
                else None,
                "code": 400,
            }
        }
    ).encode()
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
