"""Per-user output-token limiter: GCRA with one theoretical arrival time per user.

Vocabulary (GCRA, translated once into token-bucket terms):

- *emission interval* ``T = 1/rate`` seconds: the pace at which a user earns one token.
- *theoretical arrival time* ``TAT``: when the user's bucket will be full again; a
  token taken advances it by ``T``.
- *delay variation tolerance* ``burst`` (100 ms): how far ahead of now the TAT may
  run, i.e. the bucket depth measured in time.

A token is allowed at ``now`` iff ``TAT - now <= burst``. Consequence: any window of
``W`` seconds holds at most ``(W + burst) * rate + 1`` granted tokens, and a user who
asks continuously gets at least ``W * rate - 1``.

Every time is stored multiplied by the user's rate (``scaled = ns * tokens/s``), so
advancing by ``1/rate`` seconds is adding exactly ``NS_PER_S``: integers only, no
rounding drift however long a user streams. Python ints never overflow, which is why
scaled values must not leave the process (see the control plane's duration fields).

Which rate applies to a user (its own limit, its tier's, an exemption or the
default) is ``pacing.limits``' concern; the limiter keeps that table and, on every
change, rescales the state of the users it affects (see ``set_rate``).

The limiter never reads a clock: ``now_ns`` comes in with every call (a monotonic
clock in nanoseconds). It is not thread-safe; its owner serialises access.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pacing.limits import MAX_RATE, OFF, LimitSource, LimitTable, validate_rate

__all__ = [
    "DEFAULT_BURST_NS",
    "MAX_RATE",
    "NO_DEFAULT",
    "NS_PER_S",
    "UNLIMITED",
    "LimitSource",
    "LimitTable",
    "OutputRateLimiter",
    "validate_rate",
]

NS_PER_S = 1_000_000_000
DEFAULT_BURST_NS = 100_000_000
#: ``available`` for a user who is not limited: more than any step can charge.
UNLIMITED = 2**62
#: The default rate that limits nobody the table does not name.
NO_DEFAULT = 0


@dataclass(slots=True)
class _Cell:
    """One user's GCRA state: the TAT scaled by the rate it was stored under."""

    scaled_tat: int
    rate: int


