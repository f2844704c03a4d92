"""The API-process side of the metrics payload (``engine_ext.stats_payload``):
``take_payload`` removes it from vLLM's ``SchedulerStats`` and ``parse``
validates it into a ``Payload`` (pure: no vLLM at run time, no Prometheus).

Invariant: ``parse`` accepts every payload ``engine_ext.payload_builder`` builds
(after a msgpack round trip) and raises ``PayloadError``, naming the first
offending field, on a malformed one. A counter row's label is one the same
payload declares (a labelled user, tier or team) or the catch-all
(``OTHER_USER``, ``OTHER_TIER``, ``OTHER_TEAM``), its counter names are
``COUNTER_FIELDS``, and its values are non-negative: whole numbers, finite
numbers for ``FLOAT_COUNTER_FIELDS`` (a net counter's too: the builder never
sends a decrease). A team's throttled members (and member time) never exceed
its streaming ones. The bands' part names two to ``MAX_BANDS`` distinct bands,
and every band it counts or measures is one of them; a fairness index is in
(0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ext.stats_payload import (
    COUNTER_FIELDS,
    FLOAT_COUNTER_FIELDS,
    GRPC_CODES,
    OTHER_TEAM,
    OTHER_TIER,
    OTHER_USER,
    PAYLOAD_KEY,
    PAYLOAD_VERSION,
    RELOAD_RESULTS,
    STORE_RESULTS,
    STORE_TOKENS,
)
from pacing.bands import MAX_BANDS
from pacing.modes import Mode, parse_mode
from pacing.store_stats import LATENCY_BUCKETS_NS

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import SchedulerStats


class PayloadError(ValueError):
    """A payload is malformed; the message names the field."""


# -- the payload --------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    """One parsed payload: deltas since the previous one, and current gauges."""

    #: label -> {counter field -> delta}; only non-zero deltas.
    users: Mapping[str, Mapping[str, float]]
    #: label -> tokens/s of every labelled user (the complete labelled set).
    limits: Mapping[str, int]
    default_limit: int | None
    #: label -> prompt tokens/s of every labelled user with a prompt rate of
    #: its own (a subset of ``limits``' labels).
    prompt_limits: Mapping[str, int]
    #: The default prompt rate; ``None`` without one.
    default_prompt_limit: int | None
    #: label -> the ceiling (tokens/s borrowed up to, ``pacing.ceilings``) of
    #: every labelled user with one (a subset of ``limits``' labels).
    ceiling_limits: Mapping[str, int]
    #: The default ceiling; ``None`` without one.
    default_ceiling_limit: int | None
    #: Whether a holder within its rate waited at this engine's last step
    #: start, so that no other holder borrowed; ``None`` while no holder has a
    #: ceiling (or pacing is off).
    borrowing_blocked: bool | None
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
    tier_counters: Mapping[str, Mapping[str, float]]
    #: label -> tokens/s shared by the members of every labelled team (the
    #: complete labelled set).
    teams: Mapping[str, int]
    #: team label -> {counter field -> delta}; only non-zero deltas.
    team_counters: Mapping[str, Mapping[str, float]]
    #: team label -> (members with live requests, those of them throttled) at
    #: this engine now: every label with a team series while any team exists.
    team_members: Mapping[str, tuple[int, int]]
    #: team label -> (member-ns streaming, member-ns throttled) deltas.
    team_member_ns: Mapping[str, tuple[int, int]]
    #: The store's part; ``None`` without a store.
    store: StorePart | None
    #: This engine's fair share; ``None`` when the engine sent none.
    fair_share: FairSharePart | None
    #: The priority bands; ``None`` while the policy has no bands.
    bands: BandsPart | None


@dataclass(frozen=True)
class BandsPart:
    """A payload's priority bands: deltas since the previous payload, and
    gauges of the engine that sent it."""

    #: The bands in force, highest first (every band with series).
    names: tuple[str, ...]
    #: band -> output tokens charged to its users; only non-zero deltas.
    tokens: Mapping[str, int]
    #: band -> ns its requests waited in the waiting queue; non-zero deltas.
    wait_ns: Mapping[str, int]
    #: band -> startable requests waiting at the engine's last step start,
    #: every band; ``None`` while pacing is off or nothing was counted.
    waiting: Mapping[str, int] | None
    #: band -> Jain's fairness index over its users with live requests, in
    #: (0, 1]; only bands with a user measured.
    fairness: Mapping[str, float]


@dataclass(frozen=True)
class FairSharePart:
    """A payload's fair share: gauges of the engine that sent it."""

    enabled: bool
    #: The largest weighted-service difference among the users backlogged at
    #: the engine's last step (``pacing.fair_share.FairShare.gap``).
    gap: float


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
    prompt_limits = _str_int_map(raw.get("prompt_limits"), "prompt_limits")
    if not set(prompt_limits) <= set(limits):
        unknown = sorted(set(prompt_limits) - set(limits))
        raise PayloadError(f"prompt_limits has users {unknown} that are not labelled")
    default_prompt_limit = raw.get("default_prompt_limit")
    if default_prompt_limit is not None:
        default_prompt_limit = _int(default_prompt_limit, "default_prompt_limit")
    ceiling_limits = _str_int_map(raw.get("ceiling_limits"), "ceiling_limits")
    if not set(ceiling_limits) <= set(limits):
        unknown = sorted(set(ceiling_limits) - set(limits))
        raise PayloadError(f"ceiling_limits has users {unknown} that are not labelled")
    default_ceiling_limit = raw.get("default_ceiling_limit")
    if default_ceiling_limit is not None:
        default_ceiling_limit = _int(default_ceiling_limit, "default_ceiling_limit")
    if "borrowing_blocked" not in raw:
        raise PayloadError("borrowing_blocked must be 0, 1 or null")
    blocked = raw["borrowing_blocked"]
    if blocked is not None and (blocked not in (0, 1) or isinstance(blocked, bool)):
        raise PayloadError(f"borrowing_blocked must be 0, 1 or null, got {blocked!r}")
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
    teams = _str_int_map(raw.get("teams"), "teams")
    team_labels = set(teams) | {OTHER_TEAM}
    team_counters = _counter_rows(
        raw.get("team_counters"), "team_counters", team_labels, OTHER_TEAM
    )
    team_members = _member_pairs(raw.get("team_members"), "team_members", team_labels)
    team_member_ns = _member_pairs(
        raw.get("team_member_ns"), "team_member_ns", team_labels
    )
    if "store" not in raw:
        raise PayloadError("store must be an object or null")
    store_raw = raw["store"]
    store = None if store_raw is None else _parse_store(store_raw)
    if "fair_share" not in raw:
        raise PayloadError("fair_share must be an object or null")
    fair_raw = raw["fair_share"]
    fair_share = None if fair_raw is None else _parse_fair_share(fair_raw)
    if "bands" not in raw:
        raise PayloadError("bands must be an object or null")
    bands_raw = raw["bands"]
    bands = None if bands_raw is None else _parse_bands(bands_raw)
    return Payload(
        users=users,
        limits=limits,
        default_limit=default_limit,
        prompt_limits=prompt_limits,
        default_prompt_limit=default_prompt_limit,
        ceiling_limits=ceiling_limits,
        default_ceiling_limit=default_ceiling_limit,
        borrowing_blocked=None if blocked is None else bool(blocked),
        throttled_requests=_int(raw.get("throttled_requests"), "throttled_requests"),
        tracked_users=_int(raw.get("tracked_users"), "tracked_users"),
        idle_waits_s=tuple(float(x) for x in idle),
        limit_changes=_int(raw.get("limit_changes"), "limit_changes"),
        config_reloads=reloads,
        control_rpcs=rpcs,
        mode=mode,
        tiers=tiers,
        tier_counters=tier_counters,
        teams=teams,
        team_counters=team_counters,
        team_members=team_members,
        team_member_ns=team_member_ns,
        store=store,
        fair_share=fair_share,
        bands=bands,
    )


