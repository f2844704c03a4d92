"""``engine_ext.scheduling.fair_share`` on its own, over fake requests and a
fake upstream: the waiting queue's fair order and the slot moves equal those of
straightforward references (a ``min`` over the users' heads per request placed;
a ``min`` over the receiving users and a ``max`` over the candidates per move)
on seeded random queues full of ties."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from engine_ext.scheduling.fair_share import FairShareSteps
from engine_ext.scheduling.upstream import STARTABLE
from engine_ext.scheduling.users import UserBook
from pacing.accounting import Accounting
from pacing.fair_share import FairShare, FairShareSettings, Weights


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int = 0
    status: object = STARTABLE[0]


@dataclass
class FakeUpstream:
    """What fair share reads and calls of ``Upstream`` here."""

    waiting: list[FakeRequest] = field(default_factory=list)
    running: list[FakeRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    priority_policy: bool = False

    def blocks_can_be_freed(self, request: FakeRequest) -> bool:
        return True

    def preempt(self, request: FakeRequest) -> None:
        self.running.remove(request)
        self.preempted.append(request.request_id)


def fair_steps(
    rng: random.Random, users: list[str], upstream: FakeUpstream
) -> FairShareSteps:
    """Fair share over ``upstream`` with counters, weights and settings drawn
    from small sets (equal counters and slots per weight are common)."""
    settings = FairShareSettings(
        hysteresis=rng.choice([0.0, 4.0, 40.0]),
        min_run_tokens=rng.choice([1, 8]),
    )
    weights = Weights({u: rng.choice([0.5, 1.0, 2.0]) for u in users})
    ledger = FairShare(settings, weights, enabled=True)
    ledger.counter = {
        u: rng.choice([0.0, 8.0, 16.0, 50.0]) for u in users if rng.random() < 0.8
    }
    return FairShareSteps(
        upstream, ledger, UserBook(), Accounting(), lambda u: None, lambda u: None
    )


def add_requests(
    rng: random.Random,
    steps: FairShareSteps,
    users: list[str],
    count: int,
    prefix: str,
) -> list[FakeRequest]:
    requests = []
    for i in range(count):
        prompt = rng.choice([4, 8, 8, 16])
        request = FakeRequest(
            f"{prefix}{i}",
            num_prompt_tokens=prompt,
            # A prompt already computed (a resumed prefix) costs nothing more.
            num_computed_tokens=rng.choice([0, 0, 4, prompt]),
            num_output_tokens=rng.choice([0, 4, 8, 20]),
        )
        steps.book.user_of[request.request_id] = rng.choice(users)
        requests.append(request)
    return requests


def reference_order(steps: FairShareSteps) -> list[FakeRequest]:
    """Places one request at a time: the head of the user with the smallest
    projected counter (equal counters: the user whose first request waits
    first), then adds that request's prompt cost to its user."""
    ledger = steps.ledger
    queues: dict[str, list[FakeRequest]] = {}
    for request in steps.upstream.waiting:
        queues.setdefault(steps.book.user(request.request_id), []).append(request)
    projected = {user: ledger.of(user) for user in queues}
    order = []
    while queues:
        user = min(queues, key=projected.__getitem__)
        request = queues[user].pop(0)
        order.append(request)
        prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        projected[user] += ledger.cost(prompt_left, 0, steps._weight(user))
        if not queues[user]:
            del queues[user]
    return order


def reference_moves(
    steps: FairShareSteps, receivers: list[FakeRequest], free: int
) -> tuple[list[FakeRequest], list[FakeRequest]]:
    """The slot moves of the module docstring, one at a time: the receiving
    user with the fewest slots per weight (then the smallest counter, then the
    latest last receiver in fair order) takes a slot from the candidate with
    the most (then the largest counter, then the first running), if rules 1-3
    allow, else it leaves."""
    ledger = steps.ledger
    counter, user_of = ledger.counter, steps.book.user
    held: dict[str, int] = {}
    candidates: dict[str, list[FakeRequest]] = {}
    for request in steps.upstream.running:
        user = user_of(request.request_id)
        held[user] = held.get(user, 0) + 1
        floor = steps.run_floor.get(request.request_id, ledger.settings.min_run_tokens)
        if request.num_output_tokens >= floor:
            candidates.setdefault(user, []).append(request)
    for requests in candidates.values():
        requests.sort(key=lambda r: -r.num_computed_tokens)
    chosen = receivers[:free]
    for request in chosen:
        user = user_of(request.request_id)
        held[user] = held.get(user, 0) + 1
    pending: dict[str, list[FakeRequest]] = {}
    for request in reversed(receivers[free:]):
        pending.setdefault(user_of(request.request_id), []).append(request)

    def per_weight(user: str) -> float:
        return held.get(user, 0) / steps._weight(user)

    def key(user: str) -> tuple[float, float]:
        return per_weight(user), counter.get(user, 0.0)

    yielded = []
    while pending:
        user = min(pending, key=key)
        mine = counter.get(user, 0.0)
        victim_user = max(
            (
                v
                for v, requests in candidates.items()
                if requests
                and v != user
                and counter.get(v, 0.0) - mine > ledger.settings.hysteresis
                and per_weight(v) > per_weight(user)
            ),
            key=key,
            default=None,
        )
        if victim_user is None:
            del pending[user]
            continue
        yielded.append(candidates[victim_user].pop())
        held[victim_user] -= 1
        held[user] = held.get(user, 0) + 1
        chosen.append(pending[user].pop())
        if not pending[user]:
            del pending[user]
    return chosen, yielded


def ids(requests: Iterable[FakeRequest]) -> list[str]:
    return [r.request_id for r in requests]


@pytest.mark.parametrize("seed", range(200))
def test_the_fair_order_is_the_reference_order(seed):
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(rng.choice([2, 5, 20]))]
    upstream = FakeUpstream()
    steps = fair_steps(rng, users, upstream)
    upstream.waiting = add_requests(rng, steps, users, rng.randrange(1, 60), "w")
    assert ids(steps._fair_order()) == ids(reference_order(steps))


@pytest.mark.parametrize("seed", range(200))
def test_slot_moves_are_the_reference_moves(seed):
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(rng.choice([3, 6, 20]))]
    upstream = FakeUpstream()
    steps = fair_steps(rng, users, upstream)
    upstream.running = add_requests(rng, steps, users, rng.randrange(1, 30), "r")
    upstream.waiting = add_requests(rng, steps, users, rng.randrange(1, 40), "w")
    receivers = steps._fair_order()
    free = min(rng.choice([0, 0, 1, 3]), len(receivers) - 1)  # as before_step
    expected_chosen, expected_yielded = reference_moves(steps, receivers, free)
    chosen, yielded = steps._yield_slots(receivers, free, ())
    assert ids(chosen) == ids(expected_chosen)
    assert ids(yielded) == ids(expected_yielded) == upstream.preempted
    preemptions = steps.accounting.total.fair_share_preemptions
    assert preemptions == len(yielded)
