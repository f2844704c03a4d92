"""The control plane's operations, free of gRPC: validation, the limits table
(default, user entries, tiers) with its etag, the pacing mode, per-user state
reads, pagination.

Every read and write goes through ``SharedLimiter.lock`` (see
``pacing.shared``). Changes are also serialised among themselves by a
second lock, held while the new table is written to the config file; the
scheduler never waits for that write, only for the in-memory apply. Order of a
change: validate against the current table, write the whole new table and mode
(``persist``), apply the change to the limiter (or the mode to the shared
limiter) and bump the etag under the shared limiter's lock, then ``wake()`` the
engine. A failed write applies nothing.

The change lock is the engine's ``pacing.global_limits`` hub lock. With a
global store (``--output-rate-store``) the store takes the file's place: the
whole new table and mode are published through the hub's backend
(compare-and-set against the version this engine holds) before they are
applied here. Another engine's change that came first answers ABORTED (this
engine has applied it: read again and retry); a store that does not answer, or
no backend yet, answers UNAVAILABLE and applies nothing. A table another engine
published and this engine applied moves the table etag, as a local change does.

A user's *entry* (``Limit``) is what the table holds for it: its own limit, its
tier, its exemption, any of them; a *tier* exists while it has a rate or an
exemption. Both carry an etag computed from their fields; the table's etag moves
with every committed change of the table, the mode's with the mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from control import names
from control.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from control.pagination import PageTokens
from control.table import (
    MAX_EXPLICIT_LIMITS,
    MAX_TIERS,
    TableDocument,
    check_rate,
    check_table_size,
    check_tier,
    check_tier_count,
    check_user,
    shown,
)
from pacing import global_limits
from pacing.budget import StoreView, StoreViews
from pacing.limiter import LimitSource, OutputRateLimiter
from pacing.modes import Mode
from pacing.shared import COLUMNS, Reading, SharedLimiter, UserSnapshot

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
#: Bounds of a watch's update interval: below 100 ms a watch would mostly cost
#: the scheduler lock time; above a minute it is not "live".
MIN_WATCH_INTERVAL_NS = 100_000_000
MAX_WATCH_INTERVAL_NS = 60_000_000_000
DEFAULT_WATCH_INTERVAL_NS = 1_000_000_000
DEFAULT_WATCH_USERS = 20
MAX_WATCH_NAMES = 100
#: Most throttled users first: the order of a watch that names none, and the
#: CLI's default for listing user states.
MOST_THROTTLED_FIRST = "throttled_skips desc"
#: Update-mask paths: the rate is the only mutable field of ``DefaultLimit``.
_RATE_FIELD = "tokens_per_second"
_LIMIT_FIELDS = (_RATE_FIELD, "tier", "exempt")
_TIER_FIELDS = (_RATE_FIELD, "exempt")
_MODE_FIELDS = ("mode",)


@dataclass(frozen=True)
class Limit:
    """One user's entry: own limit (0: none), tier, exemption."""

    user: str
    tokens_per_second: int
    tier: str | None = None
    exempt: bool = False
    etag: str = ""

    @property
    def name(self) -> str:
        return names.limit_name(self.user)


@dataclass(frozen=True)
class Tier:
    """One tier: rate (0: none), exemption, member count."""

    tier: str
    tokens_per_second: int
    exempt: bool
    member_count: int = 0
    etag: str = ""

    @property
    def name(self) -> str:
        return names.tier_name(self.tier)


class LimitSpec(NamedTuple):
    """One entry of a table to replace, as received (``name`` is ``limits/{user}``,
    ``tier`` is ``tiers/{tier}`` or empty)."""

    name: str
    tokens_per_second: int
    tier: str = ""
    exempt: bool = False


class TierSpec(NamedTuple):
    """One tier of a table to replace, as received (``name`` is ``tiers/{tier}``)."""

    name: str
    tokens_per_second: int
    exempt: bool = False


@dataclass(frozen=True)
class LimitsTable:
    """The default, all entries and all tiers (sorted), with the etag."""

    default_tokens_per_second: int  #: 0 while pacing is off
    limits: list[Limit] = field(default_factory=list)
    etag: str = ""
    tiers: list[Tier] = field(default_factory=list)


@dataclass(frozen=True)
class PacingMode:
    """The pacing mode with its etag."""

    mode: Mode
    etag: str


@dataclass(frozen=True)
class UserState:
    """One user's limiter state plus where its limit comes from, read at one
    instant."""

    snapshot: UserSnapshot
    source: LimitSource
    tier: str | None  #: the user's tier, whichever rule decided
    shadow_skips: int
    mode: Mode
    engine_late_ns: int
    #: With a global store, the user's budget there as this engine sees it.
    store: StoreView | None = None


