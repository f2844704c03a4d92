"""10,000 users: lists stay paginated, complete and in order; latencies are
printed (run with -s), not asserted."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from control.service import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import make_rig, serving

USERS = 10_000


@pytest.fixture(scope="module")
def big():
    """10,000 users with explicit limits, counters and live requests."""
    rig = make_rig(10, {f"user-{i:05}": 1 + i % 100 for i in range(USERS)})
    with rig.host.lock:
        for i in range(USERS):
            user = f"user-{i:05}"
            rig.accounting.record(user, "charged", 1 + i % 7)
            rig.accounting.record(user, "throttled_skips", (i * 7919) % 1000)
            rig.limiter.try_take(user, rig.clock())
        rig.host.on_step(rig.clock())
    rig.counts.value = {f"user-{i:05}": (2, i % 2) for i in range(USERS)}
    service = LimitsService(rig.host)
    with serving(service) as served:
        yield rig, served


def _all_pages(call, request, field):
    items, pages, latencies = [], 0, []
    while True:
        started = time.perf_counter()
        response = call(request)
        latencies.append(time.perf_counter() - started)
        items += getattr(response, field)
        pages += 1
        if not response.next_page_token:
            return items, pages, latencies
        request.page_token = response.next_page_token


def _report(what: str, latencies: list[float]) -> None:
    ms = sorted(x * 1000 for x in latencies)
    print(
        f"\n{what}: n={len(ms)} median {statistics.median(ms):.2f} ms, "
        f"p95 {ms[int(0.95 * (len(ms) - 1))]:.2f} ms, max {ms[-1]:.2f} ms"
    )


def test_list_limits_of_10000_users_pages_through_all_in_order(big):
    _, served = big
    limits, pages, latencies = _all_pages(
        served.stub.ListLimits, pb.ListLimitsRequest(page_size=1000), "limits"
    )
    names = [limit.name for limit in limits]
    assert names == [f"limits/user-{i:05}" for i in range(USERS)]
    assert pages == 10
    _report("ListLimits page of 1000 at 10,000 users", latencies)


def test_list_user_states_of_10000_users_by_throttled_skips(big):
    _, served = big
    states, pages, latencies = _all_pages(
        served.stub.ListUserStates,
        pb.ListUserStatesRequest(page_size=1000, order_by="throttled_skips desc"),
        "user_states",
    )
    assert len(states) == USERS
    assert len({s.user for s in states}) == USERS
    keys = [(-s.throttled_skips, s.user) for s in states]
    assert keys == sorted(keys)
    assert pages == 10
    _report("ListUserStates page of 1000 by skips at 10,000 users", latencies)


def test_small_pages_stay_fast_at_10000_users(big):
    _, served = big
    latencies = []
    token = ""
    for _ in range(50):
        started = time.perf_counter()
        page = served.stub.ListUserStates(
            pb.ListUserStatesRequest(
                page_size=100, page_token=token, order_by="throttled_skips desc"
            )
        )
        latencies.append(time.perf_counter() - started)
        token = page.next_page_token
    _report("ListUserStates page of 100 by skips at 10,000 users", latencies)
    latencies = []
    token = ""
    for _ in range(50):
        started = time.perf_counter()
        page = served.stub.ListLimits(
            pb.ListLimitsRequest(page_size=100, page_token=token)
        )
        latencies.append(time.perf_counter() - started)
        token = page.next_page_token
    _report("ListLimits page of 100 at 10,000 users", latencies)


def test_get_latency_at_10000_users(big):
    _, served = big
    for rpc, request in [
        ("GetLimit", pb.GetLimitRequest(name="limits/user-04242")),
        ("GetUserState", pb.GetUserStateRequest(name="userStates/user-04242")),
    ]:
        call = getattr(served.stub, rpc)
        latencies = []
        for _ in range(200):
            started = time.perf_counter()
            call(request)
            latencies.append(time.perf_counter() - started)
        _report(f"{rpc} at 10,000 users", latencies)


class TimedLock:
    """A lock that records how long each hold lasted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: list[float] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()


@pytest.mark.parametrize(
    ("rpc", "request_"),
    [
        ("ListUserStates", pb.ListUserStatesRequest(order_by="throttled_skips desc")),
        ("ListUserStates", pb.ListUserStatesRequest()),
        ("ListLimits", pb.ListLimitsRequest()),
        ("GetUserState", pb.GetUserStateRequest(name="userStates/user-00042")),
        ("GetLimit", pb.GetLimitRequest(name="limits/user-00042")),
    ],
    ids=["states-by-skips", "states-by-user", "limits", "get-state", "get-limit"],
)
def test_how_long_a_read_holds_the_scheduler_lock(big, rpc, request_):
    """What a read costs the scheduler at 10,000 users: the host lock hold."""
    rig, served = big
    timed = TimedLock()
    original, rig.host.lock = rig.host.lock, timed
    try:
        for _ in range(20):
            getattr(served.stub, rpc)(request_)
    finally:
        rig.host.lock = original
    _report(f"host lock held by {rpc} at 10,000 users", timed.holds)


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
    rest, _, _ = _all_pages(served.stub.ListLimits, request, "limits")
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
