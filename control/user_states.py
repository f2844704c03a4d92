"""Per-user state reads: one user, a page of users in ``order_by`` order, and
the updates of a watch (validated once by ``plan_watch``).

Invariant: every state a call returns is read under one hold of
``shared.lock`` from one ``Reading``, so the states of one answer (one page, one
watch update) are of the same instant.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from control import names
from control.errors import InvalidArgument, NotFound
from control.ordering import MAX_PAGE_SIZE, Order, page_size, resume
from control.pagination import PageTokens
from control.resources import FairShareState, UserState
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
    with shared.lock:
        reading = shared.read()
        keys = order.keys(reading, _users(shared, reading))
        if after is not None:
            position = tuple(after)
            keys = [key for key in keys if key > position]
        page = heapq.nsmallest(size + 1, keys)
        states = _states(shared, reading, [key[-1] for key in page[:size]])
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
    """The states one update of ``plan`` holds, read at one instant."""
    with shared.lock:
        reading = shared.read()
        if plan.users:
            users = [u for u in plan.users if _knows(shared, reading, u)]
        else:
            keys = plan.order.keys(reading, _users(shared, reading))
            users = [key[-1] for key in heapq.nsmallest(plan.max_users, keys)]
        return _states(shared, reading, users)


def _users(shared: SharedLimiter, reading: Reading) -> set[str]:
    """The users the limiter knows: with an entry (a weight alone included),
    live requests or counters. Requires shared.lock."""
    limiter = shared.limiter
    return reading.users().union(
        limiter.memberships, limiter.exempt_users, shared.fair_share.weights.users
    )


def _knows(shared: SharedLimiter, reading: Reading, user: str) -> bool:
    """Whether ``user`` is one of ``_users``. Requires shared.lock."""
    limiter = shared.limiter
    return (
        reading.knows(user)
        or limiter.tier_of(user) is not None
        or user in limiter.exempt_users
        or user in shared.fair_share.weights.users
    )


def _states(
    shared: SharedLimiter, reading: Reading, users: Iterable[str]
) -> list[UserState]:
    """Each of ``users``' state with its limit's source, its standing under
    fair share and, with a global store, its view of the store. Requires
    shared.lock."""
    limiter = shared.limiter
    budget = shared.budget
    views = budget if isinstance(budget, StoreViews) else None
    ledger = shared.fair_share
    floor = _backlogged_floor(ledger)
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
                store=None if views is None else views.store_view(user, reading.now_ns),
            )
        )
    return states


def _backlogged_floor(ledger: FairShare) -> float | None:
    """The smallest counter among the users backlogged at the last step; None
    with fair share off (the last step's set is stale) or nobody backlogged.
    Requires shared.lock."""
    if not ledger.enabled or not ledger.backlogged:
        return None
    return min(ledger.of(user) for user in ledger.backlogged)
