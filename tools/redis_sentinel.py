"""A real Sentinel set-up on loopback for tests: a master, a replica and three
sentinels (``redis-server --sentinel``, the same binary; quorum 2) on free
ports in a temporary directory, stopped on exit. ``LocalSentinel.kill_master``
kills the master and waits until the sentinels name the replica instead."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tools.redis_server import NO_PERSISTENCE, RedisProcess, free_port

MASTER_NAME = "output-rate"
SENTINELS = 3
QUORUM = 2
#: A master not answering for this long is down to a sentinel.
DOWN_AFTER_MS = 1000
#: Longest wait for the set-up to form and for a failover.
SETTLE_TIMEOUT_S = 30.0


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5, decode_responses=True)


@dataclass
class LocalSentinel:
    master: RedisProcess
    replica: RedisProcess
    sentinels: list[RedisProcess]

    @property
    def url(self) -> str:
        return (
            "redis+sentinel://"
            + ",".join(s.address for s in self.sentinels)
            + f"/{MASTER_NAME}"
        )

    def master_port(self) -> int:
        """The master's port as the first live sentinel names it."""
        for sentinel in self.sentinels:
            if sentinel.process.poll() is None:
                _, port = _client(sentinel.port).execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME
                )
                return int(port)
        raise RuntimeError("no sentinel is running")

    def kill_master(self) -> float:
        """SIGKILLs the master; returns how long (s) until every sentinel named
        the replica as the master. The replica becomes ``master``."""
        killed = time.monotonic()
        self.master.kill()
        deadline = killed + SETTLE_TIMEOUT_S
        while not all(
            int(
                _client(s.port).execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME
                )[1]
            )
            == self.replica.port
            for s in self.sentinels
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not fail over in time")
            time.sleep(0.02)
        took = time.monotonic() - killed
        self.master, self.replica = self.replica, self.master
        return took


@contextmanager
def redis_sentinel() -> Iterator[LocalSentinel]:
    """Runs the set-up for the duration of the block; yields it once every
    sentinel sees the replica and the other sentinels (what a failover needs)."""
    with (
        tempfile.TemporaryDirectory(prefix="redis-sentinel-") as root,
        ExitStack() as stack,
    ):

        def start(name: str, args: tuple[str, ...]) -> RedisProcess:
            directory = Path(root) / name
            directory.mkdir()
            process = RedisProcess(args, free_port(), str(directory))
            stack.callback(process.stop)
            return process

        master = start("master", NO_PERSISTENCE)
        replica = start(
            "replica", (*NO_PERSISTENCE, "--replicaof", "127.0.0.1", str(master.port))
        )
        sentinels = []
        for i in range(SENTINELS):
            config = Path(root) / f"sentinel{i}.conf"
            config.write_text(
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master.port} {QUORUM}\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            )
            sentinels.append(start(f"sentinel{i}", (str(config), "--sentinel")))
        setup = LocalSentinel(master, replica, sentinels)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not all(_ready(s.port) for s in sentinels):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not find each other in time")
            time.sleep(0.1)
        yield setup


def _ready(port: int) -> bool:
    client = _client(port)
    replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
    others = client.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)
    return len(replicas) == 1 and len(others) == SENTINELS - 1
