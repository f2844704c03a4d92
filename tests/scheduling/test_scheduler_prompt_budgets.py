"""Prompt budgets on vLLM's real Scheduler and KV manager, prefix cache on, sync
and async: each user's computed prompt tokens are charged when scheduled
(cache hits and recomputation free), held while out of budget (never
truncated), within GCRA's bound of the prompt rate, with at most one held
partial prefill per user (``engine_ext.scheduling.prompt_gate``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
from vllm.v1.request import Request, RequestStatus

from pacing.policy.model import Limits, Policy, User
from pacing.prompt_budget import PROMPT_BURST_NS
from tools.scheduler_harness import (
    BLOCK_SIZE,
    SYNC_AND_ASYNC,
    Driver,
    driven_scheduler,
    make_request,
)

NS_PER_S = 1_000_000_000
STEP_MS = 10.0


def policy_doc(
    users: Mapping[str, object],
    *,
    default: object = 1000,
    teams: Mapping[str, object] | None = None,
    team_members: Mapping[str, str] | None = None,
    tiers: Mapping[str, object] | None = None,
    memberships: Mapping[str, str] | None = None,
    mode: str | None = None,
) -> dict[str, object]:
    """A policy document (what ``--output-rate-policy`` takes)."""
    if isinstance(default, int):
        default = {"tokens_per_second": default}
    doc: dict[str, object] = {"default": default, "users": dict(users)}
    if teams:
        doc["teams"] = dict(teams)
        doc["team_members"] = dict(team_members or {})
    if tiers:
        doc["tiers"] = dict(tiers)
        doc["memberships"] = dict(memberships or {})
    if mode is not None:
        doc["mode"] = mode
    return doc


def scheduler_for(model_dir: str, async_scheduling: bool, doc: dict, **kwargs):
    return driven_scheduler(
        model_dir,
        async_scheduling,
        default_rate=None,
        output_rate={"policy": doc},
        prefix_caching=True,
        **kwargs,
    )


def request_of(user: str, **kwargs) -> Request:
    """A request whose blocks are hashed (the prefix cache is on)."""
    return make_request(user, cached=True, **kwargs)


def prompt_of(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """A prompt of ``length`` tokens, distinct per seed, after ``prefix``."""
    rng = random.Random(seed)
    head = list(prefix or [])[:length]
    return head + [rng.randrange(5, 900) for _ in range(length - len(head))]


#: Counters the recorder follows per step: ``UserCounters`` fields, and
#: ``net`` (output tokens charged less refunds).
FOLLOWED = ("prompt_tokens_charged", "prompt_held_skips", "net")


def _value(counters, name: str) -> int:
    if name == "net":
        return counters.charged - counters.refunds
    return getattr(counters, name)


@dataclass
class Recorder:
    """Per step and user, what the scheduler recorded (deltas of ``FOLLOWED``
    around each ``schedule()``: the accounting forgets idle users) and what it
    really computed of each prompt for the first time (from upstream's
    scheduled tokens and advanced positions, independently of our code)."""

    scheduler: object
    clock: Callable[[], int]
    #: counter -> [(step time ns, user -> its delta in the step)]
    steps: dict[str, list[tuple[int, dict[str, int]]]] = field(
        default_factory=lambda: {name: [] for name in FOLLOWED}
    )
    #: user -> first-time computed prompt positions, over the run
    computed: dict[str, int] = field(default_factory=dict)
    #: user -> prompt positions computed again (recomputation)
    recomputed: dict[str, int] = field(default_factory=dict)
    #: most held partial prefills one user had at a step's end
    most_held_partials: int = 0
    _high: dict[str, int] = field(default_factory=dict)

    def install(self) -> None:
        scheduler = self.scheduler
        schedule = scheduler.schedule

        def recorded(*args, **kwargs):
            now = self.clock()
            before = {
                name: {u: _value(c, name) for u, c in self._counters()}
                for name in FOLLOWED
            }
            out = schedule(*args, **kwargs)
            for name in FOLLOWED:
                delta = {}
                for user, counters in self._counters():
                    moved = _value(counters, name) - before[name].get(user, 0)
                    if moved:
                        delta[user] = moved
                self.steps[name].append((now, delta))
            self._observe(out)
            return out

        scheduler.schedule = recorded

    @property
    def charged(self) -> list[tuple[int, dict[str, int]]]:
        return self.steps["prompt_tokens_charged"]

    @property
    def output(self) -> list[tuple[int, dict[str, int]]]:
        return self.steps["net"]

    def _counters(self):
        return self.scheduler.accounting.by_user().items()

    def _observe(self, out) -> None:
        scheduler = self.scheduler
        for request_id, count in out.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens
            prompt = request.num_prompt_tokens
            start = end - count
            high = self._high.get(request_id, 0)
            top = min(end, prompt)
            user = scheduler.user_of(request)
            first = max(0, top - max(start, high))
            again = max(0, min(top, high) - start)
            self.computed[user] = self.computed.get(user, 0) + first
            self.recomputed[user] = self.recomputed.get(user, 0) + again
            self._high[request_id] = max(high, top)
        gate = scheduler._steps.prompt
        held: dict[str, int] = {}
        for request in scheduler.running:
            if (
                request.request_id in gate.held_since
                and 0 < request.num_computed_tokens < request.num_prompt_tokens
            ):
                user = scheduler.user_of(request)
                held[user] = held.get(user, 0) + 1
        self.most_held_partials = max(self.most_held_partials, *held.values(), 0)

    def total(self, name: str = "prompt_tokens_charged") -> dict[str, int]:
        totals: dict[str, int] = {}
        for _, step in self.steps[name]:
            for user, count in step.items():
                totals[user] = totals.get(user, 0) + count
        return totals

    def total_charged(self) -> dict[str, int]:
        return self.total()


def most_over_gcra(
    series: list[tuple[int, dict[str, int]]],
    users: set[str],
    rate: int,
    burst_ns: int,
) -> float:
    """The largest ``charged(window) - ((W + burst) * rate + 1)`` over every
    window of steps, for the tokens ``users`` were charged together (<= 0:
    within GCRA's bound). Linear: a window [i, j] exceeds the bound iff
    ``(S_j - r t_j) - (S_{i-1} - r t_i) > burst * r + 1``."""
    worst = float("-inf")
    lowest_start = float("inf")
    total = 0
    for now, step in series:
        lowest_start = min(lowest_start, total - rate * now / NS_PER_S)
        total += sum(step.get(user, 0) for user in users)
        worst = max(worst, total - rate * now / NS_PER_S - lowest_start)
    return worst - (burst_ns * rate / NS_PER_S + 1)


def run_until_done(driver: Driver, requests: list[Request], most_steps: int) -> int:
    for step in range(most_steps):
        driver.step(STEP_MS)
        if all(request.is_finished() for request in requests):
            driver.settle()
            return step + 1
    driver.settle()
    return most_steps


@SYNC_AND_ASYNC
def test_a_prompt_flood_is_held_at_its_prompt_rate_and_every_request_completes(
    tiny_model_dir: str, async_scheduling: bool
) -> None:
    """20 distinct 400-token prompts (max_tokens 1) at once from a user with a
    prompt rate of 1,000 tok/s: every request completes with its output, the
    prompt tokens charged are exactly the positions computed, and every
    window stays within GCRA's bound."""
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 1000}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, async_scheduling, doc)
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 400), max_tokens=1)
        for i in range(20)
    ]
    driver.add(requests)
    steps = run_until_done(driver, requests, 3000)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert all(r.num_output_tokens == 1 for r in requests)
    assert recorder.total_charged()["p"] == recorder.computed["p"] == 20 * 400
    assert most_over_gcra(recorder.charged, {"p"}, 1000, PROMPT_BURST_NS) <= 0
    # 8,000 tokens at 1,000 tok/s after a full bucket (~1,001): about 7 s.
    assert steps * STEP_MS / 1000 >= (8000 - 1001) / 1000
    counters = scheduler.accounting.of("p")
    assert counters.prompt_held_skips > 0 and counters.prompt_wait_ns > 0
    assert recorder.most_held_partials <= 1


