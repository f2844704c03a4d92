"""A toy prefill/decode router for two vLLM servers that share KV through a KV
connector (e.g. vLLM's shared-storage ``ExampleConnector``), as vLLM's
disaggregation examples route: each completion request goes first to the
prefill server with one output token, which computes the prompt's KV and
leaves it in the connector, then unchanged to the decode server, whose answer
(streamed or not) is passed back as it arrives.

The prefill server's one token is dropped here: the client never sees it.

    python -m tools.pd_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

``start_pd_proxy`` runs it as a child process for tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to both servers (auth, tracing, the request id).
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
STARTUP_TIMEOUT_S = 30.0
SESSION_KEY = web.AppKey("session", ClientSession)
PREFILL_KEY = web.AppKey("prefill", str)
DECODE_KEY = web.AppKey("decode", str)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: the same prompt and sampling, one output
    token, not streamed (``stream_options`` is refused without ``stream``;
    ``min_tokens`` above one would contradict the one token)."""
    prefill = {
        key: value
        for key, value in body.items()
        if key not in ("stream", "stream_options", "min_tokens")
    }
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:  # chat's newer name for it
        prefill["max_completion_tokens"] = 1
    return prefill


async def _route(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION_KEY]
    prefill_url, decode_url = request.app[PREFILL_KEY], request.app[DECODE_KEY]
    body = await request.json()
    headers = {
        name: value
        for name, value in request.headers.items()
        if name.lower() in FORWARDED_HEADERS
    }
    async with session.post(
        prefill_url + request.path, json=prefill_body(body), headers=headers
    ) as prefilled:
        answer = await prefilled.read()
        if prefilled.status != 200:  # the prefill server's error, as it is
            return web.Response(
                status=prefilled.status,
                body=answer,
                content_type=prefilled.content_type,
            )
    async with session.post(
        decode_url + request.path, json=body, headers=headers
    ) as decoded:
        response = web.StreamResponse(
            status=decoded.status,
            headers={"Content-Type": decoded.headers.get("Content-Type", "")},
        )
        await response.prepare(request)
        # Chunk by chunk as the decode server sends them: a stream's tokens
        # must not be held back here.
        async for chunk in decoded.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _session(app: web.Application):
    # No total timeout: a paced stream may last minutes.
    app[SESSION_KEY] = ClientSession(
        connector=TCPConnector(limit=0),
        timeout=ClientTimeout(total=None, sock_connect=10),
    )
    yield
    await app[SESSION_KEY].close()


def make_app(prefill_url: str, decode_url: str) -> web.Application:
    app = web.Application()
    app[PREFILL_KEY] = prefill_url.rstrip("/")
    app[DECODE_KEY] = decode_url.rstrip("/")
    app.cleanup_ctx.append(_session)
    for path in ROUTED_PATHS:
        app.router.add_post(path, _route)
    app.router.add_get("/health", _health)
    return app


@dataclass
class PdProxy:
    """The router running as a child process."""

    process: subprocess.Popen
    base_url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def start_pd_proxy(
    prefill_url: str, decode_url: str, port: int, log_path: Path
) -> PdProxy:
    """Starts the router on 127.0.0.1:``port`` and waits until it answers."""
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.pd_proxy",
            "--prefill",
            prefill_url,
            "--decode",
            decode_url,
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proxy = PdProxy(process, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pd_proxy exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{proxy.base_url}/health", timeout=2).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proxy.stop()
    raise RuntimeError(f"pd_proxy not up in {STARTUP_TIMEOUT_S} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill server URL")
    parser.add_argument("--decode", required=True, help="decode server URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    web.run_app(
        make_app(args.prefill, args.decode),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
