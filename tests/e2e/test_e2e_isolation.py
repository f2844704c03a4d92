"""End to end: slots go to users with budget. A throttled user
holding every slot (``--max-num-seqs`` 32 on the shared server) with parked
streams does not hold another user's request out."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.slot_isolation import MAX_NUM_SEQS, SLOW_TOKENS, SLOW_USER, lockout
from tests.conftest import SERVER_LIMITS

pytestmark = pytest.mark.server


def test_a_throttled_user_holding_every_slot_does_not_lock_others_out(vllm_server):
    assert SERVER_LIMITS["users"][SLOW_USER] == 5
    result = asyncio.run(
        lockout(vllm_server.base_url, vllm_server.model, vllm_server.control_address)
    )
    report = (
        f"probe: idle {result.idle_latency_s:.3f} s, beside {MAX_NUM_SEQS} parked "
        f"streams {result.latency_s:.3f} s; preemptions {result.preemptions}"
    )
    print(f"\n{report}")
    # The probe needed one slot: at most one parked request yielded for it.
    assert result.preemptions <= 1, report
    assert result.latency_s <= 2 * result.idle_latency_s + 0.5, report
    # Nothing truncated: every parked stream, the yielded one too, completes.
    for stream in result.slow:
        assert stream.completion_tokens == SLOW_TOKENS
        assert stream.finish_reason == "length"
