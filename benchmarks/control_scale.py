"""What control-plane reads cost at 10,000 users: each read's latency through a
real gRPC server, and how long it holds the lock the scheduler holds for every
step (the time a step may wait behind it); then what a client looping on
``ListUserStates`` adds to a scheduler step's p99, side by side: no reader, a
reader on the old path (the whole read under one hold) and on the current one
(bounded holds, ``control.service.user_states``).

``python -m benchmarks.control_scale [--users 10000] [--calls 50] [--steps 1000]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from control.pagination import PageTokens
from control.server import create_server
from control.service.operations import LimitsService
from control.service.user_states import MOST_THROTTLED_FIRST, list_user_states
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


# -- a reader beside the scheduler's steps ------------------------------------------

#: A step's work under the lock: the users it charges (a saturated 256-slot batch).
STEP_USERS = 256
#: The model's forward between two steps, off the lock and off the GIL.
FORWARD_S = 0.005
#: A client's round trip between two reads (a tight loop on the lock would
#: starve the steps: a released lock is not handed to the thread waiting on it).
CLIENT_GAP_S = 0.001


class _OneHold:
    """``shared`` seen by a read that already holds its lock: the old path, a
    whole read (names, every key, the page's states) under one hold."""

    def __init__(self, shared: SharedLimiter) -> None:
        self._shared = shared
        self.lock = contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


def _read_states(shared: SharedLimiter, one_hold: bool, page: int) -> None:
    tokens = PageTokens()
    if not one_hold:
        list_user_states(shared, tokens, page, "", MOST_THROTTLED_FIRST)
        return
    with shared.lock:
        view: Any = _OneHold(shared)
        list_user_states(view, tokens, page, "", MOST_THROTTLED_FIRST)


def step_latencies(
    shared: SharedLimiter, steps: int, reader: str | None, page: int
) -> tuple[list[float], int]:
    """Each of ``steps`` scheduler steps' wall time from wanting the lock to
    releasing it (charging ``STEP_USERS`` users, then ``on_step``), with a
    thread looping on a page of ``page`` user states by throttled skips beside
    it (``reader``: "old", "new" or None); and how many reads it made."""
    stop = threading.Event()
    reads = 0

    def loop() -> None:
        nonlocal reads
        while not stop.is_set():
            _read_states(shared, reader == "old", page)
            reads += 1
            time.sleep(CLIENT_GAP_S)

    thread = threading.Thread(target=loop, daemon=True)
    if reader is not None:
        thread.start()
        time.sleep(0.2)
    charged = [f"user-{i:05}" for i in range(STEP_USERS)]
    latencies = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            with shared.lock:
                now = shared.clock()
                for user in charged:
                    shared.limiter.try_take(user, now)
                shared.accounting.record_charged(dict.fromkeys(charged, 1))
                shared.on_step(now)
            latencies.append(time.perf_counter() - started)
            time.sleep(FORWARD_S)
    finally:
        stop.set()
        if reader is not None:
            thread.join()
    return latencies, reads


def _p99_ms(seconds: list[float]) -> float:
    return statistics.quantiles(seconds, n=100)[98] * 1000


def reader_rows(shared: SharedLimiter, steps: int, repeats: int, page: int) -> None:
    """Step p99 without a reader, beside the old path and the new, in turn."""
    runs: dict[str, list[float]] = {"no reader": [], "old path": [], "new path": []}
    reads: dict[str, int] = dict.fromkeys(runs, 0)
    readers = {"no reader": None, "old path": "old", "new path": "new"}
    for _ in range(repeats):
        for name, reader in readers.items():
            latencies, count = step_latencies(shared, steps, reader, page)
            runs[name] += latencies
            reads[name] += count
    base = _p99_ms(runs["no reader"])
    print(
        f"scheduler step ({STEP_USERS} users charged under the lock, "
        f"{FORWARD_S * 1000:g} ms forward off it), {steps} steps x {repeats}, "
        f"a reader looping on ListUserStates by skips, page of {page}:"
    )
    for name, latencies in runs.items():
        p99 = _p99_ms(latencies)
        print(
            f"  {name:<10} step p99 {p99:7.2f} ms  (+{p99 - base:6.2f} ms, "
            f"{p99 / base:5.2f}x)  median {statistics.median(latencies) * 1000:6.2f} "
            f"ms  max {max(latencies) * 1000:7.2f} ms  reads {reads[name]}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=50, help="calls per read")
    parser.add_argument("--steps", type=int, default=1000, help="steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each")
    parser.add_argument("--page", type=int, default=100, help="states per read")
    args = parser.parse_args(argv)
    shared = shared_limiter(args.users)
    reader_rows(shared, args.steps, args.repeats, args.page)
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
