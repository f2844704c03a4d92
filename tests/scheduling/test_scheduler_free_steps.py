"""Free steps (every user known to have budget for all its live requests) on
vLLM's real Scheduler / AsyncScheduler with controlled outputs and a fake clock:
they charge exactly the dispatched sampling steps, per user, whether every live
request samples (charged per user in one go) or some prefill chunk or waiting
request is in the step (counted per request); they keep rotation and never let
a user overdraw."""

from __future__ import annotations

from collections import Counter

from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup
from tools.scheduler_harness import make_request


def _user(scheduler, request_id: str) -> str:
    return scheduler.user_of(scheduler.requests[request_id])


@MODES
def test_free_steps_charge_each_user_exactly_its_sampling_dispatches(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        max_num_batched_tokens=64,
    )
    driver.add(make_request(u, max_tokens=300) for u in "aab")
    driver.run(3)  # the first step is paced: nobody's budget is known yet
    every_live_request_sampled = with_prefill_chunk = 0
    for step in range(40):
        # A step where a request arrives is paced (its user's budget is not
        # known for one more request); the chunks after it are free.
        if step == 10:  # 200 prompt tokens: a few chunks that sample nothing
            driver.add([make_request("b", prompt_len=200, max_tokens=300)])
        if step == 25:
            driver.add([make_request("c", max_tokens=300)])
        before = {u: scheduler.accounting.of(u).charged for u in "abc"}
        output = driver.step()
        sampled = driver.sampled[-1]
        charged = {u: scheduler.accounting.of(u).charged - before[u] for u in "abc"}
        assert charged == {
            u: Counter(_user(scheduler, rid) for rid in sampled)[u] for u in "abc"
        }
        if scheduler._steps.hooks_bound is False:  # a free step
            every_live_request_sampled += len(sampled) == len(scheduler.requests)
            with_prefill_chunk += len(sampled) < len(output.num_scheduled_tokens)
    assert every_live_request_sampled > 20
    assert with_prefill_chunk >= 2
    assert scheduler.accounting.total.refunds == 0


@MODES
def test_a_user_running_short_in_free_steps_is_paced_before_it_overdraws(
    tiny_model_dir, async_scheduling
):
    # 4 streams at 10 ms steps want 400 tok/s of a 300 tok/s limit: free steps
    # until what is left falls below 4, then paced ones.
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=100_000, user_rates={"u": 300}
    )
    limiter = scheduler.limiter
    driver.add(make_request("u", max_tokens=400) for _ in range(4))
    driver.add([make_request("v", max_tokens=400)])
    kinds = Counter()
    for _ in range(150):
        driver.step()
        kinds["free" if scheduler._steps.hooks_bound is False else "paced"] += 1
        # Every token charged was there to take: the TAT is at most one
        # emission interval beyond the burst.
        now = driver.clock.now_ns
        assert limiter.lead_ns("u", now) <= limiter.burst_ns + 1_000_000_000 // 300
    assert kinds["free"] >= 5
    assert kinds["paced"] >= 50
    assert scheduler.accounting.of("u").throttled_skips > 0
    assert scheduler.accounting.of("v").throttled_skips == 0


@MODES
def test_after_steps_serving_every_stream_rotation_starts_at_the_first_stream(
    tiny_model_dir, async_scheduling
):
    """When every stream of a user was served, the one after the last served is
    its first: that is where the user's next short step starts."""
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=100_000, user_rates={"u": 100}
    )
    streams = [make_request("u", max_tokens=400) for _ in range(4)]
    driver.add(streams)
    ids = [r.request_id for r in streams]
    for _ in range(30):  # 1 token per step once the burst is spent: rotation
        driver.step()
    scheduler.limiter.set_rate("u", 100_000, driver.clock.now_ns)
    driver.step()  # paced: a limit changed
    for _ in range(5):
        assert sorted(driver.step_sampled()) == sorted(ids)
        assert scheduler._steps.hooks_bound is False  # a free step
    # At 10 tok/s with a full bucket: 2 tokens now, then 1 every 100 ms.
    scheduler.limiter.set_rate("u", 10, driver.clock.now_ns)
    served = [driver.step_sampled(step_ms=100) for _ in range(7)]
    assert served == [ids[:2]] + [[ids[i % 4]] for i in range(2, 8)]
