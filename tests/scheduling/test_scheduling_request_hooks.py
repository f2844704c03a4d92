"""``engine_ext.scheduling.request_hooks.RequestHooks`` on its own, as a real
vLLM scheduler holds it (``_request_hooks``, over upstream's own methods), called
directly as upstream's loops would call it, with a ``PacedStep`` over the
scheduler's real limiter:

- ``reserve_prefill_lookahead``: a middle prefill chunk is free, a step that
  samples takes one token of its user's grant once, a refused one gets 0 tokens
  or, with chunked prefill, a prefill up to its second-to-last position;
- ``handle_blocked_waiting_request``: a waiting request of a user without budget
  is skipped unless it may take a spare slot for a prefill that stops short;
- outside a paced step each hook defers to upstream alone.

At 100 tokens/s with the 100 ms burst a fresh user has 11 tokens."""

from __future__ import annotations

from vllm.v1.request import RequestStatus

from engine_ext.scheduling import ordering
from engine_ext.scheduling.grants import PacedStep
from tools.scheduler_harness import driven_scheduler, make_request, make_scheduler


def scheduler_with(tiny_model_dir, **settings):
    scheduler = make_scheduler(tiny_model_dir, default_rate=100, **settings)
    scheduler.clock = lambda: 1_000_000_000_000
    return scheduler


def added(scheduler, user: str, *, prompt_len: int = 8, computed: int = 0):
    """A request of ``user`` added to ``scheduler`` (waiting), with ``computed``
    prompt positions already computed."""
    request = make_request(user, prompt_len=prompt_len)
    scheduler.add_request(request)
    request.num_computed_tokens = computed
    return request


def paced_step(scheduler, *, without_budget=(), **kwargs) -> PacedStep:
    """A paced step in progress on ``scheduler``'s hooks; ``without_budget``
    users have spent their bucket."""
    now = scheduler.clock()
    for user in without_budget:
        scheduler.limiter.take_up_to(user, 1_000, now)
    kwargs.setdefault("capped", False)
    step = PacedStep(now, scheduler.budget, scheduler._users, **kwargs)
    scheduler._request_hooks.step = step
    return step


# -- outside a paced step ------------------------------------------------------


def test_outside_a_paced_step_the_hooks_defer_to_upstream_and_charge_nothing(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir)
    hooks = scheduler._request_hooks
    assert hooks.step is None
    sampling = added(scheduler, "a", computed=7)
    assert hooks.reserve_prefill_lookahead(sampling, 7, 1) == 1
    assert hooks.handle_blocked_waiting_request(added(scheduler, "a"))
    assert scheduler.limiter.tracked_users() == 0  # the limiter was not asked


def test_a_request_upstream_blocks_stays_blocked_whatever_its_budget(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir)
    request = added(scheduler, "a")
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # not received yet
    step = paced_step(scheduler)
    assert not scheduler._request_hooks.handle_blocked_waiting_request(request)
    assert step.left == {}  # no budget call for it


# -- reserve_prefill_lookahead -------------------------------------------------


def test_a_middle_prefill_chunk_is_free(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir, max_num_batched_tokens=32)
    request = added(scheduler, "a", prompt_len=100)
    step = paced_step(scheduler)
    hooks = scheduler._request_hooks
    assert hooks.reserve_prefill_lookahead(request, 0, 32) == 32
    assert hooks.reserve_prefill_lookahead(request, 64, 32) == 32
    # Up to the second-to-last position: still nothing sampled.
    assert hooks.reserve_prefill_lookahead(request, 64, 35) == 35
    assert step.charged == {}
    assert step.left == {}  # its user's budget was not even asked
    assert scheduler.limiter.tracked_users() == 0


