"""The store's counters for the metrics (``pacing.store_stats``), and the claimer
recording into them (``store.claimer``) on ``fakeredis`` and on a real
``redis-server``: round trips and their latency on the engine's clock, tokens
claimed, granted and returned, and the degraded flag set by an outage (a real
``redis-server`` stopped with SIGSTOP) and cleared when it answers again, as the
``vllm:output_rate_store_degraded`` gauge shows it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

import fakeredis
import pytest
import redis
from prometheus_client import CollectorRegistry

from engine_ext import metrics
from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import parse
from pacing.accounting import Accounting
from pacing.claims import ClaimedBalances, Request
from pacing.limiter import NS_PER_S, OutputRateLimiter
from pacing.store_stats import LATENCY_BUCKETS_NS, StoreStats
from store.claimer import Claimer
from store.clients import connect
from store.redis_store import Exchange, RedisStore
from tests import store_harness
from tools.fake_clock import FakeClock
from tools.redis_server import redis_server

client = store_harness.client

MS = 1_000_000

# -- the counters ----------------------------------------------------------------

#: latency (ns) -> its bucket: bounds are inclusive; past the last, the overflow.
BUCKETS = [
    (0, 0),
    (100_000, 0),
    (100_001, 1),
    (250_000, 1),
    (50 * MS, LATENCY_BUCKETS_NS.index(50 * MS)),
    (NS_PER_S, len(LATENCY_BUCKETS_NS) - 1),
    (NS_PER_S + 1, len(LATENCY_BUCKETS_NS)),
    (-5, 0),  # a clock that went backwards: no wait
]


@pytest.mark.parametrize(("latency_ns", "bucket"), BUCKETS)
def test_a_latency_lands_in_the_bucket_its_bound_includes(
    latency_ns: int, bucket: int
) -> None:
    stats = StoreStats()
    stats.record_answered(latency_ns, claimed=0, granted=0, returned=0, live_engines=1)
    expected = [0] * (len(LATENCY_BUCKETS_NS) + 1)
    expected[bucket] = 1
    assert stats.latency_counts == expected
    assert stats.latency_sums_ns[bucket] == max(0, latency_ns)


def test_an_outage_starts_at_the_first_failure_and_ends_with_an_answer() -> None:
    stats = StoreStats()
    assert not stats.degraded
    stats.record_failed(50 * MS, now_ns=1_000)
    stats.record_failed(50 * MS, now_ns=2_000)
    assert (stats.degraded, stats.down_since_ns) == (True, 1_000)
    assert (stats.round_trips_answered, stats.round_trips_failed) == (0, 2)
    stats.record_answered(MS, claimed=3, granted=2, returned=1, live_engines=4)
    assert (stats.degraded, stats.down_since_ns, stats.live_engines) == (False, None, 4)
    assert (stats.tokens_claimed, stats.tokens_granted, stats.tokens_returned) == (
        3,
        2,
        1,
    )


def test_the_fingerprint_changes_with_every_record() -> None:
    stats = StoreStats()
    seen = {stats.fingerprint()}
    stats.record_failed(0, now_ns=1)
    seen.add(stats.fingerprint())
    stats.record_answered(0, claimed=0, granted=0, returned=0, live_engines=1)
    seen.add(stats.fingerprint())
    stats.record_answered(0, claimed=1, granted=0, returned=0, live_engines=1)
    seen.add(stats.fingerprint())
    assert len(seen) == 4


# -- the claimer recording (passes driven one at a time) -------------------------


class TimedStore(RedisStore):
    """The real store, whose every exchange takes ``latency_ms`` on the engine's
    fake clock (answered or not)."""

    def __init__(
        self, client: redis.Redis, clock: FakeClock, latency_ms: float
    ) -> None:
        super().__init__(client)
        self._clock = clock
        self.latency_ms = latency_ms

    def exchange(
        self,
        claims: Mapping[str, Request],
        returns: Mapping[str, Request],
        heartbeat: tuple[str, int] | None = None,
    ) -> Exchange:
        self._clock.advance_ms(self.latency_ms)
        return super().exchange(claims, returns, heartbeat)


class Engine:
    """One engine's side: balances, a fake clock, a claimer recording into
    ``stats``."""

    def __init__(self, store: RedisStore, clock: FakeClock, rate: int) -> None:
        self.clock = clock
        self.balances = ClaimedBalances(OutputRateLimiter(rate, {}))
        self.lock = threading.Lock()
        self.stats = StoreStats()
        self.claimer = Claimer(
            store,
            self.balances,
            self.lock,
            clock,
            engine_id="engine-1",
            stats=self.stats,
        )

    def take(self, user: str, most: int) -> int:
        with self.lock:
            return self.balances.take_up_to(user, most, self.clock())[0]


def bucket_of(latency_ns: int) -> int:
    return next(
        (i for i, bound in enumerate(LATENCY_BUCKETS_NS) if latency_ns <= bound),
        len(LATENCY_BUCKETS_NS),
    )


def test_each_round_trip_is_recorded_with_its_latency_and_tokens(client):
    clock = FakeClock()
    store = TimedStore(client, clock, latency_ms=3)
    engine = Engine(store, clock, rate=10)
    engine.take("alice", 1)  # wanting: the first pass claims 1 (and beats)
    engine.claimer.run_once()
    stats = engine.stats
    assert (stats.round_trips_answered, stats.round_trips_failed) == (1, 0)
    assert (stats.tokens_claimed, stats.tokens_granted) == (1, 1)
    assert stats.live_engines == 1
    three_ms = bucket_of(3 * MS)
    assert stats.latency_counts[three_ms] == 1
    assert stats.latency_sums_ns[three_ms] == 3 * MS

    with engine.lock:  # alice's last request ends: her token goes back
        engine.balances.end_user("alice", clock())
    store.latency_ms = 0.2
    engine.claimer.run_once()
    assert stats.tokens_returned == 1
    assert stats.round_trips_answered == 2
    assert stats.latency_sums_ns[bucket_of(200_000)] == 200_000
    assert sum(stats.latency_counts) == 2

    trips = store.round_trips
    engine.claimer.run_once()  # nothing to send, no heartbeat due
    assert store.round_trips == trips
    assert stats.round_trips_answered == 2


def test_granted_is_what_the_store_granted_not_what_was_claimed(client):
    """At 1 token/s (a burst of 1) a second engine's claim gets nothing."""
    clock = FakeClock()
    first = Engine(TimedStore(client, clock, latency_ms=1), clock, rate=1)
    second = Engine(TimedStore(client, clock, latency_ms=1), clock, rate=1)
    for engine in (first, second):
        engine.take("alice", 1)
        engine.claimer.run_once()
    assert (first.stats.tokens_claimed, first.stats.tokens_granted) == (1, 1)
    assert (second.stats.tokens_claimed, second.stats.tokens_granted) == (1, 0)