@dataclass(frozen=True)
class WatchPlan:
    """A validated watch: either ``users`` (explicit) or the first ``max_users``
    in ``order`` order."""

    interval_ns: int
    users: tuple[str, ...]
    order: _Order
    max_users: int


#: Applies a change to the limiter at ``now_ns``; runs under the shared lock.
_Apply = Callable[[OutputRateLimiter, int], None]


class LimitsService:
    """Reads and changes the limits and the mode of ``shared``'s limiter; see
    the module docstring.

    ``persist``, when given, durably stores a whole new table (with the mode)
    before it is applied (raises OSError on failure). ``page_tokens`` signs page
    tokens (a fresh random key by default). ``global_store``: a store holds the
    table (module docstring); changes are refused until its backend is
    registered.
    """

    def __init__(
        self,
        shared: SharedLimiter,
        *,
        persist: Callable[[TableDocument], None] | None = None,
        page_tokens: PageTokens | None = None,
        global_store: bool = False,
    ) -> None:
        self._shared = shared
        self._persist = persist
        self._tokens = page_tokens or PageTokens()
        self._hub = global_limits.hub(shared)
        self._global_store = global_store
        self._changes = self._hub.lock
        self._hub.on_table_change(self._changed_elsewhere)
        # The etag: random per process, so an etag from before a restart never
        # matches, plus a generation bumped with every change under shared.lock.
        self._epoch = secrets.token_hex(4)
        self._generation = 0

    # -- the default -------------------------------------------------------

    def get_default_limit(self, name: str) -> int:
        """The default limit in tokens/s (0 while pacing is off)."""
        names.check_singleton(name, names.DEFAULT_LIMIT, field="name")
        with self._shared.lock:
            return self._shared.limiter.default_rate or 0

    def update_default_limit(
        self, name: str, tokens_per_second: int, update_mask: Sequence[str]
    ) -> int:
        """Sets the default limit; returns it."""
        names.check_singleton(name, names.DEFAULT_LIMIT, field="default_limit.name")
        _mask_fields(update_mask, (_RATE_FIELD,), {_RATE_FIELD})
        rate = check_rate(tokens_per_second, field="default_limit.tokens_per_second")
        with self._changes:
            doc = dataclasses.replace(self._current(), default_rate=rate)
            self._commit(doc, lambda limiter, now: limiter.set_default_rate(rate, now))
        return rate

    # -- one user's entry --------------------------------------------------

    def get_limit(self, name: str) -> Limit:
        """The entry named ``limits/{user}``; NotFound without one."""
        user = names.parse_user(name, names.LIMITS, field="name")
        with self._shared.lock:
            limiter = self._shared.limiter
            entry = self._entry(
                user,
                limiter.user_rates.get(user, 0),
                limiter.tier_of(user),
                user in limiter.exempt_users,
            )
        if entry is None:
            raise _no_limit(user)
        return entry

    def create_limit(
        self,
        limit_id: str,
        tokens_per_second: int,
        *,
        tier: str = "",
        exempt: bool = False,
    ) -> Limit:
        """Gives user ``limit_id`` an entry; AlreadyExists if it has one."""
        user = check_user(limit_id, field="limit_id")
        rate = _entry_rate(tokens_per_second, bool(tier) or exempt, "limit")
        tier_id = names.parse_tier(tier, field="limit.tier") if tier else None
        with self._changes:
            doc = self._current()
            if user in doc.users():
                raise AlreadyExists(
                    f"{shown(names.limit_name(user))} exists; use UpdateLimit"
                )
            _check_tier_exists(doc, tier_id, field="limit.tier")
            self._check_room(len(doc.users()) + 1)
            return self._commit_entry(doc, user, (rate, tier_id, exempt))

    def update_limit(
        self,
        name: str,
        tokens_per_second: int,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
        tier: str = "",
        exempt: bool = False,
        etag: str = "",
    ) -> Limit:
        """Changes the fields of entry ``name`` that ``update_mask`` selects
        (empty: those set, see the proto); creates it with ``allow_missing``. An
        update that leaves nothing removes the entry."""
        user = names.parse_user(name, names.LIMITS, field="limit.name")
        given = _set_fields(
            {_RATE_FIELD: tokens_per_second != 0, "tier": bool(tier), "exempt": exempt}
        )
        fields = _mask_fields(update_mask, _LIMIT_FIELDS, given)
        rate: int | None = None
        if _RATE_FIELD in fields:
            # 0 clears the rate only when the mask names it: an empty mask with
            # nothing set means the rate, which must then be valid.
            rate = _entry_rate(tokens_per_second, bool(update_mask), "limit")
        tier_id = None
        if "tier" in fields and tier:
            tier_id = names.parse_tier(tier, field="limit.tier")
        with self._changes:
            doc = self._current()
            current = _entry_fields(doc, user)
            if current is None and not allow_missing:
                raise _no_limit(user)
            self._check_etag(
                etag, self._limit_etag(user, current), names.limit_name(user)
            )
            old_rate, old_tier, old_exempt = current or (None, None, False)
            new = (
                rate if _RATE_FIELD in fields else old_rate,
                tier_id if "tier" in fields else old_tier,
                exempt if "exempt" in fields else old_exempt,
            )
            _check_tier_exists(doc, new[1], field="limit.tier")
            if current is None:
                if new == (None, None, False):
                    return Limit(user, 0)  # nothing to create
                self._check_room(len(doc.users()) + 1)
            return self._commit_entry(doc, user, new)

    def delete_limit(self, name: str, *, allow_missing: bool, etag: str = "") -> None:
        """Removes the entry ``name`` (the default applies again)."""
        user = names.parse_user(name, names.LIMITS, field="name")
        with self._changes:
            doc = self._current()
            current = _entry_fields(doc, user)
            if current is None:
                if allow_missing:
                    return
                raise _no_limit(user)
            self._check_etag(
                etag, self._limit_etag(user, current), names.limit_name(user)
            )
            self._commit_entry(doc, user, (None, None, False))

    def list_limits(self, page_size: int, page_token: str) -> tuple[list[Limit], str]:
        """One page of entries in user id order, and the next page's token (""
        on the last page)."""
        size = _page_size(page_size)
        after = self._resume("limits", page_token)
        with self._shared.lock:
            doc = self._current_locked()  # copies: sort off the lock
        users = doc.users()
        candidates = users if after is None else (u for u in users if u > after[0])
        page = heapq.nsmallest(size + 1, candidates)
        token = ""
        if len(page) > size:
            page = page[:size]
            token = self._tokens.encode("limits", [page[-1]])
        return [self._entry_of(doc, user) for user in page], token

    # -- tiers -------------------------------------------------------------

    def get_tier(self, name: str) -> Tier:
        """The tier named ``tiers/{tier}``; NotFound without one."""
        tier = names.parse_tier(name, field="name")
        with self._shared.lock:
            doc = self._current_locked()
        if tier not in doc.tiers:
            raise _no_tier(tier)
        return self._tier_of(doc, tier, Counter(doc.memberships.values()))

    def list_tiers(self, page_size: int, page_token: str) -> tuple[list[Tier], str]:
        """One page of tiers in tier id order, and the next page's token (""
        on the last page)."""
        size = _page_size(page_size)
        after = self._resume("tiers", page_token)
        with self._shared.lock:
            doc = self._current_locked()
        tiers = sorted(t for t in doc.tiers if after is None or t > after[0])
        page = tiers[:size]
        token = self._tokens.encode("tiers", [page[-1]]) if len(tiers) > size else ""
        members = Counter(doc.memberships.values())
        return [self._tier_of(doc, tier, members) for tier in page], token

    def create_tier(self, tier_id: str, tokens_per_second: int, exempt: bool) -> Tier:
        """Creates tier ``tier_id``; AlreadyExists if it exists."""
        tier = check_tier(tier_id, field="tier_id")
        rate = _entry_rate(tokens_per_second, exempt, "tier")
        with self._changes:
            doc = self._current()
            if tier in doc.tiers:
                raise AlreadyExists(
                    f"{shown(names.tier_name(tier))} exists; use UpdateTier"
                )
            _check_tier_room(doc)
            return self._commit_tier(doc, tier, rate, exempt)

    def update_tier(
        self,
        name: str,
        tokens_per_second: int,
        exempt: bool,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
        etag: str = "",
    ) -> Tier:
        """Changes the fields of tier ``name`` that ``update_mask`` selects
        (empty: those set, see the proto); creates it with ``allow_missing``. An
        update that leaves neither a rate nor an exemption removes the tier."""
        tier = names.parse_tier(name, field="tier.name")
        given = _set_fields({_RATE_FIELD: tokens_per_second != 0, "exempt": exempt})
        fields = _mask_fields(update_mask, _TIER_FIELDS, given)
        rate: int | None = None
        if _RATE_FIELD in fields:
            rate = _entry_rate(tokens_per_second, bool(update_mask), "tier")
        with self._changes:
            doc = self._current()
            exists = tier in doc.tiers
            if not exists:
                if not allow_missing:
                    raise _no_tier(tier)
                _check_tier_room(doc)
            current = (doc.tier_rates.get(tier), tier in doc.exempt_tiers)
            self._check_etag(
                etag,
                self._tier_etag(tier, *current) if exists else "",
                names.tier_name(tier),
            )
            new_rate = rate if _RATE_FIELD in fields else current[0]
            new_exempt = exempt if "exempt" in fields else current[1]
            if new_rate is None and not new_exempt and not exists:
                return Tier(tier, 0, False)  # nothing to create
            return self._commit_tier(doc, tier, new_rate, new_exempt)

    def delete_tier(self, name: str, *, allow_missing: bool, etag: str = "") -> None:
        """Removes tier ``name``; FailedPrecondition while it has members."""
        tier = names.parse_tier(name, field="name")
        with self._changes:
            doc = self._current()
            if tier not in doc.tiers:
                if allow_missing:
                    return
                raise _no_tier(tier)
            current = self._tier_etag(
                tier, doc.tier_rates.get(tier), tier in doc.exempt_tiers
            )
            self._check_etag(etag, current, names.tier_name(tier))
            self._commit_tier(doc, tier, None, False)

    # -- the pacing mode ---------------------------------------------------

    def get_pacing_mode(self, name: str) -> PacingMode:
        """The pacing mode and its etag."""
        names.check_singleton(name, names.PACING_MODE, field="name")
        with self._shared.lock:
            mode = self._shared.mode
        return PacingMode(mode, self._mode_etag(mode))

    def update_pacing_mode(
        self,
        name: str,
        mode: Mode | None,
        update_mask: Sequence[str],
        *,
        etag: str = "",
    ) -> PacingMode:
        """Switches the pacing mode (``None``: an unknown value, refused)."""
        names.check_singleton(name, names.PACING_MODE, field="pacing_mode.name")
        _mask_fields(update_mask, _MODE_FIELDS, set(_MODE_FIELDS))
        if mode is None:
            raise InvalidArgument("pacing_mode.mode must be ENFORCE, SHADOW or OFF")
        with self._changes:
            doc = self._current()
            assert doc.mode is not None  # _current always reads the mode
            self._check_etag(etag, self._mode_etag(doc.mode), names.PACING_MODE)
            self._commit(dataclasses.replace(doc, mode=mode), None, table=False)
        return PacingMode(mode, self._mode_etag(mode))

    # -- the whole table ---------------------------------------------------

    def get_limits_table(self, name: str) -> LimitsTable:
        """The default, every entry and every tier, with the current etag."""
        names.check_singleton(name, names.LIMITS_TABLE, field="name")
        with self._shared.lock:
            doc = self._current_locked()
            etag = self._etag()
        return self._table(doc, etag)

    def replace_limits_table(
        self,
        default_tokens_per_second: int,
        limits: Iterable[LimitSpec],
        etag: str,
        tiers: Iterable[TierSpec] = (),
    ) -> LimitsTable:
        """Replaces the default, all entries and all tiers at once (not the
        mode); Aborted when ``etag`` is not empty and not the current etag."""
        default = check_rate(
            default_tokens_per_second, field="limits_table.default_tokens_per_second"
        )
        tier_rates: dict[str, int] = {}
        exempt_tiers: set[str] = set()
        seen_tiers: set[str] = set()
        for index, spec in enumerate(tiers):
            where = f"limits_table.tiers[{index}]"
            tier = names.parse_tier(spec.name, field=f"{where}.name")
            if tier in seen_tiers:
                raise InvalidArgument(
                    f"{where}.name: {shown(names.tier_name(tier))} appears more "
                    "than once"
                )
            seen_tiers.add(tier)
            rate = _entry_rate(spec.tokens_per_second, spec.exempt, where)
            if rate is not None:
                tier_rates[tier] = rate
            if spec.exempt:
                exempt_tiers.add(tier)
        check_tier_count(len(seen_tiers))
        users: dict[str, int] = {}
        memberships: dict[str, str] = {}
        exempt_users: set[str] = set()
        seen_users: set[str] = set()
        for index, entry in enumerate(limits):
            where = f"limits_table.limits[{index}]"
            user = names.parse_user(entry.name, names.LIMITS, field=f"{where}.name")
            if user in seen_users:
                raise InvalidArgument(
                    f"{where}.name: {shown(names.limit_name(user))} "
                    "appears more than once"
                )
            seen_users.add(user)
            rate = _entry_rate(
                entry.tokens_per_second, bool(entry.tier) or entry.exempt, where
            )
            if rate is not None:
                users[user] = rate
            if entry.tier:
                tier = names.parse_tier(entry.tier, field=f"{where}.tier")
                if tier not in seen_tiers:
                    raise InvalidArgument(
                        f"{where}.tier: {shown(entry.tier)} is not one of "
                        "limits_table.tiers"
                    )
                memberships[user] = tier
            if entry.exempt:
                exempt_users.add(user)
        check_table_size(len(seen_users))
        with self._changes:
            if etag and etag != self._etag():
                raise Aborted(
                    f"etag {shown(etag)} is not current: the table changed "
                    "since it was read; read it again and retry"
                )
            doc = dataclasses.replace(
                self._current(),
                default_rate=default,
                user_rates=users,
                tier_rates=tier_rates,
                exempt_tiers=frozenset(exempt_tiers),
                memberships=memberships,
                exempt_users=frozenset(exempt_users),
            )
            new_etag = self._commit(doc, _replace_with(doc))
        return self._table(doc, new_etag)

    def reload(self, read: Callable[[], TableDocument | None]) -> bool:
        """Makes the document ``read()`` returns the table and mode, without
        persisting it (it came from the config file); ``None`` or an equal
        document changes nothing, a missing default or mode keeps the current
        one. ``read`` runs under the change lock, so no RPC change interleaves.
        Returns whether the table or the mode changed."""
        with self._changes:
            doc = read()
            if doc is None:
                return False
            current = self._current()
            doc = dataclasses.replace(
                doc,
                etag=None,
                default_rate=(
                    current.default_rate
                    if doc.default_rate is None
                    else doc.default_rate
                ),
                mode=current.mode if doc.mode is None else doc.mode,
            )
            table_changed = not doc.same_table(current)
            if not table_changed and doc.mode == current.mode:
                return False
            self._apply(
                doc, _replace_with(doc) if table_changed else None, table=table_changed
            )
        self._shared.wake()
        return True

    # -- user state --------------------------------------------------------

    def get_user_state(self, name: str) -> UserState:
        """The state of the user named ``userStates/{user}``; NotFound for a user
        the limiter does not know."""
        user = names.parse_user(name, names.USER_STATES, field="name")
        with self._shared.lock:
            reading = self._shared.read()
            if not self._knows(reading, user):
                raise NotFound(
                    f"{shown(names.user_state_name(user))}: the limiter does "
                    "not know this user (no entry, request or counters)"
                )
            return self._states(reading, [user])[0]

    def list_user_states(
        self, page_size: int, page_token: str, order_by: str
    ) -> tuple[list[UserState], str]:
        """One page of user states in ``order_by`` order, and the next page's
        token ("" on the last page)."""
        size = _page_size(page_size)
        order = _Order.parse(order_by, field="order_by")
        scope = f"userStates?order_by={order.canonical}"
        after = self._resume(scope, page_token)
        with self._shared.lock:
            reading = self._shared.read()
            keys = order.keys(reading, self._users(reading))
            if after is not None:
                position = tuple(after)
                keys = [key for key in keys if key > position]
            page = heapq.nsmallest(size + 1, keys)
            states = self._states(reading, [key[-1] for key in page[:size]])
        token = ""
        if len(page) > size:
            token = self._tokens.encode(scope, list(page[size - 1]))
        return states, token

    def plan_watch(
        self,
        interval_ns: int | None,
        state_names: Sequence[str],
        order_by: str,
        max_users: int,
    ) -> WatchPlan:
        """Validates a watch request (``interval_ns`` None: unset)."""
        if interval_ns is None:
            interval_ns = DEFAULT_WATCH_INTERVAL_NS
        if not MIN_WATCH_INTERVAL_NS <= interval_ns <= MAX_WATCH_INTERVAL_NS:
            raise InvalidArgument(
                f"interval must be between {MIN_WATCH_INTERVAL_NS // 1_000_000} ms "
                f"and {MAX_WATCH_INTERVAL_NS // 1_000_000_000} s, got "
                f"{interval_ns / 1e9:g} s"
            )
        if len(state_names) > MAX_WATCH_NAMES:
            raise InvalidArgument(
                f"names holds at most {MAX_WATCH_NAMES} entries, got {len(state_names)}"
            )
        users = tuple(
            dict.fromkeys(
                names.parse_user(n, names.USER_STATES, field=f"names[{i}]")
                for i, n in enumerate(state_names)
            )
        )
        order = _Order.parse(order_by or MOST_THROTTLED_FIRST, field="order_by")
        if max_users < 0:
            raise InvalidArgument(f"max_users must not be negative, got {max_users}")
        max_users = min(max_users or DEFAULT_WATCH_USERS, MAX_PAGE_SIZE)
        return WatchPlan(interval_ns, users, order, max_users)

    def watch_states(self, plan: WatchPlan) -> list[UserState]:
        """The states one update of ``plan`` holds, read at one instant."""
        with self._shared.lock:
            reading = self._shared.read()
            if plan.users:
                users = [u for u in plan.users if self._knows(reading, u)]
            else:
                keys = plan.order.keys(reading, self._users(reading))
                users = [key[-1] for key in heapq.nsmallest(plan.max_users, keys)]
            return self._states(reading, users)

    # -- helpers -----------------------------------------------------------

    @property
    def limit_changes(self) -> int:
        """How many new tables were committed: one per successful write RPC of
        the table (even one that leaves it as it was; not a mode change) and one
        per load of the config file that changed the table, the load at start-up
        included, and, with a global store, one per table from another engine
        applied here."""
        return self._generation

    def _current(self) -> TableDocument:
        with self._shared.lock:
            return self._current_locked()

    def _current_locked(self) -> TableDocument:
        """The table and mode in force, as a document of copies (default None
        while pacing is off). Requires shared.lock."""
        limiter = self._shared.limiter
        return TableDocument(
            default_rate=limiter.default_rate,
            user_rates=limiter.user_rates,
            tier_rates=limiter.tier_rates,
            exempt_tiers=limiter.exempt_tiers,
            memberships=limiter.memberships,
            exempt_users=limiter.exempt_users,
            mode=self._shared.mode,
        )

    def _users(self, reading: Reading) -> set[str]:
        """The users the limiter knows: with an entry, live requests or counters.
        Requires shared.lock."""
        limiter = self._shared.limiter
        return reading.users().union(limiter.memberships, limiter.exempt_users)

    def _knows(self, reading: Reading, user: str) -> bool:
        """Whether ``user`` is one of ``_users``. Requires shared.lock."""
        limiter = self._shared.limiter
        return (
            reading.knows(user)
            or limiter.tier_of(user) is not None
            or user in limiter.exempt_users
        )

    def _states(self, reading: Reading, users: Iterable[str]) -> list[UserState]:
        """Each of ``users``' state with its limit's source and, with a global
        store, its view of the store. Requires shared.lock."""
        limiter = self._shared.limiter
        budget = self._shared.budget
        views = budget if isinstance(budget, StoreViews) else None
        states = []
        for user in users:
            counters = reading.counters.get(user)
            states.append(
                UserState(
                    snapshot=reading.snapshot(user),
                    source=limiter.limit_source(user),
                    tier=limiter.tier_of(user),
                    shadow_skips=0 if counters is None else counters.shadow_skips,
                    mode=self._shared.mode,
                    engine_late_ns=0 if counters is None else counters.engine_late_ns,
                    store=None
                    if views is None
                    else views.store_view(user, reading.now_ns),
                )
            )
        return states

    def _etag(self) -> str:
        return f"{self._epoch}-{self._generation}"

    def _digest(self, *fields: object) -> str:
        """An etag computed from a resource's fields (and this process's epoch)."""
        text = repr((self._epoch, *fields)).encode()  # repr escapes any surrogate
        return f"{self._epoch}-{hashlib.sha256(text).hexdigest()[:16]}"

    def _limit_etag(self, user: str, entry: _EntryFields | None) -> str:
        return "" if entry is None else self._digest("limit", user, *entry)

    def _tier_etag(self, tier: str, rate: int | None, exempt: bool) -> str:
        return self._digest("tier", tier, rate, exempt)

    def _mode_etag(self, mode: Mode) -> str:
        return self._digest("mode", mode.value)

    @staticmethod
    def _check_etag(etag: str, current: str, name: str) -> None:
        """Aborted when ``etag`` is given and differs from ``current`` (empty:
        resource ``name`` does not exist)."""
        if etag and etag != current:
            raise Aborted(
                f"etag {shown(etag)} is not current: {shown(name)} changed "
                "since it was read; read it again and retry"
            )

    def _entry(
        self, user: str, rate: int, tier: str | None, exempt: bool
    ) -> Limit | None:
        if not rate and tier is None and not exempt:
            return None
        fields = (rate or None, tier, exempt)
        return Limit(user, rate, tier, exempt, self._limit_etag(user, fields))

    def _entry_of(self, doc: TableDocument, user: str) -> Limit:
        entry = self._entry(
            user,
            doc.user_rates.get(user, 0),
            doc.memberships.get(user),
            user in doc.exempt_users,
        )
        assert entry is not None  # ``user`` is one of doc.users()
        return entry

    def _tier_of(self, doc: TableDocument, tier: str, members: Counter[str]) -> Tier:
        rate = doc.tier_rates.get(tier)
        exempt = tier in doc.exempt_tiers
        return Tier(
            tier, rate or 0, exempt, members[tier], self._tier_etag(tier, rate, exempt)
        )

    def _table(self, doc: TableDocument, etag: str) -> LimitsTable:
        members = Counter(doc.memberships.values())
        return LimitsTable(
            default_tokens_per_second=doc.default_rate or 0,
            limits=[self._entry_of(doc, user) for user in sorted(doc.users())],
            etag=etag,
            tiers=[self._tier_of(doc, tier, members) for tier in sorted(doc.tiers)],
        )

    def _check_room(self, count: int) -> None:
        if count > MAX_EXPLICIT_LIMITS:
            raise ResourceExhausted(
                f"the table holds at most {MAX_EXPLICIT_LIMITS} users with a "
                "limit, tier or exemption; delete some first"
            )

    def _commit_entry(
        self, doc: TableDocument, user: str, entry: _EntryFields
    ) -> Limit:
        """Commits ``user``'s new entry (all None/False: removed). Requires
        self._changes."""
        rate, tier, exempt = entry
        users, memberships = dict(doc.user_rates), dict(doc.memberships)
        exempt_users = set(doc.exempt_users)
        _put(users, user, rate)
        _put(memberships, user, tier)
        if exempt:
            exempt_users.add(user)
        else:
            exempt_users.discard(user)
        new = dataclasses.replace(
            doc,
            user_rates=users,
            memberships=memberships,
            exempt_users=frozenset(exempt_users),
        )

        def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
            # Exempt first and lift last: the user is never briefly limited.
            if exempt:
                limiter.set_user_exempt(user, True, now_ns)
            limiter.set_rate(user, rate, now_ns)
            limiter.set_membership(user, tier, now_ns)
            if not exempt:
                limiter.set_user_exempt(user, False, now_ns)

        self._commit(new, apply)
        return self._entry(user, rate or 0, tier, exempt) or Limit(user, 0)

    def _commit_tier(
        self, doc: TableDocument, tier: str, rate: int | None, exempt: bool
    ) -> Tier:
        """Commits ``tier``'s new rate and exemption (None and False: removed;
        FailedPrecondition while it has members). Requires self._changes."""
        members = sum(1 for t in doc.memberships.values() if t == tier)
        if rate is None and not exempt and members:
            raise FailedPrecondition(
                f"{shown(names.tier_name(tier))} has {members} member(s): move "
                "them to another tier (or remove their tier) first"
            )
        rates = dict(doc.tier_rates)
        _put(rates, tier, rate)
        exempt_tiers = set(doc.exempt_tiers)
        if exempt:
            exempt_tiers.add(tier)
        else:
            exempt_tiers.discard(tier)
        new = dataclasses.replace(
            doc, tier_rates=rates, exempt_tiers=frozenset(exempt_tiers)
        )

        def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
            # Additions before removals: the tier never stops existing midway.
            if exempt:
                limiter.set_tier_exempt(tier, True, now_ns)
            if rate is not None or tier in limiter.tier_rates:
                limiter.set_tier_rate(tier, rate, now_ns)
            if not exempt and tier in limiter.exempt_tiers:
                limiter.set_tier_exempt(tier, False, now_ns)

        self._commit(new, apply)
        if rate is None and not exempt:
            return Tier(tier, 0, False)
        return Tier(
            tier, rate or 0, exempt, members, self._tier_etag(tier, rate, exempt)
        )

    def _commit(
        self, doc: TableDocument, apply: _Apply | None, *, table: bool = True
    ) -> str:
        """Persists ``doc`` (the whole new table and mode), applies it and
        announces it; returns the table's etag. Requires self._changes."""
        backend = self._hub.backend
        if backend is not None or self._global_store:
            self._publish(backend, doc)
        elif self._persist is not None:
            try:
                self._persist(doc)
            except OSError as exc:
                raise Unavailable(
                    f"the change was not applied: writing the config file failed: {exc}"
                ) from None
        etag = self._apply(doc, apply, table=table)
        self._shared.wake()
        return etag

    def _publish(
        self, backend: global_limits.LimitsBackend | None, doc: TableDocument
    ) -> None:
        """Makes ``doc`` every engine's through the store. Requires
        self._changes (the hub's lock)."""
        if backend is None:
            raise Unavailable(
                "the change was not applied: the limits store is not connected yet"
            )
        assert doc.mode is not None  # _current always reads the mode
        try:
            backend.publish(doc.default_rate, doc.limit_table(), doc.mode)
        except global_limits.LimitsConflict:
            raise Aborted(
                "the limits table was changed through another engine since this "
                "engine read it; it is applied here now: read it again and retry"
            ) from None
        except global_limits.LimitsUnavailable as exc:
            raise Unavailable(
                f"the change was not applied: the limits store did not take it: {exc}"
            ) from None

    def _changed_elsewhere(self) -> None:
        """A table from another engine was applied: the table etag moves.
        Called with shared.lock held."""
        self._generation += 1

    def _apply(self, doc: TableDocument, apply: _Apply | None, *, table: bool) -> str:
        """Runs ``apply`` on the limiter, makes ``doc.mode`` the mode and, for a
        change of the table, bumps the etag; returns it. Requires
        self._changes."""
        shared = self._shared
        with shared.lock:
            if apply is not None:
                apply(shared.limiter, shared.clock())
            if doc.mode is not None:
                shared.mode = doc.mode
            if table:
                self._generation += 1
            return self._etag()

    def _resume(self, scope: str, page_token: str) -> list[Any] | None:
        return self._tokens.decode(page_token, scope) if page_token else None