class OutputRateLimiter:
    """Per-user GCRA limiter for output tokens; one budget shared by all of a
    user's requests.

    ``default_rate=None`` means the feature is off: every ``try_take`` succeeds
    (the table is kept, and applies once a default is set). With
    ``table_only``, ``default_rate=NO_DEFAULT`` (0) limits only the users the
    table names (the prompt rates, ``pacing.prompt_budget``, may have no
    default); otherwise 0 is refused like any invalid rate. ``user_rates``
    overrides the default for named users; ``tier_rates``, ``memberships``,
    ``exempt_users`` and ``exempt_tiers`` complete the table (``pacing.limits``
    says how a user's limit is resolved). An exempt user is never throttled and
    holds no GCRA state.
    """

    def __init__(
        self,
        default_rate: int | None,
        user_rates: Mapping[str, int],
        burst_ns: int = DEFAULT_BURST_NS,
        *,
        tier_rates: Mapping[str, int] | None = None,
        memberships: Mapping[str, str] | None = None,
        exempt_users: Iterable[str] = (),
        exempt_tiers: Iterable[str] = (),
        table_only: bool = False,
    ) -> None:
        self._table_only = table_only
        if default_rate is not None:
            self._validate_default(default_rate)
        if isinstance(burst_ns, bool) or not isinstance(burst_ns, int) or burst_ns < 0:
            raise ValueError(
                f"burst_ns must be a non-negative integer, got {burst_ns!r}"
            )
        self._default_rate = default_rate
        self._limits = LimitTable(
            user_rates, tier_rates, memberships, exempt_users, exempt_tiers
        )
        #: The table's compiled resolution: one dict lookup per ``rate_of``.
        self._overrides = self._limits.overrides
        self._burst_ns = burst_ns
        self._cells: dict[str, _Cell] = {}
        #: Latest ``cleanup_idle_users`` time: a cell re-created for an earlier
        #: ``now`` starts there, so cleaning never hands out budget.
        self._cleaned_at_ns: int | None = None
        #: Bumped by every change of a limit: a user's budget can shrink only by
        #: taking tokens or by such a change (what callers caching "has budget"
        #: answers across calls need to know).
        self.limit_changes = 0

    @property
    def enabled(self) -> bool:
        """Whether limiting is on (a default rate is set)."""
        return self._default_rate is not None

    @property
    def default_rate(self) -> int | None:
        return self._default_rate

    @property
    def burst_ns(self) -> int:
        return self._burst_ns

    @property
    def user_rates(self) -> dict[str, int]:
        """A copy of the explicit per-user limits (not those users get from a
        tier, and with no entry for an exemption)."""
        return self._limits.user_rates

    @property
    def tier_rates(self) -> dict[str, int]:
        """A copy of the tiers' rates (an exempt tier may have none)."""
        return self._limits.tier_rates

    @property
    def memberships(self) -> dict[str, str]:
        """A copy of user -> tier."""
        return self._limits.memberships

    def tier_of(self, user: str) -> str | None:
        """The tier ``user`` is a member of, or ``None`` (one lookup, no copy)."""
        return self._limits.tier_of(user)

    @property
    def exempt_users(self) -> frozenset[str]:
        return self._limits.exempt_users

    @property
    def exempt_tiers(self) -> frozenset[str]:
        return self._limits.exempt_tiers

    def limits(self) -> LimitTable:
        """A copy of the limit table (without the default rate); edit it and
        pass it to ``replace_limits`` to apply many changes at once."""
        return self._limits.copy()

    def tracked_users(self) -> int:
        """How many users currently hold GCRA state."""
        return len(self._cells)

    def rate_of(self, user: str) -> int:
        """The limit that applies to ``user`` in tokens/s; 0 when ``user`` is not
        limited: limiting is off (the table is kept but applies only while a
        default is set) or ``user`` is exempt."""
        if self._default_rate is None:
            return 0
        return self._overrides.get(user, self._default_rate)

    def limit_source(self, user: str) -> LimitSource:
        """Where ``rate_of(user)`` comes from: ``"off"`` while there is no default
        rate, else the rule of ``pacing.limits`` that decides."""
        if self._default_rate is None:
            return OFF
        return self._limits.source(user)

    def try_take(self, user: str, now_ns: int) -> bool:
        """Reports whether ``user`` may output one token at ``now_ns``, and if so
        charges it (advances the TAT by one emission interval)."""
        rate = self.rate_of(user)
        if rate == 0:
            return True
        cell = self._cell(user, rate, now_ns)
        scaled_now = now_ns * rate
        tat = max(cell.scaled_tat, scaled_now)
        if tat - scaled_now > self._burst_ns * rate:
            return False
        cell.scaled_tat = tat + NS_PER_S
        return True

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens ``user`` may take at ``now_ns``: the number of
        consecutive ``try_take`` calls that would succeed (``UNLIMITED`` when
        the user is not limited). Changes nothing.

        The k-th take succeeds iff ``TAT + (k-1)*T - now <= burst``, so the
        answer is ``(now + burst - TAT) // T + 1``, or 0 when that is negative.
        """
        rate = self.rate_of(user)
        if rate == 0:
            return UNLIMITED
        if user in self._cells:
            tat = self._cell(user, rate, now_ns).scaled_tat
        else:  # where try_take would create the cell, without creating it
            tat = self._start_ns(now_ns) * rate
        scaled_now = now_ns * rate
        slack = scaled_now + self._burst_ns * rate - max(tat, scaled_now)
        return slack // NS_PER_S + 1 if slack >= 0 else 0

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        """Takes as many tokens as ``user`` may at ``now_ns``, at most ``most``,
        exactly as that many successful ``try_take`` calls would. Returns
        ``(taken, still available)``; see ``available``.

        The scheduler's once-per-user-and-step call: one lookup of the user's
        limit and cell, no more.
        """
        rate = self.rate_of(user)
        if rate == 0:
            return most, UNLIMITED - most
        cell = self._cell(user, rate, now_ns)
        scaled_now = now_ns * rate
        tat = max(cell.scaled_tat, scaled_now)
        slack = scaled_now + self._burst_ns * rate - tat
        if slack < 0:
            return 0, 0
        available = slack // NS_PER_S + 1
        taken = min(most, available)
        cell.scaled_tat = tat + taken * NS_PER_S
        return taken, available - taken

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """Charges every user in ``counts`` its count at once, exactly as that
        many ``try_take`` calls would if all succeeded, and returns what each
        still has available (0 when in debt). For charges already decided: the
        scheduler's after-the-fact batch when every user was known to have
        enough budget. Runs once per step for every user with demand, so the
        per-rate products are computed once per distinct rate (before the loop
        for the default rate, which most users have)."""
        default = self._default_rate
        if default is None:
            return dict.fromkeys(counts, UNLIMITED)
        ns_per_s = NS_PER_S
        burst_ns = self._burst_ns
        default_now = now_ns * default
        default_limit = default_now + burst_ns * default
        rate_of = self._overrides.get
        cell_of = self._cells.get
        bounds: dict[int, tuple[int, int]] = {}  # rate -> (scaled now, + burst)
        remaining: dict[str, int] = {}
        for user, count in counts.items():
            rate = rate_of(user, default)
            if rate == 0:
                remaining[user] = UNLIMITED
                continue
            if rate == default:
                scaled_now, limit = default_now, default_limit
            else:
                scaled = bounds.get(rate)
                if scaled is None:
                    scaled = bounds[rate] = (now_ns * rate, (now_ns + burst_ns) * rate)
                scaled_now, limit = scaled
            cell = cell_of(user)
            if cell is None or cell.rate != rate:
                cell = self._cell(user, rate, now_ns)
            tat = cell.scaled_tat
            if tat < scaled_now:
                tat = scaled_now
            tat += count * ns_per_s
            cell.scaled_tat = tat
            slack = limit - tat
            remaining[user] = slack // ns_per_s + 1 if slack >= 0 else 0
        return remaining

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Gives back ``count`` tokens charged to ``user`` (charged steps that were
        not dispatched). The TAT never moves below ``now_ns``: a refund cannot
        create budget that was never earned."""
        rate = self.rate_of(user)
        cell = self._cells.get(user)
        if rate == 0 or cell is None:
            return
        cell = self._cell(user, rate, now_ns)
        cell.scaled_tat = max(cell.scaled_tat - count * NS_PER_S, now_ns * rate)

    def end_user(self, user: str, now_ns: int) -> None:
        """Nothing to give back: a user's cell belongs to no request (idle users
        are forgotten by ``cleanup_idle_users``). For ``pacing.budget``."""

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """The earliest time, not before ``now_ns``, at which ``try_take(user)``
        succeeds: ``TAT - burst`` rounded up to the next whole nanosecond."""
        rate = self.rate_of(user)
        cell = self._cells.get(user)
        if rate == 0:
            return now_ns
        if cell is None:  # where try_take would start it
            return max(now_ns, self._start_ns(now_ns) - self._burst_ns)
        cell = self._cell(user, rate, now_ns)
        ready = -(-(cell.scaled_tat - self._burst_ns * rate) // rate)  # ceil division
        return max(ready, now_ns)

    def lead_ns(self, user: str, now_ns: int) -> int:
        """How far the user's TAT runs ahead of ``now_ns`` (0 when the bucket is
        full), rounded up."""
        rate = self.rate_of(user)
        cell = self._cells.get(user)
        if rate == 0:
            return 0
        if cell is None:  # where try_take would start it
            return self._start_ns(now_ns) - now_ns
        cell = self._cell(user, rate, now_ns)
        return max(0, -(-(cell.scaled_tat - now_ns * rate) // rate))

    def set_rate(self, user: str, rate: int | None, now_ns: int) -> None:
        """Sets ``user``'s explicit limit; ``None`` removes it (its tier's rate or
        the default applies).

        The user's token debt is kept: ``new scaled TAT = now*r' + max(0, TAT*r -
        now*r)``. The debt ``TAT*r - now*r`` counts owed tokens (times ``NS_PER_S``)
        and does not depend on the rate, so raising a limit pays the debt off
        faster at once, and lowering one grants no fresh burst. Every change of
        the table below works the same way for each user whose limit it changes;
        a user who becomes exempt loses its state, and one whose exemption is
        lifted starts afresh, with at most a full bucket.
        """
        self._apply(self._limits.set_user_rate(user, rate), now_ns)

    def set_user_exempt(self, user: str, exempt: bool, now_ns: int) -> None:
        """Marks ``user`` unlimited (whatever its own limit or tier), or lifts the
        mark; see ``set_rate`` for what happens to its state."""
        self._apply(self._limits.set_user_exempt(user, exempt), now_ns)

    def set_membership(self, user: str, tier: str | None, now_ns: int) -> None:
        """Moves ``user`` into ``tier`` (``None``: out of any tier), keeping its
        token debt; raises ValueError for a tier that does not exist."""
        self._apply(self._limits.set_membership(user, tier), now_ns)

    def set_tier_rate(self, tier: str, rate: int | None, now_ns: int) -> None:
        """Sets ``tier``'s rate, creating the tier; ``None`` removes the rate (and
        the tier, unless exempt; refused with ValueError while it has members).
        Every member without a limit of its own keeps its token debt at the new
        pace, as in ``set_rate``."""
        self._apply(self._limits.set_tier_rate(tier, rate), now_ns)

    def set_tier_exempt(self, tier: str, exempt: bool, now_ns: int) -> None:
        """Marks ``tier`` unlimited (creating it if needed) or lifts the mark,
        which removes a tier without a rate (refused with ValueError while it has
        members). Members with a limit of their own are not affected."""
        self._apply(self._limits.set_tier_exempt(tier, exempt), now_ns)

    def replace_limits(
        self, limits: LimitTable, now_ns: int, users: Iterable[str] | None = None
    ) -> None:
        """Makes ``limits`` the limit table (the limiter takes it over; the
        default rate is not part of it), as if every difference had been set one
        by one at ``now_ns``: all at once or, the table being valid, not at all.
        ``users``, when given, are the only users whose limit may differ (the
        others' state is not visited)."""
        self._limits = limits
        self._overrides = limits.overrides
        self._apply(list(self._cells) if users is None else users, now_ns)

    def set_default_rate(self, rate: int, now_ns: int) -> None:
        """Sets the default limit (turning limiting on; ``NO_DEFAULT``: only the
        users the table names are limited); users with an explicit limit, a
        tier or an exemption are unaffected, the others keep their token debt
        as in ``set_rate``."""
        self._validate_default(rate)
        self._default_rate = rate
        self._apply(
            [user for user in self._cells if user not in self._overrides], now_ns
        )

    def _validate_default(self, rate: int) -> None:
        if not (self._table_only and rate == NO_DEFAULT):
            validate_rate(rate, field="default_rate")

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Drops users whose TAT is not ahead of ``now_ns`` and returns how many.

        A dropped user who returns starts at ``TAT = now``, exactly what the kept
        state would give (``max(TAT, now)``), so cleaning never changes behaviour.
        (Should a later call carry an earlier ``now``, the user starts at the
        cleaning time instead: stricter, never looser; ``available``,
        ``ready_at_ns`` and ``lead_ns`` answer accordingly.)
        """
        idle = [
            user
            for user, cell in self._cells.items()
            if cell.scaled_tat <= now_ns * cell.rate
        ]
        for user in idle:
            del self._cells[user]
        if self._cleaned_at_ns is None or now_ns > self._cleaned_at_ns:
            self._cleaned_at_ns = now_ns
        return len(idle)

    def _start_ns(self, now_ns: int) -> int:
        """The TAT of a user without state, created at ``now_ns``."""
        cleaned = self._cleaned_at_ns
        return now_ns if cleaned is None or cleaned < now_ns else cleaned

    def _cell(self, user: str, rate: int, now_ns: int) -> _Cell:
        """Returns ``user``'s cell stored under ``rate``, creating or rescaling it.

        Requires ``rate > 0``.
        """
        cell = self._cells.get(user)
        if cell is None:
            start_ns = self._start_ns(now_ns)
            cell = self._cells[user] = _Cell(scaled_tat=start_ns * rate, rate=rate)
        elif cell.rate != rate:
            _rescale(cell, rate, now_ns)
        return cell

    def _apply(self, users: Iterable[str], now_ns: int) -> None:
        """Counts a change of limits (``limit_changes``) and brings ``users``'
        state in line with their limit at ``now_ns``: rescaled (debt kept), or
        dropped for a user no longer limited."""
        self.limit_changes += 1
        cells = self._cells
        # Only users holding state have any to rescale or drop: picked out in C
        # (``users`` may be every member of a large tier).
        for user in list(filter(cells.__contains__, users)):
            rate = self.rate_of(user)
            if rate == 0:
                del cells[user]
            else:
                cell = cells[user]
                if cell.rate != rate:
                    _rescale(cell, rate, now_ns)


def _rescale(cell: _Cell, rate: int, now_ns: int) -> None:
    """Stores ``cell`` under ``rate`` from ``now_ns`` on, keeping its token debt
    (see ``OutputRateLimiter.set_rate``)."""
    debt = cell.scaled_tat - now_ns * cell.rate
    cell.scaled_tat = now_ns * rate + (debt if debt > 0 else 0)
    cell.rate = rate
