"""``schedule()`` cost with teams vs the same users without (the goal: within
1.05x), measured side by side in one run.

``schedule()`` + ``update_from_output()`` per step of our scheduler on vLLM's
real ``Scheduler`` and KV manager with controlled outputs, timed on the
scheduling thread's CPU (``benchmarks.compare_stock.cpu_timer``), pacing on at
``MAX_RATE`` (no cap binds): R requests of U users all decoding, and on the
teams side every user a member of one of T teams whose rates are far above
what its members take (``pacing.teams``: each token charged to the user and to
its team). The two schedulers are stepped in turn, A B then B A, and each
repeat is a fresh pair; each side's figure is its median over the repeats.
Beside the ratio: the share of steps that ran as free steps on each side (a
team's promises keep its members out of paced steps while it does not bind).

``python -m benchmarks.team_schedule_cost [--requests 1024] [--users 1000]
[--teams 100] [--repeats 5] [--steps 200]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.compare_stock import MAX_STEPS, _user, cpu_timer, decoding
from benchmarks.table import Row, ratio_of_medians, render
from pacing.limiter import MAX_RATE
from tools.scheduler_harness import Driver
from tools.tiny_model import ensure_tiny_model

GOAL = "≤ 1.05x"
STEPS = 200


def _side(model_dir: str, requests: int, users: int, teams: int) -> tuple[Any, Driver]:
    output_rate: dict[str, object] = {}
    if teams:
        output_rate = {
            "team_rates": {f"team-{t}": MAX_RATE for t in range(teams)},
            "team_members": {_user(i): f"team-{i % teams}" for i in range(users)},
        }
    return decoding(
        model_dir,
        requests,
        users,
        False,
        default_rate=MAX_RATE,
        output_rate=output_rate,
    )


def _free_steps(scheduler: Any, driver: Driver, steps: int) -> float:
    """The share of ``steps`` more steps that were free (nobody constrained)."""
    free = 0
    for _ in range(steps):
        free += not scheduler._users.constrained
        driver.step(step_ms=10.0)
    return free / steps


def time_pair(
    model_dir: str, requests: int, users: int, teams: int, steps: int
) -> tuple[float, float, float, float]:
    """One repeat: seconds per step without and with teams, and each side's
    share of free steps."""
    sides = [_side(model_dir, requests, users, n) for n in (0, teams)]
    timers = [cpu_timer(scheduler) for scheduler, _ in sides]
    gc.collect()
    for step in range(steps):
        for _, driver in sides if step % 2 == 0 else reversed(sides):
            driver.step(step_ms=10.0)
    plain, teamed = (timer() / steps for timer in timers)
    free = [_free_steps(scheduler, driver, 20) for scheduler, driver in sides]
    return plain, teamed, free[0], free[1]


def measure(
    model_dir: str, requests: int, users: int, teams: int, steps: int, repeats: int
) -> list[Row]:
    time_pair(model_dir, requests, users, teams, 5)  # first-use costs, not kept
    runs = [time_pair(model_dir, requests, users, teams, steps) for _ in range(repeats)]
    plain = [run[0] for run in runs]
    teamed = [run[1] for run in runs]
    ratios = [b / a for a, b in zip(plain, teamed, strict=True)]
    return [
        Row(
            f"1 step, R={requests} U={users}: {teams} teams / no teams",
            f"{statistics.median(plain) * 1e6:.0f} µs",
            f"{statistics.median(teamed) * 1e6:.0f} µs",
            f"{ratio_of_medians(teamed, plain):.3f}x",
            GOAL,
        ),
        Row(
            "  teams / no teams in each repeat, lowest to highest",
            ratio=f"{min(ratios):.3f}-{max(ratios):.3f}x",
        ),
        Row(
            "  free steps",
            f"{statistics.median(run[2] for run in runs):.0%}",
            f"{statistics.median(run[3] for run in runs):.0%}",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--teams", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS, help="timed, per repeat")
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= MAX_STEPS:
        parser.error(f"--steps must be in 1..{MAX_STEPS} (the model's context)")
    if not 1 <= args.teams <= args.users:
        parser.error("--teams must be in 1..--users")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{os.cpu_count()} cores, load average {load} at start; 'stock' is the "
        "same users without teams, 'ours' with teams; "
        f"{args.steps} steps per repeat, median of {args.repeats}",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-team-cost-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    rows = measure(
        model_dir, args.requests, args.users, args.teams, args.steps, args.repeats
    )
    print(render(rows))


if __name__ == "__main__":
    main()
