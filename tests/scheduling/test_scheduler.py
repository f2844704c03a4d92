"""Scheduling rules (docs/reference/spec-promises.md) on vLLM's real
Scheduler / AsyncScheduler and KV manager, with controlled model-runner outputs and
a fake clock."""

from __future__ import annotations

from collections import Counter

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from engine_ext.scheduler import (
    OutputRateAsyncScheduler,
    OutputRateScheduler,
    scheduler_class_for,
)
from engine_ext.scheduling import ordering
from pacing.limiter import MAX_RATE, OutputRateLimiter
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import (
    Driver,
    make_request,
    run_seeded_workload,
    runner_output,
    upstream_and_ours,
)
from tools.scheduler_harness import driven_scheduler as setup


class CountingLimiter(OutputRateLimiter):
    """The real limiter, counting the calls that spend or return budget, per
    user."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.take_calls: Counter[str] = Counter()
        self.refund_calls: Counter[str] = Counter()

    def try_take(self, user: str, now_ns: int) -> bool:
        self.take_calls[user] += 1
        return super().try_take(user, now_ns)

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        self.take_calls[user] += 1
        return super().take_up_to(user, most, now_ns)

    def take_each(self, counts, now_ns: int) -> dict[str, int]:
        self.take_calls.update(counts.keys())
        return super().take_each(counts, now_ns)

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        self.refund_calls[user] += 1
        super().refund(user, now_ns, count)


def use_counting_limiter(scheduler) -> CountingLimiter:
    """Gives ``scheduler`` a counting limiter with the same limits, where the
    scheduler's limiter is held: the facade it shares with the control plane."""
    old = scheduler.limiter
    limiter = CountingLimiter(old.default_rate, old.user_rates)
    scheduler.output_rate_shared.limiter = limiter
    assert scheduler.limiter is limiter
    return limiter


def step_until_preempted(driver: Driver, request, max_steps: int = 100) -> None:
    """Steps until ``request`` is preempted (KV blocks run out); fails if it
    never is."""
    for _ in range(max_steps):
        driver.step()
        if request.status == RequestStatus.PREEMPTED:
            return
    raise AssertionError(f"{request.request_id} was not preempted in {max_steps} steps")


def test_scheduler_variant_matches_async_scheduling():
    assert scheduler_class_for(True) is OutputRateAsyncScheduler
    assert scheduler_class_for(False) is OutputRateScheduler
    assert issubclass(OutputRateAsyncScheduler, AsyncScheduler)
    assert issubclass(OutputRateScheduler, Scheduler)


@MODES
def test_decode_steps_charge_one_token_each(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=100_000)
    driver.add([make_request("u", prompt_len=8, max_tokens=20)])
    sampling_dispatches = 0
    for _ in range(40):
        sampling_dispatches += len(driver.step_sampled())
    counters = scheduler.accounting.of("u")
    assert sampling_dispatches >= 20
    assert counters.charged == sampling_dispatches
    assert counters.refunds == 0


@MODES
def test_middle_prefill_chunks_are_free_and_last_chunk_charges(
    tiny_model_dir, async_scheduling
):
    # 100 prompt tokens, 32 per step: chunks 32, 32, 32, 4; only the last samples.
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        max_num_batched_tokens=32,
    )
    driver.add([make_request("u", prompt_len=100, max_tokens=1)])
    charged_after = []
    for _ in range(4):
        driver.step()
        charged_after.append(scheduler.accounting.of("u").charged)
    assert [out.total_num_scheduled_tokens for out in driver.outputs] == [32, 32, 32, 4]
    assert charged_after == [0, 0, 0, 1]


@MODES
def test_refused_chunked_prefill_stops_at_second_to_last_position(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=1)
    # Spend the burst (0.1 s * 1 tok/s + 1 token) with a first request.
    driver.add([make_request("u", prompt_len=4, max_tokens=50)])
    driver.step()
    late = make_request("u", prompt_len=40, max_tokens=5)
    driver.add([late])
    output = driver.step()
    assert output.num_scheduled_tokens.get(late.request_id) == 39
    assert late.num_computed_tokens == 39
    assert scheduler.accounting.of("u").charged == 1


