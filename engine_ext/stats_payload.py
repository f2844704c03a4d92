"""The output-rate metrics payload: what the engine-core scheduler adds to each
``SchedulerStats`` for the API process to export (pure: no vLLM, no Prometheus).

Transport: vLLM sends ``SchedulerStats`` from the engine core to the API process
inside every ``EngineCoreOutputs`` (msgpack). Its ``kv_connector_stats`` field is an
untyped ``dict[str, Any]`` that only KV connectors fill, and KV connectors are
refused with pacing on, so the payload travels there under ``PAYLOAD_KEY``. The API
process's stat logger (``engine_ext.metrics``) removes it again before vLLM's own
loggers look at the field: vLLM's logging stat logger crashes on a non-empty
``kv_connector_stats`` when no connector is configured.

Semantics: counters are *deltas* since the previous payload, exactly like vLLM's own
prefix-cache stats. vLLM hands each step's stats to one API process only, so with
several API processes only deltas add up right (Prometheus sums them); a payload is
built once per engine step. Gauges are current values.

Cardinality: a ``user`` label exists only for users with an explicit limit (the
operator's limits table, never ids taken from requests), at most
``max_labelled_users`` of them; every other user's events are reported under
``OTHER_USER``. The labelled set is sticky: a labelled user keeps the label while
their explicit limit exists, new ones are admitted in name order while room is left.
Tiers are labelled the same way (every tier that exists, at most
``MAX_LABELLED_TIERS``; the rest under ``OTHER_TIER``); a tier's counters sum its
members' events, each event counted in the tier its user belongs to when the
payload is built, and users in no tier are in no tier's counters.

Store: with a global store configured (``SharedLimiter.store_stats``), the
payload carries the engine's store traffic (``pacing.store_stats``): round trips
by result, their latency per fixed bucket as (count, total ns) deltas (each
bucket's mean lies within it, so the API process can replay the bucket exactly),
tokens claimed, granted and returned as deltas, and the degraded flag and live
engines as gauges. Without a store the entry is ``None`` and no store series
exist.

Cost: one build is O(labelled users) without tiers; with tiers it also reads the
counters of every user the accounting holds (those with live requests or recent
events), once: O(users).

Encoding: the payload holds plain data only (dicts, lists, str, int, float, None)
and every string in it encodes as strict UTF-8, because vLLM's msgpack encoder
raises on anything else and that would end its output thread. User ids are
validated at every entry point (``pacing.identity``); as a second line, a user
whose id does not encode is never labelled (counted under ``OTHER_USER``) and an
RPC method name that does not encode counts as ``OTHER_METHOD``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from pacing.accounting import Accounting, UserCounters
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode, parse_mode
from pacing.settings import DEFAULT_MAX_LABELLED_USERS
from pacing.shared import ControlPlaneSnapshot
from pacing.store_stats import LATENCY_BUCKETS_NS, StoreStats

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import SchedulerStats

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Key of the payload inside ``SchedulerStats.kv_connector_stats``.
PAYLOAD_KEY = "output_rate"
#: Bumped whenever the payload's shape changes; a mismatch is rejected.
PAYLOAD_VERSION = 3
#: The ``user`` label value of every user without a label of their own.
OTHER_USER = "__other__"
#: The ``tier`` label value of every tier without a label of its own.
OTHER_TIER = "__other__"
#: Most tiers with a ``tier`` label of their own. Tiers are the operator's, so
#: few; the cap holds should a control-plane client create many.
MAX_LABELLED_TIERS = 100
#: The ``user`` label value of the default limit in the limits gauge.
DEFAULT_LIMIT_USER = "__default__"
#: Idle waits kept between two payloads. One payload is built per engine step and
#: there is at most one idle wait per step, so this bounds memory only when
#: payloads stop being collected (e.g. stats logging turned off).
MAX_PENDING_IDLE_WAITS = 1024
#: The ``method`` label value of an RPC method name that does not encode.
OTHER_METHOD = "__other__"
#: gRPC status code names (``grpc.StatusCode.X.name``); anything else is UNKNOWN.
GRPC_CODES = frozenset(
    {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)
RELOAD_RESULTS = ("success", "failure")
#: Results of a store round trip, as carried and exported.
STORE_RESULTS = ("ok", "error")
#: Store token counters, as carried and exported.
STORE_TOKENS = ("claimed", "granted", "returned")
#: Label values with a meaning of their own; a user so named is never labelled.
_RESERVED_LABELS = frozenset({OTHER_USER, DEFAULT_LIMIT_USER})
#: The per-user counters carried, in ``UserCounters`` field names.
COUNTER_FIELDS = tuple(f.name for f in fields(UserCounters))
#: A user's counters as a tuple in ``COUNTER_FIELDS`` order (one C call).
_counter_values = attrgetter(*COUNTER_FIELDS)
_ZEROS = (0,) * len(COUNTER_FIELDS)


class PayloadError(ValueError):
    """A payload is malformed; the message names the field."""


class FailureLog:
    """Reports failures of our code where vLLM calls it (a step's stats, the API
    process's stat logger), which must be caught there rather than raised into
    vLLM's thread. A failure may repeat on every engine step, so the traceback is
    logged at the 1st, 2nd, 4th, 8th, ... failure: log2(n) lines for n."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        #: Failures so far.
        self.count = 0

    def record(self) -> None:
        """Counts one failure; logs the exception being handled (call it from an
        ``except`` block) when the count is a power of two."""
        self.count += 1
        if self.count & (self.count - 1) == 0:
            self._log.exception(
                "%s (failure %d; logged at failures 1, 2, 4, 8, ...)",
                self._what,
                self.count,
            )


# -- the payload --------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """One parsed payload: deltas since the previous one, and current gauges."""

    #: label -> {counter field -> delta}; only non-zero deltas.
    users: Mapping[str, Mapping[str, int]]
    #: label -> tokens/s of every labelled user (the complete labelled set).
    limits: Mapping[str, int]
    default_limit: int | None
    throttled_requests: int
    tracked_users: int
    idle_waits_s: tuple[float, ...]
    limit_changes: int
    config_reloads: Mapping[str, int]
    control_rpcs: Mapping[tuple[str, str], int]
    mode: Mode
    #: label -> tokens/s of each member of every labelled tier (the complete
    #: labelled set); 0 for an exempt tier (unlimited).
    tiers: Mapping[str, int]
    #: tier label -> {counter field -> delta}; only non-zero deltas.
    tier_counters: Mapping[str, Mapping[str, int]]
    #: The store's part; ``None`` without a store.
    store: StorePart | None


@dataclass(frozen=True)
class StorePart:
    """A payload's store traffic: deltas since the previous payload, and
    current gauges (``pacing.store_stats``)."""

    #: result (``STORE_RESULTS``) -> round trips
    round_trips: Mapping[str, int]
    #: per bucket of ``LATENCY_BUCKETS_NS`` (then one past the last bound):
    #: (round trips, their total latency in ns)
    latency_ns: tuple[tuple[int, int], ...]
    #: ``STORE_TOKENS`` name -> tokens
    tokens: Mapping[str, int]
    degraded: bool
    live_engines: int


class _Labels:
    """Names with a label of their own: at most ``cap``, sticky (a name keeps
    its label while it stays eligible), new ones admitted in name order while
    room is left. Reserved label values and names that do not encode are never
    labelled."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self.names: dict[str, None] = {}  # insertion-ordered set

    def update(self, eligible: Collection[str]) -> list[str]:
        """Labels from ``eligible`` (a set or a mapping's keys); returns the
        names that lost their label."""
        lost = [name for name in self.names if name not in eligible]
        for name in lost:
            del self.names[name]
        if len(self.names) < self._cap:
            candidates = (
                name
                for name in eligible
                if name not in self.names
                and name not in _RESERVED_LABELS
                and _encodable(name)
            )
            for name in sorted(candidates):
                if len(self.names) >= self._cap:
                    break
                self.names[name] = None
        return lost


class PayloadBuilder:
    """Turns the scheduler's cumulative counters into per-step payloads.

    Owned by the scheduler (engine-core thread only, like the limiter), except
    that ``observe_idle_wait`` is called by the engine loop on the same thread.
    """

    def __init__(
        self,
        max_labelled_users: int = DEFAULT_MAX_LABELLED_USERS,
        max_labelled_tiers: int = MAX_LABELLED_TIERS,
    ) -> None:
        self._users = _Labels(max_labelled_users)
        self._tiers = _Labels(max_labelled_tiers)
        self._last: dict[str, UserCounters] = {}
        self._last_total = UserCounters()
        #: user -> (its counters object, their values) at the previous build,
        #: for every user the accounting held; None while no tier exists.
        self._tier_seen: dict[str, tuple[UserCounters, tuple[int, ...]]] | None = None
        self._last_control = ControlPlaneSnapshot()
        self._idle_waits: list[float] = []
        #: The store stats reported last and a copy of their values then.
        self._store_source: StoreStats | None = None
        self._last_store = StoreStats()
        self._built_once = False
        #: Where the scheduler reports a failed build (the step's stats then go
        #: to the API process without a payload).
        self.failures = FailureLog(
            logger, "output-rate metrics payload not built; stats sent without it"
        )

    @property
    def labelled_users(self) -> list[str]:
        """Users that currently have their own ``user`` label."""
        return list(self._users.names)

    def observe_idle_wait(self, seconds: float) -> None:
        """Records one idle wait of the engine loop (time actually blocked)."""
        if len(self._idle_waits) < MAX_PENDING_IDLE_WAITS:
            self._idle_waits.append(float(seconds))

    def build(
        self,
        *,
        accounting: Accounting,
        user_rates: Mapping[str, int],
        default_rate: int | None,
        throttled_requests: int,
        tracked_users: int,
        control: ControlPlaneSnapshot | None = None,
        mode: Mode = Mode.ENFORCE,
        limiter: OutputRateLimiter | None = None,
        store: StoreStats | None = None,
    ) -> dict[str, Any]:
        """The payload for this step: counter deltas since the previous ``build``
        (labelled users from ``user_rates``, the rest as ``OTHER_USER``), the
        labelled users' limits, the given gauges and ``mode``, with
        ``limiter`` (whose table says the tiers and their members) the tiers'
        limits and counter deltas, and with ``store`` (read under the lock its
        recorder holds) the store's part.

        Assumes ``accounting`` keeps labelled users' counters; if it forgot one
        and the user came back, the new counts are taken as a fresh start.
        """
        for user in self._users.update(user_rates):
            self._last.pop(user, None)
        first = not self._built_once
        self._built_once = True

        users: dict[str, dict[str, int]] = {}
        labelled_sum = UserCounters()
        for user in self._users.names:
            now = accounting.of(user)
            before = self._last.get(user)
            if before is None:
                # Labelled since the first build: everything counts. Labelled
                # later (new explicit limit): earlier events were already
                # reported under OTHER_USER.
                before = UserCounters() if first else now
            delta = _delta(now, before)
            self._last[user] = now
            labelled_sum.add(delta)
            if row := _nonzero(delta):
                users[user] = row

        total = _copy(accounting.total)
        other = _delta(total, self._last_total)
        self._last_total = total
        other = UserCounters(
            **{
                name: max(0, getattr(other, name) - getattr(labelled_sum, name))
                for name in COUNTER_FIELDS
            }
        )
        if row := _nonzero(other):
            users[OTHER_USER] = row

        tiers, tier_counters = self._tier_part(accounting, limiter, first)

        # No snapshot means no control-plane news (not a reset to zero).
        control = self._last_control if control is None else _normalized(control)
        previous, self._last_control = self._last_control, control
        idle_waits, self._idle_waits = self._idle_waits, []
        return {
            "v": PAYLOAD_VERSION,
            "users": users,
            "limits": {user: int(user_rates[user]) for user in self._users.names},
            "default_limit": default_rate,
            "throttled_requests": int(throttled_requests),
            "tracked_users": int(tracked_users),
            "idle_waits_s": idle_waits,
            "limit_changes": max(0, control.limit_changes - previous.limit_changes),
            "config_reloads": _positive_deltas(
                control.config_reloads, previous.config_reloads
            ),
            "control_rpcs": [
                [method, code, n]
                for (method, code), n in _positive_deltas(
                    control.rpcs, previous.rpcs
                ).items()
            ],
            "mode": mode.value,
            "tiers": tiers,
            "tier_counters": tier_counters,
            "store": None if store is None else self._store_part(store),
        }

    def _store_part(self, store: StoreStats) -> dict[str, Any]:
        """The store's deltas since the previous build (from zero for a stats
        object not reported before) and its gauges."""
        if store is not self._store_source:
            self._store_source, self._last_store = store, StoreStats()
        now, before = _copy_store(store), self._last_store
        self._last_store = now
        return {
            "round_trips": {
                "ok": now.round_trips_answered - before.round_trips_answered,
                "error": now.round_trips_failed - before.round_trips_failed,
            },
            "latency_ns": [
                [count - count_before, total - total_before]
                for count, count_before, total, total_before in zip(
                    now.latency_counts,
                    before.latency_counts,
                    now.latency_sums_ns,
                    before.latency_sums_ns,
                    strict=True,
                )
            ],
            "tokens": {
                "claimed": now.tokens_claimed - before.tokens_claimed,
                "granted": now.tokens_granted - before.tokens_granted,
                "returned": now.tokens_returned - before.tokens_returned,
            },
            "degraded": int(now.degraded),
            "live_engines": int(now.live_engines),
        }

    def _tier_part(
        self, accounting: Accounting, limiter: OutputRateLimiter | None, first: bool
    ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        """The labelled tiers' limits (0: exempt) and every tier label's counter
        deltas: each user's events since the previous build go to the tier it
        is a member of now."""
        rates = {} if limiter is None else limiter.tier_rates
        exempt = frozenset() if limiter is None else limiter.exempt_tiers
        self._tiers.update(rates.keys() | exempt)
        tiers = {
            tier: 0 if tier in exempt else rates[tier] for tier in self._tiers.names
        }
        if limiter is None or not (rates or exempt):
            self._tier_seen = None  # no tier: nothing to count, nothing to keep
            return tiers, {}
        # While tiers were absent nobody was tracked: the events before this
        # build are nobody's tier events (except at the first build, which
        # reports everything since start-up).
        count_new = first or self._tier_seen is not None
        previous = self._tier_seen or {}
        memberships = limiter.memberships
        labelled = self._tiers.names
        seen: dict[str, tuple[UserCounters, tuple[int, ...]]] = {}
        # label -> the counter values of its members now, and at the last build
        nows: dict[str, list[tuple[int, ...]]] = {}
        thens: dict[str, list[tuple[int, ...]]] = {}
        for user, counters in accounting.by_user().items():
            values: tuple[int, ...] = _counter_values(counters)
            seen[user] = (counters, values)
            before = previous.get(user)
            if before is None:
                if not count_new:
                    continue
                base = _ZEROS  # its counters began after the previous build
            elif before[0] is not counters:
                base = _ZEROS  # forgotten, then counted again from zero
            else:
                base = before[1]
                if values == base:
                    continue
            tier = memberships.get(user)
            if tier is None:
                continue
            label = tier if tier in labelled else OTHER_TIER
            nows.setdefault(label, []).append(values)
            thens.setdefault(label, []).append(base)
        self._tier_seen = seen
        counters_by_tier: dict[str, dict[str, int]] = {}
        for label, values_now in nows.items():
            # Column sums in C rather than a Python loop per user and field.
            columns_now = zip(*values_now, strict=True)
            columns_then = zip(*thens[label], strict=True)
            row = {
                name: sum(now) - sum(then)
                for name, now, then in zip(
                    COUNTER_FIELDS, columns_now, columns_then, strict=True
                )
            }
            if row := {name: delta for name, delta in row.items() if delta}:
                counters_by_tier[label] = row
        return tiers, counters_by_tier


def attach(scheduler_stats: SchedulerStats, payload: dict[str, Any]) -> None:
    """Puts ``payload`` into ``scheduler_stats`` (a vLLM ``SchedulerStats``) for
    the trip to the API process, keeping anything a KV connector put there."""
    carried = dict(scheduler_stats.kv_connector_stats or {})
    carried[PAYLOAD_KEY] = payload
    scheduler_stats.kv_connector_stats = carried


def take_payload(scheduler_stats: SchedulerStats | None) -> object | None:
    """Removes and returns the raw payload from ``scheduler_stats`` (``None`` if it
    carries none), leaving ``kv_connector_stats`` as it was before ``attach``."""
    if scheduler_stats is None:
        return None
    carried = scheduler_stats.kv_connector_stats
    if not carried or PAYLOAD_KEY not in carried:
        return None
    raw: object = carried.pop(PAYLOAD_KEY)
    if not carried:
        scheduler_stats.kv_connector_stats = None
    return raw


def parse(raw: object) -> Payload:
    """Validates a payload as built by ``PayloadBuilder.build`` (after a msgpack
    round trip: tuples arrive as lists); raises ``PayloadError`` naming the first
    offending field."""
    if not isinstance(raw, Mapping):
        raise PayloadError(f"payload must be an object, got {type(raw).__name__}")
    if raw.get("v") != PAYLOAD_VERSION:
        raise PayloadError(
            f"payload version {raw.get('v')!r} is not {PAYLOAD_VERSION}: engine core "
            "and API process run different engine_ext versions"
        )
    limits = _str_int_map(raw.get("limits"), "limits")
    labels = set(limits) | {OTHER_USER}
    users = _counter_rows(raw.get("users"), "users", labels, OTHER_USER)
    default_limit = raw.get("default_limit")
    if default_limit is not None:
        default_limit = _int(default_limit, "default_limit")
    idle = raw.get("idle_waits_s")
    if not isinstance(idle, list | tuple) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in idle
    ):
        raise PayloadError("idle_waits_s must be a list of non-negative numbers")
    reloads = _str_int_map(raw.get("config_reloads"), "config_reloads")
    if not set(reloads) <= set(RELOAD_RESULTS):
        raise PayloadError(f"config_reloads keys must be among {RELOAD_RESULTS}")
    rpcs: dict[tuple[str, str], int] = {}
    rpcs_raw = raw.get("control_rpcs")
    if not isinstance(rpcs_raw, list | tuple):
        raise PayloadError("control_rpcs must be a list")
    for entry in rpcs_raw:
        if not (
            isinstance(entry, list | tuple)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[1] in GRPC_CODES
        ):
            raise PayloadError(f"control_rpcs entry {entry!r} is not [method, code, n]")
        rpcs[(entry[0], entry[1])] = _int(entry[2], "control_rpcs count")
    try:
        mode = parse_mode(raw.get("mode"), field="mode")
    except ValueError as exc:
        raise PayloadError(str(exc)) from None
    tiers = _str_int_map(raw.get("tiers"), "tiers")
    tier_counters = _counter_rows(
        raw.get("tier_counters"), "tier_counters", set(tiers) | {OTHER_TIER}, OTHER_TIER
    )
    if "store" not in raw:
        raise PayloadError("store must be an object or null")
    store_raw = raw["store"]
    store = None if store_raw is None else _parse_store(store_raw)
    return Payload(
        users=users,
        limits=limits,
        default_limit=default_limit,
        throttled_requests=_int(raw.get("throttled_requests"), "throttled_requests"),
        tracked_users=_int(raw.get("tracked_users"), "tracked_users"),
        idle_waits_s=tuple(float(x) for x in idle),
        limit_changes=_int(raw.get("limit_changes"), "limit_changes"),
        config_reloads=reloads,
        control_rpcs=rpcs,
        mode=mode,
        tiers=tiers,
        tier_counters=tier_counters,
        store=store,
    )


def _parse_store(raw: object) -> StorePart:
    """Validates the store's part of a payload (``PayloadBuilder._store_part``)."""
    if not isinstance(raw, Mapping):
        raise PayloadError("store must be an object or null")
    round_trips = _str_int_map(raw.get("round_trips"), "store.round_trips")
    if set(round_trips) != set(STORE_RESULTS):
        raise PayloadError(f"store.round_trips keys must be {STORE_RESULTS}")
    tokens = _str_int_map(raw.get("tokens"), "store.tokens")
    if set(tokens) != set(STORE_TOKENS):
        raise PayloadError(f"store.tokens keys must be {STORE_TOKENS}")
    latency = raw.get("latency_ns")
    if (
        not isinstance(latency, list | tuple)
        or len(latency) != len(LATENCY_BUCKETS_NS) + 1
    ):
        raise PayloadError(
            f"store.latency_ns must be a list of {len(LATENCY_BUCKETS_NS) + 1} "
            "[count, total ns] pairs"
        )
    buckets: list[tuple[int, int]] = []
    lower = -1  # latencies are >= 0: the first bucket holds 0
    for index, entry in enumerate(latency):
        name = f"store.latency_ns[{index}]"
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise PayloadError(f"{name} must be a [count, total ns] pair")
        count, total = _int(entry[0], name), _int(entry[1], name)
        upper = LATENCY_BUCKETS_NS[index] if index < len(LATENCY_BUCKETS_NS) else None
        # Replayed as count observations of their mean, which must be in it.
        if count == 0:
            inside = total == 0
        else:
            inside = total > lower * count and (upper is None or total <= upper * count)
        if not inside:
            raise PayloadError(f"{name}: {total} ns over {count} is not in its bucket")
        buckets.append((count, total))
        if upper is not None:
            lower = upper
    degraded = raw.get("degraded")
    if degraded not in (0, 1) or isinstance(degraded, bool):
        raise PayloadError(f"store.degraded must be 0 or 1, got {degraded!r}")
    return StorePart(
        round_trips=round_trips,
        latency_ns=tuple(buckets),
        tokens=tokens,
        degraded=bool(degraded),
        live_engines=_int(raw.get("live_engines"), "store.live_engines"),
    )


# -- helpers --------------------------------------------------------------------


def _copy(counters: UserCounters) -> UserCounters:
    copy = UserCounters()
    copy.add(counters)
    return copy


def _copy_store(stats: StoreStats) -> StoreStats:
    copy = replace(stats)
    copy.latency_counts = list(stats.latency_counts)
    copy.latency_sums_ns = list(stats.latency_sums_ns)
    return copy


def _delta(now: UserCounters, before: UserCounters) -> UserCounters:
    """``now - before`` per counter; a counter that went down restarted from zero
    (its owner forgot it), so its whole current value is new."""
    delta = UserCounters()
    for name in COUNTER_FIELDS:
        current, previous = getattr(now, name), getattr(before, name)
        setattr(delta, name, current - previous if current >= previous else current)
    return delta


def _nonzero(counters: UserCounters) -> dict[str, int]:
    return {
        name: value
        for name in COUNTER_FIELDS
        if (value := getattr(counters, name)) != 0
    }


def _normalized(snapshot: ControlPlaneSnapshot) -> ControlPlaneSnapshot:
    """``snapshot`` with label values ``parse`` accepts: unknown status codes
    become ``UNKNOWN``, method names that do not encode ``OTHER_METHOD``, unknown
    reload results are left out (one bad value must not get every later payload
    rejected, nor fail to encode)."""
    rpcs: dict[tuple[str, str], int] = {}
    for (method, code), count in snapshot.rpcs.items():
        key = (
            method if _encodable(method) else OTHER_METHOD,
            code if code in GRPC_CODES else "UNKNOWN",
        )
        rpcs[key] = rpcs.get(key, 0) + count
    return ControlPlaneSnapshot(
        limit_changes=snapshot.limit_changes,
        config_reloads={
            result: count
            for result, count in snapshot.config_reloads.items()
            if result in RELOAD_RESULTS
        },
        rpcs=rpcs,
    )


def _encodable(text: str) -> bool:
    """Whether ``text`` encodes as strict UTF-8 (no lone surrogates), as vLLM's
    msgpack encoder requires."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _positive_deltas(
    now: Mapping[Any, int], before: Mapping[Any, int]
) -> dict[Any, int]:
    return {
        key: value - before.get(key, 0)
        for key, value in now.items()
        if value > before.get(key, 0)
    }


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PayloadError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _counter_rows(
    value: object, name: str, labels: set[str], other: str
) -> dict[str, dict[str, int]]:
    """``value`` as label -> {counter field -> delta}, every label in ``labels``."""
    if not isinstance(value, Mapping):
        raise PayloadError(f"{name} must be an object")
    rows: dict[str, dict[str, int]] = {}
    for label, row in value.items():
        if label not in labels:
            raise PayloadError(
                f"{name} has label {label!r} that is neither labelled nor {other}"
            )
        counters = _str_int_map(row, f"{name}[{label!r}]")
        unknown = set(counters) - set(COUNTER_FIELDS)
        if unknown:
            raise PayloadError(
                f"{name}[{label!r}] has unknown counters {sorted(unknown)}"
            )
        rows[label] = counters
    return rows


def _str_int_map(value: object, name: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise PayloadError(f"{name} must be an object")
    result: dict[str, int] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PayloadError(f"{name} has a non-string key {key!r}")
        result[key] = _int(item, f"{name}[{key!r}]")
    return result
