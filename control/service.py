"""The control plane's operations, free of gRPC: validation, the limits table
with its etag, per-user state reads, pagination.

Every read and write goes through ``SharedLimiter.lock`` (see
``pacing.shared``). Changes are also serialised among themselves by a
second lock, held while the new table is written to the config file; the
scheduler never waits for that write, only for the in-memory apply. Order of a
change: validate, write the new table (``persist``), apply it to the limiter and
bump the etag under the shared limiter's lock, then ``wake()`` the engine. A
failed write applies nothing.
"""

from __future__ import annotations

import heapq
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from control import names
from control.errors import (
    Aborted,
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from control.pagination import PageTokens
from control.table import (
    MAX_EXPLICIT_LIMITS,
    TableDocument,
    check_rate,
    check_table_size,
    check_user,
    shown,
)
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
#: The only mutable field of ``Limit`` and ``DefaultLimit``.
_RATE_FIELD = "tokens_per_second"


@dataclass(frozen=True)
class Limit:
    """One user's explicit limit."""

    user: str
    tokens_per_second: int

    @property
    def name(self) -> str:
        return names.limit_name(self.user)


@dataclass(frozen=True)
class LimitsTable:
    """The default and all explicit limits (sorted by user), with the etag."""

    default_tokens_per_second: int  #: 0 while pacing is off
    limits: list[Limit] = field(default_factory=list)
    etag: str = ""


@dataclass(frozen=True)
class WatchPlan:
    """A validated watch: either ``users`` (explicit) or the first ``max_users``
    in ``order`` order."""

    interval_ns: int
    users: tuple[str, ...]
    order: _Order
    max_users: int


class LimitsService:
    """Reads and changes the limits of ``shared``'s limiter; see the module docstring.

    ``persist``, when given, durably stores a whole new table before it is
    applied (raises OSError on failure). ``page_tokens`` signs page tokens
    (a fresh random key by default).
    """

    def __init__(
        self,
        shared: SharedLimiter,
        *,
        persist: Callable[[TableDocument], None] | None = None,
        page_tokens: PageTokens | None = None,
    ) -> None:
        self._shared = shared
        self._persist = persist
        self._tokens = page_tokens or PageTokens()
        self._changes = threading.Lock()
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
        _check_mask(update_mask)
        rate = check_rate(tokens_per_second, field="default_limit.tokens_per_second")
        with self._changes:
            _, users = self._table()
            self._commit(rate, users)
        return rate

    # -- one user's limit --------------------------------------------------

    def get_limit(self, name: str) -> Limit:
        """The explicit limit named ``limits/{user}``; NotFound without one."""
        user = names.parse_user(name, names.LIMITS, field="name")
        with self._shared.lock:
            rate = self._shared.limiter.user_rates.get(user)
        if rate is None:
            raise _no_limit(user)
        return Limit(user, rate)

    def create_limit(self, limit_id: str, tokens_per_second: int) -> Limit:
        """Gives user ``limit_id`` an explicit limit; AlreadyExists if it has one."""
        user = check_user(limit_id, field="limit_id")
        rate = check_rate(tokens_per_second, field="limit.tokens_per_second")
        with self._changes:
            default, users = self._table()
            if user in users:
                raise AlreadyExists(
                    f"{shown(names.limit_name(user))} exists; use UpdateLimit"
                )
            self._check_room(len(users) + 1)
            users[user] = rate
            self._commit(default, users)
        return Limit(user, rate)

    def update_limit(
        self,
        name: str,
        tokens_per_second: int,
        update_mask: Sequence[str],
        *,
        allow_missing: bool,
    ) -> Limit:
        """Changes the explicit limit ``name``; creates it with ``allow_missing``."""
        user = names.parse_user(name, names.LIMITS, field="limit.name")
        _check_mask(update_mask)
        rate = check_rate(tokens_per_second, field="limit.tokens_per_second")
        with self._changes:
            default, users = self._table()
            if user not in users:
                if not allow_missing:
                    raise _no_limit(user)
                self._check_room(len(users) + 1)
            users[user] = rate
            self._commit(default, users)
        return Limit(user, rate)

    def delete_limit(self, name: str, *, allow_missing: bool) -> None:
        """Removes the explicit limit ``name`` (the default applies again)."""
        user = names.parse_user(name, names.LIMITS, field="name")
        with self._changes:
            default, users = self._table()
            if user not in users:
                if allow_missing:
                    return
                raise _no_limit(user)
            del users[user]
            self._commit(default, users)

    def list_limits(self, page_size: int, page_token: str) -> tuple[list[Limit], str]:
        """One page of explicit limits in user id order, and the next page's
        token ("" on the last page)."""
        size = _page_size(page_size)
        after = self._resume("limits", page_token)
        with self._shared.lock:
            rates = self._shared.limiter.user_rates  # a copy: sort off the lock
        candidates = rates if after is None else (u for u in rates if u > after[0])
        page = heapq.nsmallest(size + 1, candidates)
        token = ""
        if len(page) > size:
            page = page[:size]
            token = self._tokens.encode("limits", [page[-1]])
        return [Limit(user, rates[user]) for user in page], token

    # -- the whole table ---------------------------------------------------

    def get_limits_table(self, name: str) -> LimitsTable:
        """The default and every explicit limit, with the current etag."""
        names.check_singleton(name, names.LIMITS_TABLE, field="name")
        with self._shared.lock:
            default, users = self._table_locked()
            etag = self._etag()
        return _table(default or 0, users, etag)

    def replace_limits_table(
        self,
        default_tokens_per_second: int,
        limits: Iterable[tuple[str, int]],
        etag: str,
    ) -> LimitsTable:
        """Replaces the default and all explicit limits at once; Aborted when
        ``etag`` is not empty and not the current etag. ``limits`` holds
        (``limits/{user}``, tokens/s) pairs."""
        default = check_rate(
            default_tokens_per_second, field="limits_table.default_tokens_per_second"
        )
        users: dict[str, int] = {}
        for index, (name, rate) in enumerate(limits):
            field_name = f"limits_table.limits[{index}]"
            user = names.parse_user(name, names.LIMITS, field=f"{field_name}.name")
            if user in users:
                raise InvalidArgument(
                    f"{field_name}.name: {shown(names.limit_name(user))} "
                    "appears more than once"
                )
            users[user] = check_rate(rate, field=f"{field_name}.tokens_per_second")
        check_table_size(len(users))
        with self._changes:
            if etag and etag != self._etag():
                raise Aborted(
                    f"etag {shown(etag)} is not current: the table changed "
                    "since it was read; read it again and retry"
                )
            new_etag = self._commit(default, users)
        return _table(default, users, new_etag)

    def reload(self, read: Callable[[], TableDocument | None]) -> bool:
        """Makes the document ``read()`` returns the table, without persisting it
        (it came from the config file); ``None`` or an equal table changes
        nothing, a missing default keeps the current one. ``read`` runs under the
        change lock, so no RPC change interleaves. Returns whether the table
        changed."""
        with self._changes:
            doc = read()
            if doc is None:
                return False
            default, users = self._table()
            new_default = doc.default_rate if doc.default_rate is not None else default
            if (new_default, dict(doc.user_rates)) == (default, users):
                return False
            self._apply(new_default, dict(doc.user_rates))
        self._shared.wake()
        return True

    # -- user state --------------------------------------------------------

    def get_user_state(self, name: str) -> UserSnapshot:
        """The state of the user named ``userStates/{user}``; NotFound for a user
        the limiter does not know."""
        user = names.parse_user(name, names.USER_STATES, field="name")
        with self._shared.lock:
            reading = self._shared.read()
            if not reading.knows(user):
                raise NotFound(
                    f"{shown(names.user_state_name(user))}: the limiter does "
                    "not know this user (no explicit limit, request or counters)"
                )
            return reading.snapshot(user)

    def list_user_states(
        self, page_size: int, page_token: str, order_by: str
    ) -> tuple[list[UserSnapshot], str]:
        """One page of user states in ``order_by`` order, and the next page's
        token ("" on the last page)."""
        size = _page_size(page_size)
        order = _Order.parse(order_by, field="order_by")
        scope = f"userStates?order_by={order.canonical}"
        after = self._resume(scope, page_token)
        with self._shared.lock:
            reading = self._shared.read()
            keys = order.keys(reading, reading.users())
            if after is not None:
                position = tuple(after)
                keys = [key for key in keys if key > position]
            page = heapq.nsmallest(size + 1, keys)
            states = [reading.snapshot(key[-1]) for key in page[:size]]
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

    def watch_states(self, plan: WatchPlan) -> list[UserSnapshot]:
        """The states one update of ``plan`` holds, read at one instant."""
        with self._shared.lock:
            reading = self._shared.read()
            if plan.users:
                users = [u for u in plan.users if reading.knows(u)]
            else:
                keys = plan.order.keys(reading, reading.users())
                users = [key[-1] for key in heapq.nsmallest(plan.max_users, keys)]
            return [reading.snapshot(u) for u in users]

    # -- helpers -----------------------------------------------------------

    def _table(self) -> tuple[int | None, dict[str, int]]:
        with self._shared.lock:
            return self._table_locked()

    def _table_locked(self) -> tuple[int | None, dict[str, int]]:
        """(default, None while pacing is off; copy of the explicit limits).
        Requires shared.lock."""
        limiter = self._shared.limiter
        return limiter.default_rate, limiter.user_rates

    @property
    def limit_changes(self) -> int:
        """How many new tables were committed: one per successful write RPC
        (even one that leaves the table as it was) and one per load of the config
        file that changed the table, the load at start-up included."""
        return self._generation

    def _etag(self) -> str:
        return f"{self._epoch}-{self._generation}"

    def _check_room(self, count: int) -> None:
        if count > MAX_EXPLICIT_LIMITS:
            raise ResourceExhausted(
                f"the table holds at most {MAX_EXPLICIT_LIMITS} explicit limits; "
                "delete some first"
            )

    def _commit(self, default: int | None, users: dict[str, int]) -> str:
        """Persists, applies and announces a whole new table; returns its etag.
        Requires self._changes."""
        if self._persist is not None:
            try:
                self._persist(TableDocument(default_rate=default, user_rates=users))
            except OSError as exc:
                raise Unavailable(
                    f"the change was not applied: writing the config file failed: {exc}"
                ) from None
        etag = self._apply(default, users)
        self._shared.wake()
        return etag

    def _apply(self, default: int | None, users: dict[str, int]) -> str:
        """Makes (``default``, ``users``) the limiter's table, keeping every user's
        token debt, and bumps the etag; returns it. Requires self._changes."""
        shared = self._shared
        with shared.lock:
            limiter = shared.limiter
            now_ns = shared.clock()
            if default is not None and default != limiter.default_rate:
                limiter.set_default_rate(default, now_ns)
            current = limiter.user_rates
            for user in current.keys() - users.keys():
                limiter.set_rate(user, None, now_ns)
            for user, rate in users.items():
                if current.get(user) != rate:
                    limiter.set_rate(user, rate, now_ns)
            self._generation += 1
            return self._etag()

    def _resume(self, scope: str, page_token: str) -> list[Any] | None:
        return self._tokens.decode(page_token, scope) if page_token else None


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


def _check_mask(update_mask: Sequence[str]) -> None:
    for path in update_mask:
        if path not in ("*", _RATE_FIELD):
            raise InvalidArgument(
                f"update_mask: cannot update {shown(path)}; the only mutable "
                f"field is {_RATE_FIELD}"
            )


def _page_size(page_size: int) -> int:
    if page_size < 0:
        raise InvalidArgument(f"page_size must not be negative, got {page_size}")
    return min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _no_limit(user: str) -> NotFound:
    return NotFound(
        f"{shown(names.limit_name(user))} does not exist: the user has no "
        "explicit limit (the default applies)"
    )


def _table(default: int, users: Mapping[str, int], etag: str) -> LimitsTable:
    return LimitsTable(
        default_tokens_per_second=default,
        limits=[Limit(user, rate) for user, rate in sorted(users.items())],
        etag=etag,
    )
