"""What control-plane reads cost at 10,000 users: each read's latency through a
real gRPC server, and how long it holds the lock the scheduler holds for every
step (the time a step may wait behind it).

``python -m benchmarks.control_scale [--users 10000] [--calls 50]``
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import grpc

from control.server import create_server
from control.service import LimitsService
from control.user_states import MOST_THROTTLED_FIRST
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.shared import SharedLimiter
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc


class TimedLock:
    """A lock that records how long each hold lasted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: list[float] = []
        self._since = 0.0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()


def shared_limiter(users: int) -> SharedLimiter:
    """``users`` users with explicit limits, counters and live requests."""
    names = [f"user-{i:05}" for i in range(users)]
    limiter = OutputRateLimiter(10, {u: 1 + i % 100 for i, u in enumerate(names)})
    accounting = Accounting()
    now = time.monotonic_ns()
    for i, user in enumerate(names):
        accounting.record(user, "charged", 1 + i % 7)
        accounting.record(user, "throttled_skips", (i * 7919) % 1000)
        limiter.try_take(user, now)
    counts = {user: (2, i % 2) for i, user in enumerate(names)}
    shared = SharedLimiter(
        limiter, accounting, time.monotonic_ns, request_counts=lambda: counts
    )
    with shared.lock:
        shared.on_step(now)
    return shared


def _report(what: str, seconds: list[float]) -> None:
    ms = sorted(x * 1000 for x in seconds)
    print(
        f"{what:<58} n={len(ms):<4} median {statistics.median(ms):7.2f} ms  "
        f"p95 {ms[int(0.95 * (len(ms) - 1))]:7.2f} ms  max {ms[-1]:7.2f} ms"
    )


def _paged(call: Callable, request) -> Callable[[], None]:
    """A call that walks the pages of ``request``, one page per call (back to
    the first after the last)."""
    token = ""

    def next_page() -> None:
        nonlocal token
        request.page_token = token
        token = call(request).next_page_token

    return next_page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=50, help="calls per read")
    args = parser.parse_args(argv)
    shared = shared_limiter(args.users)
    server, port = create_server("127.0.0.1:0", LimitsService(shared))
    server.start()
    server.set_serving()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.OutputRateControlStub(channel)
    user = f"user-{args.users // 2:05}"
    reads = {
        "ListLimits, page of 1000": _paged(
            stub.ListLimits, pb.ListLimitsRequest(page_size=1000)
        ),
        "ListLimits, page of 100": _paged(
            stub.ListLimits, pb.ListLimitsRequest(page_size=100)
        ),
        "ListUserStates by skips, page of 1000": _paged(
            stub.ListUserStates,
            pb.ListUserStatesRequest(page_size=1000, order_by=MOST_THROTTLED_FIRST),
        ),
        "ListUserStates by skips, page of 100": _paged(
            stub.ListUserStates,
            pb.ListUserStatesRequest(page_size=100, order_by=MOST_THROTTLED_FIRST),
        ),
        "GetLimit": lambda: stub.GetLimit(pb.GetLimitRequest(name=f"limits/{user}")),
        "GetUserState": lambda: stub.GetUserState(
            pb.GetUserStateRequest(name=f"userStates/{user}")
        ),
    }
    print(f"{args.users} users, {args.calls} calls per read")
    try:
        for what, read in reads.items():
            read()  # warm-up
            timed = TimedLock()
            original, shared.lock = shared.lock, timed
            latencies = []
            try:
                for _ in range(args.calls):
                    started = time.perf_counter()
                    read()
                    latencies.append(time.perf_counter() - started)
            finally:
                shared.lock = original
            _report(f"{what}: latency", latencies)
            _report(f"{what}: scheduler lock held", timed.holds)
    finally:
        channel.close()
        server.stop(0).wait()


if __name__ == "__main__":
    main()
