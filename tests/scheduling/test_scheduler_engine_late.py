"""Engine-late time (``UserCounters.engine_late_ns``): by how much the gaps between
scheduling steps exceeded the limiter's burst while a user had a request in the
engine, on vLLM's real Scheduler / AsyncScheduler with a fake clock."""

from __future__ import annotations

import random

from vllm.v1.request import RequestStatus

from pacing.limiter import DEFAULT_BURST_NS
from pacing.modes import Mode
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup
from tools.scheduler_harness import make_request

BURST_MS = DEFAULT_BURST_NS / 1e6


def late_ms(scheduler, user: str) -> float:
    return scheduler.accounting.of(user).engine_late_ns / 1e6


def step_across_gap(driver, gap_ms: float) -> None:
    """A step, then ``gap_ms`` until the next one, which counts the gap."""
    driver.step(gap_ms)
    driver.step()


@MODES
def test_engine_late_counts_only_the_gap_beyond_the_burst(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    driver.add([make_request("u", prompt_len=4, max_tokens=1000)])
    for gap_ms in (10, 50, BURST_MS):  # the burst absorbs gaps up to itself
        driver.step(gap_ms)
    driver.step()
    assert late_ms(scheduler, "u") == 0
    step_across_gap(driver, BURST_MS + 150)
    assert late_ms(scheduler, "u") == 150


@MODES
def test_a_user_whose_request_arrived_during_the_gap_was_not_kept_waiting(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    driver.add([make_request("u", prompt_len=4)])
    driver.step(BURST_MS + 40)
    driver.add([make_request("v", prompt_len=4)])  # during the late gap
    driver.step()
    assert (late_ms(scheduler, "u"), late_ms(scheduler, "v")) == (40, 0)
    # Once its request has been in the engine across a late gap, v counts too.
    step_across_gap(driver, BURST_MS + 25)
    assert (late_ms(scheduler, "u"), late_ms(scheduler, "v")) == (65, 25)


@MODES
def test_a_request_added_and_aborted_in_the_gap_leaves_the_waiting_one_counted(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    driver.add([make_request("u", prompt_len=4)])
    driver.step(BURST_MS + 60)
    aborted = make_request("u", prompt_len=4)
    driver.add([aborted])  # during the late gap, and gone before its end
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    driver.step()
    assert late_ms(scheduler, "u") == 60


@MODES
def test_a_finished_user_is_not_late(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=1000)
    driver.add([make_request("u", prompt_len=4, max_tokens=2)])
    driver.run(4)  # u's request has finished
    assert not scheduler.has_unfinished_requests()
    driver.add([make_request("v", prompt_len=4)])
    step_across_gap(driver, BURST_MS + 500)
    assert (late_ms(scheduler, "u"), late_ms(scheduler, "v")) == (0, 500)


@MODES
def test_engine_late_is_not_counted_with_pacing_mode_off(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=10)
    driver.add([make_request("u", prompt_len=4)])
    driver.step()
    scheduler.output_rate_shared.mode = Mode.OFF
    step_across_gap(driver, BURST_MS + 300)
    assert late_ms(scheduler, "u") == 0
    scheduler.output_rate_shared.mode = Mode.ENFORCE
    step_across_gap(driver, BURST_MS + 70)
    assert late_ms(scheduler, "u") == 70


@MODES
def test_a_user_with_steady_demand_falls_short_of_its_limit_by_at_most_engine_late(
    tiny_model_dir, async_scheduling
):
    """The promise behind the counter (its metric's and UserState's docs): a
    user who always has more requests than tokens to give gets at least
    ``limit * (elapsed - engine_late)`` tokens, however late the steps come;
    and never more than GCRA's ceiling."""
    rate = 20
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=rate)
    driver.add([make_request("u", prompt_len=4, max_tokens=10_000) for _ in range(4)])
    gaps = random.Random(7).choices([3, 10, 30, 90, 120, 250, 600], k=400)
    start_ns = driver.clock.now_ns
    for gap_ms in gaps:
        driver.step(gap_ms)
    elapsed_s = (driver.clock.now_ns - gap_ms * 1_000_000 - start_ns) / 1e9
    counters = scheduler.accounting.of("u")
    charged = counters.charged - counters.refunds
    late_s = counters.engine_late_ns / 1e9
    assert late_s > 0.1 * elapsed_s  # the late steps did cost budget ...
    assert charged < rate * elapsed_s - 10  # ... more than the burst holds
    assert charged >= rate * (elapsed_s - late_s)
    assert charged <= rate * (elapsed_s + BURST_MS / 1e3) + 1
