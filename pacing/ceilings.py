"""Ceilings: a holder's rate is guaranteed, its ceiling may be borrowed from
capacity nobody else is waiting for (pure: no vLLM, the clock passed in).

Vocabulary (HTB's *rate* and *ceil*):

- *ceiling*: a holder's ``ceiling_tokens_per_second`` (``pacing.policy``), at
  least its rate, resolved as the rate is (``pacing.limits``: the user's own,
  its tier's, the default). Unset: no borrowing.
- *borrow cell*: a GCRA cell per user at ``ceiling - rate`` (the same 100 ms
  burst as the rate), apart from the user's own budget: tokens borrowed are
  never charged to the rate, so borrowing leaves no debt against it, and any
  window of ``W`` seconds holds at most ``(W + burst) * ceiling + 2`` tokens
  (each cell's bound, summed).
- *needy*: a holder within its rate (it has budget of its own) with a request
  that waits to start: the scheduler finds them at every step's start
  (``engine_ext.scheduling.spare``) and says so with ``lend_to``.
- *spare* for a holder: no holder but itself is needy. Only then does it
  borrow; otherwise it gets its own budget alone, from that step on.

Teams, one level up: a team's ceiling gives the team a borrow cell at
``ceiling - rate`` beside its cell (``TeamLending``), spent once the team's
rate is, while no user outside the team is needy; its members still hold to
their own rates and ceilings.

The rate is what a global store shares across engines; the borrow cells are
this engine's own, so a holder borrows each engine's spare capacity apart.

Not thread-safe; the owner serialises access (the shared limiter's lock).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from pacing.accounting import Accounting
from pacing.budget import BudgetSource
from pacing.limiter import NO_DEFAULT, NS_PER_S, OutputRateLimiter
from pacing.policy.model import Policy

#: The policy attribute that holds a ceiling.
CEILING = "ceiling_tokens_per_second"


def sets_ceilings(policy: Policy) -> bool:
    """Whether any holder of ``policy`` has a ceiling."""
    holders = [
        policy.default,
        *(limits for groups in policy.groups.values() for limits in groups.values()),
        *(entry.limits for entry in policy.users.values()),
    ]
    return any(limits.ceiling_tokens_per_second is not None for limits in holders)


class BorrowCells(OutputRateLimiter):
    """Borrow cells, one per holder (a user, or a team) that borrows, each at
    its ``ceiling - rate``: a table of GCRA cells with the rate's burst."""

    def __init__(self, burst_ns: int) -> None:
        super().__init__(NO_DEFAULT, {}, burst_ns, table_only=True)

    def lent_rate(self, holder: str, rate: int, ceiling: int, now_ns: int) -> int:
        """``holder``'s borrow cell rate for ``rate`` and ``ceiling``, the cell
        kept at it (0: none: no rate, or a ceiling not above it)."""
        lent = ceiling - rate if rate else 0
        current = self.rate_of(holder)
        if lent <= 0:
            if current:
                self.set_rate(holder, None, now_ns)
            return 0
        if current != lent:
            self.set_rate(holder, lent, now_ns)
        return lent

    def refund_ahead(self, holder: str, count: int, now_ns: int) -> int:
        """Gives back up to ``count`` to ``holder``'s cell, as far as it is
        charged ahead of now (never more than was borrowed); how many it took
        back."""
        lent = self.rate_of(holder)
        if not lent:
            return 0
        back = min(count, self.lead_ns(holder, now_ns) * lent // NS_PER_S)
        if back:
            self.refund(holder, now_ns, back)
        return back

    def forget_idle(self, now_ns: int, live: Collection[str]) -> None:
        """Drops the cells of holders not in ``live`` whose cell is full again
        (a returning holder starts where it would anyway)."""
        for holder in [h for h in self.user_rates if h not in live]:
            if not self.lead_ns(holder, now_ns):
                self.set_rate(holder, None, now_ns)


class Ceilings:
    """The ceilings of the policy in force (a table only: ``rate_of`` is a
    user's ceiling; ``team_ceilings`` the teams'), the borrowing budget over
    the scheduler's own and the teams' borrow cells."""

    __slots__ = ("_borrowing", "_lending", "active", "table", "team_ceilings")

    def __init__(self, policy: Policy) -> None:
        self.table = OutputRateLimiter(NO_DEFAULT, {}, table_only=True)
        #: team -> its ceiling.
        self.team_ceilings: dict[str, int] = {}
        self._borrowing: Borrowing | None = None
        self._lending: TeamLending | None = None
        #: Whether any holder has a ceiling: while not, nobody borrows.
        self.active = False
        self.apply(policy, 0)

    def apply(self, policy: Policy, now_ns: int) -> None:
        """Makes ``policy``'s ceilings the table."""
        default = policy.default.ceiling_tokens_per_second
        if (default or NO_DEFAULT) != self.table.default_rate:
            self.table.set_default_rate(default or NO_DEFAULT, now_ns)
        self.table.replace_limits(policy.limit_table(CEILING), now_ns)
        self.team_ceilings = dict(policy.team_table(CEILING).rates)
        self.active = sets_ceilings(policy)
        if self._borrowing is not None:
            self._borrowing.limits_changed()

    @property
    def borrowing(self) -> Borrowing | None:
        """The borrowing budget the scheduler spends from while any holder
        has a ceiling (built by ``over``)."""
        return self._borrowing if self.active else None

    def over(
        self,
        base: BudgetSource,
        rate_of: Callable[[str], int],
        accounting: Accounting,
        burst_ns: int,
        team_of: Callable[[str], str | None] = lambda user: None,
    ) -> Borrowing:
        """The borrowing budget over ``base`` (the same one while ``base`` is);
        ``team_of``: the team a user is charged to."""
        borrowing = self._borrowing
        if borrowing is None or borrowing.base is not base:
            borrowing = self._borrowing = Borrowing(
                base, rate_of, self.table.rate_of, accounting, burst_ns, team_of
            )
        return borrowing

    def lending(self, team_rate_of: Callable[[str], int | None]) -> TeamLending | None:
        """The teams' borrow cells while a team has a ceiling (after ``over``:
        the needy holders are the borrowing budget's); ``team_rate_of``: a
        team's rate."""
        borrowing = self.borrowing
        if borrowing is None or not self.team_ceilings:
            return None
        lending = self._lending
        if lending is None or lending.borrowing is not borrowing:
            lending = self._lending = TeamLending(
                borrowing, team_rate_of, self.team_ceilings.get
            )
        return lending


class Borrowing:
    """``BudgetSource``: a user's own budget (``base``) first, then, while the
    engine is spare for it, its borrow cell."""

    __slots__ = (
        "_bumps",
        "_needy",
        "accounting",
        "base",
        "burst_ns",
        "ceiling_of",
        "cells",
        "rate_of",
        "take_up_to",
        "team_of",
    )

    def __init__(
        self,
        base: BudgetSource,
        rate_of: Callable[[str], int],
        ceiling_of: Callable[[str], int],
        accounting: Accounting,
        burst_ns: int,
        team_of: Callable[[str], str | None] = lambda user: None,
    ) -> None:
        self.base = base
        #: A user's rate (0: not limited, so it never needs to borrow).
        self.rate_of = rate_of
        #: A user's ceiling (0: none).
        self.ceiling_of = ceiling_of
        #: The team a user is charged to (a team borrows while only its own
        #: members are needy).
        self.team_of = team_of
        self.burst_ns = burst_ns
        self.accounting = accounting
        #: One cell per user that borrowed, at its ``ceiling - rate``.
        self.cells = BorrowCells(burst_ns)
        self._needy: frozenset[str] = frozenset()
        self._bumps = 0
        #: ``BudgetSource.take_up_to``: the base's own while two holders or
        #: more are needy (nobody may borrow: no call of ours in between).
        self.take_up_to: Callable[[str, int, int], tuple[int, int]] = (
            self._take_borrowing
        )

    @property
    def limit_changes(self) -> int:
        return self.base.limit_changes + self._bumps

    @property
    def needy(self) -> frozenset[str]:
        """The holders within their rate that waited at this step's start."""
        return self._needy

    def lend_to(self, needy: Collection[str]) -> None:
        """This step's needy holders (enough to tell anyone's spare: those of
        two owners, ``owner_of``). A borrower that loses its spare loses
        budget: that is a limit change, so the scheduler forgets the headroom
        it cached."""
        needy, before = frozenset(needy), self._needy
        if (
            needy
            and needy != before
            and (not before or len({self.owner_of(u) for u in before}) == 1)
        ):
            self._bumps += 1  # someone (a user or a team) spare before may not be
        self._needy = needy
        self.take_up_to = (
            self._take_borrowing if self._anyone_spare() else self.base.take_up_to
        )

    def owner_of(self, user: str) -> tuple[str, str]:
        """Whose spare a needy ``user`` takes away: its team's, else its own
        (the needy scan stops at two owners)."""
        team = self.team_of(user)
        return ("user", user) if team is None else ("team", team)

    def limits_changed(self) -> None:
        """A ceiling changed: cached headroom may be too high."""
        self._bumps += 1

    def _anyone_spare(self) -> bool:
        """Whether ``spare_for`` may hold for some user: not while two users or
        more are needy."""
        return len(self._needy) < 2

    def spare_for(self, user: str) -> bool:
        """Whether ``user`` may borrow in this step: nobody else is needy."""
        needy = self._needy
        return not needy or (len(needy) == 1 and user in needy)

    def spare_for_team(self, team: str) -> bool:
        """Whether ``team`` may borrow in this step: no user outside it is
        needy."""
        team_of = self.team_of
        return all(team_of(user) == team for user in self._needy)

    def _borrow_rate(self, user: str, now_ns: int) -> int:
        """``user``'s borrow cell rate, the cell kept at it (0: none)."""
        return self.cells.lent_rate(
            user, self.rate_of(user), self.ceiling_of(user), now_ns
        )

    def _take_borrowing(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        """Takes of ``user``'s own budget first, then, while the engine is
        spare for it, of its borrow cell."""
        taken, left = self.base.take_up_to(user, most, now_ns)
        if (
            taken == most
            or not self.spare_for(user)
            or not self._borrow_rate(user, now_ns)
        ):
            return taken, left
        borrowed, lendable = self.cells.take_up_to(user, most - taken, now_ns)
        if borrowed:
            self.accounting.record(user, "borrowed_tokens", borrowed)
        return taken + borrowed, left + lendable

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """Charges each user's own budget as far as it goes and, while the
        engine is spare for it, the rest to its borrow cell (a free step's
        charges: each user was known to have them)."""
        if not self._anyone_spare():
            return self.base.take_each(counts, now_ns)
        own: dict[str, int] = {}
        lent: dict[str, int] = {}
        for user, count in counts.items():
            if (
                count
                and self.spare_for(user)
                and self.ceiling_of(user)
                and self._borrow_rate(user, now_ns)
            ):
                has = self.base.available(user, now_ns)
                if has < count:
                    own[user] = has
                    lent[user] = count - has
                    continue
            own[user] = count
        remaining = self.base.take_each(own, now_ns)
        if lent:
            more = self.cells.take_each(lent, now_ns)
            for user, count in lent.items():
                self.accounting.record(user, "borrowed_tokens", count)
                remaining[user] += more[user]
        return remaining

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Gives back to the borrow cell first, as far as it is charged ahead
        of now (never more than was borrowed), the rest to ``base``."""
        back = self.cells.refund_ahead(user, count, now_ns)
        if back:
            self.accounting.record(user, "borrowed_tokens", -back)
        if count > back:
            self.base.refund(user, now_ns, count - back)

    def available(self, user: str, now_ns: int) -> int:
        available = self.base.available(user, now_ns)
        if self.spare_for(user) and self._borrow_rate(user, now_ns):
            available += self.cells.available(user, now_ns)
        return available

    def end_user(self, user: str, now_ns: int) -> None:
        self.base.end_user(user, now_ns)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        ready = self.base.ready_at_ns(user, now_ns)
        if ready > now_ns and self.spare_for(user) and self._borrow_rate(user, now_ns):
            return min(ready, self.cells.ready_at_ns(user, now_ns))
        return ready

    def forget_idle(self, now_ns: int, live: Collection[str]) -> None:
        """Drops the borrow cells of users without live requests whose cell is
        full again."""
        self.cells.forget_idle(now_ns, live)


class TeamLending:
    """The teams' borrow cells: one per team with a ceiling, at ``ceiling -
    rate``, spent by ``TeamBudget`` once the team's own cell is, while no user
    outside the team is needy (``Borrowing.spare_for_team``). Tokens a team
    borrows are recorded as borrowed by the members they went to."""

    __slots__ = ("borrowing", "ceiling_of", "cells", "rate_of")

    def __init__(
        self,
        borrowing: Borrowing,
        rate_of: Callable[[str], int | None],
        ceiling_of: Callable[[str], int | None],
    ) -> None:
        self.borrowing = borrowing
        #: A team's rate (None: not a team).
        self.rate_of = rate_of
        #: A team's ceiling (None: none).
        self.ceiling_of = ceiling_of
        self.cells = BorrowCells(borrowing.burst_ns)

    def _lent_rate(self, team: str, now_ns: int) -> int:
        """``team``'s borrow cell rate, the cell kept at it (0: none)."""
        return self.cells.lent_rate(
            team, self.rate_of(team) or 0, self.ceiling_of(team) or 0, now_ns
        )

    def lendable(self, team: str, now_ns: int) -> int:
        """Tokens ``team`` may borrow now (0 unless the engine is spare for it)."""
        if not self.borrowing.spare_for_team(team) or not self._lent_rate(team, now_ns):
            return 0
        return self.cells.available(team, now_ns)

    def take(self, team: str, count: int, now_ns: int) -> int:
        """Takes up to ``count`` of ``team``'s borrow cell; what it took."""
        return self.cells.take_up_to(team, count, now_ns)[0]

    def charge(self, team: str, count: int, now_ns: int) -> None:
        """Charges ``count`` to ``team``'s borrow cell, as far as it goes into
        its burst (a free step's charges: they were known to be there)."""
        self.cells.take_each({team: count}, now_ns)

    def refund(self, team: str, count: int, now_ns: int) -> int:
        """Gives back up to ``count`` to ``team``'s borrow cell, as far as it
        is charged ahead of now; how many it took back."""
        return self.cells.refund_ahead(team, count, now_ns)

    def ready_at_ns(self, team: str, now_ns: int) -> int | None:
        """When ``team`` may borrow a token (None: it may not borrow now)."""
        if not self.borrowing.spare_for_team(team) or not self._lent_rate(team, now_ns):
            return None
        return self.cells.ready_at_ns(team, now_ns)

    def record(self, shares: Mapping[str, int]) -> None:
        """Records each member's share of tokens its team borrowed (negative:
        given back)."""
        record = self.borrowing.accounting.record
        for user, count in shares.items():
            if count:
                record(user, "borrowed_tokens", count)

    def forget_idle(self, now_ns: int, teams: Collection[str]) -> None:
        """Drops the borrow cells of teams not in ``teams`` whose cell is
        full again."""
        self.cells.forget_idle(now_ns, teams)
