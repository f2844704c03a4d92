"""Fixtures for the store's tests: the same tests run on ``fakeredis`` and on a
real ``redis-server`` (started once per session on a free loopback port, no
persistence, stopped at the end)."""

from __future__ import annotations

from collections.abc import Iterator

import fakeredis
import pytest
import redis

from pacing.claims import ClaimedBalances
from store.claimer import Claimer
from store.clients import connect
from tools.counting_store import CountingStore
from tools.redis_server import redis_server

BACKENDS = ("fakeredis", "redis-server")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture(params=BACKENDS)
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """An empty database on each backend."""
    if request.param == "fakeredis":
        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    real = connect(request.getfixturevalue("redis_url"), timeout_s=5.0)
    real.flushdb()
    yield real
    real.close()


def claim_through_a_store(
    scheduler, clock
) -> tuple[ClaimedBalances, CountingStore, Claimer]:
    """Makes claimed balances, filled from a fresh fakeredis store by a real
    claimer on ``clock``, the budget ``scheduler`` spends from."""
    shared = scheduler.output_rate_shared
    balances = ClaimedBalances(scheduler.limiter)
    with shared.lock:
        shared.use_budget(balances)
    store = CountingStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    claimer = Claimer(store, balances, shared.lock, clock, engine_id="e")
    return balances, store, claimer