@SYNC_AND_ASYNC
def test_cache_hits_are_never_charged(
    tiny_model_dir: str, async_scheduling: bool
) -> None:
    """The same 400-token prompt sent 20 times after one warm request: each is
    charged only the uncached tail (the prefix cache covers whole blocks), so
    all 20 run unheld within one bucket."""
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 1000}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, async_scheduling, doc)
    same = prompt_of(7, 400)
    warm = request_of("p", prompt_token_ids=same, max_tokens=1)
    driver.add([warm])
    run_until_done(driver, [warm], 100)
    driver.clock.advance_ms(2000)  # the bucket fills again
    charged = scheduler.accounting.of("p").prompt_tokens_charged
    assert charged == 400
    again = [request_of("p", prompt_token_ids=same, max_tokens=1) for _ in range(20)]
    driver.add(again)
    run_until_done(driver, again, 200)
    tail = 400 - (399 // BLOCK_SIZE) * BLOCK_SIZE  # what a hit leaves to compute
    counters = scheduler.accounting.of("p")
    assert counters.prompt_tokens_charged - charged == 20 * tail
    assert counters.prompt_held_skips == 0


@pytest.mark.parametrize(
    ("async_scheduling", "chunked"),
    [(False, True), (True, True), (False, False)],
    ids=["chunked-sync", "chunked-async", "whole-sync"],
)
def test_seeded_workloads_stay_within_gcra_bounds_and_nothing_starves(
    tiny_model_dir: str, async_scheduling: bool, chunked: bool
) -> None:
    """10,000 steps of a seeded workload: users with their own prompt rates, a
    team sharing one, an exempt user and one without a prompt rate, prompts of
    mixed lengths with shared prefixes (prefix cache on), outputs of mixed
    lengths, a few aborts, a small KV cache that preempts. Each holder's charged
    prompt tokens stay within GCRA's bound (whole chunks: plus one chunk), the
    charges are exactly the positions computed for the first time (cache hits
    and recomputation free), every request ends, and output pacing holds."""
    rates = {"p1": 300, "p2": 800}
    team_rate = 500
    doc = policy_doc(
        {
            "p1": {"tokens_per_second": 200, "prompt_tokens_per_second": 300},
            "p2": {"tokens_per_second": 200, "prompt_tokens_per_second": 800},
            "t1": 200,
            "t2": 200,
            "e": {"tokens_per_second": 200, "exempt": True},
            "u": 200,
        },
        teams={"k": {"tokens_per_second": 1000, "prompt_tokens_per_second": team_rate}},
        team_members={"t1": "k", "t2": "k"},
    )
    scheduler, driver = scheduler_for(
        tiny_model_dir,
        async_scheduling,
        doc,
        max_num_seqs=8,
        max_num_batched_tokens=512 if not chunked else 256,
        enable_chunked_prefill=chunked,
        num_blocks=64,
    )
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    rng = random.Random(41)
    # Chance of an arrival per step: p1 and the team ask for more prompt
    # tokens than their rates (about 460 and 550 tok/s), p2 for less.
    arrivals = {"p1": 0.02, "p2": 0.012, "t1": 0.012, "t2": 0.012, "e": 0.008}
    arrivals["u"] = 0.008
    prefixes = [prompt_of(1000 + i, rng.randrange(64, 257)) for i in range(3)]
    users = list(arrivals)
    requests: list[Request] = []
    for step in range(10_000):
        for user in users:
            if rng.random() < arrivals[user]:
                length = rng.randrange(10, 450)
                prefix = rng.choice(prefixes) if rng.random() < 0.5 else None
                request = request_of(
                    user,
                    prompt_token_ids=prompt_of(rng.randrange(10**9), length, prefix),
                    max_tokens=rng.randrange(1, 60),
                )
                requests.append(request)
                driver.add([request])
        if step % 997 == 0 and requests:
            victim = rng.choice(requests)
            if not victim.is_finished():
                scheduler.finish_requests(
                    victim.request_id, RequestStatus.FINISHED_ABORTED
                )
        driver.step(STEP_MS)
    run_until_done(driver, requests, 20_000)
    assert all(request.is_finished() for request in requests)
    charged = recorder.total_charged()
    for user in users:
        assert charged.get(user, 0) == recorder.computed.get(user, 0), user
    slack = 0 if chunked else 512  # whole mode: one chunk beyond the bound
    for user, rate in rates.items():
        assert most_over_gcra(recorder.charged, {user}, rate, PROMPT_BURST_NS) <= slack
    assert (
        most_over_gcra(recorder.charged, {"t1", "t2"}, team_rate, PROMPT_BURST_NS)
        <= slack
    )
    for user in ("p1", "p2", "t1", "t2", "u"):  # output pacing unchanged
        assert most_over_gcra(recorder.output, {user}, 200, 100_000_000) <= 0
    held = recorder.total("prompt_held_skips")
    assert held.get("p1", 0) > 0 and held.get("t1", 0) > 0 and held.get("t2", 0) > 0
    assert "e" not in held and "u" not in held
    assert sum(request.num_preemptions for request in requests) > 0
    assert recorder.most_held_partials <= 1


@SYNC_AND_ASYNC
def test_prompt_rates_that_never_bind_change_no_decision(
    tiny_model_dir: str, async_scheduling: bool
) -> None:
    """A policy whose prompt rates are never reached schedules exactly as the
    same policy without them, step by step."""
    traces = []
    for prompt_rate in (None, 1_000_000):
        extra = {} if prompt_rate is None else {"prompt_tokens_per_second": prompt_rate}
        doc = policy_doc(
            {"a": {"tokens_per_second": 50, **extra}, "b": 400},
            default={"tokens_per_second": 1000, **extra},
        )
        _, driver = scheduler_for(tiny_model_dir, async_scheduling, doc, num_blocks=60)
        rng = random.Random(5)
        trace = []
        for step in range(400):
            if rng.random() < 0.2:
                driver.add(
                    [
                        request_of(
                            rng.choice(["a", "b", "c"]),
                            prompt_token_ids=prompt_of(step, rng.randrange(5, 300)),
                            max_tokens=rng.randrange(1, 60),
                            request_id=f"r{step}",
                        )
                    ]
                )
            out = driver.step(STEP_MS)
            trace.append(dict(out.num_scheduled_tokens))
        traces.append(trace)
    assert traces[0] == traces[1]


def test_shadow_mode_holds_nothing_and_counts_what_enforce_would_hold(
    tiny_model_dir: str,
) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 200}},
        mode="shadow",
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 300), max_tokens=1)
        for i in range(6)
    ]
    driver.add(requests)
    steps = run_until_done(driver, requests, 200)
    counters = scheduler.accounting.of("p")
    assert steps < 20  # nothing held: 1,800 tokens at upstream's pace
    assert counters.prompt_held_skips == 0
    assert counters.prompt_shadow_holds > 0
    # Charged what the budget covered, the rest ran uncharged.
    assert 0 < counters.prompt_tokens_charged < 6 * 300


