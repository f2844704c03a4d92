"""End to end: a limit changed over gRPC mid-stream shows in the stream itself."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine_ext.measure import StreamResult, run_streams
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.server

SLOW, FAST = 10, 50


def tokens_between(result: StreamResult, start: float, end: float) -> int:
    return sum(start <= t < end for t in result.token_times)


def first_time_at_rate(result: StreamResult, since: float, rate: float) -> float:
    """Seconds after ``since`` until a 0.5 s window of the stream first holds
    90 % of ``rate`` (tokens are counted from the window's first token)."""
    for t in result.token_times:
        if t >= since and tokens_between(result, t, t + 0.5) >= 0.9 * rate * 0.5:
            return t - since
    raise AssertionError(f"the stream never reached {rate} tok/s after the change")


def test_rate_change_mid_stream_takes_effect_within_a_second(vllm_server):
    channel = grpc.insecure_channel(vllm_server.control_address)
    stub = pb_grpc.OutputRateControlStub(channel)
    limit = pb.Limit(name="limits/user-live", tokens_per_second=SLOW)
    stub.UpdateLimit(pb.UpdateLimitRequest(limit=limit, allow_missing=True))
    changes: dict[str, tuple[float, float]] = {}

    def set_rate(rate: int) -> tuple[float, float]:
        """Changes the limit; returns when the RPC was sent and when it returned
        (the change lands in between: persisted first, then applied)."""
        limit = pb.Limit(name="limits/user-live", tokens_per_second=rate)
        sent = time.monotonic()
        stub.UpdateLimit(pb.UpdateLimitRequest(limit=limit))
        return sent, time.monotonic()

    async def scenario() -> StreamResult:
        task = asyncio.create_task(
            run_streams(vllm_server.base_url, vllm_server.model, [("user-live", 240)])
        )
        await asyncio.sleep(4)  # well past the stream's first tokens
        changes["raised"] = await asyncio.to_thread(set_rate, FAST)
        await asyncio.sleep(3)
        changes["lowered"] = await asyncio.to_thread(set_rate, SLOW)
        (result,) = await task
        return result

    try:
        result = asyncio.run(scenario())
    finally:
        channel.close()
    assert result.completion_tokens == 240
    (raise_sent, raised), (_, lowered) = changes["raised"], changes["lowered"]
    before = tokens_between(result, raise_sent - 2, raise_sent)
    speed_up_s = first_time_at_rate(result, raised, FAST)
    after_raise = tokens_between(result, raised + 1, raised + 2)
    after_lower = tokens_between(result, lowered + 1, lowered + 3) / 2
    print(
        f"\n{before / 2:.1f} tok/s before; the RPC took {raised - raise_sent:.3f} s; "
        f"{FAST} tok/s reached {speed_up_s:.3f} s after it returned; "
        f"{after_raise} tok/s in the 2nd second; "
        f"{after_lower:.1f} tok/s from 1 s after lowering"
    )
    assert before <= 2 * SLOW * 1.1 + 1
    assert speed_up_s <= 1.0
    assert 0.9 * FAST <= after_raise <= FAST * 1.1 + 1
    # Lowered: no fresh burst, the slow pace within a second.
    assert tokens_between(result, lowered, lowered + 1) <= FAST * 0.15 + SLOW + 1
    assert 0.9 * SLOW <= after_lower <= SLOW * 1.1 + 1