def test_a_step_that_samples_is_charged_once(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir)
    request = added(scheduler, "a", computed=7)
    step = paced_step(scheduler)
    hooks = scheduler._request_hooks
    assert hooks.reserve_prefill_lookahead(request, 7, 1) == 1
    assert hooks.reserve_prefill_lookahead(request, 7, 1) == 1  # asked again
    assert step.charged == {request.request_id: "a"}
    assert step.granted == {"a": 1}
    assert scheduler.limiter.available("a", step.now_ns) == 10


def test_the_last_prefill_chunk_samples_and_is_charged(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir, max_num_batched_tokens=32)
    request = added(scheduler, "a", prompt_len=100, computed=96)
    step = paced_step(scheduler)
    assert scheduler._request_hooks.reserve_prefill_lookahead(request, 96, 4) == 4
    assert step.charged == {request.request_id: "a"}


def test_a_refused_step_gets_no_tokens_without_chunked_prefill(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir, enable_chunked_prefill=False)
    decoding = added(scheduler, "a", computed=7)
    prompt = added(scheduler, "a")
    step = paced_step(scheduler, without_budget=("a",))
    hooks = scheduler._request_hooks
    assert hooks.reserve_prefill_lookahead(decoding, 7, 1) == 0
    assert hooks.reserve_prefill_lookahead(prompt, 0, 8) == 0
    assert step.charged == {}
    assert step.refused == {"a"}
    assert step.skips == {"a": 2}


def test_a_refused_prefill_stops_at_its_second_to_last_position_with_chunked_prefill(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir)
    long = added(scheduler, "a", prompt_len=100, computed=64)
    whole = added(scheduler, "a")
    decoding = added(scheduler, "a", computed=7)
    step = paced_step(scheduler, without_budget=("a",))
    hooks = scheduler._request_hooks
    assert hooks.reserve_prefill_lookahead(long, 64, 36) == 35  # up to position 98
    assert hooks.reserve_prefill_lookahead(whole, 0, 8) == 7
    assert hooks.reserve_prefill_lookahead(decoding, 7, 1) == 0
    assert step.charged == {}
    assert step.skips == {"a": 3}


def test_in_shadow_mode_a_step_refused_a_token_runs_whole(tiny_model_dir):
    scheduler = scheduler_with(tiny_model_dir)
    request = added(scheduler, "a", computed=7)
    step = paced_step(scheduler, without_budget=("a",), shadow=True)
    assert scheduler._request_hooks.reserve_prefill_lookahead(request, 7, 1) == 1
    assert step.shadow_skips == {"a": 1}
    assert step.refused == set()


def test_throttled_running_requests_raise_the_active_cap_up_to_the_slots(
    tiny_model_dir,
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, default_rate=100, max_num_seqs=3, max_num_active_seqs=2
    )
    slow = [make_request("slow") for _ in range(2)]
    driver.add(slow)
    driver.step()
    assert scheduler.running == slow
    step = paced_step(scheduler, without_budget=("slow",), capped=True)
    hooks = scheduler._request_hooks
    caps = []
    for request in slow:
        computed = request.num_computed_tokens
        assert hooks.reserve_prefill_lookahead(request, computed, 1) == 0
        caps.append(scheduler.max_num_active_reqs)
    assert caps == [3, 3]  # 2 + 1, then 2 + 2 held to the 3 slots
    assert step.running_throttled == 2
    assert step.running_granted == 0


def test_under_the_active_cap_granted_running_requests_are_counted(tiny_model_dir):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, default_rate=100, max_num_seqs=3, max_num_active_seqs=2
    )
    fast = [make_request("fast") for _ in range(2)]
    driver.add(fast)
    driver.step()
    step = paced_step(scheduler, capped=True)
    hooks = scheduler._request_hooks
    for request in fast:
        assert hooks.reserve_prefill_lookahead(request, request.num_computed_tokens, 1)
    assert step.running_granted == 2
    assert scheduler.max_num_active_reqs == 2
    # The cap bounds the running loop too: no third grant in this step.
    assert hooks.reserve_prefill_lookahead(fast[0], fast[0].num_computed_tokens, 1) == 0