def _parse_bands(raw: object) -> BandsPart:
    """Validates the bands' part of a payload (``PayloadBuilder._bands_part``)."""
    if not isinstance(raw, Mapping):
        raise PayloadError("bands must be an object or null")
    names = raw.get("names")
    if (
        not isinstance(names, list | tuple)
        or not 2 <= len(names) <= MAX_BANDS
        or not all(isinstance(name, str) and name for name in names)
        or len(set(names)) != len(names)
    ):
        raise PayloadError(
            f"bands.names must be a list of 2 to {MAX_BANDS} distinct band names"
        )
    known = set(names)

    def counted(value: object, name: str) -> dict[str, int]:
        counts = _str_int_map(value, name)
        if not set(counts) <= known:
            unknown = sorted(set(counts) - known)
            raise PayloadError(f"{name} has bands {unknown} that are not in names")
        return counts

    tokens = counted(raw.get("tokens"), "bands.tokens")
    wait_ns = counted(raw.get("wait_ns"), "bands.wait_ns")
    if "waiting" not in raw:
        raise PayloadError("bands.waiting must be an object or null")
    waiting = raw["waiting"]
    if waiting is not None:
        waiting = counted(waiting, "bands.waiting")
        if set(waiting) != known:
            raise PayloadError("bands.waiting must count every band in names")
    fairness_raw = raw.get("fairness")
    if not isinstance(fairness_raw, Mapping):
        raise PayloadError("bands.fairness must be an object")
    fairness: dict[str, float] = {}
    for band, value in fairness_raw.items():
        where = f"bands.fairness[{band!r}]"
        if band not in known:
            raise PayloadError(f"bands.fairness has band {band!r} that is not in names")
        index = _number(value, where)
        if not 0 < index <= 1:
            raise PayloadError(f"{where} must be in (0, 1], got {value!r}")
        fairness[band] = index
    return BandsPart(
        names=tuple(names),
        tokens=tokens,
        wait_ns=wait_ns,
        waiting=waiting,
        fairness=fairness,
    )