#: An entry's fields: own rate (None: none), tier (None: none), exempt.
_EntryFields = tuple[int | None, str | None, bool]


def _entry_fields(doc: TableDocument, user: str) -> _EntryFields | None:
    """``user``'s entry in ``doc``, or None without one."""
    fields = (
        doc.user_rates.get(user),
        doc.memberships.get(user),
        user in doc.exempt_users,
    )
    return None if fields == (None, None, False) else fields


def _replace_with(doc: TableDocument) -> _Apply:
    """Applies the default and the whole table of ``doc`` (the core's table is
    built here, off the scheduler lock)."""
    table = doc.limit_table()
    default = doc.default_rate

    def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
        if default is not None and default != limiter.default_rate:
            limiter.set_default_rate(default, now_ns)
        limiter.replace_limits(table, now_ns)

    return apply


def _put(mapping: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``mapping[key]``, or removes it for ``None``."""
    if value is None:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _check_tier_exists(doc: TableDocument, tier: str | None, *, field: str) -> None:
    if tier is not None and tier not in doc.tiers:
        raise FailedPrecondition(
            f"{field}: {shown(names.tier_name(tier))} does not exist; create it first"
        )


def _check_tier_room(doc: TableDocument) -> None:
    if len(doc.tiers) >= MAX_TIERS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_TIERS} tiers; delete some first"
        )


def _entry_rate(rate: int, optional: bool, where: str) -> int | None:
    """A resource's own rate: ``None`` for 0 when ``optional`` (it has a tier
    or an exemption instead), else a valid rate."""
    if rate == 0 and optional:
        return None
    return check_rate(rate, field=f"{where}.tokens_per_second")


@dataclass(frozen=True)
class _Order:
    """A parsed ``order_by``: fields with directions; ties broken by user."""

    fields: tuple[tuple[str, bool], ...]  # (field, descending)

    @classmethod
    def parse(cls, order_by: str, *, field: str) -> _Order:
        parsed: list[tuple[str, bool]] = []
        for item in filter(None, (part.strip() for part in order_by.split(","))):
            words = item.split()
            name, direction = words[0], words[1:]
            if direction not in ([], ["asc"], ["desc"]):
                raise InvalidArgument(
                    f"{field}: {shown(item)} must be a field name optionally "
                    "followed by asc or desc"
                )
            descending = direction == ["desc"]
            if name == "user":
                if descending:
                    raise InvalidArgument(f"{field}: user can only be sorted ascending")
                break  # user ids are unique: nothing after them matters
            if name not in COLUMNS:
                raise InvalidArgument(
                    f"{field}: cannot sort by {shown(name)}; sortable fields: "
                    f"user, {', '.join(COLUMNS)}"
                )
            if any(name == seen for seen, _ in parsed):
                raise InvalidArgument(f"{field}: {name} appears more than once")
            parsed.append((name, descending))
        return cls(tuple(parsed))

    @property
    def canonical(self) -> str:
        return ",".join(f"{n} desc" if d else n for n, d in self.fields) or "user"

    def keys(self, reading: Reading, users: Iterable[str]) -> list[tuple[Any, ...]]:
        """Each user's sort key, ending with the user id: ascending tuple order
        is the requested order. One pass per field (this runs under the
        shared limiter's lock for every known user)."""
        columns = [
            (reading.column(name), -1 if desc else 1) for name, desc in self.fields
        ]
        if not columns:
            return [(user,) for user in users]
        if len(columns) == 1:
            ((column, sign),) = columns
            return [(sign * column.get(user, 0), user) for user in users]
        return [
            (*[sign * column.get(user, 0) for column, sign in columns], user)
            for user in users
        ]


def _mask_fields(
    update_mask: Sequence[str], mutable: Sequence[str], given: set[str]
) -> set[str]:
    """The fields an update changes: those the mask names (``*``: all of
    ``mutable``), or with an empty mask those ``given`` (set in the request),
    or the first mutable field when none is."""
    fields: set[str] = set()
    for path in update_mask:
        if path == "*":
            fields.update(mutable)
        elif path in mutable:
            fields.add(path)
        else:
            raise InvalidArgument(
                f"update_mask: cannot update {shown(path)}; mutable: "
                f"{', '.join(mutable)}"
            )
    if update_mask:
        return fields
    return given or {mutable[0]}


def _set_fields(set_: dict[str, bool]) -> set[str]:
    """The fields a request sets (non-default values), for an empty mask."""
    return {name for name, is_set in set_.items() if is_set}


def _page_size(page_size: int) -> int:
    if page_size < 0:
        raise InvalidArgument(f"page_size must not be negative, got {page_size}")
    return min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _no_limit(user: str) -> NotFound:
    return NotFound(
        f"{shown(names.limit_name(user))} does not exist: the user has no "
        "entry (the default applies)"
    )


def _no_tier(tier: str) -> NotFound:
    return NotFound(f"{shown(names.tier_name(tier))} does not exist")
