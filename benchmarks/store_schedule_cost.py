"""``schedule()`` cost with a store vs without (the goal: within 1.05x, claims
are off the scheduling path), measured side by side in one run.

``schedule()`` + ``update_from_output()`` per step of our scheduler on vLLM's
real ``Scheduler`` and KV manager with controlled outputs, timed as
``benchmarks.compare_stock`` part 1 times it (``cpu_timer``: the calling
thread's CPU time), pacing on at ``MAX_RATE`` (no limit reached), R requests
of U users all decoding:

- local: the engine's own limiter is the budget (no store);
- store: what ``--output-rate-store`` runs in an engine (``store.runtime.attach``:
  ``StoreBudget`` over ``ClaimedBalances``, the background claimer and the
  limits sync) against a real ``redis-server`` on loopback
  (``tools.redis_server``): every token is spent from a claimed balance.

The two schedulers are stepped in turn, A B then B A, one step each, so that
drift of a shared machine hits both alike (here, repeats taken a whole timing
at a time, as part 1 takes them, gave ratios anywhere from 0.93 to 1.14 with
medians of 5); each repeat is a fresh pair, the figure each side's median
over the repeats. The claimer runs in real time, so the schedulers' clock is
real time too (``WallClock``), and each pair of steps is followed by a sleep
of ``STEP_MS``: the model's step, during which the claimer works as in a
server. The claimer's thread, its round trips and its passes under the lock
are not the scheduling thread's CPU time, and a step waiting for the lock or
the GIL waits without CPU: the ratio is what claims cost on the scheduling
path itself. Beside it: the budget's calls per step on each side, the tokens
the store side emitted (R per step unless it ran short of balance, which
would make it do less work), and the round trips and tokens the store granted
meanwhile.

``python -m benchmarks.store_schedule_cost [--requests 16,256] [--users 8,64]
[--repeats 5] [--steps 200]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compare_stock import (
    MAX_STEPS,
    STEP_MS,
    calls_per_step,
    cpu_timer,
    decoding,
)
from benchmarks.table import Row, ratio_of_medians, render
from pacing.limiter import MAX_RATE
from pacing.settings.store import StoreSettings
from store.runtime import RunningStore, attach
from tools.redis_server import redis_server
from tools.scheduler_harness import Driver
from tools.tiny_model import ensure_tiny_model

REQUESTS = (16, 256)
USERS = (8, 64)
#: Untimed steps after the store attaches: each user's claims grow from one
#: token to its demand (a claim covers the time since the last one).
WARMUP_STEPS = 40
#: Timed steps per repeat; with the warm-up's, the counted ones and
#: ``decoding``'s, every request stays below the tiny model's context (none
#: finishes meanwhile).
STEPS = 200
#: Steps after the timed ones in which the budget's calls are counted.
COUNTED_STEPS = 20
#: The budget source's operations (``pacing.budget.BudgetSource``) counted.
BUDGET_OPERATIONS = (
    "take_up_to",
    "take_each",
    "refund",
    "available",
    "ready_at_ns",
    "end_user",
)
GOAL = "≤ 1.05x"


class WallClock:
    """Monotonic nanoseconds that go on from ``start_ns`` in real time; a step
    of the model (``advance_ms``) is a sleep. Takes the place of the harness's
    fake clock: the claimer claims, lands and expires in real time."""

    def __init__(self, start_ns: int) -> None:
        self._offset = start_ns - time.monotonic_ns()

    def __call__(self) -> int:
        return time.monotonic_ns() + self._offset

    def advance_ms(self, ms: float) -> None:
        time.sleep(ms / 1000)


@dataclass(frozen=True)
class StoreTraffic:
    """What the claimer did during the timed steps (``StoreStats`` deltas)."""

    round_trips: int  #: answered
    failed: int
    granted: int  #: tokens


@dataclass(frozen=True)
class Timing:
    """One side of one repeat."""

    seconds_per_step: float  #: CPU of the scheduling thread, mean per step
    steps: int
    wall_s: float  #: the timed steps' wall time (both sides' and the sleeps)
    emitted: int  #: tokens sampled in the timed steps (R per step: none short)
    budget_calls: float  #: per step, after the timed steps (``calls_per_step``)
    store: StoreTraffic | None = None  #: during the timed steps, with a store


@dataclass
class _Side:
    """One engine: a scheduler, its driver, its store when it has one."""

    scheduler: Any
    driver: Driver
    running: RunningStore | None

    @classmethod
    def start(
        cls, model_dir: str, requests: int, users: int, store_url: str | None
    ) -> _Side:
        scheduler, driver = decoding(
            model_dir, requests, users, False, default_rate=MAX_RATE
        )
        clock = WallClock(driver.clock())
        # The shared limiter (and so the claimer) reads scheduler.clock.
        scheduler.clock = driver.clock = clock
        shared = scheduler.output_rate_shared
        running = attach(shared, StoreSettings(store_url)) if store_url else None
        return cls(scheduler, driver, running)

    def traffic(self) -> tuple[int, int, int]:
        """The store's answered and failed round trips and granted tokens so
        far (zeros without a store)."""
        shared = self.scheduler.output_rate_shared
        with shared.lock:
            stats = shared.store_stats
            if stats is None:
                return (0, 0, 0)
            return (
                stats.round_trips_answered,
                stats.round_trips_failed,
                stats.tokens_granted,
            )


def time_pair(
    model_dir: str, url: str, requests: int, users: int, steps: int
) -> dict[str, Timing]:
    """One repeat: a local and a store side, ``steps`` timed steps each, taken
    in turn (see the module docstring)."""
    sides: dict[str, _Side] = {}
    try:
        for name, store_url in (("local", None), ("store", url)):
            sides[name] = _Side.start(model_dir, requests, users, store_url)
        pair = list(sides.values())
        _step_in_turn(pair, WARMUP_STEPS)
        elapsed = [cpu_timer(side.scheduler) for side in pair]
        first = [len(side.driver.sampled) for side in pair]
        before = [side.traffic() for side in pair]
        gc.collect()
        started = time.monotonic()
        _step_in_turn(pair, steps)
        wall_s = time.monotonic() - started
        emitted = [
            sum(len(sampled) for sampled in side.driver.sampled[start:])
            for side, start in zip(pair, first, strict=True)
        ]
        after = [side.traffic() for side in pair]
        calls = [
            calls_per_step(
                side.scheduler.output_rate_shared.budget,
                side.driver,
                COUNTED_STEPS,
                BUDGET_OPERATIONS,
            )
            for side in pair
        ]
    finally:
        for side in sides.values():
            if side.running is not None:
                side.running.stop()
    timings = {}
    for k, (name, side) in enumerate(sides.items()):
        traffic = None
        if side.running is not None:
            traffic = StoreTraffic(
                *(a - b for a, b in zip(after[k], before[k], strict=True))
            )
        timings[name] = Timing(
            elapsed[k]() / steps, steps, wall_s, emitted[k], calls[k], traffic
        )
    return timings


def _step_in_turn(pair: list[_Side], steps: int) -> None:
    """``steps`` steps of each side, A B then B A, a model's step between."""
    for step in range(steps):
        for side in pair if step % 2 == 0 else reversed(pair):
            side.driver.step(step_ms=0)
        time.sleep(STEP_MS / 1000)


