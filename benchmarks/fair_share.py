"""Weighted fair share (issue 22) against stock vLLM, measured side by side in
one run and printed as one table.

``python -m benchmarks.fair_share [--only server,scheduler] [--repeats 3]
[--pairs 2] [--users 1000] [--steps 300]``

- ``server``: the saturated workload of ``tools.fair_share_workload`` (8 slots,
  a flooder's 24 requests x 2,000 tokens, then three light users' 4 x 1,000,
  light requests streamed) on stock vLLM and on ours (caps at 100,000 tok/s,
  never binding), with fair share on and switched off live (FCFS); both
  servers up at once on the same CPUs, this client on the others
  (``benchmark_cpus``), runs taken in turn, the order reversed every repeat,
  then once more on a freshly started pair. Rows:
  1. output tok/s over the whole workload (completion tokens over the wall
  time from the first request sent to the last response), ours over stock,
  and each repeat's ratio (its runs follow one another);
  2. the light requests' time to first token under the flood, and alone on
  the idle server (ours); 3. Jain's index over the users' shares normalized to
  the max-min fair allocation (25 % each), and the smallest normalized share,
  on the server's counters, over the window of ``all_served_window``.
- ``scheduler``: 4. ``schedule()`` CPU time per call on vLLM's real
  ``Scheduler`` (``tools.scheduler_harness``, fake clock), 1,000 users with one
  or two requests each on 256 slots (most wait), pacing on (caps not binding),
  fair share on vs off, the two stepped in turn, the order alternating.

Goals are the issue's; printed beside the figures, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.compare_stock import _bind_env, check_servers
from benchmarks.table import Row, render
from engine_ext.scheduler import OutputRateScheduler
from pacing.limiter import MAX_RATE
from tools.fair_share_workload import (
    ENGINE_ARGS,
    FAIR_SHARE_ARGS,
    FLOOD_STREAMS,
    FLOOD_TOKENS,
    LIGHT,
    LIGHT_STREAMS,
    LIGHT_TOKENS,
    SLOTS,
    Window,
    WorkloadRun,
    all_served_window,
    backlogged_window,
    check_complete,
    jain_index,
    normalized_shares,
    run_workload,
    switch_fair_share,
    users,
)
from tools.local_server import (
    VllmServer,
    cpu_shares,
    start_paced_server,
    start_server,
)
from tools.scheduler_harness import BLOCK_SIZE, Driver, driven_scheduler, make_request
from tools.tiny_model import ensure_tiny_model

PARTS = ("server", "scheduler")
#: The server-side variants: stock vLLM, ours with fair share on, ours off.
VARIANTS = ("stock", "fair", "fcfs")

# -- 1-3. the saturated workload on real servers ----------------------------------


def benchmark_cpus() -> tuple[set[int], set[int]]:
    """CPUs for this client and for both servers (empty sets: one CPU, nothing
    confined). Both servers share one set and serve in turn, so each runs on
    the same CPUs as its baseline; measured here with each server on a CPU of
    its own and the client floating, runs of one server spread over 1,781-3,166
    tok/s and ours read 0.89-0.93x stock, against 0.95-0.99x with every server
    on one CPU and the client on the other."""
    if len(os.sched_getaffinity(0)) < 2:
        return set(), set()
    client, servers = cpu_shares(2)
    return client, servers


def start_pair(
    model_dir: str, workdir: Path, pair: int
) -> tuple[VllmServer, VllmServer]:
    """Ours (fair share on, control plane) and stock vLLM, started at once,
    then both confined to the servers' CPUs, this process to the client's."""
    client_cpus, server_cpus = benchmark_cpus()
    placement = workdir / f"pair-{pair}"
    (placement / "ours").mkdir(parents=True)
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(
            start_paced_server,
            model_dir,
            placement / "ours",
            {},
            [*FAIR_SHARE_ARGS, *ENGINE_ARGS],
            env=_bind_env(server_cpus),
        )
        stock = pool.submit(
            start_server,
            model_dir,
            placement / "stock.log",
            list(ENGINE_ARGS),
            stock=True,
            env=_bind_env(server_cpus),
        )
        servers = ours.result(), stock.result()
    if server_cpus:
        for server in servers:
            server.confine(server_cpus)
        os.sched_setaffinity(0, client_cpus)
    return servers


#: Per variant, its runs by name (the names the users are suffixed with).
Runs = dict[str, list[tuple[str, WorkloadRun]]]


def server_runs(ours: VllmServer, stock: VllmServer, repeats: int, tag: str) -> Runs:
    """``repeats`` runs of each variant in turn (the order reversed every
    repeat), and after each repeat the light users alone on ours."""
    runs: Runs = {v: [] for v in (*VARIANTS, "alone")}
    for k in range(repeats):
        order = VARIANTS if k % 2 == 0 else VARIANTS[::-1]
        for variant in (*order, "alone"):
            name = f"{variant}-{tag}-{k}"
            if variant != "stock":
                switch_fair_share(ours, variant != "fcfs")
            server = stock if variant == "stock" else ours
            run = run_workload(
                server, name, stream_light=True, flood=variant != "alone"
            )
            check_complete(run, name)
            runs[variant].append((name, run))
            print(f"  {name}: {run.tokens_per_s:,.0f} tok/s, {_ttft(run)}", flush=True)
            if variant in ("fair", "fcfs"):
                print(f"    {_fairness_text(run, name)}", flush=True)
    return runs


def repeat_ratios(rate: dict[str, list[float]]) -> list[float]:
    """Fair share on over stock, repeat by repeat: both runs of a repeat follow
    one another, so a slower spell of a shared machine hits both alike."""
    return [
        fair / stock for fair, stock in zip(rate["fair"], rate["stock"], strict=True)
    ]


def _ttfts(runs: Sequence[WorkloadRun]) -> list[float]:
    """The streamed (light) requests' times to first token, in seconds."""
    return [r.ttft_s for run in runs for r in run.requests if r.ttft_s is not None]


