"""Ceilings on vLLM's real Scheduler and KV manager, sync and async: a user
borrows above its rate up to its ceiling while nobody else within its rate
waits, is back at its rate in the step after someone does, and never owes its
rate for what it borrowed (``pacing.ceilings``, ``engine_ext.scheduling.spare``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest

from engine_ext.scheduling.upstream import STARTABLE
from tools.scheduler_harness import SYNC_AND_ASYNC, driven_scheduler, make_request

NS_PER_S = 1_000_000_000
BURST_S = 0.1
STEP_MS = 10.0


def policy_doc(users: Mapping[str, object], default: int = 1000) -> dict[str, object]:
    return {"default": {"tokens_per_second": default}, "users": dict(users)}


def scheduler_for(model_dir: str, async_scheduling: bool, doc: dict, **kwargs):
    return driven_scheduler(
        model_dir,
        async_scheduling,
        default_rate=None,
        output_rate={"policy": doc},
        **kwargs,
    )


@dataclass
class Recorder:
    """Per step: its time, each user's net charged and borrowed tokens (deltas
    around ``schedule()``: the accounting forgets idle users), and the users
    that had a startable request waiting at the step's start that had also
    waited at the previous step's start, or with every slot held (read from
    upstream's queues, apart from our code)."""

    scheduler: object
    clock: Callable[[], int]
    times: list[int] = field(default_factory=list)
    net: list[dict[str, int]] = field(default_factory=list)
    borrowed: list[dict[str, int]] = field(default_factory=list)
    waited: list[set[str]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def install(self) -> None:
        scheduler = self.scheduler
        schedule = scheduler.schedule

        def recorded(*args, **kwargs):
            self.times.append(self.clock())
            self.waited.append(self._waiting_users())
            before = self._counters()
            out = schedule(*args, **kwargs)
            after = self._counters()
            for index, bucket in enumerate((self.net, self.borrowed)):
                bucket.append(
                    {
                        user: moved
                        for user, values in after.items()
                        if (moved := values[index] - before.get(user, (0, 0))[index])
                    }
                )
            return out

        scheduler.schedule = recorded

    def _counters(self) -> dict[str, tuple[int, int]]:
        return {
            user: (c.charged - c.refunds, c.borrowed_tokens)
            for user, c in self.scheduler.accounting.by_user().items()
        }

    def _waiting_users(self) -> set[str]:
        scheduler = self.scheduler
        full = len(scheduler.running) >= scheduler.max_num_running_reqs
        users = set()
        seen = set()
        for request in scheduler.waiting:
            seen.add(request.request_id)
            if request.status in STARTABLE and (
                full or request.request_id in self._seen
            ):
                users.add(scheduler.user_of(request))
        self._seen = seen
        now = self.clock()
        # Within its own rate: its GCRA cell (no store here) has a token.
        return {u for u in users if scheduler.limiter.available(u, now) > 0}

    def tokens(self, user: str, start: int, end: int, *, own: bool = False) -> int:
        """``user``'s net tokens in steps ``[start, end)``; ``own``: less what
        it borrowed."""
        total = 0
        for index in range(start, end):
            total += self.net[index].get(user, 0)
            if own:
                total -= self.borrowed[index].get(user, 0)
        return total

    def worst_window(self, user: str, rate: int, window_s: float, *, own=False):
        """The most tokens above GCRA's bound ``(W + burst) * rate`` in any
        window of ``window_s`` seconds starting at a step."""
        worst = -(10**9)
        times = self.times
        end = 0
        window_ns = int(window_s * NS_PER_S)
        for start in range(len(times)):
            end = max(end, start)
            while end < len(times) and times[end] - times[start] < window_ns:
                end += 1
            span_s = (times[end - 1] - times[start]) / NS_PER_S + STEP_MS / 1000
            bound = (span_s + BURST_S) * rate
            worst = max(worst, self.tokens(user, start, end, own=own) - bound)
        return worst


def seeded_arrivals(
    rng: random.Random, driver, users: list[str]
) -> Callable[[int], None]:
    """A step hook: with probability 0.02 a step, 1-3 requests of one of
    ``users`` (5-119 output tokens, 4-39 prompt tokens) arrive."""

    def arrivals(index: int) -> None:
        if rng.random() < 0.02:
            user = rng.choice(users)
            driver.add(
                [
                    make_request(
                        user,
                        max_tokens=rng.randrange(5, 120),
                        prompt_len=rng.randrange(4, 40),
                    )
                    for _ in range(rng.randrange(1, 4))
                ]
            )

    return arrivals


def run_recorded(scheduler, driver, steps: int, before_step=None) -> Recorder:
    recorder = Recorder(scheduler, driver.clock)
    recorder.install()
    for index in range(steps):
        if before_step is not None:
            before_step(index)
        driver.step(STEP_MS)
    driver.settle()
    return recorder


@SYNC_AND_ASYNC
def test_a_borrower_alone_reaches_its_ceiling_and_stays_within_it(
    tiny_model_dir: str, async_scheduling: bool
):
    doc = policy_doc({"b": {"tokens_per_second": 20, "ceiling_tokens_per_second": 100}})
    scheduler, driver = scheduler_for(tiny_model_dir, async_scheduling, doc)
    driver.add([make_request("b", max_tokens=5000) for _ in range(4)])
    recorder = run_recorded(scheduler, driver, 500)
    seconds = 500 * STEP_MS / 1000
    tokens = recorder.tokens("b", 0, 500)
    # Asking for 4 tokens a step (400/s) it gets its ceiling, not its rate.
    assert tokens >= 100 * seconds - 2
    assert recorder.worst_window("b", 100, 1.0) <= 2
    assert recorder.worst_window("b", 100, seconds) <= 2
    # What it took of its own budget stays within its rate.
    assert recorder.worst_window("b", 20, 1.0, own=True) <= 1
    assert sum(sum(step.values()) for step in recorder.borrowed) >= 80 * seconds - 3


@SYNC_AND_ASYNC
def test_a_borrower_is_back_at_its_rate_the_step_another_user_waits(
    tiny_model_dir: str, async_scheduling: bool
):
    """``b`` holds every slot, borrowing; ``a`` (within its rate) arrives: from
    the first step ``a`` waits in, ``b`` borrows nothing, its parked requests
    yield their slots but one, which its rate needs, and ``a`` is served."""
    doc = policy_doc({"b": {"tokens_per_second": 20, "ceiling_tokens_per_second": 100}})
    scheduler, driver = scheduler_for(
        tiny_model_dir, async_scheduling, doc, max_num_seqs=4
    )
    driver.add([make_request("b", max_tokens=5000) for _ in range(4)])
    arrive_at = 200
    a_requests = [make_request("a", max_tokens=5000) for _ in range(4)]

    def arrive(index: int) -> None:
        if index == arrive_at:
            driver.add(a_requests)

    recorder = run_recorded(scheduler, driver, 500, arrive)
    assert recorder.tokens("b", 100, arrive_at) >= 100 * 1.0 - 2  # borrowing
    waited = [i for i, users in enumerate(recorder.waited) if "a" in users]
    assert waited and waited[0] == arrive_at  # every slot is b's: a waits at once
    for index in waited:
        assert not recorder.borrowed[index].get("b")
    # From the first step a waited in, b is held to its rate.
    assert recorder.worst_window("b", 20, 1.0, own=False) > 2  # it did borrow
    after = recorder.tokens("b", arrive_at, 500)
    span_s = (500 - arrive_at) * STEP_MS / 1000
    assert after <= (span_s + BURST_S) * 20 + 1
    # a took the slots b borrowed, b keeps one for its rate.
    assert recorder.tokens("a", arrive_at + 10, 500) >= 3 * (500 - arrive_at - 20)
    assert sum(r.status.name == "RUNNING" for r in a_requests) == 3


@pytest.mark.parametrize("seed", [1, 2])
@SYNC_AND_ASYNC
def test_seeded_workloads_borrow_only_spare_capacity_within_every_bound(
    tiny_model_dir: str, async_scheduling: bool, seed: int
):
    """10,000 steps of random arrivals of five users, two with ceilings, in a
    four-slot engine: no user's tokens exceed its ceiling's bound, what a
    borrower takes of its own budget never exceeds its rate's, and nobody
    borrows in a step where another user within its rate waited."""
    rng = random.Random(seed)
    limits = {
        "b1": {"tokens_per_second": 20, "ceiling_tokens_per_second": 100},
        "b2": {"tokens_per_second": 50, "ceiling_tokens_per_second": 80},
        "u1": {"tokens_per_second": 30},
        "u2": {"tokens_per_second": 200},
        "u3": {"tokens_per_second": 1000},
    }
    scheduler, driver = scheduler_for(
        tiny_model_dir, async_scheduling, policy_doc(limits), max_num_seqs=4
    )
    users = list(limits)
    steps = 10_000

    arrivals = seeded_arrivals(rng, driver, users)

    recorder = run_recorded(scheduler, driver, steps, arrivals)
    for user, spec in limits.items():
        ceiling = spec.get("ceiling_tokens_per_second", spec["tokens_per_second"])
        for window_s in (0.5, 2.0):
            assert recorder.worst_window(user, ceiling, window_s) <= 2, user
            own = recorder.worst_window(
                user, spec["tokens_per_second"], window_s, own=True
            )
            assert own <= 1, user
    borrowed_steps = 0
    for index, borrowed in enumerate(recorder.borrowed):
        for user in [u for u, taken in borrowed.items() if taken > 0]:
            borrowed_steps += 1
            needy = recorder.waited[index] - {user}
            assert not needy, (index, user, needy)
    assert borrowed_steps > 100  # the workload did borrow


@SYNC_AND_ASYNC
def test_a_borrower_keeps_its_rate_in_an_engine_others_saturate(
    tiny_model_dir: str, async_scheduling: bool
):
    """``b`` (rate 20, ceiling 100) streams alone at its ceiling; 12 streams of
    three other users then fill the four slots and wait: ``b`` is back at its
    rate, not starved, keeping one slot while its next token is due."""
    doc = policy_doc({"b": {"tokens_per_second": 20, "ceiling_tokens_per_second": 100}})
    scheduler, driver = scheduler_for(
        tiny_model_dir, async_scheduling, doc, max_num_seqs=4
    )
    b = [make_request("b", max_tokens=480) for _ in range(2)]
    driver.add(b)
    driver.run(100)
    alone = sum(r.num_output_tokens for r in b)
    assert 100 - 2 <= alone <= (1.0 + BURST_S) * 100 + 2
    others = [make_request(f"o{i % 3}", max_tokens=480) for i in range(12)]
    driver.add(others)
    driver.run(100)  # the others fill the slots; b yields what it borrowed
    before = sum(r.num_output_tokens for r in b)
    others_before = sum(r.num_output_tokens for r in others)
    driver.run(300)
    held = (sum(r.num_output_tokens for r in b) - before) / 3.0
    assert abs(held - 20) <= 0.15 * 20, held
    assert scheduler.accounting.of("b").borrowed_tokens >= 80 - 3
    # The others have the other three slots, a token a step each.
    others_got = sum(r.num_output_tokens for r in others) - others_before
    assert others_got >= 3 * 300 - 12
