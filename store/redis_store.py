"""The Redis side of the global budget: a thin wrapper over a ``redis`` client
(``store.clients``: one server, a Sentinel-managed master or a Redis Cluster)
that runs the store's scripts, many per round trip (over a cluster, one
pipeline per shard, sent together: ``store.shards``), and turns every failure
into ``StoreError``.

Key layout (``KeySpace``; the prefix is ``output_rate``, or
``output_rate:FLEET`` for a named fleet: ``KeySpace.of_fleet``):

- ``output_rate:user:{alice}``: alice's GCRA cell (``store.cell``); the hash tag
  is the user id, so users spread over a cluster's slots;
- ``output_rate:team:{acme}``: team acme's cell (``pacing.teams``), claimed by
  each engine's second claimer (``KeySpace(cells="team")``);
- ``output_rate:prompt:{alice}`` and ``output_rate:prompt-team:{acme}``: the
  prompt budgets' cells (``pacing.prompt_budget``: ``cells="prompt"`` and
  ``"prompt-team"``), at the prompts' 1 s tolerance, each claimed by a
  claimer of its own while some holder has a prompt rate (``store.runtime``);
- ``{output_rate}:limits``: the limits table, a hash of ``version``,
  ``stamp`` and ``document`` (``store.limits_table``); changes are published
  on the channel ``output_rate:limits``;
- ``{output_rate}:engines``: live engines, a sorted set of engine ids scored by
  when their heartbeat runs out (Redis time, ms).

Every script touches only the one key it declares, so each runs within one
slot of a cluster (the two ``{output_rate}`` keys share a slot as well: a
fleet's prefix is their hash tag whole, and holds no brace).

Scripts run by ``EVALSHA``; a server that does not know one (restarted, or
flushed, or a replica promoted) gets them all loaded (on every master of a
cluster), then the calls that failed are run again (two
more round trips).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from pacing.claims import Request
from pacing.global_limits import LimitsVersion
from pacing.limiter import DEFAULT_BURST_NS, MAX_RATE
from pacing.policy.model import Policy
from pacing.store_url import validate_fleet
from store import cell, limits_table
from store.clients import Client, LazyCluster
from store.shards import ShardedPipelines

T = TypeVar("T")

#: What a failed call raises: a ``RedisError``, or a cluster whose layout no
#: node gave (redis-py's cluster errors are not all ``RedisError``).
_FAILURES = (RedisError, RedisClusterException)

#: KEYS[1]: the engines' sorted set. ARGV: engine id, heartbeat lifetime (ms).
#: Drops the engines whose heartbeat ran out, renews this one and returns how
#: many are live. The set itself expires with the last heartbeat.
HEARTBEAT: Final = """
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now_ms))
redis.call('ZADD', KEYS[1], string.format('%.0f', now_ms + ttl), ARGV[1])
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', ttl))
return redis.call('ZCARD', KEYS[1])
"""


class StoreError(Exception):
    """The store did not serve a call: unreachable, too slow (a timeout) or
    refusing (a Redis error reply)."""


class StaleLimits(Exception):
    """A limits write named a version that is no longer the current one."""

    def __init__(self, current: LimitsVersion) -> None:
        super().__init__(f"the limits table is at version {current}")
        self.current = current


#: ``write_limits``' expected version where there must be no table yet.
NO_TABLE: Final = LimitsVersion(0, "")


#: The prefix of every key and channel of a store without fleets.
DEFAULT_PREFIX = "output_rate"


@dataclass(frozen=True)
class KeySpace:
    """The names of the store's keys and channel, under ``prefix``: every key
    starts with it, or with it as a hash tag (``{prefix}``)."""

    prefix: str = DEFAULT_PREFIX
    #: What the cells are kept for: ``user`` or ``team``, ``prompt`` or
    #: ``prompt-team`` (team names follow the user-id rule, and a user's
    #: prompt cell is not its output cell, so the kinds need keys apart).
    cells: str = "user"

    @classmethod
    def of_fleet(cls, fleet: str | None) -> KeySpace:
        """Fleet ``fleet``'s keys, apart from every other fleet's and from
        those of a store without fleets (``None``: those, as before fleets)."""
        if fleet is None:
            return cls()
        return cls(f"{DEFAULT_PREFIX}:{validate_fleet(fleet)}")

    def __post_init__(self) -> None:
        if not self.prefix or "{" in self.prefix or "}" in self.prefix:
            raise ValueError(
                f"key prefix must be non-empty and hold no braces, got {self.prefix!r}"
            )

    def cell(self, user: str) -> str:
        return f"{self.prefix}:{self.cells}:{{{user}}}"

    @property
    def limits(self) -> str:
        return f"{{{self.prefix}}}:limits"

    @property
    def engines(self) -> str:
        return f"{{{self.prefix}}}:engines"

    @property
    def limits_channel(self) -> str:
        return f"{self.prefix}:limits"


@dataclass(frozen=True)
class Grant:
    """A claim's answer."""

    granted: int
    available: int  #: what the cell could still grant at once after it
    debt: int  #: the cell's debt after it, in micro-tokens (``store.cell``)
    server_time_us: int  #: Redis time the cell was read at
    #: 0 when ``available`` > 0, else how long until the cell grants again
    retry_after_ns: int


