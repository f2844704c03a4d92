"""``engine_ext.scheduling.slots`` on its own, over the real limiter, real vLLM
``Request`` objects and, where a victim is preempted, a real vLLM scheduler:
waiting requests of users with budget are found in admission order, a victim
never has a higher priority than the request it yields to, and victims come in
the order lowest priority, user furthest from budget, most recently served
stream."""

from __future__ import annotations

from vllm.v1.request import RequestStatus

from engine_ext.scheduling import ordering
from engine_ext.scheduling.grants import PacedStep
from engine_ext.scheduling.slots import (
    SlotYielding,
    first_yielding_to,
    waiting_with_budget,
)
from engine_ext.scheduling.upstream import Upstream
from engine_ext.scheduling.users import UserBook
from pacing.limiter import OutputRateLimiter
from tools.scheduler_harness import driven_scheduler, make_request, make_scheduler

MS = 1_000_000
T0 = 1_000_000 * MS


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# -- first_yielding_to ---------------------------------------------------------


def test_the_first_victim_of_the_same_or_a_lower_priority_yields_and_is_taken():
    top, low, middle = (make_request("v", priority=p) for p in (0, 2, 1))
    victims = [top, low, middle]
    assert first_yielding_to(victims, make_request("w", priority=1)) is low
    assert victims == [top, middle]
    assert first_yielding_to(victims, make_request("w", priority=1)) is middle
    assert victims == [top]


def test_no_victim_of_a_higher_priority_yields():
    top = make_request("v", priority=0)
    victims = [top]
    assert first_yielding_to(victims, make_request("w", priority=1)) is None
    assert victims == [top]  # still there for a request it may yield to
    assert first_yielding_to(victims, make_request("w", priority=0)) is top
    assert first_yielding_to(victims, make_request("w", priority=0)) is None


# -- waiting_with_budget -------------------------------------------------------


def step_over(*requests, without_budget: tuple[str, ...] = ()) -> PacedStep:
    """A step over a 100 tokens/s limiter for a book of ``requests``;
    ``without_budget`` users have spent their bucket."""
    book = UserBook()
    for request in requests:
        user = request.sampling_params.extra_args["output_rate_user"]
        book.add(request.request_id, user, paced=True)
    limiter = OutputRateLimiter(100, {})
    for user in without_budget:
        limiter.take_up_to(user, 1_000, T0)
    return PacedStep(T0, limiter, book, capped=False)


def test_waiting_requests_of_users_with_budget_are_found_in_admission_order():
    slow = make_request("slow")
    fast1, fast2, fast3 = (make_request("fast") for _ in range(3))
    other = make_request("other")
    waiting = [slow, fast1, other, fast2, fast3]
    step = step_over(*waiting, without_budget=("slow",))
    assert waiting_with_budget(step, waiting, limit=3) == [fast1, other, fast2]
    assert waiting_with_budget(step, waiting, limit=10) == [fast1, other, fast2, fast3]


def test_only_requests_that_can_start_now_are_found():
    grammar = make_request("fast")
    grammar.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    remote = make_request("fast")
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    preempted = make_request("fast")
    preempted.status = RequestStatus.PREEMPTED
    ready = make_request("fast")
    waiting = [grammar, remote, preempted, ready]
    step = step_over(*waiting)
    assert waiting_with_budget(step, waiting, limit=4) == [preempted, ready]


def test_no_waiting_request_is_found_when_no_user_has_budget():
    waiting = [make_request("slow") for _ in range(3)]
    step = step_over(*waiting, without_budget=("slow",))
    assert waiting_with_budget(step, waiting, limit=3) == []
    assert step.granted == {"slow": 0}  # one budget call for the user


# -- SlotYielding.victims --------------------------------------------------------


