"""What pacing costs the scheduler per step, side by side in one run: vLLM's
``Scheduler.schedule()`` vs ours (limit never reached, and every user throttled),
on the real scheduler and KV manager with controlled outputs (no model).

``python -m benchmarks.scheduler_overhead [--requests 64] [--steps 2000]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler

from tools.fake_clock import FakeClock
from tools.scheduler_harness import Driver, make_request, make_scheduler
from tools.tiny_model import ensure_tiny_model


def time_steps(model_dir: str, requests: int, steps: int, **kwargs) -> float:
    """Mean seconds per schedule()+update_from_output() over ``steps`` steps of
    ``requests`` decoding streams of 8 users."""
    clock = FakeClock()
    scheduler = make_scheduler(
        model_dir, clock=clock, max_num_seqs=requests, num_blocks=20_000, **kwargs
    )
    driver = Driver(scheduler, clock)
    driver.add(
        make_request(f"user-{i % 8}", prompt_len=16, max_tokens=10 * steps)
        for i in range(requests)
    )
    driver.run(5)  # prefill done, all decoding
    started = time.perf_counter()
    driver.run(steps, step_ms=1)
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model_dir = str(ensure_tiny_model(Path(tempfile.gettempdir()) / "tiny-bench"))
    variants = {
        "upstream": dict(default_rate=None, scheduler_cls=Scheduler),
        "paced, limit not reached": dict(default_rate=1_000_000),
        "paced, every user throttled": dict(default_rate=1),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for kwargs in variants.values():  # warm-up: first-use costs, not kept
        time_steps(model_dir, args.requests, 50, **kwargs)
    for _ in range(args.rounds):  # interleaved, so drift hits all alike
        for name, kwargs in variants.items():
            results[name].append(
                time_steps(model_dir, args.requests, args.steps, **kwargs)
            )
    base = statistics.median(results["upstream"])
    print(f"{args.requests} running requests, {args.steps} steps, {args.rounds} rounds")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<30} {median * 1e6:8.1f} µs/step  x{median / base:.2f}")


if __name__ == "__main__":
    main()
