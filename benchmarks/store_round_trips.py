"""Redis round trips per second per engine against the number of active users:
engines with the real claimer (``store.claimer``) on a real ``redis-server`` on
loopback, each driven by a simulated scheduler that spends from its balances.

Each simulated engine steps every ``--step-ms``: under the shared lock it asks
every user for ``--streams`` tokens (``take_up_to``, as the scheduler's paced
step does) and pokes the claimer when a user starts wanting. Every user is
limited to ``--rate`` tokens/s and wants far more (a stream per token per step),
so every user is paced by the store: the worst case for round trips. Also shown:
claims per second, tokens granted per second against the limit (``users * rate``
over all engines), and how long a claimer pass holds the scheduler's lock.

``python -m benchmarks.store_round_trips [--users 1,10,100,1000] [--engines 1]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from store.clients import connect
from tools.counting_store import CountingStore
from tools.redis_server import redis_server
from tools.simulated_engine import SimulatedEngine


def measure(url: str, users: int, args: argparse.Namespace) -> None:
    names = [f"user-{i:05}" for i in range(users)]
    engines = [
        SimulatedEngine(
            CountingStore(connect(url)),
            f"engine-{e}",
            names,
            rate=args.rate,
            streams=args.streams,
            step_s=args.step_ms / 1000,
        )
        for e in range(args.engines)
    ]
    for engine in engines:
        engine.start()
    time.sleep(args.warm_up)
    before = [(e.store.round_trips, e.store.claims, e.store.granted) for e in engines]
    for engine in engines:
        engine.lock.claimer_holds.clear()
    time.sleep(args.seconds)
    after = [(e.store.round_trips, e.store.claims, e.store.granted) for e in engines]
    for engine in engines:
        engine.stop()
    per_engine = [
        [(a - b) / args.seconds for a, b in zip(end, start, strict=True)]
        for start, end in zip(before, after, strict=True)
    ]
    trips = statistics.mean(row[0] for row in per_engine)
    claims = statistics.mean(row[1] for row in per_engine)
    granted = sum(row[2] for row in per_engine)
    holds = sorted(h * 1e6 for e in engines for h in e.lock.claimer_holds)
    steps = sorted(s * 1e6 for e in engines for s in e.step_seconds)
    print(
        f"{users:>6} {trips:>12.0f} {claims:>11.0f} {claims / max(trips, 1):>10.1f}"
        f" {granted:>10.0f} {users * args.rate:>8}"
        f" {statistics.median(holds):>9.0f} {holds[int(0.99 * (len(holds) - 1))]:>9.0f}"
        f" {statistics.median(steps):>9.0f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="1,10,100,1000")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--rate", type=int, default=30, help="tokens/s per user")
    parser.add_argument("--streams", type=int, default=2, help="per user and engine")
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warm-up", type=float, default=1.0)
    args = parser.parse_args(argv)
    print(
        f"{args.engines} engine(s), {args.rate} tok/s per user, {args.streams} "
        f"stream(s) per user and engine, a step every {args.step_ms} ms"
    )
    print(
        f"{'users':>6} {'trips/s/eng':>12} {'claims/s/e':>11} {'per trip':>10}"
        f" {'tok/s':>10} {'limit':>8} {'hold p50':>9} {'hold p99':>9}"
        f" {'step p50':>9}   (holds and steps in us)"
    )
    with redis_server() as url:
        for users in (int(n) for n in args.users.split(",")):
            measure(url, users, args)


if __name__ == "__main__":
    main()
