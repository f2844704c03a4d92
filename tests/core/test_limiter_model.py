"""Model check of ``OutputRateLimiter`` with tiers, exemptions and pacing modes.

A Hypothesis state machine drives the limiter, inside the ``SharedLimiter`` the
scheduler and the control plane share, with random sequences of ``try_take``,
``available`` and that many takes, the scheduler's paced step (``take_up_to``
for a user's demand, then a ``refund`` of what was not dispatched), its free
step (``take_each``), ``refund`` of one or more tokens, changes of user limits,
tier rates, memberships and exemptions (one at a time, or on a copy of the table
handed back through ``replace_limits``), default-rate changes, pacing-mode
changes, idle-user cleanup and clock steps: standing still (also within a rule:
many calls at one instant), forward and, in some runs, back.

Modes act as ``engine_ext/scheduling/steps.py`` applies them (``pacing.modes``): the
mode is read from ``SharedLimiter.mode`` at each step and changed under its
lock. ``enforce`` and ``shadow`` make the same limiter calls; what ``enforce``
refuses is a throttled skip there and a shadow skip (run uncharged) in
``shadow``. ``off`` makes no limiter call at all (nothing charged, refunded or
recorded), while limit changes and idle cleanup go on.

The reference model is naive: the limit table as plain dicts and sets, resolved
by its own reading of the rules in ``pacing.limits``; each user's limit history
cut into *segments* of constant effective limit; the time of every net granted
token (a refund takes back the latest charge not yet refunded, as in
``tests/core/test_limiter.py``); and which users hold state. After every step it
checks, in exact integer arithmetic:

1. ``rate_of`` and ``limit_source`` of every user are the model's.
2. An unlimited user (exempt, or no default rate) is always granted, has
   ``available == UNLIMITED``, and holds no state: ``tracked_users()`` is exactly
   the number of users the model says have state (created by a take while
   limited, dropped by becoming unlimited or by a cleanup of an idle user).
3. Upper bound, whatever the clock did: any two net grants ``i < j`` (call
   order) of one segment at rate ``r`` satisfy ``(j - i) * T <= t_j - t_i +
   burst``, which implies at most ``(W + burst) * r + 1`` grants in any window of
   ``W`` inside the segment.
4. Lower bound: a user who takes everything available at each of a run of
   demand times ``t_0 < ... < t_k`` at most ``burst`` apart (the first of them
   granting at least one token; nothing else done for that user, its limit
   constant, the clock not stepping back) gets more than ``(t_j - t_i) * r - 1``
   tokens at the demand times in ``(t_i, t_j]``: after such a take the TAT is
   in ``(t + burst, t + burst + T]``, so it never falls behind the next demand
   and every token in between is counted.
5. ``available`` is the number of ``try_take`` calls that succeed in a row,
   never more than a full bucket.
6. Every change of limits keeps each affected user's token debt in tokens (the
   lead before and after are the roundings of one debt at the two rates);
   users whose limit did not change are untouched; a user who becomes limited
   after an exemption starts with at most a full bucket (exactly one when the
   clock never stepped back).
7. Cleanup never changes an answer: on a clock that never steps back, a twin
   limiter that never cleans, and that gets every change one at a time, gives
   the same answer to every question. (With steps back the cleaned limiter may
   be stricter, as ``cleanup_idle_users`` documents, and the twin is left out.)
   The twin gets ``take_up_to`` and ``take_each`` as that many ``try_take``
   calls, so the same check proves they charge exactly as those would.
8. ``take_up_to(most)`` takes ``min(most, available)`` and reports the rest
   available; ``take_each`` of counts within what is available leaves
   ``available - count``; a refund of what a step did not dispatch leaves the
   user as if only the dispatched tokens had been taken.
9. Modes: a mode change changes no answer and is not a change of limits
   (``limit_changes`` stays); every valid change of limits bumps
   ``limit_changes`` by one, an invalid one not at all. ``off`` charges
   nothing, and promise 3 spans every mode change, so switching back hands out
   no burst (only what the kept state and the elapsed time allow, at most a
   full bucket). The accounting's counters are those the model counted: tokens
   charged, refunds, throttled skips only in ``enforce``, shadow skips only in
   ``shadow``.
10. Budget only grows with time (what the scheduler's headroom cache relies
    on): on a clock that never steps back, with no change of limits, a user's
    ``available`` never drops by more than the tokens taken in between.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from pacing.accounting import Accounting, UserCounters
from pacing.limiter import (
    DEFAULT_BURST_NS,
    NS_PER_S,
    UNLIMITED,
    LimitSource,
    LimitTable,
    OutputRateLimiter,
)
from pacing.modes import Mode
from pacing.shared import SharedLimiter

MS = 1_000_000
USERS = ("ann", "bob", "cat", "dan")
TIERS = ("free", "pro", "staff")
RATES = st.sampled_from([1, 3, 7, 10, 20, 40, 333, 1000]) | st.integers(1, 1000)
BURSTS = st.sampled_from([0, 1, 30 * MS, DEFAULT_BURST_NS]) | st.integers(0, 200 * MS)
users = st.sampled_from(USERS)
tiers = st.sampled_from(TIERS)


def full_bucket(rate: int, burst: int) -> int:
    """What a fresh user may take at once: ``burst * rate + 1`` tokens."""
    return burst * rate // NS_PER_S + 1


def debt_kept(lead: int, rate: int, new_lead: int, new_rate: int) -> bool:
    """Whether ``lead`` ns at ``rate`` and ``new_lead`` ns at ``new_rate`` can be
    the rounded-up leads of one debt ``d`` (in ns * tokens/s, an integer):
    ``lead = ceil(d / rate)``, ``new_lead = ceil(d / new_rate)``."""
    if lead == 0 or new_lead == 0:
        return lead == new_lead
    low = max((lead - 1) * rate, (new_lead - 1) * new_rate)
    return low < min(lead * rate, new_lead * new_rate)


@st.composite
def tables(draw: st.DrawFn) -> dict:
    """A valid limit table over ``USERS`` and ``TIERS``."""
    tier_rates = draw(st.dictionaries(tiers, RATES))
    exempt_tiers = draw(st.sets(tiers, max_size=1))
    existing = sorted(tier_rates.keys() | exempt_tiers)
    memberships = (
        draw(st.dictionaries(users, st.sampled_from(existing))) if existing else {}
    )
    return {
        "user_rates": draw(st.dictionaries(users, RATES)),
        "tier_rates": tier_rates,
        "memberships": memberships,
        "exempt_users": draw(st.sets(users, max_size=1)),
        "exempt_tiers": exempt_tiers,
    }


@dataclass
class UserModel:
    """What the model keeps for one user."""

    rate: int = 0  #: effective limit, 0 when unlimited
    segment: int = 0  #: bumped whenever ``rate`` changes
    #: Net charges, oldest first: (segment, time). A refund pops the last one.
    charges: list[tuple[int, int]] = field(default_factory=list)
    #: Demand run for the lower bound: (time, tokens granted since its start).
    demand: list[tuple[int, int]] = field(default_factory=list)
    #: What the accounting must hold for the user (promise 9).
    counted: UserCounters = field(default_factory=UserCounters)


class LimiterModel(RuleBasedStateMachine):
    """The limiter in its shared facade (and, on a monotone clock, a twin that
    never cleans) against the reference model; see the module docstring."""

    # -- set-up --------------------------------------------------------------------

    @initialize(
        default=st.one_of(st.none(), RATES, RATES, RATES),
        burst=BURSTS,
        start=st.integers(-(10**15), 10**15),
        monotone=st.booleans(),
        table=tables(),
        mode=st.sampled_from(Mode),
    )
    def setup(
        self,
        default: int | None,
        burst: int,
        start: int,
        monotone: bool,
        table: dict,
        mode: Mode,
    ) -> None:
        self.now = start
        self.burst = burst
        self.monotone = monotone
        self.default = default
        self.user_rates: dict[str, int] = dict(table["user_rates"])
        self.tier_rates: dict[str, int] = dict(table["tier_rates"])
        self.tier_of: dict[str, str] = dict(table["memberships"])
        self.exempt_users: set[str] = set(table["exempt_users"])
        self.exempt_tiers: set[str] = set(table["exempt_tiers"])
        rest = {k: v for k, v in table.items() if k != "user_rates"}
        self.lim = OutputRateLimiter(default, table["user_rates"], burst, **rest)
        self.shared = SharedLimiter(
            self.lim, Accounting(), clock=lambda: self.now, mode=mode
        )
        self.twin = (
            OutputRateLimiter(default, table["user_rates"], burst, **rest)
            if monotone
            else None
        )
        self.users = {u: UserModel(rate=self.resolve(u)[0]) for u in USERS}
        self.with_state: set[str] = set()  # users holding state in ``lim``
        self.twin_with_state: set[str] = set()
        # Promise 10: the last step's answers, and the tokens taken since.
        self.seen: tuple[int, int, dict[str, int]] | None = None
        self.taken_since: Counter[str] = Counter()

    def limiters(self) -> list[OutputRateLimiter]:
        return [self.lim] if self.twin is None else [self.lim, self.twin]

    # -- the model's own resolution ------------------------------------------------

    def resolve(self, user: str) -> tuple[int, LimitSource]:
        if self.default is None:
            return 0, LimitSource("off")
        if user in self.exempt_users:
            return 0, LimitSource("exempt")
        if user in self.user_rates:
            return self.user_rates[user], LimitSource("user")
        tier = self.tier_of.get(user)
        if tier is None:
            return self.default, LimitSource("default")
        if tier in self.exempt_tiers:
            return 0, LimitSource("exempt", tier)
        return self.tier_rates[tier], LimitSource("tier", tier)

    def tier_exists(self, tier: str) -> bool:
        return tier in self.tier_rates or tier in self.exempt_tiers

    def has_members(self, tier: str) -> bool:
        return tier in self.tier_of.values()

    # -- the clock -----------------------------------------------------------------

    @rule(data=st.data())
    def clock_step(self, data: st.DataObject) -> None:
        """Moves the clock: not at all, a little, up to a burst, up to 2 s, or,
        in runs that allow it, back by up to 2 s."""
        steps = [
            st.just(0),
            st.integers(0, 5 * MS),
            st.integers(0, DEFAULT_BURST_NS),
            st.integers(0, 2 * NS_PER_S),
        ]
        if not self.monotone:
            steps.append(st.integers(-2 * NS_PER_S, -1))
        self.now += data.draw(st.one_of(steps), label="dt")

    # -- the pacing mode -----------------------------------------------------------

    @rule(mode=st.sampled_from(Mode))
    def set_mode(self, mode: Mode) -> None:
        """The control plane switches the mode under the lock: no answer
        changes, and it is no change of limits (promise 9)."""
        before = {u: answers(self.lim, u, self.now) for u in USERS}
        changes = self.lim.limit_changes
        with self.shared.lock:
            self.shared.mode = mode
        assert self.lim.limit_changes == changes
        assert {u: answers(self.lim, u, self.now) for u in USERS} == before

    def calls_limiter(self) -> bool:
        """Whether the scheduler's step calls the limiter in the mode now (all
        but ``off``). Requires the lock held, as the step holds it."""
        return self.shared.mode is not Mode.OFF

    def count_step(
        self, user: str, charged: int, refunds: int = 0, refused: int = 0
    ) -> None:
        """Records a step's events in the accounting as the scheduler does in
        the mode now, and in the model (promise 9)."""
        counted = self.users[user].counted
        accounting = self.shared.accounting
        if charged:
            accounting.record_charged({user: charged})
            counted.charged += charged
        if refunds:
            accounting.record(user, "refunds", refunds)
            counted.refunds += refunds
        if refused:
            shadow = self.shared.mode is Mode.SHADOW
            accounting.record(
                user, "shadow_skips" if shadow else "throttled_skips", refused
            )
            if shadow:
                counted.shadow_skips += refused
            else:
                counted.throttled_skips += refused
        self.taken_since[user] += charged

    # -- taking and refunding ------------------------------------------------------

    @rule(user=users)
    def take(self, user: str) -> None:
        with self.shared.lock:
            if not self.calls_limiter():
                self.end_demand(user)
                return
            model = self.users[user]
            granted = [lim.try_take(user, self.now) for lim in self.limiters()]
            assert len(set(granted)) == 1, f"{user}: cleaned, twin disagree {granted}"
            self.end_demand(user)
            self.count_step(user, int(granted[0]), refused=int(not granted[0]))
            if model.rate == 0:
                assert granted[0], f"{user} is not limited, yet refused"
                return
            self.created_state(user)
            if granted[0]:
                self.grant(user, 1)

    @rule(user=users, data=st.data())
    def take_available(self, user: str, data: st.DataObject) -> None:
        """Asks ``available``, then takes that many, or a few more or fewer."""
        available = min(self.lim.available(user, self.now), 50)
        most = st.just(available + 1) | st.integers(0, available + 3)
        self.take_many(user, data.draw(most, label="most"))

    @rule(user=users, data=st.data())
    def stream(self, user: str, data: st.DataObject) -> None:
        """Continuous demand: takes everything available, and is refused once
        more, at each of a few times at most a burst apart (promise 4)."""
        gaps = st.lists(st.integers(0, self.burst) | st.just(self.burst), max_size=25)
        for gap in data.draw(gaps, label="gaps"):
            self.now += gap
            self.take_many(user, min(self.lim.available(user, self.now), 50) + 1)

    def take_many(self, user: str, most: int) -> None:
        """``most`` takes in a row at one instant: the first ``available``
        succeed, the rest are refused (promise 5)."""
        with self.shared.lock:
            if not self.calls_limiter():
                self.end_demand(user)
                return
            model = self.users[user]
            available = self.lim.available(user, self.now)
            if model.rate == 0:
                assert available == UNLIMITED
                for lim in self.limiters():
                    assert all(lim.try_take(user, self.now) for _ in range(most))
                self.count_step(user, most)
                return
            assert available <= full_bucket(model.rate, self.burst)
            taken = min(most, available)
            want = [True] * taken + [False] * (most - taken)
            for lim in self.limiters():
                got = [lim.try_take(user, self.now) for _ in range(most)]
                assert got == want, f"{user}: {available} available, takes went {got}"
            self.count_step(user, taken, refused=most - taken)
            if most:
                self.created_state(user)
            self.grant(user, taken)
            if most > available:
                self.demanded(user, taken)
            else:
                self.end_demand(user)

    @rule(user=users, data=st.data())
    def paced_step(self, user: str, data: st.DataObject) -> None:
        """The scheduler's paced step for one user: one ``take_up_to`` for its
        demand (its live requests), then one refund of the tokens charged but
        not dispatched (promise 8). The twin takes the same one by one."""
        with self.shared.lock:
            if not self.calls_limiter():
                self.end_demand(user)
                return
            model = self.users[user]
            available = self.lim.available(user, self.now)
            most = data.draw(
                st.integers(0, 8) | st.just(min(available, 50) + 1), label="demand"
            )
            taken, remaining = self.lim.take_up_to(user, most, self.now)
            lost = data.draw(st.just(0) | st.integers(0, taken), label="undispatched")
            if lost:
                self.lim.refund(user, self.now, lost)
            if self.twin is not None:
                got = [self.twin.try_take(user, self.now) for _ in range(most)]
                assert got == [True] * taken + [False] * (most - taken), (user, got)
                if lost:
                    self.twin.refund(user, self.now, lost)
            self.count_step(user, taken, refunds=lost, refused=most - taken)
            if model.rate == 0:
                assert (taken, remaining) == (most, UNLIMITED - most), user
                assert self.lim.available(user, self.now) == UNLIMITED
                return
            assert (taken, remaining) == (
                min(most, available),
                available - min(most, available),
            ), f"{user}: {available} available, demand {most}"
            after = self.lim.available(user, self.now)
            assert after == available - taken + lost, f"{user}: {after} after refund"
            self.with_state.add(user)  # take_up_to creates it, even for 0
            if most:
                self.twin_with_state.add(user)
            self.grant(user, taken - lost)
            if most > available and not lost:
                self.demanded(user, taken)
            else:
                self.end_demand(user)

    @rule(data=st.data())
    def free_step(self, data: st.DataObject) -> None:
        """The scheduler's free step: users known to have budget for all their
        demand are charged it after the fact in one ``take_each`` (promise 8);
        the twin takes the same one by one."""
        with self.shared.lock:
            if not self.calls_limiter():
                return
            counts: dict[str, int] = {}
            before: dict[str, int] = {}
            for user in data.draw(st.lists(users, unique=True), label="users"):
                before[user] = self.lim.available(user, self.now)
                if before[user]:
                    most = min(before[user], 20)
                    counts[user] = data.draw(st.integers(1, most), label=user)
            remaining = self.lim.take_each(counts, self.now)
            assert remaining.keys() == counts.keys()
            for user, count in counts.items():
                if self.twin is not None:
                    assert all(self.twin.try_take(user, self.now) for _ in range(count))
                self.count_step(user, count)
                self.end_demand(user)
                if self.users[user].rate == 0:
                    assert remaining[user] == UNLIMITED, user
                    continue
                assert remaining[user] == before[user] - count, user
                assert self.lim.available(user, self.now) == remaining[user], user
                self.created_state(user)
                self.grant(user, count)

    @rule(user=users, count=st.just(1) | st.integers(1, 5))
    def refund(self, user: str, count: int) -> None:
        with self.shared.lock:
            self.end_demand(user)
            if not self.calls_limiter():
                return
            for lim in self.limiters():
                lim.refund(user, self.now, count)
            self.count_step(user, 0, refunds=count)
            charges = self.users[user].charges
            del charges[max(0, len(charges) - count) :]

    # -- changing limits -----------------------------------------------------------

    @rule(user=users, rate=st.none() | RATES, whole=st.booleans())
    def set_user_rate(self, user: str, rate: int | None, whole: bool) -> None:
        def model() -> None:
            if rate is None:
                self.user_rates.pop(user, None)
            else:
                self.user_rates[user] = rate

        self.change(
            model,
            lambda lim: lim.set_rate(user, rate, self.now),
            lambda table: table.set_user_rate(user, rate),
            valid=True,
            whole=whole,
        )

    @rule(user=users, exempt=st.booleans(), whole=st.booleans())
    def set_user_exempt(self, user: str, exempt: bool, whole: bool) -> None:
        def model() -> None:
            if exempt:
                self.exempt_users.add(user)
            else:
                self.exempt_users.discard(user)

        self.change(
            model,
            lambda lim: lim.set_user_exempt(user, exempt, self.now),
            lambda table: table.set_user_exempt(user, exempt),
            valid=True,
            whole=whole,
        )

    @rule(user=users, tier=st.none() | tiers, whole=st.booleans())
    def set_membership(self, user: str, tier: str | None, whole: bool) -> None:
        def model() -> None:
            if tier is None:
                self.tier_of.pop(user, None)
            else:
                self.tier_of[user] = tier

        self.change(
            model,
            lambda lim: lim.set_membership(user, tier, self.now),
            lambda table: table.set_membership(user, tier),
            valid=tier is None or self.tier_exists(tier),
            whole=whole,
        )

    @rule(tier=tiers, rate=st.none() | RATES, whole=st.booleans())
    def set_tier_rate(self, tier: str, rate: int | None, whole: bool) -> None:
        def model() -> None:
            if rate is None:
                self.tier_rates.pop(tier, None)
            else:
                self.tier_rates[tier] = rate

        removes = rate is None and tier not in self.exempt_tiers
        self.change(
            model,
            lambda lim: lim.set_tier_rate(tier, rate, self.now),
            lambda table: table.set_tier_rate(tier, rate),
            valid=not (removes and self.has_members(tier)),
            whole=whole,
        )

    @rule(tier=tiers, exempt=st.booleans(), whole=st.booleans())
    def set_tier_exempt(self, tier: str, exempt: bool, whole: bool) -> None:
        def model() -> None:
            if exempt:
                self.exempt_tiers.add(tier)
            else:
                self.exempt_tiers.discard(tier)

        removes = not exempt and tier not in self.tier_rates
        self.change(
            model,
            lambda lim: lim.set_tier_exempt(tier, exempt, self.now),
            lambda table: table.set_tier_exempt(tier, exempt),
            valid=not (removes and self.has_members(tier)),
            whole=whole,
        )

    @rule(rate=RATES)
    def set_default_rate(self, rate: int) -> None:
        def model() -> None:
            self.default = rate

        self.change(
            model,
            lambda lim: lim.set_default_rate(rate, self.now),
            None,
            valid=True,
            whole=False,
        )

    def change(
        self,
        model: Callable[[], object],
        one: Callable[[OutputRateLimiter], object],
        on_table: Callable[[LimitTable], object] | None,
        *,
        valid: bool,
        whole: bool,
    ) -> None:
        """Makes one change of limits: on the limiter directly (``one``) or, when
        ``whole``, on a copy of its table handed back through ``replace_limits``;
        the twin always gets it directly. An invalid change must raise
        ValueError and change nothing. Then checks promise 6."""
        before = {
            u: (
                self.lim.rate_of(u),
                self.lim.lead_ns(u, self.now),
                u in self.with_state,
            )
            for u in USERS
        }
        changes = [lim.limit_changes for lim in self.limiters()]
        with self.shared.lock:
            self.change_each(one, on_table, valid=valid, whole=whole)
        assert [lim.limit_changes for lim in self.limiters()] == [
            n + valid for n in changes
        ], "a valid change counts once, an invalid one not at all"
        if valid:
            model()
        for user, (rate, lead, had_state) in before.items():
            self.limit_may_have_changed(user, rate, lead, had_state)

    def change_each(
        self,
        one: Callable[[OutputRateLimiter], object],
        on_table: Callable[[LimitTable], object] | None,
        *,
        valid: bool,
        whole: bool,
    ) -> None:
        for lim in self.limiters():
            if whole and lim is self.lim and on_table is not None:
                table = lim.limits()
                if not valid:
                    with pytest.raises(ValueError):
                        on_table(table)
                    continue
                on_table(table)
                lim.replace_limits(table, self.now)
            elif valid:
                one(lim)
            else:
                with pytest.raises(ValueError):
                    one(lim)

    def limit_may_have_changed(
        self, user: str, rate: int, lead: int, had_state: bool
    ) -> None:
        model = self.users[user]
        new_rate = self.resolve(user)[0]
        new_lead = self.lim.lead_ns(user, self.now)
        if new_rate == model.rate:
            assert new_lead == lead, f"{user}: untouched, yet lead {lead}->{new_lead}"
            return
        model.rate = new_rate
        model.segment += 1
        model.demand.clear()
        if new_rate == 0:
            self.with_state.discard(user)
            self.twin_with_state.discard(user)
        elif not had_state:
            # A fresh start (after an exemption, or limiting turned on, or no
            # state yet): at most a full bucket.
            available = self.lim.available(user, self.now)
            fresh = full_bucket(new_rate, self.burst)
            assert available == fresh if self.monotone else available <= fresh
        else:
            assert debt_kept(lead, rate, new_lead, new_rate), (
                f"{user}: lead {lead} ns at {rate}/s became {new_lead} at {new_rate}/s"
            )

    # -- cleanup -------------------------------------------------------------------

    @rule()
    def cleanup(self) -> None:
        """Idle-user cleanup, which the engine runs in every mode."""
        idle = {u for u in self.with_state if self.lim.lead_ns(u, self.now) == 0}
        with self.shared.lock:
            assert self.lim.cleanup_idle_users(self.now) == len(idle)
        self.with_state -= idle

    # -- bookkeeping ---------------------------------------------------------------

    def created_state(self, user: str) -> None:
        self.with_state.add(user)
        self.twin_with_state.add(user)

    def grant(self, user: str, count: int) -> None:
        """Records ``count`` grants at now and checks promise 3 for the last."""
        if count == 0:
            return
        model = self.users[user]
        model.charges.extend([(model.segment, self.now)] * count)
        times = [t for seg, t in model.charges if seg == model.segment]
        last = len(times) - 1
        for i, t_i in enumerate(times[:last]):
            assert (last - i) * NS_PER_S <= (
                self.now - t_i + self.burst
            ) * model.rate, (
                f"{user}: grants #{i} at {t_i} and #{last} at {self.now} "
                f"at {model.rate} tok/s"
            )

    def demanded(self, user: str, taken: int) -> None:
        """``user`` took everything available: extends its demand run and checks
        promise 4 against every earlier demand time of the run."""
        demand = self.users[user].demand
        if demand and not 0 <= self.now - demand[-1][0] <= self.burst:
            demand.clear()
        if not demand:
            if taken:
                demand.append((self.now, taken))
            return
        total = demand[-1][1] + taken
        rate = self.users[user].rate
        for t_i, total_i in demand:
            got = total - total_i
            assert got * NS_PER_S > (self.now - t_i) * rate - NS_PER_S, (
                f"{user}: {got} tokens in ({t_i}, {self.now}] at {rate} tok/s"
            )
        demand.append((self.now, total))

    def end_demand(self, user: str) -> None:
        self.users[user].demand.clear()

    # -- after every step ----------------------------------------------------------

    @invariant()
    def answers_match_the_model(self) -> None:
        now = self.now
        for user in USERS:
            rate, source = self.resolve(user)
            assert (self.lim.rate_of(user), self.lim.limit_source(user)) == (
                rate,
                source,
            ), user
            lead = self.lim.lead_ns(user, now)
            ready = self.lim.ready_at_ns(user, now)
            available = self.lim.available(user, now)
            if rate == 0:
                assert (lead, ready, available) == (0, now, UNLIMITED), user
            else:
                assert lead >= 0
                assert ready == max(now, now + lead - self.burst), user
                assert available <= full_bucket(rate, self.burst), user
                assert (available > 0) == (ready == now), user
        assert self.lim.tracked_users() == len(self.with_state)

    @invariant()
    def counters_are_the_models(self) -> None:
        for user in USERS:
            assert self.shared.accounting.of(user) == self.users[user].counted, user

    @invariant()
    def budget_only_grows_with_time(self) -> None:
        """Promise 10, between the previous step's answers and these."""
        now, changes = self.now, self.lim.limit_changes
        available = {u: self.lim.available(u, now) for u in USERS}
        if self.monotone and self.seen is not None:
            then, then_changes, then_available = self.seen
            if changes == then_changes:
                assert now >= then
                for user in USERS:
                    floor = then_available[user] - self.taken_since[user]
                    assert available[user] >= floor, (
                        f"{user}: {then_available[user]} available at {then}, "
                        f"{self.taken_since[user]} taken, {available[user]} at {now}"
                    )
        self.seen = (now, changes, available)
        self.taken_since.clear()

    @invariant()
    def cleanup_changes_no_answer(self) -> None:
        if self.twin is None:
            return
        for user in USERS:
            got = answers(self.lim, user, self.now)
            want = answers(self.twin, user, self.now)
            assert got == want, f"{user}: cleaned {got}, twin {want}"
        assert self.twin.tracked_users() == len(self.twin_with_state)


def answers(lim: OutputRateLimiter, user: str, now: int) -> tuple[object, ...]:
    return (
        lim.rate_of(user),
        lim.limit_source(user),
        lim.available(user, now),
        lim.ready_at_ns(user, now),
        lim.lead_ns(user, now),
    )


# About 9 s of CPU here: the suite's budget for this check is 20 s.
LimiterModel.TestCase.settings = settings(
    max_examples=450, stateful_step_count=50, deadline=None
)
TestTheLimiterKeepsTheReferenceModelsPromises = LimiterModel.TestCase
