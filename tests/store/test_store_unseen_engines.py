"""No N x R while the store has never been reached: an engine that has not yet
heard the live-engine set from the store divides each limit by the stated
fleet size (``--output-rate-store-expected-engines``) in its local share,
and without one pauses limited users (fail closed) until the store answers.
Several engines' real store runtimes (``store.runtime.attach``: claimer,
budget, limits sync) start while nothing listens on the store's port; then a
real ``redis-server`` starts there and they take the real count; then it
stops and their shares follow that count. Engine clocks are fake (moved by
the test); the claimers and Redis run for real."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from pacing.claims import ClaimedBalances, burst_tokens
from pacing.limiter import NS_PER_S, OutputRateLimiter
from pacing.settings.store import StoreSettings
from pacing.store_budget import DEGRADED_AFTER_NS
from store.claimer import DEFAULT_HEARTBEAT_NS, HEARTBEAT_LIFETIMES, Claimer
from store.clients import connect
from store.redis_store import RedisStore
from store.runtime import RunningStore, attach
from tests.control_harness import Rig, make_rig
from tools.fake_clock import FakeClock
from tools.redis_server import NO_PERSISTENCE, RedisProcess, free_port

#: Every user's global limit, tokens/s.
RATE = 120
ENGINES = 3
#: The fake window over which each engine's share is measured.
WINDOW_S = 10
EVENTUALLY_S = 20.0


@contextlib.contextmanager
def engines(url: str, **settings: object) -> Iterator[list[tuple[Rig, RunningStore]]]:
    started: list[tuple[Rig, RunningStore]] = []
    try:
        for _ in range(ENGINES):
            rig = make_rig(default_rate=RATE)
            started.append((rig, attach(rig.shared, StoreSettings(url, **settings))))
        yield started
    finally:
        for _, running in started:
            running.stop()


@contextlib.contextmanager
def redis_on(port: int) -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="redis-late-") as directory:
        server = RedisProcess(NO_PERSISTENCE, port, directory)
        try:
            yield
        finally:
            server.stop()


def wait_for(
    condition: Callable[[], bool],
    moving: list[tuple[Rig, RunningStore]] | None = None,
) -> None:
    """Waits until ``condition()`` holds, moving the clocks of the engines
    ``moving`` by 100 ms every 10 ms meanwhile (their heartbeats come due)."""
    deadline = time.monotonic() + EVENTUALLY_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {EVENTUALLY_S} s"
        time.sleep(0.01)
        if moving is not None:
            advance_all(moving, 100)


def advance_all(fleet: list[tuple[Rig, RunningStore]], ms: float) -> None:
    for rig, _ in fleet:
        rig.clock.advance_ms(ms)


def outage_seen(fleet: list[tuple[Rig, RunningStore]]) -> None:
    """Every claimer has failed a call (its heartbeat comes due, if nothing
    else), then the outage lasts past the point where the local share stands
    in."""
    wait_for(
        lambda: all(r.budget.claimed.store_down_since_ns is not None for _, r in fleet),
        moving=fleet,
    )
    advance_all(fleet, 2 * DEGRADED_AFTER_NS / 1e6)


def taken_over_window(fleet: list[tuple[Rig, RunningStore]], user: str) -> list[int]:
    """The tokens of ``user`` each engine hands out over ``WINDOW_S`` fake
    seconds, asked for every 10 ms (far more than any limit)."""
    taken = [0] * len(fleet)
    for _ in range(WINDOW_S * 100):
        for i, (rig, running) in enumerate(fleet):
            rig.clock.advance_ms(10)
            with rig.shared.lock:
                taken[i] += running.budget.take_up_to(user, RATE, rig.clock())[0]
    return taken


def bound(divisor: int) -> int:
    """What ``ENGINES`` engines may hand out over the window, each at
    ``RATE // divisor`` from a full burst."""
    share = RATE // divisor
    return ENGINES * (
        share * WINDOW_S + burst_tokens(share, make_rig().limiter.burst_ns)
    )


