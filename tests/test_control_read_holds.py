"""Reads that cannot stall the engine: at 10,000 users, every hold of the lock
the scheduler holds for each step reads at most ``KEYS_PER_HOLD`` users' sort
keys or ``STATES_PER_HOLD`` users' states, whatever the number of users, and
releases the lock in between (counted in users, not timed; the time is in
``benchmarks/control_scale.py``)."""

from __future__ import annotations

import threading

import pytest

from control.service.operations import LimitsService
from control.service.user_states import (
    KEYS_PER_HOLD,
    MOST_THROTTLED_FIRST,
    STATES_PER_HOLD,
)
from pacing.accounting import UserCounters
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

USERS = 10_000


class UsersPerHold:
    """A real lock that records, for each hold, how many distinct users'
    counters were read while it was held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._touched: set[str] = set()
        self.holds: list[int] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._held = True
        self._touched = set()

    def __exit__(self, *exc: object) -> None:
        self.holds.append(len(self._touched))
        self._held = False
        self._lock.release()

    def touched(self, user: str) -> None:
        if self._held:
            self._touched.add(user)


def _watched_counters(user: str, holds: UsersPerHold, of: UserCounters):
    """``of``'s values in a ``UserCounters`` that reports each read of a field."""

    class Watched(UserCounters):
        def __getattribute__(self, name: str):
            if not name.startswith("_"):
                holds.touched(user)
            return super().__getattribute__(name)

    watched = Watched()
    watched.add(of)
    return watched


@pytest.fixture(scope="module")
def big():
    """10,000 users with explicit limits, counters and live requests, whose
    counters report their reads to the lock."""
    rig = make_rig(10, {f"user-{i:05}": 1 + i % 100 for i in range(USERS)})
    holds = UsersPerHold()
    with rig.shared.lock:
        for i in range(USERS):
            user = f"user-{i:05}"
            rig.accounting.record(user, "charged", 1 + i % 7)
            rig.accounting.record(user, "throttled_skips", (i * 7919) % 1000)
            rig.limiter.try_take(user, rig.clock())
        rig.shared.on_step(rig.clock())
        counters = rig.accounting._users  # the live dict by_user() shows
        for user, of in list(counters.items()):
            counters[user] = _watched_counters(user, holds, of)
    rig.counts.value = {f"user-{i:05}": (2, i % 2) for i in range(USERS)}
    rig.shared.lock = holds
    with serving(LimitsService(rig.shared)) as served:
        yield holds, served


def _bounded(holds: list[int], bound: int) -> None:
    assert holds, "the read never took the lock"
    assert max(holds) <= bound, holds


@pytest.mark.parametrize(
    ("request_", "bound"),
    [
        (
            pb.ListUserStatesRequest(page_size=1000, order_by=MOST_THROTTLED_FIRST),
            KEYS_PER_HOLD,
        ),
        # Sorted by user id, no counter is read for a key: only for states.
        (pb.ListUserStatesRequest(page_size=1000), STATES_PER_HOLD),
        (
            pb.ListUserStatesRequest(
                page_size=100, order_by="recent_tokens_per_second"
            ),
            KEYS_PER_HOLD,
        ),
    ],
    ids=["page-of-1000-by-skips", "page-of-1000-by-user", "page-of-100-by-rate"],
)
def test_a_list_of_10000_users_holds_the_lock_for_a_bounded_number_of_users(
    big, request_, bound
):
    holds, served = big
    holds.holds.clear()
    page = served.stub.ListUserStates(request_)
    assert len(page.user_states) == request_.page_size
    _bounded(holds.holds, bound)
    # Every user's key was read, in holds the scheduler could step between.
    assert sum(holds.holds) >= (USERS if request_.order_by else request_.page_size)


def test_a_watch_of_the_most_throttled_holds_the_lock_for_a_bounded_number_of_users(
    big,
):
    holds, served = big
    holds.holds.clear()
    updates = served.stub.WatchUserStates(
        pb.WatchUserStatesRequest(max_users=1000, order_by=MOST_THROTTLED_FIRST)
    )
    first = next(updates)
    updates.cancel()
    assert len(first.user_states) == 1000
    skips = [state.throttled_skips for state in first.user_states]
    assert skips == sorted(skips, reverse=True)
    _bounded(holds.holds, KEYS_PER_HOLD)
