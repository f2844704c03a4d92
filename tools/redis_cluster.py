"""A real Redis Cluster on loopback for tests and benchmarks: ``masters``
``redis-server --cluster-enabled yes`` processes (and ``replicas`` per master)
on free ports in a temporary directory, joined by ``redis-cli --cluster
create``, stopped on exit. ``LocalCluster`` moves a slot from one master to
another while clients use it, and kills a master for its replica to take over."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tools.redis_server import NO_PERSISTENCE, RedisProcess

#: A node not heard from for this long is failed (its replica takes over).
NODE_TIMEOUT_MS = 1000
#: Longest wait for the cluster to agree on its state.
SETTLE_TIMEOUT_S = 30.0


#: A node's cluster bus listens this far above its port.
BUS_OFFSET = 10000


def cluster_port() -> int:
    """A free port whose bus port is free too, both below Linux's ephemeral
    range (an outgoing connection may take a port from that range at any
    time) and every port above 1024."""
    low, _ = map(
        int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    )
    while True:
        port = random.randrange(1025, low - BUS_OFFSET)
        if all(_free(p) for p in (port, port + BUS_OFFSET)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _client(node: RedisProcess) -> redis.Redis:
    return redis.Redis(port=node.port, socket_timeout=5, decode_responses=True)


@dataclass
class LocalCluster:
    nodes: list[RedisProcess]

    @property
    def url(self) -> str:
        """The store URL naming every node as a seed."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def node_id(self, node: RedisProcess) -> str:
        node_id: str = _client(node).execute_command("CLUSTER", "MYID")
        return node_id

    def masters(self) -> list[RedisProcess]:
        """The live nodes that serve slots, as the first live node sees it."""
        live = [n for n in self.nodes if n.process.poll() is None]
        slots = _client(live[0]).execute_command("CLUSTER", "SLOTS")
        ports = {int(entry[2][1]) for entry in slots}
        return [n for n in live if n.port in ports]

    def master_of(self, slot: int) -> RedisProcess:
        live = next(n for n in self.nodes if n.process.poll() is None)
        for start, end, master, *_ in _client(live).execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"slot {slot} is not served")

    def move_slot(
        self, slot: int, target: RedisProcess, importing_s: float = 0.0
    ) -> None:
        """Moves ``slot`` to ``target`` the way ``redis-cli --cluster reshard``
        does: the target imports, the source migrates, its keys move with
        ``MIGRATE``, and every master learns the new owner. For
        ``importing_s`` after the keys moved the slot stays half-moved, so
        clients meet ``ASK`` before they meet ``MOVED``."""
        source = self.master_of(slot)
        src, dst = _client(source), _client(target)
        src_id, dst_id = self.node_id(source), self.node_id(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
            )
        time.sleep(importing_s)
        for node in (target, source, *self.masters()):
            _client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def fail_over(self, master: RedisProcess) -> RedisProcess:
        """Kills ``master`` (SIGKILL) and waits until one of its replicas
        serves its slots; returns that replica."""
        replicas = [
            n
            for n in self.nodes
            if n is not master
            and n.process.poll() is None
            and _client(n).info("replication").get("master_port") == master.port
        ]
        master.kill()
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            for replica in replicas:
                if _client(replica).info("replication")["role"] == "master":
                    return replica
            if time.monotonic() > deadline:
                raise RuntimeError("no replica took over within the timeout")
            time.sleep(0.05)

    def wait_settled(self) -> None:
        """Until every live node says the cluster is ok and sees the same
        slot owners."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            live = [n for n in self.nodes if n.process.poll() is None]
            views = set()
            ok = True
            for node in live:
                client = _client(node)
                ok = ok and "cluster_state:ok" in client.execute_command(
                    "CLUSTER", "INFO"
                )
                views.add(str(sorted(client.execute_command("CLUSTER", "SLOTS"))))
            if ok and len(views) == 1:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not settle")
            time.sleep(0.1)


@contextmanager
def redis_cluster(masters: int = 3, replicas: int = 0) -> Iterator[LocalCluster]:
    """Runs a cluster of ``masters`` masters with ``replicas`` replicas each
    for the duration of the block."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError(
            "redis-cli not found: run scripts/setup.sh --with-test-services"
        )
    with (
        tempfile.TemporaryDirectory(prefix="redis-cluster-") as root,
        ExitStack() as stack,
    ):
        nodes: list[RedisProcess] = []
        for i in range(masters * (1 + replicas)):
            directory = Path(root) / str(i)
            directory.mkdir()
            args = (
                *NO_PERSISTENCE,
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            )  # fmt: skip
            node = RedisProcess(args, cluster_port(), str(directory))
            stack.callback(node.stop)
            nodes.append(node)
        subprocess.run(
            [
                cli, "--cluster", "create", *(n.address for n in nodes),
                "--cluster-replicas", str(replicas), "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        cluster = LocalCluster(nodes)
        cluster.wait_settled()
        if replicas:
            _wait_replicas_synced(cluster)
        yield cluster


def _wait_replicas_synced(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        roles = [_client(n).info("replication") for n in cluster.nodes]
        if all(
            r["role"] == "master" or r.get("master_link_status") == "up" for r in roles
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the replicas did not sync")
        time.sleep(0.1)