def test_mode_off_charges_and_holds_nothing(tiny_model_dir: str) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}, mode="off"
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 300), max_tokens=1)
        for i in range(4)
    ]
    driver.add(requests)
    assert run_until_done(driver, requests, 200) < 10
    counters = scheduler.accounting.of("p")
    assert counters.prompt_tokens_charged == counters.prompt_held_skips == 0


@pytest.mark.parametrize(
    "holder",
    ["default", "tier", "exempt_user", "exempt_tier"],
)
def test_the_prompt_rate_resolves_like_the_output_rate(
    tiny_model_dir: str, holder: str
) -> None:
    """The default's and a tier's prompt rates hold; an exempt user or tier
    is unlimited for prompts too."""
    tiers = {"slow": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}
    doc = {
        "default": policy_doc(
            {}, default={"tokens_per_second": 1000, "prompt_tokens_per_second": 100}
        ),
        "tier": policy_doc({}, tiers=tiers, memberships={"p": "slow"}),
        "exempt_user": policy_doc(
            {"p": {"exempt": True}},
            default={"tokens_per_second": 1000, "prompt_tokens_per_second": 100},
        ),
        "exempt_tier": policy_doc(
            {},
            default={"tokens_per_second": 1000, "prompt_tokens_per_second": 100},
            tiers={"free": {"exempt": True}},
            memberships={"p": "free"},
        ),
    }[holder]
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 300), max_tokens=1)
        for i in range(4)
    ]
    driver.add(requests)
    steps = run_until_done(driver, requests, 2000)
    held = scheduler.accounting.of("p").prompt_held_skips
    if holder.startswith("exempt"):
        assert held == 0 and steps < 10
    else:  # 1,200 tokens at 100 tok/s after a bucket of 101: about 11 s
        assert held > 0 and steps * STEP_MS / 1000 >= (1200 - 101) / 100


