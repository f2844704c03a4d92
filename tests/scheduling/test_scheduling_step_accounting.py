"""``engine_ext.scheduling.step_accounting`` on its own (pure: no vLLM):
``EngineLate`` counts only users waiting across a whole gap, by how much the gap
exceeded the burst; ``ThrottleEpisodes`` keeps an episode open from a request's
first refusal until it is next dispatched a sampling step or ends."""

from __future__ import annotations

import pytest

from engine_ext.scheduling.step_accounting import EngineLate, ThrottleEpisodes
from pacing.accounting import Accounting

MS = 1_000_000
BURST = 100 * MS
T0 = 1_000_000 * MS  # a monotonic clock is far from 0


def late_ns(accounting: Accounting) -> dict[str, int]:
    return {
        user: counters.engine_late_ns
        for user, counters in accounting.by_user().items()
        if counters.engine_late_ns
    }


# gap since the previous step (None: no previous step), live requests, added
# since the previous step, counted -> engine_late_ns per user, by hand.
GOLDEN = {
    "the first step has no gap": (None, {"a": 1}, {}, True, {}),
    "a gap of exactly the burst is absorbed": (BURST, {"a": 1}, {}, True, {}),
    "a gap one ns beyond the burst counts one ns": (
        BURST + 1,
        {"a": 1},
        {},
        True,
        {"a": 1},
    ),
    "every user waiting across the gap is counted": (
        250 * MS,
        {"a": 1, "b": 3},
        {},
        True,
        {"a": 150 * MS, "b": 150 * MS},
    ),
    "a user whose every request arrived in the gap is not counted": (
        250 * MS,
        {"a": 2, "b": 1},
        {"a": 2},
        True,
        {"b": 150 * MS},
    ),
    "a user with one request older than the gap is counted": (
        250 * MS,
        {"a": 2},
        {"a": 1},
        True,
        {"a": 150 * MS},
    ),
    "more added than live (some ended in the gap) is not counted": (
        250 * MS,
        {"a": 1},
        {"a": 2},
        True,
        {},
    ),
    "a step that is not counted (mode off) records nothing": (
        250 * MS,
        {"a": 1},
        {},
        False,
        {},
    ),
    "a user with no live request is not counted": (
        250 * MS,
        {},
        {"a": 1},
        True,
        {},
    ),
}


@pytest.mark.parametrize(
    ("gap_ns", "live", "added", "counted", "want"), GOLDEN.values(), ids=GOLDEN.keys()
)
def test_engine_late_counts_what_the_gap_exceeded_the_burst_by_for_waiting_users(
    gap_ns, live, added, counted, want
):
    engine_late = EngineLate()
    accounting = Accounting()
    now = T0
    if gap_ns is not None:
        engine_late.record(
            T0, counted=True, burst_ns=BURST, live={}, added={}, accounting=accounting
        )
        now = T0 + gap_ns
    # The table gives requests added per user; the book keeps request id -> user.
    added = {f"{user}-{i}": user for user, n in added.items() for i in range(n)}
    engine_late.record(
        now,
        counted=counted,
        burst_ns=BURST,
        live=live,
        added=added,
        accounting=accounting,
    )
    assert late_ns(accounting) == want
    assert accounting.total.engine_late_ns == sum(want.values())
    assert engine_late.stepped_at_ns == now
    assert added == {}  # cleared for the next gap


def test_the_added_requests_are_forgotten_even_at_the_first_step_and_when_not_counted():
    engine_late = EngineLate()
    accounting = Accounting()
    for now, counted in ((T0, True), (T0 + 500 * MS, False)):
        added = {"r1": "a"}
        engine_late.record(
            now,
            counted=counted,
            burst_ns=BURST,
            live={"a": 1},
            added=added,
            accounting=accounting,
        )
        assert added == {}
    assert late_ns(accounting) == {}


def test_a_gap_is_measured_from_the_previous_step_even_an_uncounted_one():
    engine_late = EngineLate()
    accounting = Accounting()
    live = {"a": 1}
    engine_late.record(
        T0, counted=True, burst_ns=BURST, live=live, added={}, accounting=accounting
    )
    # Mode off for one step, 1 s later: nothing counted, but the gap restarts.
    engine_late.record(
        T0 + 1000 * MS,
        counted=False,
        burst_ns=BURST,
        live=live,
        added={},
        accounting=accounting,
    )
    engine_late.record(
        T0 + 1150 * MS,
        counted=True,
        burst_ns=BURST,
        live=live,
        added={},
        accounting=accounting,
    )
    assert late_ns(accounting) == {"a": 50 * MS}


def test_consecutive_late_gaps_add_up_per_user():
    engine_late = EngineLate()
    accounting = Accounting()
    live = {"a": 1}
    for now in (T0, T0 + 300 * MS, T0 + 350 * MS, T0 + 600 * MS):
        engine_late.record(
            now,
            counted=True,
            burst_ns=BURST,
            live=live,
            added={},
            accounting=accounting,
        )
    # Gaps 300, 50 and 250 ms: 200 + 0 + 150 beyond the burst.
    assert late_ns(accounting) == {"a": 350 * MS}


# -- ThrottleEpisodes ----------------------------------------------------------


def test_no_episode_is_kept_for_a_request_never_refused():
    episodes = ThrottleEpisodes()
    assert not episodes
    episodes.dispatched("r1", T0)
    assert not episodes
    assert episodes.end("r1", T0 + MS) is None


def test_an_episode_opens_at_the_first_refusal_and_counts_every_step_passed_over():
    episodes = ThrottleEpisodes()
    episodes.passed_over("r1", T0)
    episodes.passed_over("r1", T0 + 10 * MS)
    episodes.passed_over("r1", T0 + 20 * MS)
    assert episodes
    throttling = episodes.by_request["r1"]
    assert throttling.steps == 3
    assert throttling.since_ns == T0  # the first refusal, not the latest


def test_a_dispatch_closes_the_episode_and_a_second_one_adds_nothing():
    episodes = ThrottleEpisodes()
    episodes.passed_over("r1", T0)
    episodes.dispatched("r1", T0 + 30 * MS)
    episodes.dispatched("r1", T0 + 90 * MS)
    throttling = episodes.by_request["r1"]
    assert throttling.total_ns == 30 * MS
    assert throttling.since_ns is None
    assert episodes.end("r1", T0 + 200 * MS) == (1, 0.03)


def test_ending_a_request_closes_its_open_episode_and_forgets_it():
    episodes = ThrottleEpisodes()
    episodes.passed_over("r1", T0)  # episode 1: 20 ms
    episodes.dispatched("r1", T0 + 20 * MS)
    episodes.passed_over("r1", T0 + 50 * MS)  # episode 2: open until the end
    episodes.passed_over("r1", T0 + 60 * MS)
    assert episodes.end("r1", T0 + 150 * MS) == (3, 0.12)
    assert not episodes
    assert episodes.end("r1", T0 + 200 * MS) is None


def test_episodes_of_different_requests_are_kept_apart():
    episodes = ThrottleEpisodes()
    episodes.passed_over("r1", T0)
    episodes.passed_over("r2", T0 + 10 * MS)
    episodes.dispatched("r1", T0 + 40 * MS)
    assert episodes.end("r2", T0 + 50 * MS) == (1, 0.04)
    assert episodes.end("r1", T0 + 60 * MS) == (1, 0.04)