def test_engines_started_while_the_store_is_down_stay_within_the_limit_then_count() -> (
    None
):
    port = free_port()  # nothing listens there yet
    stated = ENGINES + 1  # the stated size may exceed the fleet, never undercut it
    with engines(f"redis://127.0.0.1:{port}/0", expected_engines=stated) as fleet:
        outage_seen(fleet)
        taken = taken_over_window(fleet, "alice")
        print(f"\nshares over {WINDOW_S} s, stated {stated}: {taken}")
        assert sum(taken) <= bound(stated) <= RATE * WINDOW_S + ENGINES * 5
        assert min(taken) >= (RATE // stated) * WINDOW_S  # paced, not stopped

        with redis_on(port):
            # Heard for a whole heartbeat lifetime: the count is the real one.
            wait_for(
                lambda: all(
                    r.budget.claimed.share_divisor == ENGINES for _, r in fleet
                ),
                moving=fleet,
            )
            assert all(r.budget.claimed.live_engines == ENGINES for _, r in fleet)
        outage_seen(fleet)
        taken = taken_over_window(fleet, "bob")
        print(f"shares over {WINDOW_S} s, counted {ENGINES}: {taken}")
        assert sum(taken) <= bound(ENGINES)
        assert min(taken) >= (RATE // ENGINES) * WINDOW_S


def test_without_a_stated_size_limited_users_wait_until_the_store_is_heard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with caplog.at_level(logging.WARNING), engines(url) as fleet:
        outage_seen(fleet)
        assert taken_over_window(fleet, "alice") == [0] * ENGINES
        advance_all(fleet, 10 * NS_PER_S / 1e6)  # past the failure mode's start
        assert taken_over_window(fleet, "alice") == [0] * ENGINES
        with redis_on(port):
            wait_for(
                lambda: all(
                    r.budget.claimed.share_divisor == ENGINES for _, r in fleet
                ),
                moving=fleet,
            )
        outage_seen(fleet)
        taken = taken_over_window(fleet, "alice")
        assert sum(taken) <= bound(ENGINES)
        assert min(taken) >= (RATE // ENGINES) * WINDOW_S
    waits = [r.message for r in caplog.records if "wait" in r.message]
    assert len(waits) == ENGINES, waits  # one line per engine
    assert "--output-rate-store-expected-engines" in waits[0]


def test_a_count_emptied_by_a_flushall_is_not_taken_before_the_set_refills(
    redis_url: str,
) -> None:
    """Engines that counted ``ENGINES`` keep that count for a heartbeat
    lifetime after a FLUSHALL empties the live set (their peers beat back in
    within a period); a smaller count that lasts a whole lifetime is taken."""
    client = connect(redis_url, timeout_s=5.0)
    assert isinstance(client, redis.Redis)
    client.flushdb()
    store = RedisStore(client)
    clocks = [FakeClock() for _ in range(ENGINES)]
    balances = [ClaimedBalances(OutputRateLimiter(RATE, {})) for _ in clocks]
    claimers = [
        Claimer(store, b, threading.Lock(), c, engine_id=f"engine-{i}")
        for i, (b, c) in enumerate(zip(balances, clocks, strict=True))
    ]
    lifetime_ms = DEFAULT_HEARTBEAT_NS * HEARTBEAT_LIFETIMES / 1e6
    for clock in (None, *clocks):  # all beat, then each again a lifetime on
        for i, claimer in enumerate(claimers):
            if clock is clocks[i]:
                clock.advance_ms(lifetime_ms)
            claimer.run_once()
    assert [b.share_divisor for b in balances] == [ENGINES] * ENGINES

    client.flushall()
    clocks[0].advance_ms(DEFAULT_HEARTBEAT_NS / 1e6)
    claimers[0].run_once()  # the store now counts this engine alone
    assert (balances[0].live_engines, balances[0].share_divisor) == (ENGINES,) * 2
    clocks[0].advance_ms(lifetime_ms)
    claimers[0].run_once()  # alone for a whole lifetime: the others are gone
    assert balances[0].share_divisor == 1
    client.close()
