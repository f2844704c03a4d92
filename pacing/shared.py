"""The seam between the scheduler and the control plane: one lock around the
limiter and its counters.

Concurrency design. The limiter and the accounting are plain objects driven by
the engine-core's scheduler thread; the control plane runs in gRPC worker
threads of the same process. Instead of a command queue drained at step
boundaries, both sides share ``SharedLimiter.lock``:

- the scheduler holds it for the whole of each ``schedule()`` call (which is
  where every ``try_take``, ``refund``, counter update and idle-user cleanup
  happens) and calls ``on_step(now_ns)`` before releasing it;
- the control plane takes it for every read and every write.

So a change lands between two steps, exactly as a queued command would, and a
read sees the state of one step boundary: limits, TATs and counters of all
users agree with each other (a consistent snapshot). Holding one lock for a
step costs the scheduler one uncontended acquire and release (well under a
microsecond); the price is that a control-plane call delays the next step by
as long as it holds the lock, so control-plane code under the lock never does
I/O and a read of user states holds it for a bounded number of users at a time
(``control.service.user_states``: about 1 ms per hold; a get well under 1 ms). A
tier's rate or exemption change is
O(members) in C set and dict operations plus a rescale of each member holding
state (at 50,000 members, about 5 ms when few hold state, 55 ms when all
do). A change then calls ``wake()`` so that an engine idle-waiting on the
limiter re-plans with the new limits at once instead of after its current wait
(at most 50 ms).

Also here: each user's recent tokens/s, sampled from the accounting's net
charged tokens (charged minus refunds) once per ``rate_interval_ns``; and the
attached control plane's counters for the metrics (``control_snapshot``), so
that the scheduler reads them from the facade, never from the control plane.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TypeVar

from pacing.accounting import Accounting, UserCounters
from pacing.budget import BudgetSource
from pacing.ceilings import Ceilings, TeamLending
from pacing.fair_share import FairShare
from pacing.fair_share_policy import policy_of as share_policy_of
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.model import Policy, policy_of
from pacing.prompt_budget import PromptBudgets
from pacing.recent_rate import NS_PER_S, RecentRates
from pacing.store_stats import StoreStats
from pacing.teams import TeamBudget, Teams

_V = TypeVar("_V")

#: ``request_counts()`` result: user -> (running requests, throttled requests).
RequestCounts = Mapping[str, tuple[int, int]]

#: ``UserCounters`` attribute behind each counter column (those of
#: ``UserSnapshot`` and the fair-share ones).
_COUNTER_FIELDS = {
    "tokens_charged": "charged",
    "refunds": "refunds",
    "throttled_skips": "throttled_skips",
    "throttled_preemptions": "throttled_preemptions",
    "fair_share_service": "fair_share_service",
    "fair_share_preemptions": "fair_share_preemptions",
}
_REQUEST_FIELDS = {"running_requests": 0, "throttled_requests": 1}
#: Numeric ``UserSnapshot`` fields ``Reading.column`` gives for all users at once.
COLUMNS = (*_COUNTER_FIELDS, *_REQUEST_FIELDS, "recent_tokens_per_second")


@dataclass(frozen=True)
class UserSnapshot:
    """One user's limiter state at one instant; durations in nanoseconds."""

    user: str
    limit: int  #: tokens/s that apply (explicit or default); 0 when pacing is off
    tat_lead_ns: int
    next_token_in_ns: int
    tokens_charged: int
    refunds: int
    throttled_skips: int
    throttled_preemptions: int
    running_requests: int
    throttled_requests: int
    recent_tokens_per_second: float
    #: The prompt budget (``pacing.prompt_budget``): the prompt rate that
    #: applies to the user itself (own, tier's, default's; 0: none), its TAT
    #: lead and time to its next prompt token, and its prompt counters.
    prompt_limit: int
    prompt_tat_lead_ns: int
    prompt_next_token_in_ns: int
    prompt_tokens_charged: int
    prompt_held_skips: int
    prompt_shadow_holds: int
    prompt_wait_ns: int


@dataclass(frozen=True)
class ControlPlaneSnapshot:
    """Cumulative control-plane events at one moment (for the metrics)."""

    limit_changes: int = 0  #: committed limit tables, the start-up load included
    config_reloads: Mapping[str, int] = field(default_factory=dict)  # result -> n
    rpcs: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (m, code)


