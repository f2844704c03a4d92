"""Reads that cannot stall the engine: at 10,000 users in 1,000 teams, every
hold of the lock the scheduler holds for each step reads at most
``KEYS_PER_HOLD`` users' sort keys, ``STATES_PER_HOLD`` users' or teams'
states or ``MEMBERS_PER_HOLD`` team members, whatever the number of users and
teams, and releases the lock in between (counted in users and teams, not
timed; the time is in ``benchmarks/control_scale.py``)."""

from __future__ import annotations

import threading

import pytest

from control.service.holds import KEYS_PER_HOLD, MEMBERS_PER_HOLD, STATES_PER_HOLD
from control.service.operations import LimitsService
from control.service.user_states import MOST_THROTTLED_FIRST
from pacing.accounting import UserCounters
from pacing.teams import TeamTable
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

USERS = 10_000
TEAMS = 1_000
#: Half the users are members of this team, the others 5 each of the rest.
BIG_TEAM = "team-0000"


class NamesPerHold:
    """A real lock that records, for each hold, the distinct users whose
    counters and teams whose counters were read while it was held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._touched: set[str] = set()
        self.holds: list[set[str]] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._held = True
        self._touched = set()

    def __exit__(self, *exc: object) -> None:
        self.holds.append(self._touched)
        self._held = False
        self._lock.release()

    def touched(self, name: str) -> None:
        if self._held:
            self._touched.add(name)

    def counts(self, prefix: str) -> list[int]:
        """For each hold, how many names starting with ``prefix`` it read."""
        return [sum(n.startswith(prefix) for n in hold) for hold in self.holds]


def _watched_counters(user: str, holds: NamesPerHold, of: UserCounters):
    """``of``'s values in a ``UserCounters`` that reports each read of a field."""

    class Watched(UserCounters):
        def __getattribute__(self, name: str):
            if not name.startswith("_"):
                holds.touched(user)
            return super().__getattribute__(name)

    watched = Watched()
    watched.add(of)
    return watched


class _WatchedTeamCounts(dict[str, int]):
    """A team -> count dict that reports each team read through ``get``."""

    def __init__(self, holds: NamesPerHold, of: dict[str, int]) -> None:
        super().__init__(of)
        self._holds = holds

    def get(self, team, default=None):
        self._holds.touched(team)
        return super().get(team, default)


def _team_of(i: int) -> str:
    return BIG_TEAM if i < USERS // 2 else f"team-{i % TEAMS:04}"


@pytest.fixture(scope="module")
def big():
    """10,000 users with explicit limits, counters and live requests in 1,000
    teams, whose counters report their reads to the lock."""
    rig = make_rig(10, {f"user-{i:05}": 1 + i % 100 for i in range(USERS)})
    holds = NamesPerHold()
    teams = TeamTable(
        {f"team-{t:04}": 1000 for t in range(TEAMS)},
        {f"user-{i:05}": _team_of(i) for i in range(USERS)},
    )
    with rig.shared.lock:
        rig.shared.teams.replace(teams, rig.clock())
        rig.shared.teams.charged = _WatchedTeamCounts(holds, {BIG_TEAM: 7})
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


def _users(holds: NamesPerHold) -> list[int]:
    return holds.counts("user-")


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
    _bounded(_users(holds), bound)
    # Every user's key was read, in holds the scheduler could step between.
    assert sum(_users(holds)) >= (USERS if request_.order_by else request_.page_size)


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
    _bounded(_users(holds), KEYS_PER_HOLD)


def test_a_list_of_1000_teams_holds_the_lock_for_a_bounded_number_of_teams_and_members(
    big,
):
    holds, served = big
    holds.holds.clear()
    page = served.stub.ListTeamStates(pb.ListTeamStatesRequest(page_size=TEAMS))
    assert [s.team for s in page.team_states] == [f"team-{t:04}" for t in range(TEAMS)]
    assert page.next_page_token == ""
    _bounded(holds.counts("team-"), STATES_PER_HOLD)
    _bounded(_users(holds), MEMBERS_PER_HOLD)
    # Every team and every member was read, in holds the scheduler could step
    # between, and the sums over those holds are whole.
    assert sum(holds.counts("team-")) == TEAMS
    assert sum(_users(holds)) == USERS
    members = {s.team: s.member_count for s in page.team_states}
    assert (members[BIG_TEAM], members["team-0999"]) == (USERS // 2 + 5, 5)
    running = sum(s.running_members for s in page.team_states)
    throttled = sum(s.throttled_members for s in page.team_states)
    assert (running, throttled) == (USERS, USERS // 2)
    assert page.team_states[0].tokens_charged == 7


def test_a_team_of_5000_members_is_read_in_bounded_holds(big):
    holds, served = big
    holds.holds.clear()
    state = served.stub.GetTeamState(
        pb.GetTeamStateRequest(name=f"teamStates/{BIG_TEAM}")
    )
    assert (state.member_count, state.running_members) == (USERS // 2 + 5,) * 2
    _bounded(_users(holds), MEMBERS_PER_HOLD)
    assert sum(_users(holds)) == USERS // 2 + 5
