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


class Ceilings:
    """The ceilings of the policy in force (a table only: ``rate_of`` is a
    user's ceiling) and the borrowing budget over the scheduler's own."""

    __slots__ = ("_borrowing", "active", "table")

    def __init__(self, policy: Policy) -> None:
        self.table = OutputRateLimiter(NO_DEFAULT, {}, table_only=True)
        self._borrowing: Borrowing | None = None
        #: Whether any holder has a ceiling: while not, nobody borrows.
        self.active = False
        self.apply(policy, 0)

    def apply(self, policy: Policy, now_ns: int) -> None:
        """Makes ``policy``'s ceilings the table."""
        default = policy.default.ceiling_tokens_per_second
        if (default or NO_DEFAULT) != self.table.default_rate:
            self.table.set_default_rate(default or NO_DEFAULT, now_ns)
        self.table.replace_limits(policy.limit_table(CEILING), now_ns)
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
    ) -> Borrowing:
        """The borrowing budget over ``base`` (the same one while ``base`` is)."""
        borrowing = self._borrowing
        if borrowing is None or borrowing.base is not base:
            borrowing = self._borrowing = Borrowing(
                base, rate_of, self.table.rate_of, accounting, burst_ns
            )
        return borrowing


class Borrowing:
    """``BudgetSource``: a user's own budget (``base``) first, then, while the
    engine is spare for it, its borrow cell."""

    __slots__ = (
        "_bumps",
        "_needy",
        "accounting",
        "base",
        "ceiling_of",
        "cells",
        "rate_of",
    )

    def __init__(
        self,
        base: BudgetSource,
        rate_of: Callable[[str], int],
        ceiling_of: Callable[[str], int],
        accounting: Accounting,
        burst_ns: int,
    ) -> None:
        self.base = base
        #: A user's rate (0: not limited, so it never needs to borrow).
        self.rate_of = rate_of
        #: A user's ceiling (0: none).
        self.ceiling_of = ceiling_of
        self.accounting = accounting
        #: One cell per user that borrowed, at its ``ceiling - rate``.
        self.cells = OutputRateLimiter(NO_DEFAULT, {}, burst_ns, table_only=True)
        self._needy: frozenset[str] = frozenset()
        self._bumps = 0

    @property
    def limit_changes(self) -> int:
        return self.base.limit_changes + self._bumps

    @property
    def needy(self) -> frozenset[str]:
        """The holders within their rate that waited at this step's start."""
        return self._needy

    def lend_to(self, needy: Collection[str]) -> None:
        """This step's needy holders (at most two are needed to tell anyone's
        spare). A borrower that loses its spare loses budget: that is a
        limit change, so the scheduler forgets the headroom it cached."""
        needy, before = frozenset(needy), self._needy
        if needy and (not before or (len(before) == 1 and needy != before)):
            self._bumps += 1  # someone spare before is not now
        self._needy = needy

    def limits_changed(self) -> None:
        """A ceiling changed: cached headroom may be too high."""
        self._bumps += 1

    def spare_for(self, user: str) -> bool:
        """Whether ``user`` may borrow in this step: nobody else is needy."""
        needy = self._needy
        return not needy or (len(needy) == 1 and user in needy)

    def _borrow_rate(self, user: str, now_ns: int) -> int:
        """``user``'s borrow cell rate, the cell kept at it (0: none)."""
        rate = self.rate_of(user)
        lent = self.ceiling_of(user) - rate if rate else 0
        cells = self.cells
        current = cells.rate_of(user)
        if lent <= 0:
            if current:
                cells.set_rate(user, None, now_ns)
            return 0
        if current != lent:
            cells.set_rate(user, lent, now_ns)
        return lent

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
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
        lent = self.cells.rate_of(user)
        back = 0
        if lent:
            ahead = self.cells.lead_ns(user, now_ns) * lent // NS_PER_S
            back = min(count, ahead)
            if back:
                self.cells.refund(user, now_ns, back)
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
        full again (a returning user starts where it would anyway)."""
        cells = self.cells
        for user in [u for u in cells.user_rates if u not in live]:
            if not cells.lead_ns(user, now_ns):
                cells.set_rate(user, None, now_ns)
