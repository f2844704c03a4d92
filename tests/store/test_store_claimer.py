"""The claimer (``store.claimer``) between an engine's balances and the store, on
``fakeredis`` and on a real ``redis-server``: passes driven one at a time on
fake engine clocks, then the thread itself."""

from __future__ import annotations

import threading
import time

import fakeredis
import pytest
import redis

from pacing.claims import CellReading, ClaimedBalances
from pacing.limiter import NS_PER_S, OutputRateLimiter
from store.claimer import Claimer, tat_lead_ns
from store.clients import connect
from store.redis_store import RedisStore
from tests import store_harness
from tools.fake_clock import FakeClock

client = store_harness.client


class Engine:
    """One engine's side: balances, a fake clock, a claimer, a wake counter."""

    def __init__(self, store: RedisStore, name: str, rate: int) -> None:
        self.clock = FakeClock()
        self.balances = ClaimedBalances(OutputRateLimiter(rate, {}))
        self.lock = threading.Lock()
        self.wakes = 0
        self.claimer = Claimer(
            store,
            self.balances,
            self.lock,
            self.clock,
            engine_id=name,
            wake=self.wake,
        )

    def wake(self) -> None:
        self.wakes += 1

    def take(self, user: str, most: int) -> int:
        with self.lock:
            return self.balances.take_up_to(user, most, self.clock())[0]

    def held(self, user: str) -> int:
        return self.balances.available(user, self.clock())


def test_a_pass_claims_for_a_wanting_user_and_wakes_the_engine(client):
    store = RedisStore(client)
    engine = Engine(store, "engine-1", 10)
    assert engine.take("alice", 1) == 0  # nothing held: refused, now wanting
    engine.claimer.run_once()
    assert (engine.held("alice"), engine.wakes) == (1, 1)
    assert engine.take("alice", 1) == 1
    assert engine.balances.live_engines == 1  # its own heartbeat


def test_a_pass_with_nothing_to_do_makes_no_round_trip(client):
    store = RedisStore(client)
    engine = Engine(store, "engine-1", 10)
    engine.claimer.run_once()  # the first heartbeat
    trips = store.round_trips
    engine.claimer.run_once()
    assert store.round_trips == trips


def test_the_heartbeats_count_the_live_engines(client):
    store = RedisStore(client)
    first, second = Engine(store, "engine-1", 10), Engine(store, "engine-2", 10)
    first.claimer.run_once()
    second.claimer.run_once()
    assert second.balances.live_engines == 2
    second.claimer.stop()  # leaves the live set
    first.clock.advance_ms(1000)  # its next heartbeat is due
    first.claimer.run_once()
    assert first.balances.live_engines == 1


def test_an_expired_lease_returns_the_tokens_to_the_other_engines(client):
    """At 1 token/s (a burst of 1), engine A holds the only token; B gets none.
    When A's lease ends, A gives it back and B can claim it at once, 0.9 s
    before the cell would have granted it anew."""
    store = RedisStore(client)
    a, b = Engine(store, "engine-a", 1), Engine(store, "engine-b", 1)
    a.take("alice", 1)
    a.claimer.run_once()
    assert a.held("alice") == 1
    b.take("alice", 1)
    b.claimer.run_once()
    assert b.held("alice") == 0
    a.clock.advance_ms(1000)  # A's lease ends, unspent
    a.claimer.run_once()
    assert a.held("alice") == 0
    b.clock.advance_ms(1000)  # past the wait the cell gave B
    assert b.take("alice", 1) == 0  # B's next step: still nothing
    b.claimer.run_once()
    assert b.held("alice") == 1


def test_a_users_last_request_ending_gives_its_tokens_back(client):
    store = RedisStore(client)
    a, b = Engine(store, "engine-a", 1), Engine(store, "engine-b", 1)
    a.take("alice", 1)
    a.claimer.run_once()
    with a.lock:
        a.balances.end_user("alice", a.clock())
    a.claimer.run_once()
    b.take("alice", 1)
    b.claimer.run_once()
    assert b.held("alice") == 1


def reading(engine: Engine, user: str) -> CellReading | None:
    with engine.lock:
        return engine.balances.cell_reading(user, engine.clock())


def test_each_answer_hands_in_the_users_global_tat_lead(client):
    """At 1 token/s (a burst of 1), A's claim of the only token moves the
    user's one cell 1 s ahead. B, granted nothing, reads that same cell: a
    lead it did nothing for. A's return takes the token off again."""
    store = RedisStore(client)
    a, b = Engine(store, "engine-a", 1), Engine(store, "engine-b", 1)
    a.take("alice", 1)
    a.claimer.run_once()
    assert a.held("alice") == 1
    assert reading(a, "alice") == CellReading(NS_PER_S, 0)  # a fresh cell
    b.take("alice", 1)
    b.claimer.run_once()
    assert b.held("alice") == 0
    seen = reading(b, "alice")
    assert seen is not None
    assert 0 < seen.tat_lead_ns <= NS_PER_S
    a.clock.advance_ms(400)  # on A's clock the lead it read runs down
    assert reading(a, "alice") == CellReading(600_000_000, 400_000_000)
    with a.lock:
        a.balances.end_user("alice", a.clock())
    a.claimer.run_once()  # the return's answer: the cell is full again
    assert reading(a, "alice") == CellReading(0, 0)