@MODES
def test_without_chunked_prefill_a_refused_prefill_waits_whole(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=1,
        enable_chunked_prefill=False,
    )
    driver.add([make_request("u", prompt_len=4, max_tokens=50)])
    driver.step()
    late = make_request("u", prompt_len=40, max_tokens=5)
    driver.add([late])
    output = driver.step()
    assert late.request_id not in output.num_scheduled_tokens
    assert late.num_computed_tokens == 0


@MODES
def test_charges_equal_sampling_dispatches_so_nothing_is_charged_twice(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=30, user_rates={"b": 500}
    )
    requests = [make_request("a", max_tokens=200) for _ in range(4)]
    requests += [make_request("b", max_tokens=200) for _ in range(3)]
    user_of = {
        r.request_id: r.sampling_params.extra_args["output_rate_user"] for r in requests
    }
    driver.add(requests)
    dispatched = Counter()
    for _ in range(200):
        for rid in driver.step_sampled(step_ms=7):
            dispatched[user_of[rid]] += 1
    for user in ("a", "b"):
        counters = scheduler.accounting.of(user)
        assert counters.charged - counters.refunds == dispatched[user]
    assert scheduler.accounting.of("a").throttled_skips > 0


@MODES
def test_a_refused_user_is_asked_at_most_once_per_step(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=5)
    limiter = use_counting_limiter(scheduler)
    driver.add(make_request("u", max_tokens=100) for _ in range(6))
    refused_steps = steps_without_budget = 0
    for _ in range(30):
        before = limiter.take_calls["u"]
        has_budget = limiter.available("u", driver.clock.now_ns) > 0
        granted = len(driver.step_sampled(step_ms=5))
        # One call per step while it has budget, whether it grants 6 tokens or
        # a few; none while it has none (it sleeps: test_scheduler_sleepers).
        assert limiter.take_calls["u"] - before == has_budget
        refused_steps += granted < 6
        steps_without_budget += not has_budget
    assert refused_steps > 20
    assert steps_without_budget > 5


@MODES
def test_refund_when_kv_allocation_fails_after_charge(tiny_model_dir, async_scheduling):
    # 3 blocks of 16 tokens: two requests decoding past 24 tokens cannot both fit.
    # 20 tok/s is below the two streams' demand: every step is paced, charging
    # before allocation.
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=20, num_blocks=4
    )
    driver.add(make_request("u", prompt_len=14, max_tokens=40) for _ in range(2))
    dispatched = 0
    for _ in range(300):
        dispatched += len(driver.step_sampled())
    counters = scheduler.accounting.of("u")
    assert counters.refunds > 0
    assert counters.charged - counters.refunds == dispatched


@MODES
def test_a_step_where_every_user_has_budget_charges_after_dispatch_and_never_refunds(
    tiny_model_dir, async_scheduling
):
    # As above, but far below the limit: failed allocations are never charged.
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=100_000, num_blocks=4
    )
    driver.add(make_request("u", prompt_len=14, max_tokens=40) for _ in range(2))
    dispatched = 0
    for _ in range(60):
        dispatched += len(driver.step_sampled())
    assert any(output.preempted_req_ids for output in driver.outputs)
    counters = scheduler.accounting.of("u")
    assert counters.refunds == 0
    assert counters.charged == dispatched


@MODES
def test_refund_when_a_charged_request_is_preempted_in_the_same_step(
    tiny_model_dir, async_scheduling
):
    # PRIORITY: the low-priority request is charged and scheduled first, then
    # preempted (removed from the step) when the high-priority one needs blocks.
    # Its user's 10 tok/s keeps it paced (charged before allocation).
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"low": 10},
        num_blocks=3,
        policy="priority",
    )
    low = make_request("low", prompt_len=15, max_tokens=40, priority=5)
    high = make_request("high", prompt_len=15, max_tokens=40, priority=0)
    driver.add([low])
    driver.step()
    driver.add([high])
    for _ in range(40):
        driver.step()
    assert scheduler.accounting.of("low").refunds > 0
    low_net = scheduler.accounting.of("low")
    assert low_net.charged - low_net.refunds == sum(
        low.request_id in sampled for sampled in driver.sampled
    )


