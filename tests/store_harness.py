"""Fixtures for the store's tests: the same tests run on ``fakeredis`` and on a
real ``redis-server`` (started once per session on a free loopback port, no
persistence, stopped at the end), and with ``client_or_cluster`` on a real
three-master Redis Cluster as well (started once per session); and
``stored_table``, a limits table as the store carries it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import fakeredis
import pytest
import redis
from redis.cluster import RedisCluster

from pacing.claims import ClaimedBalances
from pacing.fair_share_policy import SharePolicy
from pacing.limits import LimitTable
from pacing.modes import Mode
from pacing.policy.model import Policy, policy_of
from pacing.teams import TeamTable
from store.claimer import Claimer
from store.clients import LazyCluster, connect
from tools.counting_store import CountingStore
from tools.redis_cluster import LocalCluster, redis_cluster
from tools.redis_server import redis_server

BACKENDS = ("fakeredis", "redis-server")
CLUSTER = "redis-cluster"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture(params=BACKENDS)
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """An empty database on each backend."""
    with _empty(request, request.param) as empty:
        assert isinstance(empty, redis.Redis)
        yield empty


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    with redis_cluster(masters=3) as cluster:
        yield cluster


@pytest.fixture(params=(*BACKENDS, CLUSTER))
def client_or_cluster(
    request: pytest.FixtureRequest,
) -> Iterator[redis.Redis | RedisCluster]:
    """``client``'s backends and an empty real cluster."""
    with _empty(request, request.param) as empty:
        yield empty


@contextmanager
def _empty(
    request: pytest.FixtureRequest, backend: str
) -> Iterator[redis.Redis | RedisCluster]:
    if backend == "fakeredis":
        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    if backend == CLUSTER:
        lazy = connect(request.getfixturevalue("local_cluster").url, timeout_s=5.0)
        assert isinstance(lazy, LazyCluster)
        real: redis.Redis | RedisCluster = lazy.get()
    else:
        single = connect(request.getfixturevalue("redis_url"), timeout_s=5.0)
        assert isinstance(single, redis.Redis)
        real = single
    real.flushall()
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


def stored_table(
    default_rate: int | None,
    table: LimitTable | None = None,
    mode: Mode = Mode.ENFORCE,
    share: SharePolicy | None = None,
    teams: TeamTable | None = None,
) -> Policy:
    """A table as the store carries it (``store.limits_table``): the policy of
    these runtime pieces, its mode set (``ENFORCE`` unless given) and its
    fair-share switch ``share``'s (off unless given)."""
    share = SharePolicy() if share is None else share
    return policy_of(
        default_rate=default_rate,
        table=LimitTable() if table is None else table,
        teams=TeamTable() if teams is None else teams,
        share=share,
        mode=mode,
        fair_share=share.enabled,
    )
