"""Many commands over a Redis Cluster in one round trip: one pipeline per shard
(the master serving the commands' slots), every shard's pipeline sent before
any answer is read, so the pass waits about as long as the slowest shard, not
the sum. redis-py's own cluster pipeline refuses ``EVALSHA``, which is all the
claimer sends.

Redirections are followed here, at most ``MAX_REDIRECTS`` times per command:
``MOVED`` (the slot has a new master: the client's slot table is patched, the
command sent there) and ``ASK`` (the slot is being migrated and the key is
already on the importing master: the command is sent there after ``ASKING``).
A shard that does not answer fails the whole call (``ConnectionError`` or
``TimeoutError``) after its connections are dropped and the cluster's layout is
read again, so that the next call reaches a master promoted meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ConnectionError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError,
)

#: Redirections followed per command before its error reply is the answer.
MAX_REDIRECTS = 2

#: A command: the key that routes it, and its arguments as sent.
Command = tuple[str, tuple[Any, ...]]


class ShardedPipelines:
    """Runs commands over ``client``'s cluster; see the module docstring."""

    def __init__(self, client: RedisCluster) -> None:
        # Any: redis-py leaves most of the cluster client's methods unannotated.
        self._client: Any = client

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """Every command's answer, in order; an error reply is its exception
        (a ``ResponseError``) in the list."""
        results: list[Any] = [None] * len(commands)
        targets = {
            i: (self._client.get_node_from_key(key), False)
            for i, (key, _) in enumerate(commands)
        }
        for _ in range(MAX_REDIRECTS + 1):
            try:
                self._send(commands, targets, results)
            except (ConnectionError, TimeoutError):
                self._relearn()
                raise
            targets = {}
            for i, result in enumerate(results):
                if isinstance(result, MovedError):
                    self._client.nodes_manager.move_slot(result)
                    targets[i] = (self._node(result), False)
                elif isinstance(result, AskError):
                    targets[i] = (self._node(result), True)
            if not targets:
                break
        return results

    def on_every_master(self, command: tuple[Any, ...]) -> None:
        """Runs ``command`` on every master (loading a script); raises the
        first error."""
        for node in self._client.get_primaries():
            self._client.get_redis_connection(node).execute_command(*command)

    def _node(self, redirect: AskError) -> ClusterNode:
        name = f"{redirect.host}:{redirect.port}"
        node: ClusterNode | None = self._client.nodes_manager.get_node(node_name=name)
        if node is None:  # a master the client has not seen yet
            self._client.nodes_manager.initialize()
            node = self._client.nodes_manager.get_node(node_name=name)
        if node is None:
            raise RedisClusterException(f"redirected to unknown node {name}")
        return node

    def _send(
        self,
        commands: Sequence[Command],
        targets: dict[int, tuple[ClusterNode, bool]],
        results: list[Any],
    ) -> None:
        """Sends the ``targets`` commands, one pipeline per node, and reads the
        answers into ``results``."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, (node, _) in targets.items():
            by_node.setdefault(node.name, (node, []))[1].append(i)
        taken: list[tuple[Any, Any, list[int]]] = []
        failed = True
        try:
            for node, indices in by_node.values():
                pool = self._client.get_redis_connection(node).connection_pool
                connection = pool.get_connection()
                taken.append((pool, connection, indices))
                packed: list[tuple[Any, ...]] = []
                for i in indices:
                    if targets[i][1]:
                        packed.append(("ASKING",))
                    packed.append(commands[i][1])
                connection.send_packed_command(connection.pack_commands(packed))
            for _, connection, indices in taken:
                for i in indices:
                    if targets[i][1]:
                        connection.read_response()  # ASKING's OK
                    try:
                        results[i] = connection.read_response()
                    except ResponseError as error:
                        results[i] = error
            failed = False
        finally:
            for pool, connection, _ in taken:
                if failed:  # a broken socket, or answers left unread
                    connection.disconnect()
                pool.release(connection)

    def _relearn(self) -> None:
        """Reads the cluster's layout again (best effort: the next call tries
        again)."""
        with suppress(RedisError, RedisClusterException):
            self._client.nodes_manager.initialize()
