"""Per-user state reads: one user, a page of users in ``order_by`` order, and
the updates of a watch (validated once by ``plan_watch``).

Invariant: a read never holds ``shared.lock`` (held by the scheduler for each
step) for more than ``KEYS_PER_HOLD`` users' sort keys or ``STATES_PER_HOLD``
users' states (``control.service.holds``), whatever the number of users, so
a step waits behind a read for at most about a millisecond. The names are
copied under one hold (C-level copies, no per-user Python work), the keys read
hold after hold, the page chosen off the lock, then its states read hold after
hold. Each state is of
one instant (one ``Reading``); the states of one page may be of a few
consecutive step boundaries, and the order is that of the keys as read.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from control import names
from control.errors import InvalidArgument, NotFound
from control.pagination import PageTokens
from control.resources import CeilingState, FairShareState, UserState
from control.service.holds import KEYS_PER_HOLD, STATES_PER_HOLD, let_a_step_in
from control.service.ordering import MAX_PAGE_SIZE, Order, page_size, resume
from control.table import shown
from pacing.budget import StoreViews
from pacing.fair_share import FairShare
from pacing.shared import Reading, SharedLimiter

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


@dataclass(frozen=True)
class WatchPlan:
    """A validated watch: either ``users`` (explicit) or the first ``max_users``
    in ``order`` order."""

    interval_ns: int
    users: tuple[str, ...]
    order: Order
    max_users: int


def get_user_state(shared: SharedLimiter, name: str) -> UserState:
    """The state of the user named ``userStates/{user}``; NotFound for a user
    the limiter does not know."""
    user = names.parse_user(name, names.USER_STATES, field="name")
    with shared.lock:
        reading = shared.read()
        if not _knows(shared, reading, user):
            raise NotFound(
                f"{shown(names.user_state_name(user))}: the limiter does "
                "not know this user (no entry, request or counters)"
            )
        return _states(shared, reading, [user])[0]


def list_user_states(
    shared: SharedLimiter,
    tokens: PageTokens,
    requested_size: int,
    page_token: str,
    order_by: str,
) -> tuple[list[UserState], str]:
    """One page of user states in ``order_by`` order, and the next page's
    token ("" on the last page)."""
    size = page_size(requested_size)
    order = Order.parse(order_by, field="order_by")
    scope = f"userStates?order_by={order.canonical}"
    after = resume(tokens, scope, page_token)
    page = _first(shared, order, size + 1, None if after is None else tuple(after))
    states = _states_in_holds(shared, [key[-1] for key in page[:size]])
    token = ""
    if len(page) > size:
        token = tokens.encode(scope, list(page[size - 1]))
    return states, token


def plan_watch(
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
    order = Order.parse(order_by or MOST_THROTTLED_FIRST, field="order_by")
    if max_users < 0:
        raise InvalidArgument(f"max_users must not be negative, got {max_users}")
    max_users = min(max_users or DEFAULT_WATCH_USERS, MAX_PAGE_SIZE)
    return WatchPlan(interval_ns, users, order, max_users)


def watch_states(shared: SharedLimiter, plan: WatchPlan) -> list[UserState]:
    """The states one update of ``plan`` holds."""
    if plan.users:
        users: Sequence[str] = plan.users
    else:
        users = [key[-1] for key in _first(shared, plan.order, plan.max_users, None)]
    return _states_in_holds(shared, users)


def _first(
    shared: SharedLimiter, order: Order, count: int, after: tuple[Any, ...] | None
) -> list[tuple[Any, ...]]:
    """The ``count`` smallest sort keys of the known users (after ``after``,
    when given), read ``KEYS_PER_HOLD`` users per hold of the lock."""
    names = _users(shared)
    first: list[tuple[Any, ...]] = []
    for start in range(0, len(names), KEYS_PER_HOLD):
        chunk = names[start : start + KEYS_PER_HOLD]
        with shared.lock:
            keys = order.keys(shared.read(), chunk)
        let_a_step_in()
        if after is not None:
            keys = [key for key in keys if key > after]
        first = heapq.nsmallest(count, [*first, *keys])
    return first


def _states_in_holds(shared: SharedLimiter, users: Sequence[str]) -> list[UserState]:
    """The states of those of ``users`` the limiter knows, in their order, read
    ``STATES_PER_HOLD`` users per hold of the lock."""
    states = []
    for start in range(0, len(users), STATES_PER_HOLD):
        with shared.lock:
            reading = shared.read()
            known = [
                user
                for user in users[start : start + STATES_PER_HOLD]
                if _knows(shared, reading, user)
            ]
            states += _states(shared, reading, known)
        let_a_step_in()
    return states


def _users(shared: SharedLimiter) -> list[str]:
    """The users the limiter knows: with an entry (a weight, a prompt rate, a
    ceiling or a band alone included), live requests or counters. Holds the
    lock only to copy the names (C-level copies); merges them off the lock."""
    limiter = shared.limiter
    with shared.lock:
        reading = shared.read()
        copies = [
            [*reading.explicit_rates],
            [*reading.counts],
            [*reading.counters],
            [*limiter.memberships],
            [*limiter.exempt_users],
            [*shared.fair_share.weights.users],
            [*shared.prompt.limiter.user_rates],
            [*shared.ceilings.table.user_rates],
            [*shared.bands.users],
        ]
    return list(set().union(*copies))


def _knows(shared: SharedLimiter, reading: Reading, user: str) -> bool:
    """Whether ``user`` is one of ``_users``. Requires shared.lock."""
    limiter = shared.limiter
    return (
        reading.knows(user)
        or limiter.tier_of(user) is not None
        or user in limiter.exempt_users
        or user in shared.fair_share.weights.users
        or shared.prompt.limiter.limit_source(user).kind == "user"
        or shared.ceilings.table.limit_source(user).kind == "user"
        or user in shared.bands.users
    )


def _states(
    shared: SharedLimiter, reading: Reading, users: Iterable[str]
) -> list[UserState]:
    """Each of ``users``' state with its limit's source, its standing under
    fair share, its ceiling, its band and, with a global store, its view of
    the store. Requires shared.lock."""
    limiter = shared.limiter
    # Builds the borrowing budget while any holder has a ceiling.
    views = _store_views(shared.budget)
    ceilings = shared.ceilings
    borrowing = ceilings.borrowing
    ledger = shared.fair_share
    floor = _backlogged_floor(ledger)
    bands = shared.bands
    teams = shared.teams
    states = []
    for user in users:
        counters = reading.counters.get(user)
        tier = limiter.tier_of(user)
        backlogged = floor is not None and user in ledger.backlogged
        states.append(
            UserState(
                snapshot=reading.snapshot(user),
                source=limiter.limit_source(user),
                tier=tier,
                shadow_skips=0 if counters is None else counters.shadow_skips,
                mode=shared.mode,
                engine_late_ns=0 if counters is None else counters.engine_late_ns,
                fair_share=FairShareState(
                    weight=ledger.weights.of(user, tier),
                    service=0.0 if counters is None else counters.fair_share_service,
                    preemptions=0
                    if counters is None
                    else counters.fair_share_preemptions,
                    enabled=ledger.enabled,
                    backlogged=backlogged,
                    lead=ledger.of(user) - floor
                    if backlogged and floor is not None
                    else 0.0,
                ),
                ceiling=CeilingState(
                    ceiling=ceilings.table.rate_of(user),
                    borrowed_tokens=0 if counters is None else counters.borrowed_tokens,
                    may_borrow=borrowing is not None and borrowing.spare_for(user),
                ),
                store=None if views is None else views.store_view(user, reading.now_ns),
                band=bands.name_of(bands.index_of(user, tier, teams.team_of(user))),
            )
        )
    return states


def _store_views(budget: object) -> StoreViews | None:
    """The global store's budget under ``budget``: the budget itself, or the
    one a wrapper spends from (the borrowing budget over it while any holder
    has a ceiling, the teams' while any team exists: each holds it as
    ``base``); None without a store."""
    while budget is not None:
        if isinstance(budget, StoreViews):
            return budget
        budget = getattr(budget, "base", None)
    return None


def _backlogged_floor(ledger: FairShare) -> float | None:
    """The smallest counter among the users backlogged at the last step; None
    with fair share off (the last step's set is stale) or nobody backlogged.
    Requires shared.lock."""
    if not ledger.enabled or not ledger.backlogged:
        return None
    return min(ledger.of(user) for user in ledger.backlogged)
