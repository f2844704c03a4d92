"""The store's capacity model, measured: Redis operations per engine per second
against active users and the claim horizon, what one operation costs a Redis
shard in CPU time, and from those the users one shard serves and the shards a
fleet needs.

Engines are ``tools.simulated_engine`` (the real claimer and balances, a
stepping thread in place of the scheduler) against one real ``redis-server``
on loopback (one shard: a cluster's master runs the same scripts on its own
users' keys). Every active user streams on ``--engines-per-user`` engines and
wants more than its limit (``--rate``), so each is paced by the store: the
worst case. Per row: round trips and operations (``EVALSHA`` calls: claims,
returns, heartbeats) per engine per second, operations per active user per
second, and the shard's CPU time per operation (``INFO cpu`` over
``INFO commandstats``, network handling included).

The summary sizes a deployment from the last row's cost per operation: a shard
kept at ``--cpu-share`` of its one core (Redis runs commands on one thread)
serves ``share / cost`` operations per second; ``--fleet-engines`` engines with
``--fleet-users`` active users need that many shards for users times operations
per user per second.

``python -m benchmarks.store_capacity [--users 100,1000,3000] [--horizon-ms 25,50,100]``
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import redis

from store.clients import connect
from tools.counting_store import CountingStore
from tools.redis_server import redis_server
from tools.simulated_engine import SimulatedEngine


@dataclass(frozen=True)
class Row:
    users: int
    horizon_ms: float
    trips_per_engine: float
    ops_per_engine: float
    ops_per_user: float
    cpu_share: float  #: of one core, the shard's
    cpu_us_per_op: float
    granted_share: float  #: tokens granted against the users' limits


def _redis_counts(monitor: redis.Redis) -> tuple[float, int]:
    """The shard's CPU seconds so far and its ``EVALSHA`` calls."""
    cpu = monitor.info("cpu")
    calls = monitor.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(calls)


def measure(url: str, users: int, horizon_ms: float, args: argparse.Namespace) -> Row:
    names = [f"user-{i:06}" for i in range(users)]
    engines = [
        SimulatedEngine(
            CountingStore(connect(url)),
            f"engine-{e}",
            # Each user on --engines-per-user engines, users spread evenly.
            [
                name
                for i, name in enumerate(names)
                if (e - i) % args.engines < args.engines_per_user
            ],
            rate=args.rate,
            streams=args.streams,
            step_s=args.step_ms / 1000,
            horizon_ns=round(horizon_ms * 1e6),
        )
        for e in range(args.engines)
    ]
    monitor = redis.Redis.from_url(url, socket_timeout=5)
    monitor.flushall()
    for engine in engines:
        engine.start()
    time.sleep(args.warm_up)
    cpu_before, calls_before = _redis_counts(monitor)
    trips_before = [e.store.round_trips for e in engines]
    granted_before = sum(e.store.granted for e in engines)
    started = time.monotonic()
    time.sleep(args.seconds)
    cpu_after, calls_after = _redis_counts(monitor)
    elapsed = time.monotonic() - started
    trips = sum(e.store.round_trips for e in engines) - sum(trips_before)
    granted = sum(e.store.granted for e in engines) - granted_before
    for engine in engines:
        engine.stop()
    monitor.close()
    ops = calls_after - calls_before
    return Row(
        users=users,
        horizon_ms=horizon_ms,
        trips_per_engine=trips / elapsed / args.engines,
        ops_per_engine=ops / elapsed / args.engines,
        ops_per_user=ops / elapsed / users,
        cpu_share=(cpu_after - cpu_before) / elapsed,
        cpu_us_per_op=(cpu_after - cpu_before) / max(ops, 1) * 1e6,
        granted_share=granted / elapsed / (users * args.rate),
    )


def print_row(row: Row) -> None:
    print(
        f"{row.users:>7} {row.horizon_ms:>8.0f} {row.trips_per_engine:>10.0f}"
        f" {row.ops_per_engine:>10.0f} {row.ops_per_user:>9.1f}"
        f" {row.cpu_share:>8.0%} {row.cpu_us_per_op:>9.1f} {row.granted_share:>8.0%}"
    )


def print_sizing(rows: list[Row], args: argparse.Namespace) -> None:
    cost_us = rows[-1].cpu_us_per_op
    per_shard = args.cpu_share * 1e6 / cost_us
    print(
        f"\none shard at {args.cpu_share:.0%} of a core: {per_shard:,.0f} ops/s "
        f"({cost_us:.1f} us each, the last row's)"
    )
    print(f"{'horizon ms':>10} {'ops/user/s':>11} {'users/shard':>12} {'shards':>7}")
    for horizon_ms in sorted({row.horizon_ms for row in rows}):
        per_user = max(r.ops_per_user for r in rows if r.horizon_ms == horizon_ms)
        heartbeats = args.fleet_engines  # one per engine per second
        load = args.fleet_users * per_user + heartbeats
        print(
            f"{horizon_ms:>10.0f} {per_user:>11.1f} {per_shard / per_user:>12,.0f}"
            f" {math.ceil(load / per_shard):>7}"
        )
    print(
        f"(shards for {args.fleet_engines} engines x {args.fleet_users:,} active "
        f"users at {args.rate} tok/s, each on {args.engines_per_user} engine(s))"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="100,1000,3000")
    parser.add_argument("--horizon-ms", default="25,50,100")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--engines-per-user", type=int, default=1)
    parser.add_argument("--rate", type=int, default=30, help="tokens/s per user")
    parser.add_argument("--streams", type=int, default=2, help="per user and engine")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warm-up", type=float, default=1.5)
    parser.add_argument("--cpu-share", type=float, default=0.5)
    parser.add_argument("--fleet-engines", type=int, default=100)
    parser.add_argument("--fleet-users", type=int, default=100_000)
    args = parser.parse_args(argv)
    print(
        f"{args.engines} engines, {args.rate} tok/s per user, each user on "
        f"{args.engines_per_user} engine(s) with {args.streams} stream(s), a step "
        f"every {args.step_ms} ms; one redis-server"
    )
    print(
        f"{'users':>7} {'horizon':>8} {'trips/s/e':>10} {'ops/s/e':>10}"
        f" {'ops/u/s':>9} {'redis':>8} {'us/op':>9} {'granted':>8}"
    )
    rows = []
    with redis_server() as url:
        for horizon_ms in (float(h) for h in args.horizon_ms.split(",")):
            for users in (int(n) for n in args.users.split(",")):
                rows.append(measure(url, users, horizon_ms, args))
                print_row(rows[-1])
    print_sizing(rows, args)


if __name__ == "__main__":
    main()
