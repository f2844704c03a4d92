"""The store on a real Redis Cluster (``tools.redis_cluster``, loopback): one
pipeline per shard, all in flight together; claims going on while a user's
slot moves to another master and while a master fails over to its replica,
with the cell's bound holding over the whole run.

The engines are ``tools.simulated_engine``: the real claimer and balances, a
stepping thread in place of the scheduler, every user wanting far more than its
limit. Their store calls time out after ``PATIENT_S``: a failed round trip here
is an error or an outage, not a slow machine. The bound is checked on Redis'
own clock: from the first grant to the last, W seconds, a fresh user's cell
grants at most (W + 0.1)·R + 1 tokens (``store.cell``); a cell lost or
duplicated on the way would grant a fresh burst (0.1·R + 1) beyond it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import key_slot

from pacing.claims import Request
from pacing.limiter import DEFAULT_BURST_NS, NS_PER_S
from store.clients import connect
from store.redis_store import KeySpace, RedisStore
from tools.counting_store import CountingStore
from tools.redis_cluster import LocalCluster, redis_cluster
from tools.redis_server import RedisProcess
from tools.simulated_engine import SimulatedEngine

PATIENT_S = 1.0
RATE = 1000  # tok/s: a burst of 101 tokens
#: Tokens each engine asks for per 5 ms step: 4,000 tok/s, far above the limit,
#: so the cell alone decides how many are granted.
STREAMS = 20
BURST_S = DEFAULT_BURST_NS / NS_PER_S


def _client(node: RedisProcess) -> redis.Redis:
    return redis.Redis(port=node.port, socket_timeout=5, decode_responses=True)


def user_on(cluster: LocalCluster, master: RedisProcess, prefix: str) -> str:
    """A user id whose cell is served by ``master``."""
    keys = KeySpace()
    for i in range(10_000):
        user = f"{prefix}-{i}"
        if cluster.master_of(key_slot(keys.cell(user).encode())) is master:
            return user
    raise LookupError("no such user")


def test_the_users_keys_spread_over_the_masters_and_the_tables_share_a_slot(
    local_cluster: LocalCluster,
) -> None:
    keys = KeySpace()
    masters = {
        local_cluster.master_of(key_slot(keys.cell(f"user-{i}").encode())).port
        for i in range(100)
    }
    assert masters == {m.port for m in local_cluster.masters()}
    assert key_slot(keys.limits.encode()) == key_slot(keys.engines.encode())


def test_a_pass_sends_every_shards_pipeline_before_reading_any(
    local_cluster: LocalCluster,
) -> None:
    """The first shard is paused for 300 ms (``CLIENT PAUSE``): the second
    shard's claim runs at once, before the first's, as it could not if the
    pipelines were sent one after another's answer."""
    first, second, *_ = local_cluster.masters()
    slow, fast = (
        user_on(local_cluster, first, "slow"),
        user_on(local_cluster, second, "fast"),
    )
    store = RedisStore(connect(local_cluster.url, timeout_s=5.0))
    store.claim("warm-up", 1, 10)  # the layout read, the scripts loaded
    trips = store.round_trips
    _client(first).execute_command("CLIENT", "PAUSE", 300, "ALL")
    answer = store.exchange({slow: Request(1, 10), fast: Request(1, 10)}, {})
    assert store.round_trips == trips + 1
    ran_after_us = (
        answer.grants[slow].server_time_us - answer.grants[fast].server_time_us
    )
    print(f"\nthe paused shard ran its claim {ran_after_us / 1000:.1f} ms later")
    assert ran_after_us > 0


@pytest.fixture
def engines(local_cluster: LocalCluster) -> Iterator[list[SimulatedEngine]]:
    yield from _engines(local_cluster.url, "moving-user")