def _ttft(run: WorkloadRun) -> str:
    ttfts = _ttfts([run])
    return f"light TTFT median {statistics.median(ttfts):.2f} s, max {max(ttfts):.2f} s"


def windows(run: WorkloadRun, name: str) -> dict[str, Window | None]:
    """The two windows of a run on ours: while all four users are served (the
    e2e test's; none under FCFS, whose light users are served one after
    another) and while all four have requests in the server."""
    names, demand = users(name), LIGHT_STREAMS * LIGHT_TOKENS
    return {
        "served": all_served_window(run.reads, names, demand),
        "backlogged": backlogged_window(run, names, demand),
    }


def fairness(window: Window | None) -> tuple[float, float] | None:
    """Jain's index and the smallest normalized share over ``window`` (None
    without a window or tokens in it)."""
    if window is None or not sum(window.counts.values()):
        return None
    shares = normalized_shares(list(window.shares.values()))
    return jain_index(shares), min(shares)


def _fairness_text(run: WorkloadRun, name: str) -> str:
    parts = []
    for kind, window in windows(run, name).items():
        measured = fairness(window)
        if window is None or measured is None:
            parts.append(f"{kind}: none")
            continue
        shares = ", ".join(f"{share:.3f}" for share in window.shares.values())
        parts.append(
            f"{kind}: reads {window.first}..{window.last} of {len(run.reads)}, "
            f"{sum(window.counts.values()):,} tokens, shares {shares}, "
            f"Jain {measured[0]:.4f}, min normalized {measured[1]:.3f}"
        )
    return "; ".join(parts)