def test_an_outage_is_recorded_as_failed_round_trips_and_degraded(client):
    """Fakeredis is disconnected; the real server is paused (CLIENT PAUSE), so
    the exchange times out. Either way the round trip counts as failed, with
    the time it took, and the engine is degraded until one is answered."""
    fake = isinstance(client, fakeredis.FakeRedis)
    clock = FakeClock()
    if fake:
        store = TimedStore(client, clock, latency_ms=5)
    else:  # the claimer's own client, with the default (short) timeouts
        kwargs = client.connection_pool.connection_kwargs
        claimer_client = connect(f"redis://{kwargs['host']}:{kwargs['port']}/0")
        store = TimedStore(claimer_client, clock, latency_ms=5)
    engine = Engine(store, clock, rate=10)
    engine.claimer.run_once()  # scripts loaded, heartbeat sent
    engine.take("alice", 1)
    if fake:
        client.connection_pool.connection_kwargs["server"].connected = False
    else:
        client.execute_command("CLIENT", "PAUSE", 2000, "ALL")
    engine.claimer.run_once()
    stats = engine.stats
    assert (stats.round_trips_answered, stats.round_trips_failed) == (1, 1)
    assert stats.degraded
    assert stats.down_since_ns == clock()
    assert stats.latency_counts[bucket_of(5 * MS)] == 2
    assert stats.tokens_claimed == 0  # the failed claim is in no count
    if fake:
        client.connection_pool.connection_kwargs["server"].connected = True
    deadline = time.monotonic() + 10
    while stats.degraded:
        assert time.monotonic() < deadline, "the store did not come back"
        clock.advance_ms(10)
        engine.claimer.run_once()
    assert stats.down_since_ns is None
    assert stats.round_trips_answered == 2
    assert stats.tokens_granted == 1


# -- the claimer thread against a stopped redis-server ---------------------------


def degraded_gauge(builder: PayloadBuilder, stats: StoreStats, lock) -> float | None:
    """``stats`` through a payload (as the scheduler builds it, under the
    lock) to the exporter: the degraded gauge ``/metrics`` would show."""
    with lock:
        raw = builder.build(
            accounting=Accounting(),
            user_rates={},
            default_rate=10,
            throttled_requests=0,
            tracked_users=0,
            store=stats,
        )
    registry = CollectorRegistry()
    metrics.OutputRateMetrics("m", registry).apply(parse(raw), engine=0)
    return registry.get_sample_value(
        metrics.STORE_DEGRADED, {"model_name": "m", "engine": "0"}
    )


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_stopped_redis_server_sets_the_degraded_gauge_and_its_return_clears_it():
    """The claimer thread on the real clock (heartbeats every 20 ms, the
    default 50 ms timeouts); redis-server is stopped with SIGSTOP, then
    continued with SIGCONT."""
    with redis_server() as url:
        control = connect(url, timeout_s=5.0)
        pid = int(control.info("server")["process_id"])
        balances = ClaimedBalances(OutputRateLimiter(10, {}))
        lock = threading.Lock()
        stats = StoreStats()
        claimer = Claimer(
            RedisStore(connect(url)),
            balances,
            lock,
            time.monotonic_ns,
            engine_id="engine-1",
            period_s=0.005,
            heartbeat_ns=20 * MS,
            stats=stats,
        )
        builder = PayloadBuilder()
        claimer.start()
        try:
            wait_until(lambda: stats.round_trips_answered > 0, "no round trip")
            assert degraded_gauge(builder, stats, lock) == 0
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(lambda: stats.degraded, "no outage recorded")
                assert degraded_gauge(builder, stats, lock) == 1
                with lock:
                    failed = stats.round_trips_failed
                    answered_then = stats.round_trips_answered
                assert failed > 0
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_until(lambda: not stats.degraded, "the outage did not end")
            assert degraded_gauge(builder, stats, lock) == 0
        finally:
            claimer.stop()
            control.close()
        assert stats.round_trips_answered > answered_then
        # Every round trip, answered or failed, is in the histogram.
        assert sum(stats.latency_counts) == (
            stats.round_trips_answered + stats.round_trips_failed
        )