def test_a_teams_prompt_rate_is_shared_by_its_members(tiny_model_dir: str) -> None:
    doc = policy_doc(
        {"a": 1000, "b": 1000},
        teams={"k": {"tokens_per_second": 1000, "prompt_tokens_per_second": 400}},
        team_members={"a": "k", "b": "k"},
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    requests = [
        request_of(user, prompt_token_ids=prompt_of(i, 300), max_tokens=1)
        for i, user in enumerate(["a", "b"] * 6)
    ]
    driver.add(requests)
    run_until_done(driver, requests, 3000)
    assert all(r.is_finished() for r in requests)
    assert most_over_gcra(recorder.charged, {"a", "b"}, 400, PROMPT_BURST_NS) <= 0
    charged = recorder.total_charged()
    assert charged["a"] == charged["b"] == 6 * 300


def test_a_prompt_rate_set_while_running_applies_at_the_next_step(
    tiny_model_dir: str,
) -> None:
    """Hot reload: the policy in force replaced under the lock (as the
    control plane and the store's sync do) re-applies the prompt tables."""
    doc = policy_doc({"p": 1000})
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    shared = scheduler.output_rate_shared
    assert not shared.prompt.active
    with shared.lock:
        shared.policy = Policy(
            default=Limits(1000),
            users={"p": User(Limits(1000, prompt_tokens_per_second=100))},
        )
    assert shared.prompt.active and shared.prompt.rate_of("p") == 100
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 300), max_tokens=1)
        for i in range(3)
    ]
    driver.add(requests)
    steps = run_until_done(driver, requests, 2000)
    assert steps * STEP_MS / 1000 >= (900 - 101) / 100
    with shared.lock:
        shared.policy = Policy(default=Limits(1000))
    assert not shared.prompt.active


