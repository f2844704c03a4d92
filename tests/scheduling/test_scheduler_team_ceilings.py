"""Team ceilings on vLLM's real Scheduler and KV manager, sync and async: a
team borrows above its rate up to its ceiling while no user outside it waits
within its rate, is back at its rate from the step one does, never owes its
rate for what it borrowed, and its members still hold to their own rates
(``pacing.ceilings.TeamLending``, ``pacing.teams.TeamBudget``)."""

from __future__ import annotations

import random

import pytest

from tests.scheduling.test_scheduler_ceilings import (
    BURST_S,
    STEP_MS,
    run_recorded,
    scheduler_for,
    seeded_arrivals,
)
from tools.scheduler_harness import SYNC_AND_ASYNC, make_request

TEAM = {"tokens_per_second": 40, "ceiling_tokens_per_second": 120}


def team_doc(members: dict[str, int], others: dict[str, int] | None = None) -> dict:
    """Team ``acme`` (``TEAM``) with ``members`` (user -> own rate) and users
    outside it (user -> rate)."""
    users: dict[str, object] = {
        user: {"tokens_per_second": rate, "team": "acme"}
        for user, rate in members.items()
    }
    users.update({u: {"tokens_per_second": r} for u, r in (others or {}).items()})
    return {
        "default": {"tokens_per_second": 1000},
        "teams": {"acme": dict(TEAM)},
        "users": users,
    }


def team_tokens(recorder, members, start: int, end: int, *, own=False) -> int:
    return sum(recorder.tokens(u, start, end, own=own) for u in members)


def team_worst_window(recorder, members, rate: int, window_s: float, *, own=False):
    """The most of the members' tokens above ``(W + burst) * rate`` in any
    window of ``window_s`` seconds starting at a step."""
    times = recorder.times
    window_ns = int(window_s * 1e9)
    worst = -(10**9)
    end = 0
    for start in range(len(times)):
        end = max(end, start)
        while end < len(times) and times[end] - times[start] < window_ns:
            end += 1
        span_s = (times[end - 1] - times[start]) / 1e9 + STEP_MS / 1000
        tokens = team_tokens(recorder, members, start, end, own=own)
        worst = max(worst, tokens - (span_s + BURST_S) * rate)
    return worst


@SYNC_AND_ASYNC
def test_a_team_alone_reaches_its_ceiling_and_its_members_their_rates(
    tiny_model_dir: str, async_scheduling: bool
):
    """Two members (own rates 100 and 30) stream alone: together they reach
    the team's ceiling (120), not its rate (40), and neither exceeds its own
    rate; what the team took of its own rate's budget stays within it."""
    members = {"m1": 100, "m2": 30}
    scheduler, driver = scheduler_for(
        tiny_model_dir, async_scheduling, team_doc(members)
    )
    driver.add([make_request(u, max_tokens=5000) for u in members for _ in range(3)])
    recorder = run_recorded(scheduler, driver, 500)
    seconds = 500 * STEP_MS / 1000
    assert team_tokens(recorder, members, 0, 500) >= 120 * seconds - 3
    assert team_worst_window(recorder, members, 120, 1.0) <= 2
    assert team_worst_window(recorder, members, 120, seconds) <= 2
    # The team's own budget: what was not borrowed stays within its rate.
    assert team_worst_window(recorder, members, 40, 1.0, own=True) <= 1
    for user, rate in members.items():
        assert recorder.worst_window(user, rate, 1.0) <= 1, user
    borrowed = sum(sum(step.values()) for step in recorder.borrowed)
    assert borrowed >= 80 * seconds - 3
    shared = scheduler.output_rate_shared
    assert borrowed == sum(shared.accounting.of(u).borrowed_tokens for u in members)


@SYNC_AND_ASYNC
def test_a_team_is_back_at_its_rate_the_step_a_user_outside_waits(
    tiny_model_dir: str, async_scheduling: bool
):
    """The team's members hold every slot, borrowing; ``a`` (outside the team,
    within its rate) arrives: from the first step it waits in, the team
    borrows nothing and is held to its rate."""
    members = {"m1": 1000, "m2": 1000}
    scheduler, driver = scheduler_for(
        tiny_model_dir,
        async_scheduling,
        team_doc(members, {"a": 1000}),
        max_num_seqs=4,
    )
    driver.add([make_request(u, max_tokens=5000) for u in members for _ in range(2)])
    arrive_at = 200

    def arrive(index: int) -> None:
        if index == arrive_at:
            driver.add([make_request("a", max_tokens=5000) for _ in range(4)])

    recorder = run_recorded(scheduler, driver, 500, arrive)
    assert team_tokens(recorder, members, 100, arrive_at) >= 120 * 1.0 - 2
    waited = [i for i, users in enumerate(recorder.waited) if "a" in users]
    assert waited and waited[0] == arrive_at
    for index in waited:
        assert not any(recorder.borrowed[index].get(u) for u in members), index
    span_s = (500 - arrive_at) * STEP_MS / 1000
    after = team_tokens(recorder, members, arrive_at, 500)
    assert after <= (span_s + BURST_S) * 40 + 1
    assert recorder.tokens("a", arrive_at + 10, 500) > 0


@SYNC_AND_ASYNC
def test_a_member_waiting_does_not_stop_its_own_team_borrowing(
    tiny_model_dir: str, async_scheduling: bool
):
    """Only users outside the team stop it borrowing: with four slots and
    three members' eight streams waiting in turn, the team still reaches its
    ceiling."""
    members = {"m1": 1000, "m2": 1000, "m3": 1000}
    scheduler, driver = scheduler_for(
        tiny_model_dir, async_scheduling, team_doc(members), max_num_seqs=4
    )
    driver.add([make_request(u, max_tokens=5000) for u in members for _ in range(3)])
    recorder = run_recorded(scheduler, driver, 400)
    assert any("m1" in users or "m2" in users for users in recorder.waited)
    seconds = 400 * STEP_MS / 1000
    assert team_tokens(recorder, members, 0, 400) >= 120 * seconds - 3


@pytest.mark.parametrize("seed", [1, 2])
@SYNC_AND_ASYNC
def test_seeded_workloads_keep_a_team_within_its_ceiling_and_borrow_only_spare(
    tiny_model_dir: str, async_scheduling: bool, seed: int
):
    """10,000 steps of random arrivals of three members and two users outside
    the team in a four-slot engine: the team's tokens stay within its
    ceiling's bound and, less what it borrowed, within its rate's; every user
    within its own; the team never borrows in a step where a user outside it
    waited within its rate."""
    rng = random.Random(seed)
    members = {"m1": 30, "m2": 60, "m3": 1000}
    others = {"u1": 50, "u2": 1000}
    scheduler, driver = scheduler_for(
        tiny_model_dir,
        async_scheduling,
        team_doc(members, others),
        max_num_seqs=4,
    )
    users = [*members, *others]

    arrivals = seeded_arrivals(rng, driver, users)

    recorder = run_recorded(scheduler, driver, 10_000, arrivals)
    for window_s in (0.5, 2.0):
        assert team_worst_window(recorder, members, 120, window_s) <= 2
        assert team_worst_window(recorder, members, 40, window_s, own=True) <= 1
    for user, rate in {**members, **others}.items():
        assert recorder.worst_window(user, rate, 1.0) <= 1, user
    borrowed_steps = 0
    for index, borrowed in enumerate(recorder.borrowed):
        if any(borrowed.get(u, 0) > 0 for u in members):
            borrowed_steps += 1
            outside = recorder.waited[index] - set(members)
            assert not outside, (index, outside)
    assert borrowed_steps > 100  # the workload did borrow