def _parse_fair_share(raw: object) -> FairSharePart:
    """Validates the fair-share part of a payload (``PayloadBuilder.build``)."""
    if not isinstance(raw, Mapping):
        raise PayloadError("fair_share must be an object or null")
    enabled = raw.get("enabled")
    if enabled not in (0, 1) or isinstance(enabled, bool):
        raise PayloadError(f"fair_share.enabled must be 0 or 1, got {enabled!r}")
    return FairSharePart(
        enabled=bool(enabled), gap=_number(raw.get("gap"), "fair_share.gap")
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


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PayloadError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _number(value: object, name: str) -> float:
    """A finite non-negative number (an integer or a float)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value < math.inf
    ):
        raise PayloadError(
            f"{name} must be a finite non-negative number, got {value!r}"
        )
    return value


def _counter_rows(
    value: object, name: str, labels: set[str], other: str
) -> dict[str, dict[str, float]]:
    """``value`` as label -> {counter field -> delta}, every label in ``labels``."""
    if not isinstance(value, Mapping):
        raise PayloadError(f"{name} must be an object")
    rows: dict[str, dict[str, float]] = {}
    for label, row in value.items():
        where = f"{name}[{label!r}]"
        if label not in labels:
            raise PayloadError(
                f"{name} has label {label!r} that is neither labelled nor {other}"
            )
        if not isinstance(row, Mapping):
            raise PayloadError(f"{where} must be an object")
        unknown = set(row) - set(COUNTER_FIELDS)
        if unknown:
            raise PayloadError(
                f"{where} has unknown counters {sorted(map(str, unknown))}"
            )
        rows[label] = {
            field: _number(delta, f"{where}[{field!r}]")
            if field in FLOAT_COUNTER_FIELDS
            else _int(delta, f"{where}[{field!r}]")
            for field, delta in row.items()
        }
    return rows


def _member_pairs(
    value: object, name: str, labels: set[str]
) -> dict[str, tuple[int, int]]:
    """``value`` as label -> (all, throttled), throttled at most all."""
    if not isinstance(value, Mapping):
        raise PayloadError(f"{name} must be an object")
    pairs: dict[str, tuple[int, int]] = {}
    for label, pair in value.items():
        where = f"{name}[{label!r}]"
        if label not in labels:
            raise PayloadError(
                f"{name} has label {label!r} that is neither labelled nor {OTHER_TEAM}"
            )
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise PayloadError(f"{where} must be an [all, throttled] pair")
        total, throttled = _int(pair[0], where), _int(pair[1], where)
        if throttled > total:
            raise PayloadError(f"{where}: {throttled} throttled of {total}")
        pairs[label] = (total, throttled)
    return pairs


def _str_int_map(value: object, name: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise PayloadError(f"{name} must be an object")
    result: dict[str, int] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PayloadError(f"{name} has a non-string key {key!r}")
        result[key] = _int(item, f"{name}[{key!r}]")
    return result