@pytest.mark.parametrize(
    ("debt", "rate", "want"),
    [
        # 1. debt (micro-tokens), 2. rate (tokens/s), 3. lead (ns), rounded up
        (0, 5, 0),
        (1_000_000, 1, NS_PER_S),  # one token at 1/s: a second
        (1_000_000, 30, 33_333_334),
        (2_500_000, 1000, 2_500_000),
        (1, 1_000_000, 1),  # a millionth of a microsecond: 1 ns
    ],
)
def test_a_cells_debt_is_its_tat_lead_at_the_rate(debt, rate, want):
    assert tat_lead_ns(debt, rate) == want


def test_a_store_that_does_not_answer_is_recorded_and_claims_resume_after(
    client: redis.Redis,
):
    """Fakeredis is disconnected; the real server is paused (CLIENT PAUSE), so
    the claim times out. Either way the pass records the outage and the claim
    can be made again; the pass after the store is back lands it."""
    fake = isinstance(client, fakeredis.FakeRedis)
    if fake:
        store = RedisStore(client)
    else:  # the claimer's own client, with the default (short) timeouts
        kwargs = client.connection_pool.connection_kwargs
        store = RedisStore(connect(f"redis://{kwargs['host']}:{kwargs['port']}/0"))
    engine = Engine(store, "engine-1", 10)
    engine.claimer.run_once()  # scripts loaded, heartbeat sent
    engine.take("alice", 1)
    if fake:
        client.connection_pool.connection_kwargs["server"].connected = False
    else:
        client.execute_command("CLIENT", "PAUSE", 2000, "ALL")
    engine.claimer.run_once()
    assert engine.balances.store_down_since_ns == engine.clock()
    assert engine.held("alice") == 0
    if fake:
        client.connection_pool.connection_kwargs["server"].connected = True
    deadline = time.monotonic() + 10
    while engine.balances.store_down_since_ns is not None:
        assert time.monotonic() < deadline, "the store did not come back"
        engine.clock.advance_ms(10)
        engine.claimer.run_once()
    assert engine.held("alice") == 1


def test_the_thread_claims_when_poked_and_leaves_when_stopped(client):
    store = RedisStore(client)
    landed = threading.Event()
    balances = ClaimedBalances(OutputRateLimiter(10, {}))
    lock = threading.Lock()
    claimer = Claimer(
        store,
        balances,
        lock,
        time.monotonic_ns,
        engine_id="engine-1",
        wake=landed.set,
        period_s=60,  # so that only the poke can have run the pass
        heartbeat_ns=60 * NS_PER_S,
    )
    claimer.start()
    try:
        with lock:
            balances.take_up_to("alice", 1, time.monotonic_ns())
        assert balances.wants_claims
        claimer.poke()
        assert landed.wait(10)
        with lock:
            assert balances.take_up_to("alice", 1, time.monotonic_ns())[0] == 1
    finally:
        claimer.stop()
    assert client.zcard(store.keys.engines) == 0


class FlakyRates:
    """The limiter's rates, except that ``rate_of`` raises while ``broken``."""

    def __init__(self, rate: int) -> None:
        self._limiter = OutputRateLimiter(rate, {})
        self.broken = threading.Event()
        self.limit_changes = 0
        self.burst_ns = self._limiter.burst_ns

    def rate_of(self, user: str) -> int:
        if self.broken.is_set():
            raise RuntimeError("lookup failed")
        return self._limiter.rate_of(user)


def test_a_failing_pass_does_not_end_the_thread(client, caplog):
    """A bug in a pass (here: a rate lookup that raises) is logged; the thread
    goes on and claims once the lookup works."""
    store = RedisStore(client)
    rates = FlakyRates(10)
    balances = ClaimedBalances(rates)
    lock = threading.Lock()
    landed = threading.Event()
    claimer = Claimer(
        store,
        balances,
        lock,
        time.monotonic_ns,
        engine_id="engine-1",
        wake=landed.set,
        period_s=0.001,
    )
    with lock:
        balances.take_up_to("alice", 1, time.monotonic_ns())
    rates.broken.set()
    claimer.start()
    try:
        deadline = time.monotonic() + 10
        while "lookup failed" not in caplog.text:
            assert time.monotonic() < deadline, "no pass failed"
            time.sleep(0.01)
        rates.broken.clear()
        assert landed.wait(10)
    finally:
        claimer.stop()