@MODES
def test_throttled_requests_do_not_count_against_max_num_active_seqs(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=1,
        user_rates={"b": 100_000},
        max_num_seqs=8,
        max_num_active_seqs=2,
    )
    driver.add(make_request("a", prompt_len=4, max_tokens=100) for _ in range(2))
    driver.run(3)  # a's two streams spend the burst and are now parked
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
    b_requests = [make_request("b", prompt_len=4, max_tokens=100) for _ in range(2)]
    driver.add(b_requests)
    output = driver.step()
    # Without the rule, 2 running requests would fill the active cap of 2.
    assert all(r.request_id in output.num_scheduled_tokens for r in b_requests)
    assert len(scheduler.running) == 4


@MODES
def test_running_loop_is_capped_at_max_num_active_seqs(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        max_num_seqs=8,
        max_num_active_seqs=2,
    )
    driver.add(make_request("u", prompt_len=4, max_tokens=100) for _ in range(2))
    driver.run(2)
    for output in driver.run(5):
        assert len(output.num_scheduled_tokens) <= 2


@MODES
def test_throttled_request_is_the_preferred_preemption_victim(
    tiny_model_dir, async_scheduling
):
    # The parked request is the oldest; FCFS would otherwise preempt the newest.
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        num_blocks=5,
    )
    parked = make_request("slow", prompt_len=8, max_tokens=100)
    driver.add([parked])
    driver.run(2)
    fast = [make_request("fast", prompt_len=14, max_tokens=60) for _ in range(2)]
    driver.add(fast)
    step_until_preempted(driver, parked)
    assert all(r.status == RequestStatus.RUNNING for r in fast)
    assert scheduler.accounting.of("slow").throttled_preemptions == 1


@MODES
def test_throttled_victim_preference_holds_within_a_priority_only(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        num_blocks=5,
        policy="priority",
    )
    parked = make_request("slow", prompt_len=8, max_tokens=100, priority=1)
    driver.add([parked])
    driver.run(2)
    same_priority = make_request("fast", prompt_len=14, max_tokens=60, priority=1)
    driver.add([same_priority])
    step_until_preempted(driver, parked)
    assert same_priority.status == RequestStatus.RUNNING
    # Arrival times are restored once the step is over.
    assert parked.arrival_time < same_priority.arrival_time < 1e6


@MODES
def test_lower_priority_is_preempted_before_a_throttled_higher_priority_request(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        num_blocks=5,
        policy="priority",
    )
    parked = make_request("slow", prompt_len=8, max_tokens=100, priority=0)
    low = make_request("fast", prompt_len=8, max_tokens=100, priority=9)
    driver.add([parked, low])
    driver.run(2)
    urgent = make_request("fast", prompt_len=14, max_tokens=60, priority=0)
    driver.add([urgent])
    step_until_preempted(driver, low)
    assert parked.status == RequestStatus.RUNNING


