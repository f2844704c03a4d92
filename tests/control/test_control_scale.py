"""10,000 users: lists stay paginated, complete and in order, and a read does
work for the users it returns, not for all of them (counted, not timed; the
latencies are in ``benchmarks/control_scale.py``)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from control.service.holds import KEYS_PER_HOLD, STATES_PER_HOLD
from control.service.operations import LimitsService
from control.service.user_states import MOST_THROTTLED_FIRST
from pacing.shared import Reading
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

USERS = 10_000
#: Holds of the lock that read the sort keys of every user.
KEY_HOLDS = -(-USERS // KEYS_PER_HOLD)


@pytest.fixture(scope="module")
def big():
    """10,000 users with explicit limits, counters and live requests."""
    rig = make_rig(10, {f"user-{i:05}": 1 + i % 100 for i in range(USERS)})
    with rig.shared.lock:
        for i in range(USERS):
            user = f"user-{i:05}"
            rig.accounting.record(user, "charged", 1 + i % 7)
            rig.accounting.record(user, "throttled_skips", (i * 7919) % 1000)
            rig.limiter.try_take(user, rig.clock())
        rig.shared.on_step(rig.clock())
    rig.counts.value = {f"user-{i:05}": (2, i % 2) for i in range(USERS)}
    service = LimitsService(rig.shared)
    with serving(service) as served:
        yield rig, served


@pytest.fixture
def reading_calls(monkeypatch) -> Counter[str]:
    """Counts calls of ``Reading.snapshot`` (one user's whole state) and
    ``Reading.column`` (one field of every user)."""
    calls: Counter[str] = Counter()
    for name in ("snapshot", "column"):
        original = getattr(Reading, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(Reading, name, counted)
    return calls


def _all_pages(call, request, field):
    items, pages = [], 0
    while True:
        response = call(request)
        items += getattr(response, field)
        pages += 1
        if not response.next_page_token:
            return items, pages
        request.page_token = response.next_page_token


def test_list_limits_of_10000_users_pages_through_all_in_order(big):
    _, served = big
    limits, pages = _all_pages(
        served.stub.ListLimits, pb.ListLimitsRequest(page_size=1000), "limits"
    )
    names = [limit.name for limit in limits]
    assert names == [f"limits/user-{i:05}" for i in range(USERS)]
    assert pages == 10


def test_list_user_states_of_10000_users_by_throttled_skips(big):
    _, served = big
    states, pages = _all_pages(
        served.stub.ListUserStates,
        pb.ListUserStatesRequest(page_size=1000, order_by=MOST_THROTTLED_FIRST),
        "user_states",
    )
    assert len(states) == USERS
    assert len({s.user for s in states}) == USERS
    keys = [(-s.throttled_skips, s.user) for s in states]
    assert keys == sorted(keys)
    assert pages == 10


def test_a_page_builds_the_states_of_its_own_users_only(big, reading_calls):
    """Each page of 100 reads the sort field of every user once (one column per
    hold of ``KEYS_PER_HOLD`` users) and builds 100 states, whatever the page's
    position."""
    _, served = big
    token = ""
    for page_number in range(1, 51):
        page = served.stub.ListUserStates(
            pb.ListUserStatesRequest(
                page_size=100, page_token=token, order_by=MOST_THROTTLED_FIRST
            )
        )
        assert len(page.user_states) == 100
        assert reading_calls == {
            "snapshot": 100 * page_number,
            "column": page_number * KEY_HOLDS,
        }
        token = page.next_page_token


def test_a_get_builds_one_state_and_reads_no_column(big, reading_calls):
    _, served = big
    state = served.stub.GetUserState(
        pb.GetUserStateRequest(name="userStates/user-04242")
    )
    assert state.user == "user-04242"
    assert reading_calls == {"snapshot": 1}


class CountingLock:
    """A lock that counts its acquisitions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acquired = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.acquired += 1

    def __exit__(self, *exc) -> None:
        self._lock.release()


#: A page of 100 states: one hold copies the names, then one per
#: ``KEYS_PER_HOLD`` users' keys, then one per ``STATES_PER_HOLD`` states.
STATE_PAGE_HOLDS = 1 + KEY_HOLDS + -(-100 // STATES_PER_HOLD)


@pytest.mark.parametrize(
    ("rpc", "request_", "holds"),
    [
        (
            "ListUserStates",
            pb.ListUserStatesRequest(order_by=MOST_THROTTLED_FIRST),
            STATE_PAGE_HOLDS,
        ),
        ("ListUserStates", pb.ListUserStatesRequest(), STATE_PAGE_HOLDS),
        ("ListLimits", pb.ListLimitsRequest(), 1),
        ("GetUserState", pb.GetUserStateRequest(name="userStates/user-00042"), 1),
        ("GetLimit", pb.GetLimitRequest(name="limits/user-00042"), 1),
    ],
    ids=["states-by-skips", "states-by-user", "limits", "get-state", "get-limit"],
)
def test_a_read_takes_the_scheduler_lock_a_known_number_of_times(
    big, rpc, request_, holds
):
    """A get or a page of entries is one hold of the lock the scheduler holds
    for each step; a page of states a bounded hold per chunk of users
    (``tests/control/test_control_read_holds.py``)."""
    rig, served = big
    counting = CountingLock()
    original, rig.shared.lock = rig.shared.lock, counting
    try:
        for _ in range(5):
            getattr(served.stub, rpc)(request_)
    finally:
        rig.shared.lock = original
    assert counting.acquired == 5 * holds


def test_pagination_survives_changes_between_pages(big):
    """Each user that exists throughout is listed exactly once, in order."""
    _, served = big
    page = served.stub.ListLimits(pb.ListLimitsRequest(page_size=2500))
    seen = [limit.name for limit in page.limits]
    # Between pages: a user before the cursor and one after it go away, a new
    # one appears after the cursor.
    served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/user-00010"))
    served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/user-09000"))
    served.stub.CreateLimit(
        pb.CreateLimitRequest(
            limit_id="user-05000x", limit=pb.Limit(tokens_per_second=1)
        )
    )
    request = pb.ListLimitsRequest(page_size=2500, page_token=page.next_page_token)
    rest, _ = _all_pages(served.stub.ListLimits, request, "limits")
    seen += [limit.name for limit in rest]
    assert len(seen) == len(set(seen))
    assert seen == sorted(seen)
    stable = {f"limits/user-{i:05}" for i in range(USERS)} - {
        "limits/user-00010",
        "limits/user-09000",
    }
    assert stable <= set(seen)
    assert "limits/user-05000x" in seen
    assert "limits/user-09000" not in seen
