"""The choice of each step's kind (``engine_ext.scheduling.steps``): free while
nobody can be refused, sleeper while every user that may be refused has no
budget until later, unpaced with the kill switch, paced otherwise. On vLLM's
real Scheduler / AsyncScheduler with a fake clock; each kind's method is
wrapped only to record that it ran."""

from __future__ import annotations

import pytest

from pacing.modes import Mode
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler, make_request

KINDS = ("unpaced_step", "free_step", "sleepers_step", "paced_step")


def recording_kinds(scheduler) -> list[str]:
    """Per ``schedule()``, the kind of step that ran it: the last of the step
    methods to return an output (a sleeper step runs as a free step inside)."""
    steps = scheduler._steps
    ran: list[str] = []
    for kind in KINDS:
        method = getattr(steps, kind)

        def recorded(*args, _method=method, _kind=kind, **kwargs):
            output = _method(*args, **kwargs)
            if output is not None:
                ran.append(_kind)
            return output

        setattr(steps, kind, recorded)
    kinds: list[str] = []
    original_schedule = steps.schedule

    def schedule(throttle_prefills):
        ran.clear()
        output = original_schedule(throttle_prefills)
        kinds.append("sleeper" if "sleepers_step" in ran else ran[0].split("_")[0])
        return output

    steps.schedule = schedule
    return kinds


@MODES
def test_a_step_is_free_once_every_user_is_known_to_have_budget_for_all_its_requests(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=1000
    )
    kinds = recording_kinds(scheduler)
    driver.add(make_request(user, max_tokens=100) for user in "ab" for _ in range(2))
    driver.run(6)
    assert kinds[0] == "paced"  # nobody's budget is known yet
    assert not scheduler._users.constrained
    assert kinds[1:] == ["free"] * 5
    assert scheduler._steps.hooks_bound is False


@MODES
def test_the_kill_switch_runs_upstream_alone_and_charges_nothing(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=1, user_rates={}
    )
    kinds = recording_kinds(scheduler)
    driver.add(make_request("a", max_tokens=100) for _ in range(3))
    scheduler.output_rate_shared.mode = Mode.OFF
    sampled = sum(len(driver.step_sampled()) for _ in range(5))
    assert kinds == ["unpaced"] * 5
    assert sampled >= 12  # 3 streams, unthrottled after their prefill
    assert scheduler.accounting.total.charged == 0


@MODES
def test_a_user_without_budget_until_later_sleeps_and_is_paced_when_a_token_is_due(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 10},
    )
    kinds = recording_kinds(scheduler)
    driver.add([*(make_request("slow") for _ in range(2)), make_request("fast")])
    driver.run(40, step_ms=2)  # past the slow user's burst
    kinds.clear()
    limiter = scheduler.limiter
    for _ in range(100):
        due = limiter.available("slow", driver.clock.now_ns) > 0
        driver.step(step_ms=2)
        # A due token needs a paced step; a sleeper step never hands one out.
        assert (kinds[-1] == "paced") == due, (kinds[-1], due)
    assert kinds.count("sleeper") >= 60  # 10 tok/s: a token every 50 steps
    assert kinds.count("paced") >= 2


@MODES
def test_a_limit_change_makes_every_user_constrained_until_a_step_settles(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=1000
    )
    kinds = recording_kinds(scheduler)
    driver.add(make_request(user, max_tokens=100) for user in "ab")
    driver.run(3)
    assert kinds[-1] == "free"
    scheduler.limiter.set_rate("a", 2000, driver.clock.now_ns)
    scheduler.limiter.set_rate("b", 2000, driver.clock.now_ns)
    driver.step()
    assert kinds[-1] == "paced"  # every headroom was forgotten
    driver.step()
    assert kinds[-1] == "free"


@pytest.mark.parametrize("mode", [Mode.SHADOW, Mode.ENFORCE])
def test_only_enforce_sets_sleepers_aside(tiny_model_dir, mode):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, False, default_rate=100_000, user_rates={"slow": 1}
    )
    scheduler.output_rate_shared.mode = mode
    kinds = recording_kinds(scheduler)
    driver.add([make_request("slow"), make_request("fast")])
    driver.run(30, step_ms=2)
    assert ("sleeper" in kinds) == (mode is Mode.ENFORCE)
