"""Priority bands on vLLM's real Scheduler and KV manager, sync and async: a
waiting request of a higher band starts before any of a lower band, a lower
band's running request yields its slot to a higher band within the stated
bound, and fair share orders users within a band (``pacing.bands``,
``engine_ext.scheduling.bands``)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from vllm.v1.core.sched.request_queue import FCFSRequestQueue

from engine_ext.scheduling.bands import MIN_RUN_TOKENS, PREEMPT_AFTER_NS
from engine_ext.scheduling.upstream import STARTABLE, BandedQueue
from pacing.modes import Mode
from pacing.policy.model import Limits, User
from tests.scheduling.test_scheduler_fair_share import Backlog
from tools.scheduler_harness import SYNC_AND_ASYNC, driven_scheduler, make_request

BANDS = ("interactive", "standard", "batch")


def banded_scheduler(
    model_dir, async_scheduling, users, *, fair=False, weights=None, **kwargs
):
    """A scheduler whose policy puts each of ``users`` (user -> band) in its
    band, everyone else in ``standard``, with fair share (``weights``: user ->
    its weight); caps far above what the engine does."""
    doc: dict[str, object] = {"default": {"tokens_per_second": 100_000}}
    if fair:
        doc["fair_share"] = True
    if weights:
        doc["users"] = {user: {"weight": w} for user, w in weights.items()}
    scheduler, driver = driven_scheduler(
        model_dir,
        async_scheduling,
        default_rate=None,
        output_rate={"policy": doc},
        **kwargs,
    )
    shared = scheduler.output_rate_shared
    policy = shared.policy
    shared.policy = dataclasses.replace(
        policy,
        bands=BANDS,
        default=dataclasses.replace(policy.default, band="standard"),
        users={
            user: User(Limits(band=band, weight=(weights or {}).get(user)))
            for user, band in users.items()
        },
    )
    return scheduler, driver


class Watch:
    """Per step, from upstream's queues: the waiting requests at the step's
    start (startable) with their band, and the requests it started."""

    def __init__(self, scheduler, band_of_user):
        self.scheduler = scheduler
        self.band_of_user = band_of_user
        self.inversions: list[tuple[int, str, str]] = []
        self.preempted: list[str] = []
        self.started_higher = 0
        self.steps = 0
        schedule = scheduler.schedule

        def watched(*args, **kwargs):
            waiting = [r for r in scheduler.waiting if r.status in STARTABLE]
            out = schedule(*args, **kwargs)
            self._check(waiting, out)
            self.steps += 1
            return out

        scheduler.schedule = watched

    def band(self, request) -> int:
        return BANDS.index(self.band_of_user(self.scheduler.user_of(request)))

    def _check(self, waiting, out) -> None:
        started = {r.request_id for r in waiting} & set(out.num_scheduled_tokens)
        left = [r for r in waiting if r.request_id not in started]
        for request in waiting:
            if request.request_id not in started:
                continue
            mine = self.band(request)
            for other in left:
                if self.band(other) < mine and other.status in STARTABLE:
                    self.inversions.append(
                        (self.steps, request.request_id, other.request_id)
                    )


@pytest.mark.parametrize("seed", [3, 4])
@SYNC_AND_ASYNC
def test_seeded_workloads_never_start_a_lower_band_while_a_higher_one_waits(
    tiny_model_dir, async_scheduling, seed
):
    """10,000 steps of random arrivals of six users in three bands, four
    slots: no step starts a request while one of a higher band is left
    waiting, and lower bands are preempted for higher ones at most once per
    higher-band start and never before ``MIN_RUN_TOKENS`` after resuming."""
    users = {
        "i1": "interactive",
        "i2": "interactive",
        "s1": "standard",
        "s2": "standard",
        "b1": "batch",
        "b2": "batch",
    }
    scheduler, driver = banded_scheduler(
        tiny_model_dir, async_scheduling, users, max_num_seqs=4
    )
    watch = Watch(scheduler, users.__getitem__)
    #: (band, output tokens since its last preemption; None: its first)
    preemptions: list[tuple[int, int | None]] = []
    resumed_at: dict[str, int] = {}
    preempt = scheduler._preempt_request

    def recorded(request, *args, **kwargs):
        since = resumed_at.get(request.request_id)
        tokens = None if since is None else request.num_output_tokens - since
        preemptions.append((watch.band(request), tokens))
        resumed_at[request.request_id] = request.num_output_tokens
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = recorded
    rng = random.Random(seed)
    names = list(users)
    for _ in range(10_000):
        if rng.random() < 0.05:
            user = rng.choice(names)
            driver.add(
                [
                    make_request(
                        user,
                        max_tokens=rng.randrange(8, 150),
                        prompt_len=rng.randrange(4, 60),
                    )
                    for _ in range(rng.randrange(1, 4))
                ]
            )
        driver.step()
    driver.settle()
    assert watch.inversions == []
    assert preemptions, "the workload never made a band yield"
    assert all(band > 0 for band, _ in preemptions)  # interactive never yields
    # A request's first preemption may come at any time, a later one only
    # after it sampled MIN_RUN_TOKENS since it resumed.
    again = [tokens for _, tokens in preemptions if tokens is not None]
    assert all(tokens >= MIN_RUN_TOKENS for tokens in again), again


@SYNC_AND_ASYNC
def test_an_interactive_user_starts_after_the_grace_in_a_saturated_batch_band(
    tiny_model_dir, async_scheduling
):
    """Four slots held by two batch users (8 and 2 streams) that never end:
    an interactive user's 2 streams wait ``PREEMPT_AFTER_NS`` for a slot to
    free by itself, then batch streams yield theirs in the first step that
    starts that long after their arrival; they are never slower than a batch
    stream; with fair share the batch users split the rest by weight (equal),
    within a band."""
    users = {"i": "interactive", "b8": "batch", "b2": "batch"}
    scheduler, driver = banded_scheduler(
        tiny_model_dir, async_scheduling, users, fair=True, max_num_seqs=4
    )
    batch = [make_request("b8", max_tokens=100_000) for _ in range(8)]
    batch += [make_request("b2", max_tokens=100_000) for _ in range(2)]
    driver.add(batch)
    driver.run(100)
    interactive = [make_request("i", max_tokens=100_000) for _ in range(2)]
    arrived_ns = driver.clock()
    driver.add(interactive)
    while driver.clock() - arrived_ns < PREEMPT_AFTER_NS:
        scheduled = driver.step().num_scheduled_tokens
        assert not any(r.request_id in scheduled for r in interactive)
    scheduled = driver.step().num_scheduled_tokens
    assert all(r.request_id in scheduled for r in interactive)
    before = {r.request_id: r.num_output_tokens for r in batch + interactive}
    # The tiny model's context (512) ends a stream before long.
    driver.run(300)
    driver.settle()
    gained = {
        r.request_id: r.num_output_tokens - before[r.request_id]
        for r in batch + interactive
    }
    slowest_interactive = min(gained[r.request_id] for r in interactive)
    fastest_batch = max(gained[r.request_id] for r in batch)
    assert slowest_interactive >= fastest_batch
    per_user = {
        user: sum(gained[r.request_id] for r in batch if scheduler.user_of(r) == user)
        for user in ("b8", "b2")
    }
    share = per_user["b8"] / sum(per_user.values())
    assert abs(share - 0.5) <= 0.07, per_user


def test_bands_refuse_priority_scheduling(tiny_model_dir):
    """vLLM keeps a PRIORITY queue as a heap by request priority: bands would
    be reordered away, so the scheduler refuses to start with both."""
    doc = {
        "default": {"tokens_per_second": 100, "band": "standard"},
        "bands": list(BANDS),
        "users": {"i": {"band": "interactive"}},
    }
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        driven_scheduler(
            tiny_model_dir,
            False,
            default_rate=None,
            output_rate={"policy": doc},
            policy="priority",
        )
    # One band orders nothing: accepted.
    one = {**doc, "bands": ["standard"], "users": {}}
    scheduler, _ = driven_scheduler(
        tiny_model_dir,
        False,
        default_rate=None,
        output_rate={"policy": one},
        policy="priority",
    )
    assert not scheduler._steps.bands.active()


@SYNC_AND_ASYNC
def test_within_a_band_weights_give_that_service_ratio(
    tiny_model_dir, async_scheduling
):
    """An interactive user's 4 streams above four batch users of weights
    1:2:3:4 with 12 streams each, 20 slots, 10,000 steps: the interactive
    user keeps its four slots (4 tokens a step), and each batch user's share
    of the rest is its weight's share within +-5 % (the bound of fair share
    alone, ``test_weights_give_that_service_ratio``)."""
    weights = {"w1": 1, "w2": 2, "w3": 3, "w4": 4}
    users = {"i": "interactive", **dict.fromkeys(weights, "batch")}
    scheduler, driver = banded_scheduler(
        tiny_model_dir,
        async_scheduling,
        users,
        fair=True,
        weights=weights,
        max_num_seqs=20,
    )
    backlog = Backlog(
        scheduler, driver, {"i": 4, **dict.fromkeys(weights, 12)}, max_tokens=300
    )
    steps = 10_000
    for _ in range(steps):
        backlog.step()
    assert backlog.tokens["i"] >= 4 * steps * 0.97  # its prefills aside
    batch = sum(backlog.tokens[u] for u in weights)
    for user, weight in weights.items():
        share = backlog.tokens[user] / batch
        assert share == pytest.approx(weight / 10, rel=0.05), (user, share)


@SYNC_AND_ASYNC
def test_the_waiting_queue_is_banded_only_while_bands_order_the_steps(
    tiny_model_dir, async_scheduling
):
    """While the policy has bands, vLLM's waiting queue is kept in band order
    (FCFS within a band) and follows a reload that moves a user; a policy
    without bands, or the mode off, puts back an FCFS queue of the same
    requests in the same order."""
    users = {"i": "interactive", "b": "batch"}
    scheduler, driver = banded_scheduler(
        tiny_model_dir, async_scheduling, users, max_num_seqs=1
    )
    shared = scheduler.output_rate_shared
    driver.add([make_request("b", max_tokens=100_000)])
    driver.step()
    late = [make_request("b"), make_request("i"), make_request("b")]
    driver.add(late)
    driver.step()

    def waiting() -> list[str]:
        return [r.request_id for r in scheduler.waiting]

    first_b, first_i, second_b = (r.request_id for r in late)
    assert isinstance(scheduler.waiting, BandedQueue)
    assert waiting() == [first_i, first_b, second_b]
    banded = shared.policy
    shared.policy = dataclasses.replace(
        banded,
        users={"b": User(Limits(band="interactive")), "i": User(Limits(band="batch"))},
    )
    driver.step()
    assert waiting() == [first_b, second_b, first_i]
    shared.mode = Mode.OFF
    driver.step()
    assert type(scheduler.waiting) is FCFSRequestQueue
    assert waiting() == [first_b, second_b, first_i]
    shared.mode = Mode.ENFORCE
    driver.step()
    assert isinstance(scheduler.waiting, BandedQueue)
    assert waiting() == [first_b, second_b, first_i]
    shared.policy = dataclasses.replace(
        banded,
        bands=(),
        default=dataclasses.replace(banded.default, band=None),
        users={},
    )
    driver.step()
    assert type(scheduler.waiting) is FCFSRequestQueue
    assert waiting() == [first_b, second_b, first_i]