class SharedLimiter:
    """Owns the lock under which the scheduler and the control plane use the
    limiter and the accounting; see the module docstring.

    ``clock`` returns monotonic nanoseconds (the scheduler's clock).
    ``request_counts`` returns each user's (running, throttled) request counts;
    it is called with the lock held from a control-plane thread, so it must only
    read scheduler state that is changed under the lock, or copy what it reads
    atomically. ``wake`` interrupts the engine's idle wait; ``None`` when nothing
    waits (tests, or an engine without the idle-wait hook).
    """

    def __init__(
        self,
        limiter: OutputRateLimiter,
        accounting: Accounting,
        clock: Callable[[], int],
        request_counts: Callable[[], RequestCounts] = dict,
        wake: Callable[[], None] | None = None,
        *,
        rate_window_ns: int = 5 * NS_PER_S,
        rate_interval_ns: int = NS_PER_S,
        mode: Mode = Mode.ENFORCE,
        budget: BudgetSource | None = None,
        fair_share: FairShare | None = None,
        teams: Teams | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.limiter = limiter
        self._budget = budget
        #: This engine core's data-parallel index (0 without data parallelism):
        #: a part served once per server, the control plane, attaches on 0 only.
        self.engine_index = 0
        self.accounting = accounting
        self.clock = clock
        self._request_counts = request_counts
        self._wake = wake
        self._recent = RecentRates(rate_window_ns, rate_interval_ns)
        self._control_snapshot: Callable[[], ControlPlaneSnapshot] | None = None
        #: How the scheduler acts on the limiter's decisions; read at the start
        #: of every step, changed (like limits) only under the lock.
        self.mode = mode
        #: The store's traffic and state for the metrics, with a store
        #: configured (set by whatever starts the claimer, which updates it
        #: under the lock); ``None`` without one: no store metrics.
        self.store_stats: StoreStats | None = None
        #: Weighted fair share (``pacing.fair_share``): its switch, weights and
        #: counters; read every step, changed only under the lock.
        self.fair_share = FairShare() if fair_share is None else fair_share
        #: Teams (``pacing.teams``): their table, cells and in-team fair queue;
        #: a member's weight inside its team is its fair-share weight.
        self.teams = Teams(burst_ns=limiter.burst_ns) if teams is None else teams
        self.teams.weight_of = self._member_weight
        in_force = replace(
            policy
            or policy_of(
                default_rate=limiter.default_rate,
                table=limiter.limits(),
                teams=self.teams.table,
                share=share_policy_of(self.fair_share),
            ),
            mode=None,
            fair_share=None,
        )
        self._policy = in_force
        #: The prompt rates (``pacing.prompt_budget``): built from the policy in
        #: force, and rebuilt whenever it is replaced (``policy``).
        self.prompt = PromptBudgets(in_force)
        self.prompt.teams.weight_of = self._member_weight
        # The gateway's team of a user's live requests holds for both rates.
        self.prompt.teams.gateway_teams = self.teams.gateway_teams
        #: The ceilings (``pacing.ceilings``): built from the policy in force,
        #: and rebuilt whenever it is replaced (``policy``).
        self.ceilings = Ceilings(in_force)
        #: The priority bands (``pacing.bands``) of the policy in force.
        self.bands = in_force.band_table()
        self._team_budget: TeamBudget | None = None

    @property
    def policy(self) -> Policy:
        """The policy in force: what the limiter's table, the teams and the
        weights were built from (given at start; read back from them when
        not), its mode and switch aside (``mode`` and ``fair_share.enabled``
        hold them). Replaced with them, in the same hold of the lock, by
        whatever applies a new table; the prompt rates follow it here."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        now_ns = self.clock()
        self.prompt.apply(policy, now_ns)
        self.ceilings.apply(policy, now_ns)
        self.bands = policy.band_table()

    @property
    def budget(self) -> BudgetSource:
        """What the scheduler spends tokens from (``pacing.budget``): the limiter
        itself, unless a global store's claimed balances stand in; under the
        borrowing budget (``pacing.ceilings``) while any holder has a ceiling;
        wrapped in the teams' budget (``pacing.teams``) while any team exists."""
        base = self.limiter if self._budget is None else self._budget
        teams = self.teams
        if self.ceilings.active:
            limiter = self.limiter
            base = self.ceilings.over(
                base, limiter.rate_of, self.accounting, limiter.burst_ns, teams.team_of
            )
        if not teams.table:
            return base
        lending = self.team_lending
        team_budget = self._team_budget
        if (
            team_budget is None
            or team_budget.base is not base
            or team_budget.lending is not lending
        ):
            team_budget = self._team_budget = TeamBudget(
                base, teams, self.limiter.rate_of, lending
            )
        return team_budget

    @property
    def team_lending(self) -> TeamLending | None:
        """The teams' borrow cells while a team has a ceiling
        (``pacing.ceilings``), over the borrowing budget of ``budget``."""
        return self.ceilings.lending(self.teams.cells.rate_of)

    def policy_in_force(self) -> Policy:
        """The policy in force with its mode and fair-share switch (copies:
        the caller may keep it). Requires the lock."""
        return replace(self.policy, mode=self.mode, fair_share=self.fair_share.enabled)

    def _member_weight(self, user: str) -> float:
        return self.fair_share.weights.of(user, self.limiter.tier_of(user))

    def use_budget(self, budget: BudgetSource | None) -> None:
        """Makes ``budget`` what the scheduler spends from (``None``: the
        limiter again). Call with the lock held, before the scheduler caches
        anything from the old source, or bump ``budget.limit_changes``."""
        self._budget = budget

    def on_step(self, now_ns: int) -> None:
        """Records the end of a scheduling step at ``now_ns`` (samples recent
        rates when due). Requires the lock held."""
        self._recent.observe(now_ns, self._net_charged)

    def wake(self) -> None:
        """Makes an idle-waiting engine schedule again now. Call without the lock."""
        wake = self._wake
        if wake is not None:
            wake()

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Sets the ``wake`` callable once the engine exists (the scheduler, and
        so the shared limiter, is built before the engine loop's input queue is
        reachable from it)."""
        self._wake = wake

    def control_snapshot(self) -> ControlPlaneSnapshot | None:
        """The attached control plane's counters now; ``None`` when none is
        attached. Any thread, with or without the lock."""
        source = self._control_snapshot
        return None if source is None else source()

    def set_control_snapshot(
        self, source: Callable[[], ControlPlaneSnapshot] | None
    ) -> None:
        """Sets where ``control_snapshot`` reads from (the control plane, when it
        attaches); ``None`` detaches it."""
        self._control_snapshot = source

    def read(self) -> Reading:
        """Starts a read at the clock's current time. Requires the lock held for
        as long as the reading is used."""
        return Reading(self)

    def _net_charged(self) -> dict[str, int]:
        return {
            user: c.charged - c.refunds for user, c in self.accounting.by_user().items()
        }


class Reading:
    """Everything one control-plane read needs, gathered once at ``now_ns``.

    Only valid while the shared limiter's lock is held (it shares the
    accounting's dict).
    """

    def __init__(self, shared: SharedLimiter) -> None:
        self.now_ns = shared.clock()
        # A read may take a due sample too (the engine may be idle).
        shared._recent.observe(self.now_ns, shared._net_charged)
        self._limiter = shared.limiter
        self._prompt = shared.prompt.limiter
        self._recent = shared._recent
        self.counts: RequestCounts = shared._request_counts()
        self.explicit_rates: Mapping[str, int] = shared.limiter.user_rates
        self.counters: Mapping[str, UserCounters] = shared.accounting.by_user()

    def users(self) -> set[str]:
        """Users the limiter knows: with an explicit limit, live requests or
        counters."""
        return set().union(self.explicit_rates, self.counts, self.counters)

    def knows(self, user: str) -> bool:
        """Whether ``user`` is one of ``users()``."""
        return (
            user in self.explicit_rates or user in self.counts or user in self.counters
        )

    def column(
        self, name: str, users: Iterable[str] | None = None
    ) -> Mapping[str, float]:
        """Field ``name`` (one of ``COLUMNS``) of ``users`` (None: of every
        user), in one pass; users missing from the result have 0."""
        counters = self.counters if users is None else _of(self.counters, users)
        if name in _COUNTER_FIELDS:
            get = attrgetter(_COUNTER_FIELDS[name])
            return {user: get(c) for user, c in counters.items()}
        if name in _REQUEST_FIELDS:
            index = _REQUEST_FIELDS[name]
            counts = self.counts if users is None else _of(self.counts, users)
            return {user: n[index] for user, n in counts.items()}
        if name == "recent_tokens_per_second":
            totals = {u: c.charged - c.refunds for u, c in counters.items()}
            return self._recent.rates(self.now_ns, totals)
        raise ValueError(f"no column {name!r}; columns: {', '.join(COLUMNS)}")

    def recent_rate(self, user: str) -> float:
        """``user``'s net charged tokens/s over the last few seconds."""
        counters = self.counters.get(user)
        total = 0 if counters is None else counters.charged - counters.refunds
        return self._recent.rate(user, self.now_ns, total)

    def snapshot(self, user: str) -> UserSnapshot:
        """``user``'s state (zeros for a user the limiter does not know)."""
        now_ns = self.now_ns
        counters = self.counters.get(user) or UserCounters()
        running, throttled = self.counts.get(user, (0, 0))
        prompt = self._prompt
        return UserSnapshot(
            user=user,
            limit=self._limiter.rate_of(user),
            tat_lead_ns=self._limiter.lead_ns(user, now_ns),
            next_token_in_ns=self._limiter.ready_at_ns(user, now_ns) - now_ns,
            tokens_charged=counters.charged,
            refunds=counters.refunds,
            throttled_skips=counters.throttled_skips,
            throttled_preemptions=counters.throttled_preemptions,
            running_requests=running,
            throttled_requests=throttled,
            recent_tokens_per_second=self.recent_rate(user),
            prompt_limit=prompt.rate_of(user),
            prompt_tat_lead_ns=prompt.lead_ns(user, now_ns),
            prompt_next_token_in_ns=prompt.ready_at_ns(user, now_ns) - now_ns,
            prompt_tokens_charged=counters.prompt_tokens_charged,
            prompt_held_skips=counters.prompt_held_skips,
            prompt_shadow_holds=counters.prompt_shadow_holds,
            prompt_wait_ns=counters.prompt_wait_ns,
        )


def _of(mapping: Mapping[str, _V], users: Iterable[str]) -> dict[str, _V]:
    """The entries of ``mapping`` for ``users`` that it holds."""
    return {user: mapping[user] for user in users if user in mapping}
