"""``engine_ext.scheduling.ordering`` on its own, over the real limiter and real
vLLM ``Request`` objects: each user's same-priority streams are rotated to start
after the last served, parked requests (sampling next, user without budget) go
last or are biased as PRIORITY's victims, and after the step every arrival time
and ``running``'s order are restored."""

from __future__ import annotations

from engine_ext.scheduling import ordering
from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.users import UserBook
from pacing.limiter import OutputRateLimiter
from tools.scheduler_harness import make_request

T0 = 1_000_000_000_000
PROMPT = 8


def new_step(book: UserBook, *, without_budget: tuple[str, ...] = ()) -> PacedStep:
    """A step over a 100 tokens/s limiter in which ``without_budget`` users have
    spent their whole bucket."""
    limiter = OutputRateLimiter(100, {})
    for user in without_budget:
        limiter.take_up_to(user, 1_000, T0)
    return PacedStep(T0, limiter, book, capped=False)


def request_of(book: UserBook, user: str, *, sampling: bool = False, priority: int = 0):
    """A request of ``user`` known to the book: at its sampling position (the
    last prompt position) or at the start of its prefill."""
    request = make_request(user, prompt_len=PROMPT, priority=priority)
    if sampling:
        request.num_computed_tokens = PROMPT - 1
    book.add(request.request_id, user, paced=True)
    return request


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_a_users_streams_start_after_the_last_served_one_in_its_own_positions():
    book = UserBook()
    a0 = request_of(book, "a")
    b0 = request_of(book, "b")
    a1 = request_of(book, "a")
    a2 = request_of(book, "a")
    book.last_served["a"] = a1.request_id
    step = new_step(book)
    ordered = ordering.order_for_step([a0, b0, a1, a2], step, priority_policy=False)
    # a's positions 0, 2, 3 now hold a2, a0, a1; b0 keeps position 1.
    assert ordered == [a2, b0, a0, a1]


def test_no_rotation_when_the_last_served_stream_is_gone():
    book = UserBook()
    a0 = request_of(book, "a")
    a1 = request_of(book, "a")
    book.last_served["a"] = "ended-long-ago"
    step = new_step(book)
    assert ordering.order_for_step([a0, a1], step, priority_policy=False) == [a0, a1]


def test_streams_are_rotated_within_their_priority_only():
    book = UserBook()
    a0 = request_of(book, "a", priority=0)
    a1 = request_of(book, "a", priority=1)
    a2 = request_of(book, "a", priority=0)
    a3 = request_of(book, "a", priority=1)
    book.last_served["a"] = a0.request_id
    step = new_step(book)
    ordered = ordering.order_for_step([a0, a1, a2, a3], step, priority_policy=False)
    # Priority 0 (positions 0, 2) starts after a0; priority 1 has no served
    # stream among its members, so it stays.
    assert ordered == [a2, a1, a0, a3]


def test_parked_requests_go_last_in_rotated_order_and_are_counted_per_user():
    book = UserBook()
    a0 = request_of(book, "a", sampling=True)
    b0 = request_of(book, "b", sampling=True)
    a1 = request_of(book, "a")  # in its prefill: not parked
    a2 = request_of(book, "a", sampling=True)
    step = new_step(book, without_budget=("a",))
    ordered = ordering.order_for_step([a0, b0, a1, a2], step, priority_policy=False)
    assert ordered == [b0, a1, a0, a2]
    assert step.parked == [a0, a2]
    assert book.parked_counts == {"a": 2}


def test_nothing_is_parked_while_every_sampling_users_grant_has_tokens():
    book = UserBook()
    book.parked_counts = {"stale": 3}  # from the previous step
    a0 = request_of(book, "a", sampling=True)
    b0 = request_of(book, "b", sampling=True)
    step = new_step(book)
    ordered = ordering.order_for_step([a0, b0], step, priority_policy=False)
    assert ordered == [a0, b0]
    assert step.parked == []
    assert book.parked_counts == {}


def test_rotation_is_applied_before_parked_requests_are_moved_last():
    book = UserBook()
    a0 = request_of(book, "a", sampling=True)
    a1 = request_of(book, "a", sampling=True)
    a2 = request_of(book, "a", sampling=True)
    b0 = request_of(book, "b", sampling=True)
    book.last_served["a"] = a0.request_id
    step = new_step(book, without_budget=("a",))
    ordered = ordering.order_for_step([a0, a1, a2, b0], step, priority_policy=False)
    assert step.parked == [a1, a2, a0]  # served least recently first
    assert ordered == [b0, a1, a2, a0]


def test_under_priority_parked_requests_are_biased_to_be_the_victims_then_restored():
    book = UserBook()
    a0 = request_of(book, "a", sampling=True)
    b0 = request_of(book, "b", sampling=True)
    arrivals = {id(r): r.arrival_time for r in (a0, b0)}
    step = new_step(book, without_budget=("a",))
    running = [a0, b0]
    ordered = ordering.order_for_step(running, step, priority_policy=True)
    assert ordered == [b0, a0]
    assert a0.arrival_time == arrivals[id(a0)] + ordering.PRIORITY_VICTIM_BIAS_S
    assert b0.arrival_time == arrivals[id(b0)]
    # PRIORITY's victim, max by (priority, arrival_time), is now the parked one.
    assert max(running, key=lambda r: (r.priority, r.arrival_time)) is a0
    ordering.restore_arrival_times(running, step)
    assert {id(r): r.arrival_time for r in running} == arrivals
    assert step.biased_arrival == {}


def test_without_priority_no_arrival_time_is_touched():
    book = UserBook()
    a0 = request_of(book, "a", sampling=True)
    arrival = a0.arrival_time
    step = new_step(book, without_budget=("a",))
    ordering.order_for_step([a0], step, priority_policy=False)
    assert a0.arrival_time == arrival
    assert step.biased_arrival == {}


def test_unbias_restores_one_request_once_and_leaves_unbiased_ones_alone():
    book = UserBook()
    a0 = request_of(book, "a", sampling=True)
    a1 = request_of(book, "a", sampling=True)
    b0 = request_of(book, "b", sampling=True)
    arrival_a0, arrival_b0 = a0.arrival_time, b0.arrival_time
    step = new_step(book, without_budget=("a",))
    ordering.order_for_step([a0, a1, b0], step, priority_policy=True)
    ordering.unbias(step, a0)  # preempted mid-step
    assert a0.arrival_time == arrival_a0
    ordering.unbias(step, a0)
    assert a0.arrival_time == arrival_a0  # not restored to something else
    ordering.unbias(step, b0)
    assert b0.arrival_time == arrival_b0
    assert set(step.biased_arrival) == {a1.request_id}


def test_restore_order_puts_running_back_with_admitted_requests_behind():
    book = UserBook()
    x, y, z, new1, new2 = (request_of(book, "a") for _ in range(5))
    running = [new1, z, x, new2, y]
    ordering.restore_order(running, [x, y, z])
    assert running == [x, y, z, new1, new2]


def test_restore_order_drops_nothing_and_keeps_out_what_left_in_the_step():
    book = UserBook()
    x, y, z, new = (request_of(book, "a") for _ in range(4))
    running = [z, new, x]  # y was preempted in the step
    before = running
    ordering.restore_order(running, [x, y, z])
    assert running is before  # sorted in place: upstream's own list
    assert running == [x, z, new]
