"""Parked requests out of upstream's loops (``Hiding.hide_parked`` in
``engine_ext.scheduling.hiding``): while no preemption can occur, a parked request costs
a step no per-request hook call, yet is counted as passed over, keeps its slot,
and keeps its place in ``running``; on vLLM's real Scheduler / AsyncScheduler
with a fake clock. Where a step may preempt, parked requests stay in sight and
are the preferred victims (``test_throttled_request_is_the_preferred_preemption_victim``
in ``test_scheduler.py``)."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from engine_ext.scheduling.request_hooks import RequestHooks
from tools.scheduler_harness import SETTINGS_THAT_READ_RUNNING, make_request
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup


@pytest.fixture
def hook_calls(monkeypatch) -> list[str]:
    """Request ids, one per call of the paced per-request hook of upstream's
    loops (``_reserve_prefill_lookahead`` in paced steps)."""
    calls: list[str] = []
    original = RequestHooks.reserve_prefill_lookahead

    def counting(self, request, num_computed_tokens, num_new_tokens):
        calls.append(request.request_id)
        return original(self, request, num_computed_tokens, num_new_tokens)

    monkeypatch.setattr(RequestHooks, "reserve_prefill_lookahead", counting)
    return calls


def parked_beside_a_fast_user(tiny_model_dir, async_scheduling, **kwargs):
    """4 streams of a 1 tok/s user, parked past their burst, beside one stream of
    an unthrottled user."""
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        **kwargs,
    )
    # Between its tokens the slow user sleeps, and sleeper steps
    # (test_scheduler_sleepers) take over from paced ones: these tests are
    # about paced steps.
    scheduler._steps.sleepers_step = lambda *args: None
    slow = [make_request("slow", prompt_len=4, max_tokens=1000) for _ in range(4)]
    fast = make_request("fast", prompt_len=4, max_tokens=1000)
    driver.add([*slow, fast])
    driver.run(10)
    assert all(r.status == RequestStatus.RUNNING for r in slow)
    return scheduler, driver, slow, fast


@MODES
def test_a_parked_request_costs_upstreams_loops_no_hook_call(
    tiny_model_dir, async_scheduling, hook_calls
):
    _scheduler, driver, slow, fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling
    )
    slow_ids = {r.request_id for r in slow}
    hook_calls.clear()
    for _ in range(20):
        assert driver.step_sampled() == [fast.request_id]
    assert hook_calls == [fast.request_id] * 20
    assert not slow_ids & set(hook_calls)


@MODES
def test_a_hidden_parked_request_is_counted_as_passed_over_each_step(
    tiny_model_dir, async_scheduling
):
    scheduler, driver, slow, _fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling
    )
    before = scheduler.accounting.of("slow").throttled_skips
    driver.run(20)  # 1 tok/s: at most one of the 4 served in 0.2 s
    skips = scheduler.accounting.of("slow").throttled_skips - before
    served = sum(r.request_id in ids for ids in driver.sampled[-20:] for r in slow)
    assert served <= 1
    assert skips == 4 * 20 - served


@MODES
def test_hidden_parked_requests_keep_their_slots(tiny_model_dir, async_scheduling):
    # Every slot is held: 4 parked and 1 running. Another request of the user
    # without budget may not take a parked request's slot while it is hidden.
    scheduler, driver, slow, _fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling, max_num_seqs=5
    )
    late = make_request("slow", prompt_len=40, max_tokens=10)
    driver.add([late])
    for _ in range(20):
        driver.step()
        assert len(scheduler.running) <= 5
    assert late.status == RequestStatus.WAITING
    assert all(r.status == RequestStatus.RUNNING for r in slow)


@MODES
def test_hidden_parked_requests_keep_their_place_in_running(
    tiny_model_dir, async_scheduling
):
    scheduler, driver, _slow, _fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling
    )
    order = [r.request_id for r in scheduler.running]
    driver.run(20)
    assert [r.request_id for r in scheduler.running] == order


@MODES
def test_parked_requests_stay_in_sight_when_the_kv_cache_may_run_short(
    tiny_model_dir, async_scheduling, hook_calls
):
    # 7 blocks of 16: the fast request's next block could need a preemption, so
    # upstream must see the parked ones to pick one of them as its victim.
    _scheduler, driver, slow, fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling, num_blocks=7
    )
    hook_calls.clear()
    driver.run(3)
    assert {r.request_id for r in slow} <= set(hook_calls)
    assert fast.status == RequestStatus.RUNNING


@MODES
def test_parked_requests_stay_in_sight_of_a_waiting_request_when_nothing_else_runs(
    tiny_model_dir, async_scheduling, hook_calls
):
    # Upstream applies its KV watermark to a waiting request only when
    # ``running`` holds something: with every running request parked, hiding
    # them would let the newcomer take the blocks the watermark keeps.
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=100_000, user_rates={"slow": 1}
    )
    slow = [make_request("slow", prompt_len=4, max_tokens=1000) for _ in range(4)]
    driver.add(slow)
    driver.run(10)
    driver.add([make_request("fast", prompt_len=4, max_tokens=10)])
    hook_calls.clear()
    driver.step()
    assert {r.request_id for r in slow} <= set(hook_calls)
    assert len(scheduler.running) == 5


@MODES
@SETTINGS_THAT_READ_RUNNING
def test_parked_requests_stay_in_sight_under_settings_that_read_running(
    tiny_model_dir, async_scheduling, hook_calls, setting
):
    # An active cap below the slots is kept per request by our hook; a
    # long-prefill threshold is relaxed by upstream for a lone running request.
    # Either way upstream must see every running request.
    _scheduler, driver, slow, fast = parked_beside_a_fast_user(
        tiny_model_dir, async_scheduling, **setting
    )
    hook_calls.clear()
    driver.run(3)
    assert {r.request_id for r in slow} <= set(hook_calls)
    assert fast.status == RequestStatus.RUNNING
