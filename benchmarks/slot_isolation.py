"""Slots go to users with budget, on a real local vLLM server:
one throttled user fills every slot (``--max-num-seqs``) with parked streams,
then another user's request arrives. Prints that request's latency beside its
latency on the idle server, and the preemptions it cost.

``python -m benchmarks.slot_isolation [--slow-streams 32] [--crowd 100 20]``

``--crowd S N`` also runs the crowd case: S streams of the throttled user and N
requests of other users at once; prints the others' median time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.local_server import free_port, start_server
from tools.measure import StreamResult, stream_completion
from tools.tiny_model import ensure_tiny_model

SLOW_USER, SLOW_RATE, SLOW_TOKENS = "user-slow", 5, 4
PROBE_USER, PROBE_TOKENS = "user-probe", 4
MAX_NUM_SEQS = 32


@dataclass
class LockoutResult:
    idle_latency_s: float  #: median latency of the probe on the idle server
    latency_s: float  #: the probe's latency with every slot held by parked streams
    preemptions: int  #: preemptions of the throttled user's requests meanwhile
    slow: list[StreamResult]


def user_state(control_address: str, user: str) -> pb.UserState:
    with grpc.insecure_channel(control_address) as channel:
        stub = pb_grpc.OutputRateControlStub(channel)
        return stub.GetUserState(
            pb.GetUserStateRequest(name=f"userStates/{user}"), timeout=10
        )


async def wait_for_running(
    control_address: str, user: str, count: int, timeout_s: float = 60.0
) -> None:
    """Until the scheduler holds ``count`` running requests of ``user``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if user_state(control_address, user).running_requests >= count:
                return
        except grpc.RpcError as exc:  # NOT_FOUND until the user's first request
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{user} never had {count} running requests")


async def lockout(
    base_url: str,
    model: str,
    control_address: str,
    *,
    slow_streams: int = MAX_NUM_SEQS,
) -> LockoutResult:
    """The reproduction: ``slow_streams`` streams of the throttled user hold
    every slot, then one request of another user."""
    limits = httpx.Limits(max_connections=slow_streams + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as c:
        idle = [
            await stream_completion(c, model, PROBE_USER, PROBE_TOKENS)
            for _ in range(3)
        ]
        slow_tasks = [
            asyncio.create_task(stream_completion(c, model, SLOW_USER, SLOW_TOKENS))
            for _ in range(slow_streams)
        ]
        await wait_for_running(control_address, SLOW_USER, slow_streams)
        before = user_state(control_address, SLOW_USER).throttled_preemptions
        probe = await stream_completion(c, model, PROBE_USER, PROBE_TOKENS)
        slow = await asyncio.gather(*slow_tasks)
        after = user_state(control_address, SLOW_USER).throttled_preemptions
    return LockoutResult(
        idle_latency_s=statistics.median(_latency(r) for r in idle),
        latency_s=_latency(probe),
        preemptions=after - before,
        slow=slow,
    )


async def crowd(
    base_url: str, model: str, control_address: str, slow: int, others: int
) -> float:
    """Median time to first token of ``others`` requests sent beside ``slow``
    streams of the throttled user (sent first)."""
    limits = httpx.Limits(max_connections=slow + others + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as c:
        slow_tasks = [
            asyncio.create_task(stream_completion(c, model, SLOW_USER, SLOW_TOKENS))
            for _ in range(slow)
        ]
        await wait_for_running(control_address, SLOW_USER, min(slow, MAX_NUM_SEQS))
        results = await asyncio.gather(
            *(
                stream_completion(c, model, f"user-crowd-{i}", PROBE_TOKENS)
                for i in range(others)
            )
        )
        await asyncio.gather(*slow_tasks)
    return statistics.median(r.token_times[0] - r.started_at for r in results)


def _latency(result: StreamResult) -> float:
    return result.finished_at - result.started_at


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-streams", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--crowd", type=int, nargs=2, metavar=("SLOW", "OTHERS"))
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-bench-"))
    model_dir = str(ensure_tiny_model(workdir / "model"))
    control = f"127.0.0.1:{free_port()}"
    server = start_server(
        model_dir,
        workdir / "vllm.log",
        [
            "--max-num-active-seqs",
            "8",
            "--default-user-output-tokens-per-second",
            "1000",
            "--user-output-tokens-per-second",
            json.dumps({SLOW_USER: SLOW_RATE}),
            "--output-rate-control-address",
            control,
            *args.server_arg,
        ],
    )
    try:
        result = asyncio.run(
            lockout(server.base_url, model_dir, control, slow_streams=args.slow_streams)
        )
        complete = sum(r.completion_tokens == SLOW_TOKENS for r in result.slow)
        print(
            f"probe ({PROBE_TOKENS} tokens): idle {result.idle_latency_s:.3f} s, "
            f"beside {args.slow_streams} parked streams {result.latency_s:.3f} s "
            f"({result.latency_s / result.idle_latency_s:.1f}x); "
            f"preemptions {result.preemptions}; "
            f"slow streams complete {complete}/{len(result.slow)}"
        )
        if args.crowd:
            slow, others = args.crowd
            ttft = asyncio.run(crowd(server.base_url, model_dir, control, slow, others))
            print(
                f"crowd: {others} requests beside {slow} throttled streams: "
                f"median time to first token {ttft:.3f} s"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