def server_rows(pairs: list[Runs]) -> list[Row]:
    named = {v: [named_run for p in pairs for named_run in p[v]] for v in pairs[0]}
    runs = {v: [run for _, run in named_runs] for v, named_runs in named.items()}
    rate = {v: [run.tokens_per_s for run in rs] for v, rs in runs.items()}
    mean = {v: statistics.mean(r) for v, r in rate.items()}
    ratios = repeat_ratios(rate)
    workload = (
        f"{FLOOD_STREAMS} x {FLOOD_TOKENS:,} + {len(LIGHT) * LIGHT_STREAMS} x "
        f"{LIGHT_TOKENS:,} tokens on {SLOTS} slots"
    )
    rows = [
        Row(
            f"1 output tok/s, {workload}, fair share on: mean of {len(rate['fair'])}",
            f"{mean['stock']:,.0f}",
            f"{mean['fair']:,.0f}",
            f"{mean['fair'] / mean['stock']:.3f}x",
            "≥ 0.95x",
        ),
        Row(
            "  each run (a fresh server pair after the first half)",
            " / ".join(f"{r:,.0f}" for r in rate["stock"]),
            " / ".join(f"{r:,.0f}" for r in rate["fair"]),
        ),
        Row(
            "  each repeat's ratio (runs next to each other); geometric mean",
            ratio=" / ".join(f"{r:.3f}" for r in ratios)
            + f"; {statistics.geometric_mean(ratios):.3f}x",
        ),
        Row(
            "1c  fair share off (FCFS), ours: mean; each run",
            ours=f"{mean['fcfs']:,.0f}; "
            + " / ".join(f"{r:,.0f}" for r in rate["fcfs"]),
            ratio=f"{mean['fcfs'] / mean['stock']:.3f}x",
        ),
    ]
    ttft = {v: _ttfts(rs) for v, rs in runs.items()}
    median = {v: statistics.median(t) for v, t in ttft.items()}

    def median_max(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} / {max(values):.2f} s"

    rows += [
        Row(
            f"2 light TTFT under the flood, median / max of {len(ttft['fair'])}",
            median_max(ttft["stock"]),
            median_max(ttft["fair"]),
            f"{median['fair'] / median['stock']:.3f}x",
        ),
        Row("2c  fair share off (FCFS)", ours=median_max(ttft["fcfs"])),
        Row("2b light TTFT alone (idle server, ours)", ours=median_max(ttft["alone"])),
    ]
    for variant, kind, label, goals in (
        ("fair", "served", "fair share on, all four served", ("≥ 0.99", "≥ 0.95")),
        ("fair", "backlogged", "fair share on, from the light users' arrival", ()),
        ("fcfs", "backlogged", "fair share off, from the light users' arrival", ()),
    ):
        measured = [
            m
            for name, run in named[variant]
            if (m := fairness(windows(run, name)[kind])) is not None
        ]
        if not measured:
            rows.append(Row(f"3 {label}: no such window"))
            continue
        jains, mins = [m[0] for m in measured], [m[1] for m in measured]
        rows += [
            Row(
                f"3 Jain's index over normalized shares, {label}: mean (lowest) "
                f"of {len(measured)}",
                ours=f"{statistics.mean(jains):.4f} ({min(jains):.4f})",
                goal=goals[0] if goals else "",
            ),
            Row(
                "3  minimum normalized share: mean (lowest)",
                ours=f"{statistics.mean(mins):.3f} ({min(mins):.3f})",
                goal=goals[1] if goals else "",
            ),
        ]
    return rows


def server_part(model_dir: str, workdir: Path, repeats: int, pairs: int) -> list[Row]:
    measured = []
    for i in range(pairs):
        ours, stock = start_pair(model_dir, workdir, i)
        try:
            found = check_servers(ours, stock)
            print(f"pair {i}: {found} (logs in {workdir})", flush=True)
            measured.append(server_runs(ours, stock, repeats, f"p{i}"))
        finally:
            ours.stop()
            stock.stop()
    return server_rows(measured)


# -- 4. schedule() with 1,000 users ------------------------------------------------

SCHED_SLOTS = 256
PROMPT_LEN = 16
#: The harness model's context (``make_scheduler``'s max_model_len).
CONTEXT = 512
#: Untimed steps first: the first admits a whole batch of prefills.
WARMUP_STEPS = 3


def _per_call_timer(scheduler: Any) -> list[int]:
    """From now on, each ``schedule()`` call's CPU time (the calling thread's,
    in ns) is appended to the returned list."""
    calls: list[int] = []
    schedule: Callable[[], Any] = scheduler.schedule

    def timed() -> Any:
        started = time.thread_time_ns()
        try:
            return schedule()
        finally:
            calls.append(time.thread_time_ns() - started)

    scheduler.schedule = timed  # shadows the method for the driver's calls
    return calls


