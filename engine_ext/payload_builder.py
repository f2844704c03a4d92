"""The engine-core side of the metrics payload (``engine_ext.stats_payload``):
``PayloadBuilder`` turns the scheduler's cumulative counters into one payload per
engine step, and ``attach`` puts it into vLLM's ``SchedulerStats`` (pure: no
vLLM at run time, no Prometheus).

Invariant: the payload is plain data that encodes as strict UTF-8 and that
``engine_ext.payload_parser.parse`` accepts; its counters are deltas since the
previous build, so the deltas of all payloads add up to the accounting's totals
(a net counter's, ``NET_COUNTER_FIELDS``, to the highest each series' net count
reached: refunds take it back, an exported counter never goes down).

Cost: one build is O(labelled users) without tiers or teams; with either it
also reads the counters of every user the accounting holds (those with live
requests or recent events), once for both: O(users). With teams it also looks
up the team of each user with live requests: O(live users). The fair-share gap
is O(users backlogged at the last step). The ceilings cost O(labelled users).
With bands (more than one), a build reads every user's counters like tiers do
(once for all groups), and the fairness gauge looks up the band and weight of
each user with live requests and keeps a snapshot of their counters once a
second for ``BAND_FAIRNESS_WINDOW_NS``: O(live users) time, O(live users x 11)
memory.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from engine_ext.stats_payload import (
    COUNTER_FIELDS,
    DEFAULT_LIMIT_USER,
    GRPC_CODES,
    MAX_LABELLED_TIERS,
    NET_COUNTER_FIELDS,
    OTHER_METHOD,
    OTHER_TEAM,
    OTHER_TIER,
    OTHER_USER,
    PAYLOAD_KEY,
    PAYLOAD_VERSION,
    RELOAD_RESULTS,
    FailureLog,
)
from pacing.accounting import Accounting, UserCounters
from pacing.bands import BandTable
from pacing.ceilings import Ceilings
from pacing.fair_share import FairShare
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.settings.model import DEFAULT_MAX_LABELLED_USERS
from pacing.shared import ControlPlaneSnapshot
from pacing.store_stats import StoreStats
from pacing.teams import TeamTable, charged_team

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import SchedulerStats

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Idle waits kept between two payloads. One payload is built per engine step and
#: there is at most one idle wait per step, so this bounds memory only when
#: payloads stop being collected (e.g. stats logging turned off).
MAX_PENDING_IDLE_WAITS = 1024
#: Label values with a meaning of their own; a user so named is never labelled.
_RESERVED_LABELS = frozenset({OTHER_USER, DEFAULT_LIMIT_USER})
#: The counters that only go up (a decrease: the owner forgot and restarted).
_MONOTONE_FIELDS = tuple(f for f in COUNTER_FIELDS if f not in NET_COUNTER_FIELDS)
#: A user's counters as a tuple in ``COUNTER_FIELDS`` order (one C call).
_counter_values = attrgetter(*COUNTER_FIELDS)
_ZEROS: tuple[float, ...] = (0,) * len(COUNTER_FIELDS)
#: A group's counter rows being summed: label -> (its members' counter values
#: now, and at the previous build).
_Sums = dict[str, tuple[list[tuple[float, ...]], list[tuple[float, ...]]]]
#: The band fairness gauge compares what each backlogged user of a band got
#: over this window (``_BandFairness``) ...
BAND_FAIRNESS_WINDOW_NS = 10_000_000_000
#: ... from snapshots of their counters taken at most this often.
BAND_SNAPSHOT_INTERVAL_NS = 1_000_000_000


@dataclass(frozen=True)
class TeamActivity:
    """What a build reads of the teams (under the shared limiter's lock)."""

    table: TeamTable
    #: Users with live requests.
    live: Collection[str]
    #: Users with a request parked for lack of budget at the last step's start.
    throttled: Collection[str]
    #: The scheduler's clock now (monotonic ns).
    now_ns: int
    #: user -> the team its gateway named for its live requests, which wins
    #: over ``table`` (``pacing.teams.Teams.gateway_teams``).
    gateway_teams: Mapping[str, tuple[str, int]] = field(default_factory=dict)

    def team_of(self, user: str) -> str | None:
        """The team ``user`` is charged to."""
        return charged_team(self.table, self.gateway_teams, user)


class BandQueue(Protocol):
    """What a build reads of the waiting queue per band
    (``engine_ext.scheduling.band_stats.BandStats``)."""

    @property
    def queued(self) -> Mapping[str, int] | None:
        """band name -> startable requests in the waiting queue now; None:
        the policy had no bands at the last step start."""

    @property
    def wait_ns(self) -> Mapping[str, int]:
        """band name -> ns requests of the band waited, cumulative."""


@dataclass(frozen=True)
class BandActivity:
    """What a build reads of the priority bands (under the shared limiter's
    lock)."""

    #: The bands in force (``SharedLimiter.bands``).
    table: BandTable
    tier_of: Callable[[str], str | None]
    team_of: Callable[[str], str | None]
    #: A user's fair-share weight (its own, its tier's or the default).
    weight_of: Callable[[str], float]
    #: Users with live requests.
    live: Collection[str]
    #: The scheduler's clock now (monotonic ns).
    now_ns: int
    #: The waiting queue per band; None: not counted (no waiting series).
    queue: BandQueue | None = None

    def band_of(self, user: str) -> str:
        """The name of ``user``'s band: its own, its tier's, its team's, the
        default (``BandTable.index_of``)."""
        table = self.table
        return table.names[table.index_of(user, self.tier_of(user), self.team_of(user))]


class _BandFairness:
    """Jain's fairness index per band over the band's backlogged users (users
    with live requests whose band it is): ``(sum x)^2 / (n * sum x^2)`` of
    ``x`` = the output tokens dispatched to the user (charged minus refunds)
    per second over the last ``BAND_FAIRNESS_WINDOW_NS``, divided by its
    weight. 1 when all got the same per weight (one user: 1; all nothing: 1
    too), 1/n when one user got everything.

    The window: snapshots of the live users' counters, at most one per
    ``BAND_SNAPSHOT_INTERVAL_NS``; a user is measured from the oldest kept
    snapshot that holds it (the newest one at least the window old, so 10 to
    11 s ago), a user live for less than that from the first snapshot that
    found it live, as a rate. A user in no snapshot yet (live for under about
    a second) is not measured; a band with nobody measured has no index."""

    def __init__(self) -> None:
        #: (when, user -> (tokens charged, refunds), cumulative), oldest first.
        self._snapshots: deque[tuple[int, dict[str, tuple[int, int]]]] = deque()

    def reset(self) -> None:
        self._snapshots.clear()

    def measure(self, bands: BandActivity, accounting: Accounting) -> dict[str, float]:
        now = bands.now_ns
        snapshots = self._snapshots
        while len(snapshots) > 1 and snapshots[1][0] <= now - BAND_FAIRNESS_WINDOW_NS:
            snapshots.popleft()
        counters = accounting.by_user()
        current: dict[str, tuple[int, int]] = {}
        for user in bands.live:
            entry = counters.get(user)
            current[user] = (0, 0) if entry is None else (entry.charged, entry.refunds)
        shares: dict[str, list[float]] = {}
        for user, (charged, refunds) in current.items():
            base = next(
                ((at, seen[user]) for at, seen in snapshots if user in seen), None
            )
            if base is None or base[0] >= now:
                continue
            at, (charged_then, refunds_then) = base
            if charged < charged_then:  # forgotten, then counted from zero
                charged_then = refunds_then = 0
            # A refund may settle after the build that saw its charge.
            dispatched = max(0, charged - charged_then - (refunds - refunds_then))
            rate = dispatched * 1e9 / (now - at)
            shares.setdefault(bands.band_of(user), []).append(
                rate / bands.weight_of(user)
            )
        if not snapshots or now - snapshots[-1][0] >= BAND_SNAPSHOT_INTERVAL_NS:
            snapshots.append((now, current))
        return {band: _jain(xs) for band, xs in shares.items()}


class _NetDebts:
    """How far each series of a net counter (``NET_COUNTER_FIELDS``) was
    exported above its net count: refunds since took that much back, and it is
    taken out of the next rises before any is exported. So every exported
    delta is non-negative and the exported count is the highest the net count
    reached."""

    def __init__(self) -> None:
        #: (kind, label, counter field) -> the exported count minus the net one.
        self._debts: dict[tuple[str, str, str], float] = {}

    def settle(self, row: dict[str, float], kind: str, label: str) -> None:
        """Turns ``row``'s signed net deltas (kind ``kind``, label ``label``)
        into the deltas to export; drops those that are 0."""
        debts = self._debts
        for name in NET_COUNTER_FIELDS:
            signed = row.get(name, 0)
            if not signed:
                continue
            key = (kind, label, name)
            owed = debts.pop(key, 0) - signed  # a rise pays debt back first
            if owed < 0:
                row[name] = -owed
            else:
                del row[name]
                if owed:
                    debts[key] = owed

    def keep(self, kind: str, labels: Collection[str]) -> None:
        """Forgets the debts of ``kind``'s labels not in ``labels`` (a label
        that went: its series went with it)."""
        if not self._debts:
            return
        self._debts = {
            key: debt
            for key, debt in self._debts.items()
            if key[0] != kind or key[1] in labels
        }


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
        # Teams are the operator's like users with limits: the same cap.
        self._teams = _Labels(max_labelled_users)
        self._last: dict[str, UserCounters] = {}
        self._last_total = UserCounters()
        self._debts = _NetDebts()
        #: user -> (its counters object, their values) at the previous build,
        #: for every user the accounting held; None while no tier or team exists.
        self._seen: dict[str, tuple[UserCounters, tuple[float, ...]]] | None = None
        #: team label -> (members with live requests, throttled ones) at the
        #: previous build, and that build's time; empty and None without teams.
        self._members: dict[str, list[int]] = {}
        self._members_at_ns: int | None = None
        self._last_control = ControlPlaneSnapshot()
        self._idle_waits: list[float] = []
        #: The store stats reported last and a copy of their values then.
        self._store_source: StoreStats | None = None
        self._last_store = StoreStats()
        #: The band queue reported last and its cumulative waits then.
        self._band_queue: BandQueue | None = None
        self._last_band_wait: dict[str, int] = {}
        self._band_fairness = _BandFairness()
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
        fair_share: FairShare | None = None,
        teams: TeamActivity | None = None,
        prompt_user_rates: Mapping[str, int] | None = None,
        default_prompt_rate: int | None = None,
        ceilings: Ceilings | None = None,
        bands: BandActivity | None = None,
    ) -> dict[str, Any]:
        """The payload for this step: counter deltas since the previous ``build``
        (labelled users from ``user_rates``, the rest as ``OTHER_USER``), the
        labelled users' limits, the given gauges and ``mode``, with
        ``limiter`` (whose table says the tiers and their members) the tiers'
        limits and counter deltas, with ``store`` (read under the lock its
        recorder holds) the store's part, and with ``fair_share`` (read under
        the shared limiter's lock) its switch and service gap, and with
        ``teams`` the teams' limits, counter deltas and members, and with
        ``prompt_user_rates`` (the prompt table's explicit per-user rates) the
        labelled users' prompt limits; ``default_prompt_rate`` 0 or None: no
        default prompt rate; with ``ceilings`` (read under the shared limiter's
        lock) the labelled users' ceilings, the default ceiling and, while any
        holder has a ceiling and ``mode`` paces, whether borrowing was blocked;
        with ``bands`` (read under the shared limiter's lock), while the policy
        has more than one band, the tokens charged and the waits per band and,
        while ``mode`` paces, the waiting requests and the fairness per band.

        Assumes ``accounting`` keeps labelled users' counters; if it forgot one
        and the user came back, the new counts are taken as a fresh start.
        """
        for user in self._users.update(user_rates):
            self._last.pop(user, None)
        first = not self._built_once
        self._built_once = True

        users: dict[str, dict[str, float]] = {}
        debts = self._debts
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
            labelled_sum.add(delta)  # net counters signed: OTHER_USER's exact
            row = _nonzero(delta)
            debts.settle(row, "user", user)
            if row:
                users[user] = row
        debts.keep("user", (*self._users.names, OTHER_USER))

        total = _copy(accounting.total)
        other = _delta(total, self._last_total)
        self._last_total = total
        other_row = _nonzero(
            UserCounters(
                **{
                    name: max(0, getattr(other, name) - getattr(labelled_sum, name))
                    for name in _MONOTONE_FIELDS
                },
                **{
                    name: getattr(other, name) - getattr(labelled_sum, name)
                    for name in NET_COUNTER_FIELDS
                },
            )
        )
        debts.settle(other_row, "user", OTHER_USER)
        if other_row:
            users[OTHER_USER] = other_row

        tiers, tier_of = self._tier_labels(limiter)
        team_rates, team_of = self._team_labels(teams)
        banded = bands is not None and bands.table.active
        band_of = bands.band_of if bands is not None and banded else None
        band_names = bands.table.names if bands is not None and banded else ()
        tier_counters, team_counters, band_counters = self._group_counters(
            accounting,
            (
                (tier_of, self._tiers.names, OTHER_TIER),
                (team_of, team_rates, OTHER_TEAM),
                # Every band is labelled (at most MAX_BANDS): no catch-all.
                (band_of, band_names, ""),
            ),
            first,
        )
        for kind, counters, labelled, other_label, group_of in (
            ("tier", tier_counters, self._tiers.names, OTHER_TIER, tier_of),
            ("team", team_counters, team_rates, OTHER_TEAM, team_of),
        ):
            debts.keep(kind, () if group_of is None else (*labelled, other_label))
            for label, row in list(counters.items()):
                debts.settle(row, kind, label)
                if not row:
                    del counters[label]
        team_members, team_member_ns = self._member_part(teams, team_rates)
        bands_part = None  # no bands: their series go
        if bands is not None and banded:
            bands_part = self._bands_part(bands, accounting, band_counters, mode)
        else:
            self._band_fairness.reset()

        # No snapshot means no control-plane news (not a reset to zero).
        control = self._last_control if control is None else _normalized(control)
        previous, self._last_control = self._last_control, control
        idle_waits, self._idle_waits = self._idle_waits, []
        return {
            "v": PAYLOAD_VERSION,
            "users": users,
            "limits": {user: int(user_rates[user]) for user in self._users.names},
            "default_limit": default_rate,
            "prompt_limits": {}
            if not prompt_user_rates
            else {
                user: int(prompt_user_rates[user])
                for user in self._users.names
                if user in prompt_user_rates
            },
            "default_prompt_limit": int(default_prompt_rate)
            if default_prompt_rate
            else None,
            **_ceilings_part(ceilings, self._users.names, mode),
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
            "teams": team_rates,
            "team_counters": team_counters,
            "team_members": team_members,
            "team_member_ns": team_member_ns,
            "store": None if store is None else self._store_part(store),
            "fair_share": None
            if fair_share is None
            else {
                "enabled": int(fair_share.enabled),
                # Off, nobody is charged: the last step's gap would be stale.
                "gap": fair_share.gap() if fair_share.enabled else 0.0,
            },
            "bands": bands_part,
        }

    def _bands_part(
        self,
        bands: BandActivity,
        accounting: Accounting,
        counters: Mapping[str, Mapping[str, float]],
        mode: Mode,
    ) -> dict[str, Any]:
        """The bands' entry: every band's name, the tokens charged to each
        band's users (each user's events in its band now) and the waits counted
        since the previous build (from zero for a queue not reported before),
        and while ``mode`` paces the waiting requests now
        (none while nobody has live requests) and the fairness per band."""
        names = bands.table.names
        queue = bands.queue
        if queue is not self._band_queue:
            self._band_queue, self._last_band_wait = queue, {}
        wait_now = {} if queue is None else dict(queue.wait_ns)
        before = self._last_band_wait
        self._last_band_wait = wait_now
        wait_ns: dict[str, int] = {}
        for name in names:
            now, then = wait_now.get(name, 0), before.get(name, 0)
            if delta := (now - then if now >= then else now):
                wait_ns[name] = int(delta)
        waiting: dict[str, int] | None = None
        fairness: dict[str, float] = {}
        if mode is Mode.OFF:  # nothing charged: no fairness, no starving
            self._band_fairness.reset()
        else:
            counted = None if queue is None else queue.queued
            if queue is not None and not bands.live:
                waiting = dict.fromkeys(names, 0)  # nothing can wait
            elif counted is not None:
                waiting = {name: int(counted.get(name, 0)) for name in names}
            fairness = self._band_fairness.measure(bands, accounting)
        return {
            "names": list(names),
            "tokens": {
                band: int(charged)
                for band, row in counters.items()
                if (charged := row.get("charged"))
            },
            "wait_ns": wait_ns,
            "waiting": waiting,
            "fairness": fairness,
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

    def _tier_labels(
        self, limiter: OutputRateLimiter | None
    ) -> tuple[dict[str, int], Callable[[str], str | None] | None]:
        """The labelled tiers' limits (0: exempt), and the tier of a user while
        any tier exists."""
        rates = {} if limiter is None else limiter.tier_rates
        exempt = frozenset() if limiter is None else limiter.exempt_tiers
        self._tiers.update(rates.keys() | exempt)
        tiers = {
            tier: 0 if tier in exempt else rates[tier] for tier in self._tiers.names
        }
        if limiter is None or not (rates or exempt):
            return tiers, None
        return tiers, limiter.memberships.get

    def _team_labels(
        self, teams: TeamActivity | None
    ) -> tuple[dict[str, int], Callable[[str], str | None] | None]:
        """The labelled teams' limits, and the team of a user while any team
        exists."""
        rates = {} if teams is None else teams.table.rates
        self._teams.update(rates)
        labelled = {team: rates[team] for team in self._teams.names}
        if teams is None or not rates:
            return labelled, None
        return labelled, teams.team_of

    def _group_counters(
        self,
        accounting: Accounting,
        groups: tuple[
            tuple[Callable[[str], str | None] | None, Collection[str], str], ...
        ],
        first: bool,
    ) -> list[dict[str, dict[str, float]]]:
        """For each group (the group of a user, or None while the kind has none;
        the labelled groups; the catch-all label): every label's counter deltas,
        each user's events since the previous build going to the group it is a
        member of now, those of users the accounting forgot since included.
        One pass over the accounting for all groups."""
        forgotten = accounting.collect_forgotten()
        active = [
            (group_of, labelled, other)
            for group_of, labelled, other in groups
            if group_of is not None
        ]
        if not active:
            self._seen = None  # no group: nothing to count, nothing to keep
            return [{} for _ in groups]
        # While no group existed nobody was tracked: the events before this
        # build are nobody's group events (except at the first build, which
        # reports everything since start-up).
        count_new = first or self._seen is not None
        previous = self._seen or {}
        seen: dict[str, tuple[UserCounters, tuple[float, ...]]] = {}
        sums: list[_Sums] = [{} for _ in active]
        # A forgotten user's counters first: if it came back, its new ones
        # are the ones seen.
        for user, counters in chain(forgotten, accounting.by_user().items()):
            values: tuple[float, ...] = _counter_values(counters)
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
            for (group_of, labelled, other), rows in zip(active, sums, strict=True):
                group = group_of(user)
                if group is None:
                    continue
                label = group if group in labelled else other
                entry = rows.get(label)
                if entry is None:
                    entry = rows[label] = ([], [])
                entry[0].append(values)
                entry[1].append(base)
        self._seen = seen
        summed = iter([_column_deltas(rows) for rows in sums])
        return [{} if group_of is None else next(summed) for group_of, _, _ in groups]

    def _member_part(
        self, teams: TeamActivity | None, labelled: Collection[str]
    ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """Per team label while any team exists: [members with live requests,
        those of them throttled] now (every labelled team and ``OTHER_TEAM``),
        and the member-ns deltas [active, throttled]: the time since the
        previous build times the counts that build saw."""
        if teams is None or not teams.table:
            self._members, self._members_at_ns = {}, None
            return {}, {}
        counts = {label: [0, 0] for label in (*labelled, OTHER_TEAM)}
        team_of, throttled = teams.team_of, teams.throttled
        for user in teams.live:
            team = team_of(user)
            if team is None:
                continue
            row = counts[team if team in labelled else OTHER_TEAM]
            row[0] += 1
            if user in throttled:
                row[1] += 1
        member_ns: dict[str, list[int]] = {}
        if self._members_at_ns is not None:
            elapsed = max(0, teams.now_ns - self._members_at_ns)
            for label, (streaming, held) in self._members.items():
                # A team removed since leaves its last interval uncounted.
                if elapsed and streaming and label in counts:
                    member_ns[label] = [streaming * elapsed, held * elapsed]
        self._members, self._members_at_ns = counts, teams.now_ns
        return counts, member_ns


def _ceilings_part(
    ceilings: Ceilings | None, labelled: Collection[str], mode: Mode
) -> dict[str, Any]:
    """The ceilings' entries: the labelled users' ceilings (those with one:
    their own, their tier's or the default, as resolved), the default ceiling,
    and ``borrowing_blocked``: 1 if a holder within its rate waited at the
    engine's last step start (``Borrowing.needy``), so that no other holder
    borrowed in it; ``None`` while no holder has a ceiling or pacing is off."""
    if ceilings is None:
        return {
            "ceiling_limits": {},
            "default_ceiling_limit": None,
            "borrowing_blocked": None,
        }
    table = ceilings.table
    blocked: int | None = None
    if ceilings.active and mode is not Mode.OFF:
        borrowing = ceilings.borrowing  # None until a paced step built it
        blocked = int(borrowing is not None and bool(borrowing.needy))
    return {
        "ceiling_limits": {
            user: int(ceiling) for user in labelled if (ceiling := table.rate_of(user))
        },
        "default_ceiling_limit": int(table.default_rate or 0) or None,
        "borrowing_blocked": blocked,
    }


def _jain(shares: list[float]) -> float:
    """Jain's fairness index of ``shares`` (non-negative, at least one): 1 for
    equal shares (all zero too), 1/n for one share holding everything."""
    squares = sum(x * x for x in shares)
    if not squares:
        return 1.0
    total = sum(shares)
    return min(1.0, total * total / (len(shares) * squares))


def attach(scheduler_stats: SchedulerStats, payload: dict[str, Any]) -> None:
    """Puts ``payload`` into ``scheduler_stats`` (a vLLM ``SchedulerStats``) for
    the trip to the API process, keeping anything a KV connector put there."""
    carried = dict(scheduler_stats.kv_connector_stats or {})
    carried[PAYLOAD_KEY] = payload
    scheduler_stats.kv_connector_stats = carried


# -- helpers --------------------------------------------------------------------


def _column_deltas(rows: _Sums) -> dict[str, dict[str, float]]:
    """label -> its non-zero counter deltas: members' values now minus then."""
    deltas: dict[str, dict[str, float]] = {}
    for label, (values_now, values_then) in rows.items():
        # Column sums in C rather than a Python loop per user and field.
        columns_now = zip(*values_now, strict=True)
        columns_then = zip(*values_then, strict=True)
        # Never negative, floats too: each member's values are at least its
        # base, and rounded sums are monotone; but a net counter's may be
        # (``NET_COUNTER_FIELDS``: the builder settles those).
        row = {
            name: sum(now) - sum(then)
            for name, now, then in zip(
                COUNTER_FIELDS, columns_now, columns_then, strict=True
            )
        }
        if row := {name: delta for name, delta in row.items() if delta}:
            deltas[label] = row
    return deltas


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
    (its owner forgot it), so its whole current value is new. A net counter
    (``NET_COUNTER_FIELDS``) may go down by itself: its delta is signed, and
    its whole value new only if another counter says the owner restarted."""
    delta = UserCounters()
    restarted = False
    for name in _MONOTONE_FIELDS:
        current, previous = getattr(now, name), getattr(before, name)
        if current >= previous:
            setattr(delta, name, current - previous)
        else:
            setattr(delta, name, current)
            restarted = True
    for name in NET_COUNTER_FIELDS:
        current = getattr(now, name)
        setattr(delta, name, current if restarted else current - getattr(before, name))
    return delta


def _nonzero(counters: UserCounters) -> dict[str, float]:
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