def _engines(url: str, user: str) -> Iterator[list[SimulatedEngine]]:
    started = [
        SimulatedEngine(
            CountingStore(connect(url, timeout_s=PATIENT_S)),
            f"engine-{i}",
            [user],
            rate=RATE,
            streams=STREAMS,
        )
        for i in range(2)
    ]
    for engine in started:
        engine.start()
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def assert_within_the_cells_bound(engines: list[SimulatedEngine], user: str) -> None:
    stores = [engine.store for engine in engines]
    firsts = [s.first_grant_us for s in stores if s.first_grant_us is not None]
    lasts = [s.last_grant_us for s in stores if s.last_grant_us is not None]
    window_s = (max(lasts) - min(firsts)) / 1e6
    granted = sum(s.granted for s in stores)
    taken = sum(engine.taken[user] for engine in engines)
    ceiling = (window_s + BURST_S) * RATE + 1
    print(
        f"\n{granted} tokens granted over {window_s:.3f} s (at most {ceiling:.0f}), "
        f"{granted / window_s:.0f} tok/s against {RATE}; {taken} spent"
    )
    assert taken <= granted <= ceiling


def _counts(engines: list[SimulatedEngine]) -> list[int]:
    return [engine.store.granted for engine in engines]


def _wait_for_grants(engines: list[SimulatedEngine], since: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(n > b for n, b in zip(_counts(engines), since, strict=True)):
        assert time.monotonic() < deadline, "an engine got no grant within 10 s"
        time.sleep(0.01)


def test_claims_go_on_while_the_users_slot_moves_to_another_master(
    local_cluster: LocalCluster, engines: list[SimulatedEngine]
) -> None:
    """Half-way, the user's slot moves; for 0.5 s after its key moved the slot
    is half-moved (clients get ``ASK``), then ``MOVED``. No round trip fails,
    both engines claim on, and the cell (moved with its debt by ``MIGRATE``)
    grants within its bound over the whole run."""
    user = "moving-user"
    slot = key_slot(KeySpace().cell(user).encode())
    _wait_for_grants(engines, [0, 0])
    time.sleep(1.0)
    source = local_cluster.master_of(slot)
    target = next(m for m in local_cluster.masters() if m is not source)
    asking = _asking_calls(target)
    local_cluster.move_slot(slot, target, importing_s=0.5)
    _wait_for_grants(engines, _counts(engines))
    time.sleep(1.0)
    for engine in engines:
        engine.stop()
    assert local_cluster.master_of(slot) is target
    assert _asking_calls(target) > asking, "no claim met the half-moved slot"
    assert [engine.stats.round_trips_failed for engine in engines] == [0, 0]
    assert_within_the_cells_bound(engines, user)


def _asking_calls(node: RedisProcess) -> int:
    stats = _client(node).info("commandstats").get("cmdstat_asking", {})
    calls: int = stats.get("calls", 0)
    return calls


@pytest.fixture(scope="module")
def replicated() -> Iterator[LocalCluster]:
    with redis_cluster(masters=3, replicas=1) as cluster:
        yield cluster


def test_claims_go_on_from_the_replica_when_a_master_dies(
    replicated: LocalCluster,
) -> None:
    """The user's master is killed (SIGKILL) half-way; its replica takes over
    after the cluster's node timeout. The engines' round trips fail meanwhile
    (they are degraded), then both claim from the new master. The cell's bound
    holds over the whole run: the gap (over a second) is far longer than the
    100 ms of debt a failover could forget."""
    user = "failover-user"
    slot = key_slot(KeySpace().cell(user).encode())
    for engines in _engines(replicated.url, user):
        _wait_for_grants(engines, [0, 0])
        time.sleep(1.0)
        killed = time.monotonic()
        promoted = replicated.fail_over(replicated.master_of(slot))
        promoted_s = time.monotonic() - killed
        _wait_for_grants(engines, _counts(engines))
        resumed_s = time.monotonic() - killed
        degraded = [engine.stats.round_trips_failed for engine in engines]
        time.sleep(1.0)
        for engine in engines:
            engine.stop()
        print(
            f"\nreplica promoted {promoted_s:.2f} s after the kill; both engines "
            f"granted again after {resumed_s:.2f} s; failed round trips {degraded}"
        )
        assert replicated.master_of(slot) is promoted
        assert all(failed > 0 for failed in degraded)
        assert not any(engine.stats.degraded for engine in engines)
        assert_within_the_cells_bound(engines, user)