@MODES
def test_rotation_shares_tokens_evenly_across_four_streams(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    streams = [make_request("u", prompt_len=4, max_tokens=1000) for _ in range(4)]
    driver.add(streams)
    per_stream = Counter()
    for _ in range(400):  # 12 s at 30 ms per step
        for rid in driver.step_sampled(step_ms=30):
            per_stream[rid] += 1
    counts = [per_stream[r.request_id] for r in streams]
    assert sum(counts) >= 100
    assert max(counts) - min(counts) <= 1, counts


@MODES
def test_rotation_keeps_other_users_order(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    first, second = make_request("x", max_tokens=500), make_request("y", max_tokens=500)
    driver.add([first, make_request("u", max_tokens=500), second])
    driver.add([make_request("u", max_tokens=500)])
    for _ in range(20):
        driver.step(step_ms=30)
        order = [r.request_id for r in scheduler.running]
        assert order.index(first.request_id) < order.index(second.request_id)


@MODES
def test_a_throttled_users_waiting_request_does_not_block_other_users(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=1, user_rates={"b": 1000}
    )
    driver.add([make_request("a", prompt_len=4, max_tokens=100)])
    driver.step()
    # A one-token prompt cannot prefill at all without sampling.
    blocked = make_request("a", prompt_len=1, max_tokens=5)
    other = make_request("b", prompt_len=1, max_tokens=5)
    driver.add([blocked, other])
    output = driver.step()
    assert blocked.request_id not in output.num_scheduled_tokens
    assert other.request_id in output.num_scheduled_tokens
    assert scheduler.accounting.of("a").throttled_skips > 0


@pytest.mark.parametrize("async_scheduling", [True], ids=["async"])
def test_async_lookahead_step_is_charged_and_not_refunded(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=100_000)
    request = make_request("u", prompt_len=4, max_tokens=100)
    request.sampling_params.stop_token_ids = [99]
    driver.add([request])
    stop_at = 5
    in_flight = []
    emitted = 0
    for _ in range(12):
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        emitted += len(req_ids)
        tokens = [[99 if emitted == stop_at else 7] for _ in req_ids]
        in_flight.append(
            (
                output,
                runner_output(req_ids, tokens),
            )
        )
        if len(in_flight) > 1:
            scheduler.update_from_output(*in_flight.pop(0))
        driver.clock.advance_ms(10)
    assert request.is_finished()
    assert len(request.output_token_ids) == stop_at
    counters = scheduler.accounting.of("u")
    assert counters.charged == stop_at + 1  # step N+1 was already dispatched
    assert counters.refunds == 0


@MODES
def test_idle_step_reports_when_the_next_token_is_allowed(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    driver.add([make_request("u", prompt_len=4, max_tokens=100)])
    driver.run(2)  # burst: 2 tokens at once
    now = driver.clock.now_ns
    output = driver.step()
    assert output.total_num_scheduled_tokens == 0
    assert scheduler.next_ready_ns == scheduler.limiter.ready_at_ns("u", now)
    assert scheduler.next_ready_ns > now


@MODES
def test_update_from_output_never_touches_the_limiter(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    limiter = use_counting_limiter(scheduler)
    driver.add([make_request("u", prompt_len=4, max_tokens=100)])
    output = scheduler.schedule()
    # schedule() charged the step's sampled token through this limiter.
    assert limiter.take_calls["u"] == 1
    calls = (limiter.take_calls.total(), limiter.refund_calls.total())
    state = limiter.lead_ns("u", driver.clock.now_ns)
    from tools.scheduler_harness import model_output_for

    scheduler.update_from_output(output, model_output_for(scheduler, output))
    assert (limiter.take_calls.total(), limiter.refund_calls.total()) == calls
    assert limiter.lead_ns("u", driver.clock.now_ns) == state


def test_user_is_resolved_once_when_the_request_is_added(tiny_model_dir):
    scheduler, driver = setup(tiny_model_dir, False, default_rate=10)
    named, anonymous = make_request("alice"), make_request(None)
    driver.add([named, anonymous])
    named.sampling_params.extra_args["output_rate_user"] = "mallory"
    assert scheduler.user_of(named) == "alice"
    assert scheduler.user_of(anonymous) == "__anonymous__"


@MODES
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_disabled_scheduling_is_identical_to_upstream(
    tiny_model_dir, async_scheduling, policy, seed
):
    upstream, ours = upstream_and_ours(
        tiny_model_dir, async_scheduling, policy, default_rate=None
    )
    assert type(ours) is not type(upstream)
    upstream_trace = run_seeded_workload(upstream, seed)
    assert run_seeded_workload(ours, seed) == upstream_trace
    assert any(preempted for _, preempted, _, _ in upstream_trace)


@MODES
def test_idle_users_are_cleaned_up_by_time_even_without_steps(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=1000)
    requests = [make_request(f"u{i}", prompt_len=4, max_tokens=2) for i in range(5)]
    driver.add(requests)
    driver.run(6)
    assert not scheduler.has_requests()
    assert scheduler.limiter.tracked_users() == 5
    scheduler.cleanup_when_idle()  # less than an interval since the last one
    assert scheduler.limiter.tracked_users() == 5
    driver.clock.advance_ms(1000)
    scheduler.cleanup_when_idle()  # the engine is idle: no step runs
    assert scheduler.limiter.tracked_users() == 0
    assert not scheduler.cleanup_due(driver.clock.now_ns)


@MODES
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pacing_with_no_limit_reached_schedules_exactly_like_upstream(
    tiny_model_dir, async_scheduling, policy, seed
):
    upstream, ours = upstream_and_ours(
        tiny_model_dir, async_scheduling, policy, default_rate=MAX_RATE
    )
    upstream_trace = run_seeded_workload(upstream, seed)
    assert run_seeded_workload(ours, seed) == upstream_trace
    assert any(preempted for _, preempted, _, _ in upstream_trace)
    assert ours.accounting.total.charged > 0
    assert ours.accounting.total.throttled_skips == 0


def test_pacing_off_binds_no_per_request_hook(tiny_model_dir):
    scheduler, driver = setup(tiny_model_dir, False, default_rate=None)
    driver.add(make_request("u", max_tokens=20) for _ in range(3))
    driver.run(5)
    assert "_reserve_prefill_lookahead" not in vars(scheduler)
    assert "_handle_blocked_waiting_request" not in vars(scheduler)


@MODES
def test_steps_are_free_while_every_user_has_budget_for_all_its_requests(
    tiny_model_dir, async_scheduling, monkeypatch
):
    """Free steps: upstream's own per-request methods, running never reordered,
    one limiter batch per step; a user that can run short makes steps paced."""
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=1000)
    limiter = use_counting_limiter(scheduler)
    requests = [make_request(u, max_tokens=300) for u in "abc" for _ in range(3)]
    driver.add(requests)
    driver.run(3)  # the first step is paced: nobody's budget is known yet

    def no_reordering(*args, **kwargs):
        raise AssertionError("running was reordered in a free step")

    monkeypatch.setattr(ordering, "order_for_step", no_reordering)
    sampled = Counter()
    for _ in range(20):
        before = limiter.take_calls.copy()
        for request_id in driver.step_sampled():
            sampled[scheduler.user_of(scheduler.requests[request_id])] += 1
        assert (
            scheduler._reserve_prefill_lookahead
            == scheduler._request_hooks.upstream_reserve_prefill_lookahead
        )
        assert limiter.take_calls - before == Counter("abc")  # once per user
    monkeypatch.undo()
    assert sampled == Counter({"a": 60, "b": 60, "c": 60})

    limiter.set_rate("a", 20, driver.clock.now_ns)  # 3 streams at 100 tok/s
    skipped_before = scheduler.accounting.of("a").throttled_skips
    paced_steps = 0
    for _ in range(20):
        driver.step()
        paced_steps += (
            scheduler._reserve_prefill_lookahead
            == scheduler._request_hooks.reserve_prefill_lookahead
        )
    # Paced whenever "a" has a token to take; between its tokens it sleeps
    # (test_scheduler_sleepers).
    assert paced_steps >= 4
    assert scheduler.accounting.of("a").throttled_skips > skipped_before
    assert scheduler.accounting.of("b").throttled_skips == 0


@MODES
def test_the_limiter_is_asked_once_per_user_per_paced_step(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=30, user_rates={"c": 1000}
    )
    limiter = use_counting_limiter(scheduler)
    driver.add(make_request(u, max_tokens=300) for u in "abc" for _ in range(4))
    paced_steps = sleeping_steps = 0
    for _ in range(60):
        before = limiter.take_calls.copy()
        # "a" and "b" run short all along: each step is paced, unless neither
        # has a token to take (both sleep: test_scheduler_sleepers).
        both_sleep = all(
            limiter.available(user, driver.clock.now_ns) == 0 for user in "ab"
        )
        driver.step(step_ms=10)
        calls = limiter.take_calls - before
        assert all(count == 1 for count in calls.values()), calls
        paced = (
            scheduler._reserve_prefill_lookahead
            == scheduler._request_hooks.reserve_prefill_lookahead
        )
        assert paced != both_sleep
        if both_sleep:
            assert not calls["a"] and not calls["b"]
        paced_steps += paced
        sleeping_steps += both_sleep
    # A token every 33 ms each, in step with each other: awake about one step
    # in three.
    assert paced_steps >= 15
    assert sleeping_steps >= 30
