"""The ``redis`` client for a ``--output-rate-store`` URL (``pacing.store_url``):
one server, a Redis Cluster or a Sentinel-managed master. Every call fails
after the timeout instead of waiting and is never retried by the client (the
claimer tries again on its next pass); the password comes apart from the URL,
so it need not appear on a command line.

Nothing here connects: an unreachable store is the claimer's degraded mode,
not a failed start. A cluster client reads the cluster's layout when it is
built, so ``LazyCluster`` builds it on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from pacing.store_url import StoreAddress, Topology, parse_url

#: Socket timeouts: the claimer would rather report a slow store than wait on it.
DEFAULT_TIMEOUT_S = 0.05


class LazyCluster:
    """A ``RedisCluster`` built on first ``get``: building one reads the
    cluster's layout, which raises while no node answers."""

    def __init__(self, build: Callable[[], RedisCluster]) -> None:
        self._build = build
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def get(self) -> RedisCluster:
        """The client, built now if not yet (raises what building raises)."""
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client


Client = redis.Redis | RedisCluster | LazyCluster


def connect(
    url: str, *, password: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Client:
    """A client for ``url`` (see the module docstring)."""
    address = parse_url(url)
    timeouts: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    names = {"ssl_check_hostname": address.check_hostname} if address.tls else {}
    if address.topology is Topology.SERVER:
        return redis.Redis.from_url(
            address.redis_py_url, password=password, **timeouts, **names
        )
    tls: dict[str, Any] = (
        {"ssl": True, **address.tls_files, **names} if address.tls else {}
    )
    auth = {"username": address.username, "password": password}
    if address.topology is Topology.CLUSTER:
        return LazyCluster(lambda: _cluster(address, {**timeouts, **tls, **auth}))
    # Typed as Any: redis-py annotates Sentinel in some releases and not in
    # others, and its master_for keyword types differ between them.
    sentinel_class: Any = Sentinel
    sentinel = sentinel_class(list(address.nodes), sentinel_kwargs={**timeouts, **tls})
    assert address.master is not None  # parse_url requires one
    master: redis.Redis = sentinel.master_for(
        address.master, db=address.db, **timeouts, **tls, **auth
    )
    return master


def _cluster(address: StoreAddress, kwargs: dict[str, Any]) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[
            ClusterNode(host, port)  # type: ignore[no-untyped-call]
            for host, port in address.nodes
        ],
        # Served slots work while a failed master's are taken over.
        require_full_coverage=False,
        **kwargs,
    )