def test_a_preempted_request_recomputes_for_free(tiny_model_dir: str) -> None:
    """A KV cache too small for both prompts: preemption recomputes what was
    paid, and each request is charged its prompt exactly once."""
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100_000}}
    )
    scheduler, driver = scheduler_for(
        tiny_model_dir, False, doc, num_blocks=40, max_num_batched_tokens=128
    )
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    requests = [
        request_of("p", prompt_token_ids=prompt_of(i, 300), max_tokens=100)
        for i in range(3)
    ]
    driver.add(requests)
    run_until_done(driver, requests, 3000)
    assert all(r.is_finished() for r in requests)
    assert recorder.recomputed["p"] > 0
    assert recorder.total_charged()["p"] == 3 * 300


def test_an_aborted_prefill_keeps_what_its_chunks_cost(tiny_model_dir: str) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 200}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    request = request_of("p", prompt_token_ids=prompt_of(1, 450), max_tokens=1)
    driver.add([request])
    driver.run(20, STEP_MS)  # the bucket (201) and 0.2 s more: about 240 tokens
    computed = request.num_computed_tokens
    assert 0 < computed < 450
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    driver.run(3, STEP_MS)
    assert scheduler.accounting.of("p").prompt_tokens_charged == computed


def test_an_engine_with_only_held_prefills_waits_until_the_budget_comes_back(
    tiny_model_dir: str,
) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    request = request_of("p", prompt_token_ids=prompt_of(2, 400), max_tokens=1)
    driver.add([request])
    out = driver.step(STEP_MS)
    assert out.num_scheduled_tokens == {request.request_id: 101}
    out = driver.step(STEP_MS)  # 1 token earned in 10 ms: below one block
    assert not out.num_scheduled_tokens
    ready = scheduler.next_ready_ns
    assert ready is not None
    # One block (16 tokens) at 100 tok/s from a TAT 1.01 s ahead.
    assert ready - driver.clock() == pytest.approx(150_000_000 - 10_000_000, abs=1e6)


