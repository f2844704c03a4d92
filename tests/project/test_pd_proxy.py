"""The toy prefill/decode router (``tools.pd_proxy``) against two fake
upstreams on loopback: the prefill server gets the request first with one
output token and no stream, the decode server then gets it unchanged, and the
decode server's stream is passed back; a prefill error stops the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from aiohttp import web

from tools.local_server import free_port
from tools.pd_proxy import make_app, prefill_body

BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 30,
    "min_tokens": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
    "vllm_xargs": {"output_rate_user": "u"},
}


def test_the_prefill_request_asks_for_one_token_unstreamed() -> None:
    assert prefill_body(BODY) == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "vllm_xargs": {"output_rate_user": "u"},
    }
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat == {"messages": [], "max_tokens": 1, "max_completion_tokens": 1}


@asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _route(prefill_status: int) -> tuple[list[tuple[str, dict]], httpx.Response]:
    """One streamed request through the router; what each upstream got, in
    order, and the router's answer."""
    seen: list[tuple[str, dict]] = []

    async def prefill(request: web.Request) -> web.Response:
        seen.append(("prefill", await request.json()))
        return web.json_response(
            {"error": "no"} if prefill_status != 200 else {}, status=prefill_status
        )

    async def decode(request: web.Request) -> web.StreamResponse:
        seen.append(("decode", await request.json()))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in ('{"n": 1}', '{"n": 2}', "[DONE]"):
            await response.write(f"data: {data}\n\n".encode())
        return response

    prefill_app, decode_app = web.Application(), web.Application()
    prefill_app.router.add_post("/v1/completions", prefill)
    decode_app.router.add_post("/v1/completions", decode)
    async with (
        _serving(prefill_app) as prefill_url,
        _serving(decode_app) as decode_url,
        _serving(make_app(prefill_url, decode_url)) as proxy_url,
        httpx.AsyncClient(base_url=proxy_url) as client,
    ):
        answer = await client.post("/v1/completions", json=BODY)
    return seen, answer


def test_the_decode_servers_stream_follows_the_prefill() -> None:
    seen, answer = asyncio.run(_route(200))
    assert seen == [("prefill", prefill_body(BODY)), ("decode", BODY)]
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'


def test_a_prefill_error_is_answered_without_decoding() -> None:
    seen, answer = asyncio.run(_route(400))
    assert [name for name, _ in seen] == ["prefill"]
    assert answer.status_code == 400
    assert json.loads(answer.text) == {"error": "no"}
