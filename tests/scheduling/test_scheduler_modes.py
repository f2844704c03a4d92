"""Pacing modes in the scheduler (``pacing.modes``): enforce, shadow, off.

vLLM's real ``Scheduler`` / ``AsyncScheduler`` and KV manager, controlled model
outputs and a fake clock (``tools.scheduler_harness``). The mode is read from
the shared limiter at the start of every step, as the control plane sets it.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pacing.limiter import DEFAULT_BURST_NS, NS_PER_S
from pacing.modes import Mode
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup
from tools.scheduler_harness import (
    make_request,
    make_scheduler,
    run_seeded_workload,
    upstream_and_ours,
)

RATE = 10  # tok/s of user "u"
STEP_MS = 10


def sampled_per_user(scheduler, driver, steps: int) -> Counter[str]:
    sampled: Counter[str] = Counter()
    for _ in range(steps):
        for request_id in driver.step_sampled(step_ms=STEP_MS):
            sampled[scheduler.user_of(scheduler.requests[request_id])] += 1
    return sampled


def within_gcra_bound(tokens: int, seconds: float, rate: int) -> bool:
    """At most (W + burst)·rate + 1 and, under continuous demand, at least
    W·rate - 1 tokens in W seconds."""
    burst_s = DEFAULT_BURST_NS / NS_PER_S
    return seconds * rate - 1 <= tokens <= (seconds + burst_s) * rate + 1


@MODES
def test_shadow_mode_throttles_nobody_and_counts_what_enforce_would_skip(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir, async_scheduling, default_rate=1000, user_rates={"u": RATE}
    )
    scheduler.output_rate_shared.mode = Mode.SHADOW
    driver.add(make_request("u", max_tokens=1000) for _ in range(4))
    driver.add([make_request("v", max_tokens=1000)])
    driver.run(2)  # prefill
    before = scheduler.accounting.of("u")
    sampled = sampled_per_user(scheduler, driver, 300)  # 3 s
    after = scheduler.accounting.of("u")
    assert sampled["u"] == 4 * 300  # every stream, every step: nobody throttled
    charged = after.charged - before.charged
    shadow_skips = after.shadow_skips - before.shadow_skips
    # Each dispatched token is either one enforce would grant, or a shadow skip.
    assert charged + shadow_skips == sampled["u"]
    # The would-be grants follow the limit exactly as enforce's grants would.
    assert within_gcra_bound(charged, 3.0, RATE), charged
    assert after.throttled_skips == 0 and after.throttled_preemptions == 0
    assert scheduler.accounting.of("v").shadow_skips == 0
    assert scheduler.next_ready_ns is None


@MODES
def test_shadow_and_enforce_grant_the_same_tokens_to_a_user_over_its_limit(
    tiny_model_dir, async_scheduling
):
    charged = {}
    for mode in (Mode.ENFORCE, Mode.SHADOW):
        scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=RATE)
        scheduler.output_rate_shared.mode = mode
        driver.add(make_request("u", max_tokens=1000) for _ in range(4))
        sampled_per_user(scheduler, driver, 200)
        charged[mode] = scheduler.accounting.of("u").charged
    assert charged[Mode.ENFORCE] == charged[Mode.SHADOW]


@MODES
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2])
def test_off_mode_schedules_exactly_like_upstream_and_records_nothing(
    tiny_model_dir, async_scheduling, policy, seed
):
    upstream, ours = upstream_and_ours(
        tiny_model_dir,
        async_scheduling,
        policy,
        default_rate=1,  # 1 tok/s
    )
    ours.output_rate_shared.mode = Mode.OFF
    assert run_seeded_workload(ours, seed) == run_seeded_workload(upstream, seed)
    assert ours.accounting.total.charged == 0
    assert ours.accounting.total.throttled_skips == 0
    assert ours.limiter.tracked_users() == 0


@MODES
def test_switching_off_then_back_hands_out_no_more_than_a_full_bucket(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=RATE)
    driver.add(make_request("u", max_tokens=2000) for _ in range(4))
    sampled_per_user(scheduler, driver, 100)  # enforce: 1 s, in debt
    scheduler.output_rate_shared.mode = Mode.OFF
    assert sampled_per_user(scheduler, driver, 200)["u"] == 4 * 200  # flat out
    scheduler.output_rate_shared.mode = Mode.ENFORCE
    # The first 100 ms back: at most a full bucket (burst·rate + 1 = 2 tokens).
    first = sampled_per_user(scheduler, driver, 10)["u"]
    assert first <= 2
    # And from the switch on, the usual bounds over the next 3 s.
    rest = sampled_per_user(scheduler, driver, 290)["u"]
    assert within_gcra_bound(first + rest, 3.0, RATE), (first, rest)


@MODES
def test_a_mode_change_applies_at_the_next_step(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=RATE)
    driver.add(make_request("u", max_tokens=1000) for _ in range(4))
    sampled_per_user(scheduler, driver, 50)  # enforce: now parked
    assert sampled_per_user(scheduler, driver, 1)["u"] <= 1
    scheduler.output_rate_shared.mode = Mode.SHADOW
    assert sampled_per_user(scheduler, driver, 1)["u"] == 4
    scheduler.output_rate_shared.mode = Mode.ENFORCE
    assert sampled_per_user(scheduler, driver, 1)["u"] <= 1


def test_the_start_up_mode_and_limit_table_reach_the_scheduler(tiny_model_dir):
    scheduler = make_scheduler(
        tiny_model_dir,
        default_rate=100,
        output_rate={
            "mode": "shadow",
            "tier_rates": {"pro": 500},
            "memberships": {"alice": "pro"},
            "exempt_users": ["ops"],
        },
    )
    assert scheduler.output_rate_shared.mode is Mode.SHADOW
    assert scheduler.limiter.rate_of("alice") == 500
    assert scheduler.limiter.rate_of("bob") == 100
    assert scheduler.limiter.limit_source("ops").kind == "exempt"


@MODES
def test_an_exempt_user_is_never_throttled_nor_counted(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=1,
        output_rate={"exempt_users": ["ops"]},
    )
    driver.add(make_request("ops", max_tokens=1000) for _ in range(3))
    driver.add([make_request("u", max_tokens=1000)])
    driver.run(2)
    sampled = sampled_per_user(scheduler, driver, 100)
    assert sampled["ops"] == 300
    assert sampled["u"] <= 2
    ops = scheduler.accounting.of("ops")
    assert ops.throttled_skips == 0 and ops.shadow_skips == 0
    assert scheduler.limiter.tracked_users() == 1  # "u" only