@SYNC_AND_ASYNC
def test_fair_share_prices_computed_prompt_tokens_so_a_cached_prompt_is_light(
    tiny_model_dir: str, async_scheduling: bool
) -> None:
    """Fair share's service counts the prompt tokens computed, not the prompt's
    length: a user re-sending one long cached system prompt is served as light
    as the uncached tails it really costs, beside a user of distinct prompts."""
    doc = {**policy_doc({"same": 1000, "distinct": 1000}), "fair_share": True}
    scheduler, driver = scheduler_for(tiny_model_dir, async_scheduling, doc)
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    system = prompt_of(3, 400)
    ledger = scheduler.output_rate_shared.fair_share
    for i in range(10):
        pair = [
            request_of("same", prompt_token_ids=system, max_tokens=1),
            request_of(
                "distinct", prompt_token_ids=prompt_of(100 + i, 400), max_tokens=1
            ),
        ]
        driver.add(pair)
        run_until_done(driver, pair, 100)
    tail = 400 - (399 // BLOCK_SIZE) * BLOCK_SIZE
    assert recorder.computed == {"same": 400 + 9 * tail, "distinct": 10 * 400}
    service = {user: ledger.of(user) for user in ("same", "distinct")}
    assert service["same"] == pytest.approx(ledger.cost(400 + 9 * tail, 10, 1.0))
    assert service["distinct"] == pytest.approx(ledger.cost(4000, 10, 1.0))


def test_a_request_asking_for_prompt_logprobs_pays_its_whole_prompt(
    tiny_model_dir: str,
) -> None:
    """vLLM skips the prefix cache for a request asking for prompt logprobs:
    it computes, and is charged, its whole prompt."""
    scheduler, driver = scheduler_for(tiny_model_dir, False, policy_doc({"p": 1000}))
    with scheduler.output_rate_shared.lock:
        scheduler.output_rate_shared.policy = Policy(
            default=Limits(1000),
            users={"p": User(Limits(1000, prompt_tokens_per_second=100_000))},
        )
    system = prompt_of(9, 200)
    first = request_of("p", prompt_token_ids=system, max_tokens=1)
    driver.add([first])
    run_until_done(driver, [first], 50)
    with_logprobs = request_of(
        "p", prompt_token_ids=system, max_tokens=1, prompt_logprobs=1
    )
    driver.add([with_logprobs])
    run_until_done(driver, [with_logprobs], 50)
    assert scheduler.accounting.of("p").prompt_tokens_charged == 2 * 200


def test_the_wait_of_a_held_request_that_ends_is_counted_for_its_user(
    tiny_model_dir: str,
) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    request = request_of("p", prompt_token_ids=prompt_of(4, 400), max_tokens=1)
    driver.add([request])
    driver.step(STEP_MS)  # 101 tokens: the bucket
    driver.step(STEP_MS)  # held from here (1 token earned: below one block)
    driver.clock.advance_ms(25)
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    counters = scheduler.accounting.of("p")
    assert counters.prompt_held_skips == 1
    assert counters.prompt_wait_ns == 35_000_000


def test_idle_users_prompt_cells_are_dropped_like_their_output_cells(
    tiny_model_dir: str,
) -> None:
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    request = request_of("p", prompt_token_ids=prompt_of(5, 150), max_tokens=1)
    driver.add([request])
    run_until_done(driver, [request], 200)
    prompt = scheduler.output_rate_shared.prompt
    assert prompt.limiter.tracked_users() == 1
    driver.clock.advance_ms(2000)  # the bucket is full again
    scheduler.cleanup_when_idle()
    assert prompt.limiter.tracked_users() == 0


def test_the_gate_keeps_nothing_of_users_gone(tiny_model_dir: str) -> None:
    """Many users come and go beside one prompt-limited user: once they are
    gone and the users are cleaned up, the gate holds nothing of them."""
    doc = policy_doc(
        {"p": {"tokens_per_second": 1000, "prompt_tokens_per_second": 100}}
    )
    scheduler, driver = scheduler_for(tiny_model_dir, False, doc)
    requests = [
        request_of(f"u{i}", prompt_token_ids=prompt_of(i, 20), max_tokens=1)
        for i in range(200)
    ]
    requests.append(request_of("p", prompt_token_ids=prompt_of(999, 20)))
    driver.add(requests)
    run_until_done(driver, requests[:-1], 500)
    driver.clock.advance_ms(2000)
    driver.step(STEP_MS)  # a step that cleans up (due every second)
    gate = scheduler._steps.prompt
    assert set(gate.headroom) <= {"p"}
    assert set(gate.prefilling) <= {requests[-1].request_id}
    assert not gate.paid and not gate.held_since
