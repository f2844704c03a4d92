"""Sleeper steps (``Steps.sleepers_step`` in ``engine_ext.scheduling.steps``): a
user known to have no budget until a later time costs a step only the setting
aside of its requests, yet is served as soon as its next token is due, its
streams take turns, its requests count as passed over, and anything a sleeper
step cannot decide (a waiting request, a limit change, a global store) makes the
step paced.
On vLLM's real Scheduler / AsyncScheduler with a fake clock."""

from __future__ import annotations

from vllm.v1.request import RequestStatus

from tests.store_harness import claim_through_a_store
from tools.scheduler_harness import SETTINGS_THAT_READ_RUNNING, make_request
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup

STEP_MS = 2.0


def paced(scheduler) -> bool:
    """Whether the last step was paced (its per-request hooks bound)."""
    return (
        scheduler._reserve_prefill_lookahead
        == scheduler._request_hooks.reserve_prefill_lookahead
    )


def slow_beside_fast(tiny_model_dir, async_scheduling, slow_rate=20, **kwargs):
    """4 streams of a user limited to ``slow_rate`` tok/s beside one stream of an
    unthrottled user, stepped past the slow user's burst."""
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": slow_rate},
        **kwargs,
    )
    slow = [make_request("slow", prompt_len=4, max_tokens=1000) for _ in range(4)]
    fast = make_request("fast", prompt_len=4, max_tokens=1000)
    driver.add([*slow, fast])
    driver.run(60, step_ms=STEP_MS)
    return scheduler, driver, slow, fast


@MODES
def test_a_user_without_budget_sleeps_until_its_next_token_is_due(
    tiny_model_dir, async_scheduling
):
    scheduler, driver, slow, fast = slow_beside_fast(tiny_model_dir, async_scheduling)
    limiter = scheduler.limiter
    slow_ids = {r.request_id for r in slow}
    kinds = {"paced": 0, "sleeper": 0}
    for _ in range(400):  # 0.8 s of 2 ms steps (fast stays within its context)
        due = limiter.available("slow", driver.clock.now_ns) > 0
        sampled = driver.step_sampled(step_ms=STEP_MS)
        assert fast.request_id in sampled
        # Served in the very step its token is due, and only then.
        assert len(slow_ids.intersection(sampled)) == due
        assert paced(scheduler) == due
        kinds["paced" if due else "sleeper"] += 1
    assert 15 <= kinds["paced"] <= 17  # 20 tok/s
    assert kinds["sleeper"] >= 383


@MODES
def test_a_sleepers_streams_take_turns(tiny_model_dir, async_scheduling):
    _scheduler, driver, slow, _fast = slow_beside_fast(tiny_model_dir, async_scheduling)
    served = {r.request_id: 0 for r in slow}
    for _ in range(1000):
        for request_id in driver.step_sampled(step_ms=STEP_MS):
            if request_id in served:
                served[request_id] += 1
    assert sum(served.values()) >= 39
    assert max(served.values()) - min(served.values()) <= 1


@MODES
def test_sleeping_requests_count_as_passed_over_and_as_parked(
    tiny_model_dir, async_scheduling
):
    scheduler, driver, _slow, _fast = slow_beside_fast(tiny_model_dir, async_scheduling)
    limiter = scheduler.limiter
    for _ in range(50):
        skips = scheduler.accounting.of("slow").throttled_skips
        due = limiter.available("slow", driver.clock.now_ns) > 0
        driver.step(step_ms=STEP_MS)
        if not due:
            assert scheduler.accounting.of("slow").throttled_skips - skips == 4
            assert scheduler._users.parked_counts == {"slow": 4}


@MODES
def test_a_sleeper_step_keeps_running_in_order(tiny_model_dir, async_scheduling):
    scheduler, driver, _slow, _fast = slow_beside_fast(tiny_model_dir, async_scheduling)
    limiter = scheduler.limiter
    for _ in range(50):
        due = limiter.available("slow", driver.clock.now_ns) > 0
        before = list(scheduler.running)
        driver.step(step_ms=STEP_MS)
        if not due:
            assert scheduler.running == before


@MODES
def test_only_sleepers_left_tell_the_engine_when_to_step_again(
    tiny_model_dir, async_scheduling
):
    scheduler, driver, _slow, fast = slow_beside_fast(
        tiny_model_dir, async_scheduling, slow_rate=1
    )
    scheduler.finish_requests(fast.request_id, RequestStatus.FINISHED_ABORTED)
    driver.run(2, step_ms=STEP_MS)  # async: the step in flight lands
    now = driver.clock.now_ns
    output = driver.step(step_ms=STEP_MS)
    assert not output.num_scheduled_tokens
    assert not paced(scheduler)
    assert scheduler.next_ready_ns == scheduler.limiter.ready_at_ns("slow", now) > now


def asleep_beside_fast(tiny_model_dir, async_scheduling):
    """``slow_beside_fast`` at 1 tok/s, after a step in which the slow user
    slept."""
    scheduler, driver, slow, fast = slow_beside_fast(
        tiny_model_dir, async_scheduling, slow_rate=1
    )
    driver.step(step_ms=STEP_MS)
    assert not paced(scheduler)
    return scheduler, driver, slow, fast


@MODES
def test_a_waiting_request_makes_the_step_paced(tiny_model_dir, async_scheduling):
    scheduler, driver, _slow, _fast = asleep_beside_fast(
        tiny_model_dir, async_scheduling
    )
    newcomer = make_request("other", prompt_len=4, max_tokens=10)
    driver.add([newcomer])
    driver.step(step_ms=STEP_MS)
    assert paced(scheduler)
    assert newcomer.status == RequestStatus.RUNNING


@MODES
def test_a_limit_change_wakes_sleepers_at_once(tiny_model_dir, async_scheduling):
    scheduler, driver, slow, _fast = asleep_beside_fast(
        tiny_model_dir, async_scheduling
    )
    scheduler.limiter.set_rate("slow", 100_000, driver.clock.now_ns)
    sampled = driver.step_sampled(step_ms=STEP_MS)
    assert paced(scheduler)
    assert {r.request_id for r in slow} <= set(sampled)


@MODES
def test_no_sleeper_steps_with_a_global_store(tiny_model_dir, async_scheduling):
    # Claimed balances may grow by a claim before a sleeper's wake-up time.
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=20)
    _balances, _store, claimer = claim_through_a_store(scheduler, driver.clock)
    driver.add(make_request("u", prompt_len=4, max_tokens=1000) for _ in range(4))
    throttled_steps = 0
    for _ in range(100):
        skips = scheduler.accounting.of("u").throttled_skips
        driver.step(step_ms=STEP_MS)
        claimer.run_once()
        if scheduler.accounting.of("u").throttled_skips > skips:
            throttled_steps += 1
            assert paced(scheduler)
    assert throttled_steps >= 50


@MODES
@SETTINGS_THAT_READ_RUNNING
def test_no_sleeper_steps_under_settings_that_read_running(
    tiny_model_dir, async_scheduling, setting
):
    # Upstream reads both from ``running``, which a sleeper step would shorten.
    scheduler, driver, slow, fast = slow_beside_fast(
        tiny_model_dir, async_scheduling, **setting
    )
    for _ in range(50):
        sampled = driver.step_sampled(step_ms=STEP_MS)
        assert fast.request_id in sampled
        assert paced(scheduler)
    assert all(r.status == RequestStatus.RUNNING for r in slow)