def measure(
    model_dir: str,
    url: str,
    requests: int,
    users: int,
    steps: int,
    repeats: int,
) -> list[Row]:
    """Both sides at R=``requests``, U=``users``, over ``repeats`` pairs."""
    time_pair(model_dir, url, requests, users, 5)  # first-use costs, not kept
    timings: dict[str, list[Timing]] = {"local": [], "store": []}
    for _ in range(repeats):
        for name, timing in time_pair(model_dir, url, requests, users, steps).items():
            timings[name].append(timing)
    return rows(requests, users, timings)


def rows(requests: int, users: int, timings: dict[str, list[Timing]]) -> list[Row]:
    """The ratio of medians (store over local), then what shows the store was
    used: the budget's calls per step on each side, the tokens the store side
    emitted against R per step, and its store traffic."""
    local, store = timings["local"], timings["store"]
    local_s = [t.seconds_per_step for t in local]
    store_s = [t.seconds_per_step for t in store]
    ratios = [b / a for a, b in zip(local_s, store_s, strict=True)]
    traffic = [t.store for t in store if t.store is not None]
    trips = sum(t.round_trips for t in traffic)
    return [
        Row(
            f"1 step, R={requests:<4} U={users:<3} store / local limiter",
            f"{statistics.median(local_s) * 1e6:.0f} µs",
            f"{statistics.median(store_s) * 1e6:.0f} µs",
            f"{ratio_of_medians(store_s, local_s):.3f}x",
            GOAL,
        ),
        Row(
            "  store / local in each repeat, lowest to highest",
            ratio=f"{min(ratios):.3f}-{max(ratios):.3f}x",
        ),
        Row(
            "  budget calls per step",
            f"{statistics.median(t.budget_calls for t in local):.1f}",
            f"{statistics.median(t.budget_calls for t in store):.1f}",
        ),
        Row(
            "  store side: tokens emitted / R x steps",
            ours=f"{sum(t.emitted for t in store):,} / "
            f"{requests * sum(t.steps for t in store):,}",
        ),
        Row(
            "  store side: tokens granted; round trips (failed), per s",
            ours=f"{sum(t.granted for t in traffic):,}; {trips:,} "
            f"({sum(t.failed for t in traffic)}), "
            f"{trips / sum(t.wall_s for t in store):.0f}/s",
        ),
    ]


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(part) for part in value.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=_ints, default=REQUESTS, help="R list")
    parser.add_argument("--users", type=_ints, default=USERS, help="U, one per R")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed, per repeat")
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    args = parser.parse_args(argv)
    if len(args.requests) != len(args.users):
        parser.error("--requests and --users pair up: give as many of each")
    if not 1 <= args.steps <= MAX_STEPS:
        parser.error(f"--steps must be in 1..{MAX_STEPS} (the model's context)")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{os.cpu_count()} cores, load average {load} at start; 'stock' is the "
        "local limiter (no store), 'ours' the store (redis-server on loopback); "
        f"{args.steps} steps per repeat, median of {args.repeats}",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-store-cost-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    table: list[Row] = []
    with redis_server() as url:
        for r, u in zip(args.requests, args.users, strict=True):
            part = measure(model_dir, url, r, u, args.steps, args.repeats)
            print(render(part), flush=True)
            table += part
    print()
    print(render(table))


if __name__ == "__main__":
    main()