# -- handle_blocked_waiting_request --------------------------------------------


def test_a_waiting_request_of_a_user_without_budget_is_skipped_and_passed_over(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir, enable_chunked_prefill=False)
    request = added(scheduler, "slow")
    step = paced_step(scheduler, without_budget=("slow",))
    assert not scheduler._request_hooks.handle_blocked_waiting_request(request)
    assert step.refused == {"slow"}
    assert step.skips == {"slow": 1}


def test_a_waiting_request_of_a_user_with_budget_proceeds_and_is_no_longer_pending(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir, enable_chunked_prefill=False)
    request = added(scheduler, "fast")
    step = paced_step(scheduler)
    step.needy_pending = {request.request_id, "another"}
    assert scheduler._request_hooks.handle_blocked_waiting_request(request)
    assert step.needy_pending == {"another"}
    assert step.refused == set()
    assert step.skips == {}


def test_without_budget_a_waiting_request_may_prefill_short_when_no_one_needs_slots(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir)
    request = added(scheduler, "slow")
    step = paced_step(scheduler, without_budget=("slow",))
    assert step.spare_slots is None  # no user with budget waits for a slot
    assert scheduler._request_hooks.handle_blocked_waiting_request(request)
    assert step.refused == {"slow"}
    assert step.skips == {}  # admitted: reserve_prefill_lookahead stops it short


def test_without_budget_a_waiting_request_takes_only_a_slot_no_one_with_budget_needs(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir)
    first, second, third = (added(scheduler, "slow") for _ in range(3))
    step = paced_step(scheduler, without_budget=("slow",))
    hooks = scheduler._request_hooks
    step.spare_slots = 1
    step.needy_pending = {"a request of a user with budget"}
    assert not hooks.handle_blocked_waiting_request(first)  # it comes first
    step.needy_pending = set()
    assert hooks.handle_blocked_waiting_request(second)
    assert step.spare_slots == 0
    assert not hooks.handle_blocked_waiting_request(third)  # no slot left
    assert step.skips == {"slow": 2}


def test_without_budget_a_request_with_only_its_sampling_position_left_is_skipped(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir)
    one_token = added(scheduler, "slow", prompt_len=1)
    resumed = added(scheduler, "slow", computed=7)
    step = paced_step(scheduler, without_budget=("slow",))
    hooks = scheduler._request_hooks
    assert not hooks.handle_blocked_waiting_request(one_token)
    assert not hooks.handle_blocked_waiting_request(resumed)
    assert step.skips == {"slow": 2}


def test_in_shadow_mode_a_waiting_request_proceeds_without_a_budget_call(
    tiny_model_dir,
):
    scheduler = scheduler_with(tiny_model_dir, enable_chunked_prefill=False)
    request = added(scheduler, "slow")
    step = paced_step(scheduler, without_budget=("slow",), shadow=True)
    assert scheduler._request_hooks.handle_blocked_waiting_request(request)
    assert step.left == {}
    assert step.refused == set()


# -- preempting ----------------------------------------------------------------


def test_a_preempted_parked_request_is_unbiased_and_counted(tiny_model_dir):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, default_rate=100, policy="priority"
    )
    slow, fast = make_request("slow"), make_request("fast")
    driver.add([slow, fast])
    driver.step()
    arrivals = {id(r): r.arrival_time for r in (slow, fast)}
    step = paced_step(scheduler, without_budget=("slow",))
    ordering.order_for_step(scheduler.running, step, priority_policy=True)
    assert slow.arrival_time != arrivals[id(slow)]  # biased as the victim
    hooks = scheduler._request_hooks
    hooks.preempting(slow)
    hooks.preempting(fast)
    assert {id(r): r.arrival_time for r in (slow, fast)} == arrivals
    assert scheduler.accounting.of("slow").throttled_preemptions == 1
    assert scheduler.accounting.of("fast").throttled_preemptions == 0