def test_victims_lowest_priority_then_furthest_from_budget_then_most_recent(
    tiny_model_dir,
):
    scheduler = make_scheduler(tiny_model_dir)
    slots = SlotYielding(Upstream(scheduler, scheduler.schedule))
    low = make_request("near", priority=1)
    near0, near1 = make_request("near"), make_request("near")
    far0 = make_request("far")
    parked = [near0, low, far0, near1]  # rotated: later is served more recently
    step = step_over(*parked)
    limiter = step.budget
    limiter.take_up_to("near", 1_000, T0)  # its 11 tokens: ready at +10 ms
    limiter.take_each({"far": 40}, T0)  # ready at +300 ms
    assert limiter.ready_at_ns("far", T0) > limiter.ready_at_ns("near", T0) > T0
    assert slots.victims(step, parked) == [low, far0, near1, near0]


def test_a_request_that_yielded_is_not_a_victim_again(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir)
    slots = SlotYielding(Upstream(scheduler, scheduler.schedule))
    a0, a1, a2 = (make_request("a") for _ in range(3))
    step = step_over(a0, a1, a2)
    slots.yielded.add(a2.request_id)
    assert slots.victims(step, [a0, a1, a2]) == [a1, a0]


# -- SlotYielding.yield_for_waiting, on a scheduler whose slots are full --------


def parked_and_waiting(tiny_model_dir, *, slots: int, parked: int, waiting: int):
    """A scheduler with ``parked`` requests of "slow" running at their sampling
    position, "slow" without budget, and ``waiting`` requests of "fast"; the
    step, with ``running`` in its order."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, max_num_seqs=slots, default_rate=100
    )
    slow = [make_request("slow") for _ in range(parked)]
    driver.add(slow)
    driver.step()
    assert all(r.status == RequestStatus.RUNNING for r in slow)
    fast = [make_request("fast") for _ in range(waiting)]
    driver.add(fast)
    now = scheduler.clock()
    scheduler.limiter.take_up_to("slow", 1_000, now)
    step = PacedStep(now, scheduler.budget, scheduler._users, capped=False)
    scheduler.running[:] = ordering.order_for_step(
        scheduler.running, step, priority_policy=False
    )
    return scheduler, step, slow, fast


def test_a_parked_request_yields_its_slot_and_goes_to_the_front_of_the_queue(
    tiny_model_dir,
):
    scheduler, step, slow, fast = parked_and_waiting(
        tiny_model_dir, slots=2, parked=2, waiting=1
    )
    slots = scheduler._steps.slots
    slots.yield_for_waiting(step)
    victim = slow[1]  # the most recently served of the user's streams
    assert victim.status == RequestStatus.PREEMPTED
    assert scheduler.running == [slow[0]]
    assert ids(scheduler.waiting) == [victim.request_id, fast[0].request_id]
    assert slots.yielded == {victim.request_id}
    assert step.spare_slots == 0
    assert step.needy_pending == {fast[0].request_id}


def test_no_more_parked_requests_yield_than_waiting_requests_need(tiny_model_dir):
    scheduler, step, slow, fast = parked_and_waiting(
        tiny_model_dir, slots=3, parked=3, waiting=2
    )
    scheduler._steps.slots.yield_for_waiting(step)
    assert [r.status for r in slow] == [
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.PREEMPTED,
    ]
    assert step.spare_slots == 0
    assert step.needy_pending == set(ids(fast))


def test_nothing_yields_while_a_free_slot_is_enough(tiny_model_dir):
    scheduler, step, slow, fast = parked_and_waiting(
        tiny_model_dir, slots=4, parked=2, waiting=1
    )
    scheduler._steps.slots.yield_for_waiting(step)
    assert scheduler.running == slow
    assert scheduler._steps.slots.yielded == set()
    assert step.spare_slots == 1  # one free slot left after fast's
    assert step.needy_pending == set(ids(fast))


def test_nothing_yields_to_a_waiting_user_without_budget(tiny_model_dir):
    scheduler, step, slow, _ = parked_and_waiting(
        tiny_model_dir, slots=2, parked=2, waiting=0
    )
    scheduler.add_request(make_request("slow"))
    scheduler._steps.slots.yield_for_waiting(step)
    assert scheduler.running == slow
    assert scheduler._steps.slots.yielded == set()
    assert step.spare_slots is None  # no user with budget is waiting for a slot
