"""The HTTP guard: 400 for a bad ``vllm_xargs.output_rate_user`` and for beam
search, everything else passed through byte for byte (a real ASGI app)."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine_ext.http_guard import OutputRateRequestGuard, check_request_body


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"echo": (await request.body()).decode()})


APP = OutputRateRequestGuard(
    Starlette(
        routes=[
            Route("/v1/completions", echo, methods=["POST"]),
            Route("/v1/chat/completions", echo, methods=["POST"]),
            Route("/other", echo, methods=["POST"]),
        ]
    )
)


async def post(path: str, content: bytes) -> httpx.Response:
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=content)


@pytest.mark.parametrize(
    ("xargs", "reason"),
    [
        ({"output_rate_user": 5}, "must be a string, got int"),
        ({"output_rate_user": ["a"]}, "must be a string, got list"),
        ({"output_rate_user": ""}, "must not be empty"),
        ({"output_rate_user": "a" * 257}, "at most 256 bytes"),
        ({"output_rate_user": "a\x00b"}, "control characters"),
    ],
)
@pytest.mark.anyio
async def test_bad_user_gets_400_naming_the_field(xargs, reason):
    body = json.dumps({"prompt": "x", "vllm_xargs": xargs}).encode()
    response = await post("/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert reason in error["message"]
    assert "vllm_xargs.output_rate_user" in error["message"]
    assert error["code"] == 400


@pytest.mark.anyio
async def test_beam_search_gets_400():
    body = json.dumps({"messages": [], "use_beam_search": True}).encode()
    response = await post("/v1/chat/completions", body)
    assert response.status_code == 400
    assert "beam search" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "vllm_xargs": {"output_rate_user": "alice"}}',
        b'{"prompt": "x"}',
        b"not json at all",
        b"[1, 2]",
        ("é" * 5000).encode(),
    ],
)
@pytest.mark.anyio
async def test_valid_or_foreign_bodies_pass_through_unchanged(body):
    response = await post("/v1/completions", body)
    assert response.status_code == 200
    assert response.json()["echo"] == body.decode()


@pytest.mark.anyio
async def test_other_paths_are_not_inspected():
    body = b'{"vllm_xargs": {"output_rate_user": 5}}'
    response = await post("/other", body)
    assert response.status_code == 200


def test_check_request_body_accepts_a_user_at_the_byte_limit():
    assert (
        check_request_body(
            json.dumps({"vllm_xargs": {"output_rate_user": "é" * 128}}).encode()
        )
        is None
    )
    assert check_request_body(
        json.dumps({"vllm_xargs": {"output_rate_user": "é" * 129}}).encode()
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