@dataclass(frozen=True)
class Returned:
    """A return's answer."""

    debt: int  #: the cell's debt after it, in micro-tokens
    server_time_us: int  #: Redis time the cell was changed at


@dataclass
class Exchange:
    """One round trip's answers: a grant per claim, the cell after each return,
    and the live engines' count when a heartbeat went along."""

    grants: dict[str, Grant] = field(default_factory=dict)
    returned: dict[str, Returned] = field(default_factory=dict)
    live_engines: int | None = None


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_CLAIM = _Script(cell.CLAIM)
_RETURN = _Script(cell.RETURN)
_PUT_LIMITS = _Script(limits_table.PUT)
_HEARTBEAT = _Script(HEARTBEAT)
_SCRIPTS = (_CLAIM, _RETURN, _PUT_LIMITS, _HEARTBEAT)

_Call = tuple[_Script, Sequence[str], Sequence[str | int]]


class RedisStore:
    """The store's operations over one ``redis`` client (thread-safe as the
    client is: its connection pool hands each call its own connection).

    ``tolerance_ns`` is the cells' delay variation tolerance (the burst);
    every engine of one deployment must use the same.
    """

    def __init__(
        self,
        client: Client,
        *,
        keys: KeySpace | None = None,
        tolerance_ns: int = DEFAULT_BURST_NS,
    ) -> None:
        if tolerance_ns < 0 or tolerance_ns % 1000:
            raise ValueError(
                "tolerance_ns must be a non-negative whole number of "
                f"microseconds, got {tolerance_ns}"
            )
        self._client = client
        self._shards: ShardedPipelines | None = None
        self.keys = keys or KeySpace()
        self._tolerance_us = tolerance_ns // 1000
        #: Round trips made (a batch is one, loading scripts one more).
        self.round_trips = 0

    # -- the cells -------------------------------------------------------------

    def exchange(
        self,
        claims: Mapping[str, Request],
        returns: Mapping[str, Request],
        heartbeat: tuple[str, int] | None = None,
    ) -> Exchange:
        """Claims and returns tokens for many users in one round trip, with the
        heartbeat ``(engine id, lifetime ns)`` when given. Raises StoreError
        when any of it failed (the claims' tokens may or may not have been
        granted: the caller treats them as lost)."""
        for request in (*claims.values(), *returns.values()):
            if request.tokens < 0 or not 1 <= request.rate <= MAX_RATE:
                raise ValueError(
                    f"need tokens >= 0 and rate in 1..{MAX_RATE}: {request}"
                )
        calls: list[_Call] = []
        for user, request in claims.items():
            calls.append(
                (
                    _CLAIM,
                    [self.keys.cell(user)],
                    [request.tokens, request.rate, self._tolerance_us],
                )
            )
        for user, request in returns.items():
            calls.append(
                (_RETURN, [self.keys.cell(user)], [request.tokens, request.rate])
            )
        if heartbeat is not None:
            engine, lifetime_ns = heartbeat
            calls.append(
                (_HEARTBEAT, [self.keys.engines], [engine, -(-lifetime_ns // 10**6)])
            )
        results = iter(self._run(calls))
        answer = Exchange()
        for user, request in claims.items():
            granted, available, debt, now_s, now_us = next(results)
            answer.grants[user] = Grant(
                granted=granted,
                available=available,
                debt=debt,
                server_time_us=now_s * 10**6 + now_us,
                retry_after_ns=cell.retry_after_ns(
                    available, debt, request.rate, self._tolerance_us
                ),
            )
        for user in returns:
            debt, now_s, now_us = next(results)
            answer.returned[user] = Returned(debt, now_s * 10**6 + now_us)
        if heartbeat is not None:
            answer.live_engines = next(results)
        return answer

    def claim(self, user: str, tokens: int, rate: int) -> Grant:
        """Claims up to ``tokens`` for ``user`` limited to ``rate`` tokens/s."""
        return self.exchange({user: Request(tokens, rate)}, {}).grants[user]

    def peek(self, user: str, rate: int) -> Grant:
        """Reads ``user``'s cell (a claim of 0 tokens)."""
        return self.claim(user, 0, rate)

    def give_back(self, user: str, tokens: int, rate: int) -> Returned:
        """Returns ``tokens`` of ``user``'s to its cell."""
        return self.exchange({}, {user: Request(tokens, rate)}).returned[user]

    # -- engines -----------------------------------------------------------------

    def heartbeat(self, engine: str, lifetime_ns: int) -> int:
        """Marks ``engine`` live for ``lifetime_ns``; how many engines are live."""
        live = self.exchange({}, {}, (engine, lifetime_ns)).live_engines
        assert live is not None  # a heartbeat always answers with the count
        return live

    def leave(self, engine: str) -> None:
        """Marks ``engine`` gone at once (a clean shutdown)."""
        self._call(lambda: self._redis().zrem(self.keys.engines, engine))

    # -- the limits table ----------------------------------------------------------

    def read_limits(self) -> tuple[LimitsVersion, Policy] | None:
        """The stored limits table and its version; ``None`` when there is none.
        Raises ValueError for a document that breaks the table's rules."""
        counter, stamp, document = self._call(
            lambda: self._redis().hmget(
                self.keys.limits, "version", "stamp", "document"
            )
        )
        if counter is None or document is None:
            return None
        return _version(counter, stamp), limits_table.decode(document)

    def limits_version(self) -> LimitsVersion | None:
        """The stored limits table's version alone (``None``: there is none): a
        cheap check before reading a document that may be megabytes."""
        counter, stamp = self._call(
            lambda: self._redis().hmget(self.keys.limits, "version", "stamp")
        )
        return None if counter is None else _version(counter, stamp)

    def write_limits(
        self,
        policy: Policy,
        expected: LimitsVersion | None,
        *,
        count_past: int = 0,
    ) -> LimitsVersion:
        """Replaces the limits table by ``policy`` (its mode and fair-share
        switch set: ``store.limits_table.encode``) and publishes the new
        version, which it returns: a fresh stamp, and a counter past the
        current one and past ``count_past``. With ``expected``, only if that is
        still the current version (else StaleLimits, carrying the current one);
        ``NO_TABLE`` writes only where there is no table yet."""
        if expected is None:
            expected_args = ["", ""]
        else:
            expected_args = [str(expected.counter), expected.stamp]
        (result,) = self._run(
            [
                (
                    _PUT_LIMITS,
                    [self.keys.limits],
                    [
                        *expected_args,
                        secrets.token_hex(8),
                        count_past,
                        limits_table.encode(policy),
                        self.keys.limits_channel,
                    ],
                )
            ]
        )
        written, counter, stamp = result
        version = _version(counter, stamp)
        if not written:
            raise StaleLimits(version)
        return version

    def subscribe_limits(self) -> LimitsSubscription:
        """A subscription to the limits table's new versions."""
        return self._call(
            lambda: LimitsSubscription(self._redis(), self.keys.limits_channel)
        )

    # -- helpers -------------------------------------------------------------------

    def _redis(self) -> redis.Redis | RedisCluster:
        """The client (a cluster's is built on first use, inside ``_call``)."""
        if isinstance(self._client, LazyCluster):
            return self._client.get()
        return self._client

    def _call(self, call: Callable[[], T]) -> T:
        try:
            result = call()
        except _FAILURES as error:
            raise StoreError(f"{type(error).__name__}: {error}") from error
        self.round_trips += 1
        return result

    def _run(self, calls: Sequence[_Call]) -> list[Any]:
        """Runs the script calls in one round trip, in order; loads the scripts
        the server does not know and runs their calls again."""
        results = self._call(lambda: self._pipeline(calls))
        missing = [
            i for i, result in enumerate(results) if isinstance(result, NoScriptError)
        ]
        if missing:
            self._call(self._load_scripts)
            again = self._call(lambda: self._pipeline([calls[i] for i in missing]))
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise StoreError(f"{type(result).__name__}: {result}") from result
        return results

    def _load_scripts(self) -> None:
        """Loads every script (one round trip per master): a server that forgot
        one has forgotten them all."""
        client = self._redis()
        if isinstance(client, RedisCluster):
            shards = self._sharded(client)
            for script in _SCRIPTS:
                shards.on_every_master(("SCRIPT", "LOAD", script.source))
            return
        pipe = client.pipeline(transaction=False)
        for script in _SCRIPTS:
            pipe.script_load(script.source)
        pipe.execute()

    def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        client = self._redis()
        if isinstance(client, RedisCluster):
            return self._sharded(client).run(
                [
                    (keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args))
                    for script, keys, args in calls
                ]
            )
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        results: list[Any] = pipe.execute(raise_on_error=False)
        return results

    def _sharded(self, client: RedisCluster) -> ShardedPipelines:
        if self._shards is None:
            self._shards = ShardedPipelines(client)
        return self._shards


def _version(counter: bytes | str | int, stamp: bytes | str | None) -> LimitsVersion:
    """A version as Redis returned it (a table written without a stamp has
    the empty one)."""
    if isinstance(stamp, bytes):
        stamp = stamp.decode("ascii", "replace")
    return LimitsVersion(int(counter), stamp or "")


class LimitsSubscription:
    """New versions of the limits table, as published by ``write_limits``."""

    def __init__(self, client: redis.Redis | RedisCluster, channel: str) -> None:
        # redis-py annotates pubsub() from 8.2 on and leaves it unannotated
        # before: the ignore is needed with one and unused with the other.
        self._pubsub = client.pubsub(  # type: ignore[no-untyped-call, unused-ignore]
            ignore_subscribe_messages=True
        )
        self._pubsub.subscribe(channel)

    def next_version(self, timeout_s: float) -> int | None:
        """The next published version, or ``None`` after ``timeout_s`` without
        one. Raises StoreError when the connection failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            # None also for the subscription's own confirmation: read on.
            try:
                message = self._pubsub.get_message(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except _FAILURES as error:
                raise StoreError(f"{type(error).__name__}: {error}") from error
            if message is not None:
                return int(message["data"])
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self._pubsub.close()
