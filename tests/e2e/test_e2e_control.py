"""End to end: a limit changed over gRPC mid-stream shows in the stream itself."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.measure import StreamResult, most_tokens, run_streams

pytestmark = pytest.mark.server

SLOW, FAST = 10, 50


def tokens_between(result: StreamResult, start: float, end: float) -> int:
    return sum(start <= t < end for t in result.token_times)


def first_to_last_rate(result: StreamResult, start: float, end: float) -> float:
    """Tokens that reached the client in ``[start, end)`` over the span from the
    first to the last of them: a client's delays stretch it by the last one's
    delay at most, so it serves a floor (see ``tools.measure``)."""
    times = [t for t in result.token_times if start <= t < end]
    assert len(times) >= 2, f"{len(times)} tokens in [{start:.3f}, {end:.3f})"
    return len(times) / (times[-1] - times[0])


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
    (raise_sent, raised), (lower_sent, lowered) = changes["raised"], changes["lowered"]
    # Ceiling: the first k tokens were charged between the request being sent and
    # the k-th token's arrival, under SLOW until the raise was sent at the
    # earliest and FAST until the lowering returned at the latest. Past the
    # lowering it allows SLOW's burst only: a fresh burst there would exceed it.
    limits = [(result.started_at, SLOW), (raise_sent, FAST), (lowered, SLOW)]
    headroom = [
        (most_tokens(limits, t) - k, k, t)
        for k, t in enumerate(result.token_times, start=1)
    ]
    least, k, t = min(headroom)
    speed_up_s = first_time_at_rate(result, raised, FAST)
    fast = first_to_last_rate(result, raised + 1, lower_sent)
    slow = first_to_last_rate(result, lowered + 1, float("inf"))
    print(
        f"\nthe RPC took {raised - raise_sent:.3f} s; {FAST} tok/s reached "
        f"{speed_up_s:.3f} s after it returned; {fast:.1f} tok/s from 1 s after "
        f"raising, {slow:.1f} tok/s from 1 s after lowering; closest to the "
        f"ceiling: {least:.2f} tokens below it, at token {k}, "
        f"{t - result.started_at:.3f} s after sending"
    )
    assert least >= 0, f"token {k} came {-least:.2f} tokens above the ceiling"
    assert speed_up_s <= 1.0
    assert fast >= 0.9 * FAST
    assert slow >= 0.9 * SLOW