def saturated(
    model_dir: str, users: int, fair: bool
) -> tuple[OutputRateScheduler, Driver]:
    """A paced scheduler (caps not binding) with ``users`` users of one or two
    requests each on ``SCHED_SLOTS`` slots, outputs of 64-255 tokens so that
    requests end and waiting ones are admitted."""
    scheduler, driver = driven_scheduler(
        model_dir,
        False,
        default_rate=MAX_RATE,
        max_num_seqs=SCHED_SLOTS,
        max_num_batched_tokens=SCHED_SLOTS * PROMPT_LEN,
        num_blocks=SCHED_SLOTS * (CONTEXT // BLOCK_SIZE) + 1,
        output_rate={"fair_share": True} if fair else {},
    )
    driver.add(
        make_request(f"user-{i}", prompt_len=PROMPT_LEN, max_tokens=64 + (i * 37) % 192)
        for i in range(users)
        for _ in range(1 + i % 2)
    )
    driver.run(WARMUP_STEPS)
    return scheduler, driver


def schedule_cost(
    model_dir: str, users: int, steps: int, repeats: int
) -> dict[str, list[int]]:
    """Per-call ``schedule()`` CPU ns with fair share off and on, over
    ``repeats`` fresh pairs of ``steps`` steps each, stepped in turn."""
    calls: dict[str, list[int]] = {"off": [], "on": []}
    for _ in range(repeats):
        built = {name: saturated(model_dir, users, name == "on") for name in calls}
        timers = {name: _per_call_timer(s) for name, (s, _) in built.items()}
        pair = [driver for _, driver in built.values()]
        gc.collect()
        gc.disable()
        try:
            for step in range(steps):
                for driver in pair if step % 2 == 0 else pair[::-1]:
                    driver.step()
        finally:
            gc.enable()
        for name, timed in timers.items():
            calls[name] += timed
        waiting = {name: len(s.waiting) for name, (s, _) in built.items()}
        print(f"  {steps} steps each; waiting at the end: {waiting}", flush=True)
    return calls


def p99(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def scheduler_rows(users: int, calls: dict[str, list[int]]) -> list[Row]:
    off, on = calls["off"], calls["on"]
    mean_off, mean_on = statistics.mean(off) / 1e3, statistics.mean(on) / 1e3
    p99_off, p99_on = p99(off) / 1e3, p99(on) / 1e3
    setting = f"{users:,} users, {SCHED_SLOTS} slots, saturated"
    return [
        Row(
            f"4 schedule() µs, {setting}, fair share off | on: mean of {len(on):,}",
            f"{mean_off:,.0f}",
            f"{mean_on:,.0f}",
            f"{mean_on / mean_off:.3f}x",
        ),
        Row(
            "4  p99",
            f"{p99_off:,.0f}",
            f"{p99_on:,.0f}",
            f"{p99_on / p99_off:.3f}x",
        ),
    ]


# -- the run -----------------------------------------------------------------------


def _parse_only(value: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in value.split(",") if part.strip())
    if not parts or set(parts) - set(PARTS):
        raise argparse.ArgumentTypeError(f"choose from {','.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=_parse_only, default=PARTS, help=",".join(PARTS))
    parser.add_argument("--repeats", type=int, default=3, help="per server pair")
    parser.add_argument("--pairs", type=int, default=2, help="server pairs started")
    parser.add_argument("--users", type=int, default=1000, help="scheduler part")
    parser.add_argument("--steps", type=int, default=300, help="scheduler part")
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    args = parser.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores, load average {load} at start", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-fair-share-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    rows: list[Row] = []
    if "scheduler" in args.only:
        calls = schedule_cost(model_dir, args.users, args.steps, args.repeats)
        rows += scheduler_rows(args.users, calls)
        print(render(rows), flush=True)
    if "server" in args.only:
        rows = server_part(model_dir, workdir, args.repeats, args.pairs) + rows
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average {load} at the end")
    print(render(rows))


if __name__ == "__main__":
    main()
