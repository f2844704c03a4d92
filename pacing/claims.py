"""An engine's share of a user's global budget: tokens claimed in batches from a
store (``store/``, Redis) and spent here by the scheduler without any I/O.

With a store, one user's limit holds across every engine: the store keeps one
GCRA cell per user and hands out tokens in *claims*; each engine keeps what it was
granted as a local *balance*. ``ClaimedBalances`` is then the scheduler's budget
source (``pacing.budget.BudgetSource``): the scheduling step reads and spends
local state only. What talks to the store runs in a background claimer
(``store.claimer``): it asks this object what to claim and what to give back
(``plan``) and hands the answers in (``landed``, ``claims_failed``), each time
under the owner's lock, never across I/O.

Vocabulary:

- *balance*: the tokens this engine holds for a user, in *batches*, one per claim
  that landed. A batch is usable for one *lease* (``lease_ns``, 1 s) after it
  landed; what is left of it then *expires* and goes back to the store.
- *claim size*: about ``horizon_ns`` (50 ms) of this engine's recent consumption
  of the user, at least 1, at most the user's burst (``burst_tokens``: what the
  store's cell grants at once from full). When the user's claims come further
  apart than that (a busy claimer), the claim covers the time since its last
  one instead (up to a window): else a claim sized for 50 ms would have to last
  longer, consumption would shrink to it, and claims with it, below the limit.
  Consumption is measured over a sliding window of ``window_ns`` (see
  ``_Account``). A user is *wanting* (due a claim) while its balance is at most
  half its claim size.
- *unmet demand*: what the scheduler's last take of a user asked for and did
  not get, less what landed since. With ``covers_unmet`` (the prompt budgets'
  balances, ``store.runtime``) a claim covers at least that much (up to the
  burst): a prompt asks for all of its unpaid tokens at once and, below a
  floor (a KV block), takes nothing and gives back what it was handed, so the
  consumption that sizes claims stays at 0 while it waits; claims of 1 token
  per pass, each for a lease, would never add up to a floor above about 100
  tokens. The output's balances size by consumption alone.
- *return*: tokens given back to the store: what an expired batch still held, and
  the whole balance when the user's last request on this engine ends
  (``end_user``), so a user whose streams move to another engine finds its tokens
  there at once instead of after a lease.
- *fallback share*: while the store cannot be reached, an engine paces each user
  locally at ``R / N`` (``fallback_rate``), ``N`` being ``share_divisor``: the
  live engines the store reported (``live_engines``) once this engine has
  heard the live set whole, before that the fleet size the operator stated
  (``assumed_engines``) or, with none stated, no share at all.
- *cell reading*: the user's global TAT lead (the store cell's debt as time) in
  the store's answer to this engine's latest claim or return for the user, and
  when it came back (``record_cell``, ``cell_reading``), for the control
  plane's view. Kept while the user has an account here, and after that until
  its lead has run out and a lease has passed since it came back: at most one
  per active or recently seen user.

Limits come from the engine's limiter (``rates``): a user it does not limit
(exempt, or pacing without a default) is unlimited here too, and claims nothing.

Not thread-safe: like the limiter, its owner serialises access (the scheduler and
the claimer share the facade's lock). The clock comes in with every call
(monotonic nanoseconds, this engine's own; only durations cross to the store).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pacing.limiter import NS_PER_S, UNLIMITED

DEFAULT_LEASE_NS = NS_PER_S
DEFAULT_HORIZON_NS = 50_000_000
DEFAULT_WINDOW_NS = 500_000_000


def burst_tokens(rate: int, tolerance_ns: int) -> int:
    """The most tokens a GCRA cell of ``rate`` tokens/s and delay variation
    tolerance ``tolerance_ns`` grants at one instant (from a full bucket): the
    k-th is allowed iff ``(k - 1) / rate <= tolerance``."""
    return tolerance_ns * rate // NS_PER_S + 1


def fallback_rate(rate: int, live_engines: int) -> int:
    """The local rate that stands in for a global ``rate`` while the store is
    unreachable: ``rate // live_engines`` (rounded down, so the engines together
    stay within ``rate``), at least 1 so that nobody is stopped outright (the
    only case where they can exceed it: fewer tokens/s than live engines).
    0 (not limited) stays 0; ``live_engines`` below 1 counts as 1."""
    if rate == 0:
        return 0
    return max(1, rate // max(1, live_engines))


class Rates(Protocol):
    """Where the limits come from (``OutputRateLimiter`` is one)."""

    @property
    def limit_changes(self) -> int: ...

    @property
    def burst_ns(self) -> int: ...

    def rate_of(self, user: str) -> int: ...


class Request(NamedTuple):
    """``tokens`` for a user limited to ``rate`` tokens/s (the store's cell
    decays at the rate it is told)."""

    tokens: int
    rate: int


class CellReading(NamedTuple):
    """A user's global TAT lead as last read from the store, and its age."""

    #: The lead then, less the time since (``0`` once it has run out).
    tat_lead_ns: int
    #: How long ago the reading came back, on this engine's clock.
    age_ns: int


@dataclass
class Plan:
    """What the claimer should send in one round trip: claims and returns, by
    user."""

    claims: dict[str, Request] = field(default_factory=dict)
    returns: dict[str, Request] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.claims or self.returns)


class _Account:
    """One active user on this engine: its batches and its recent consumption.

    Consumption is a two-window sliding estimate (as in Cloudflare's rate
    limiter): ``current`` tokens spent since ``window_start_ns``, ``previous`` in
    the window before, weighted by how much of it still overlaps the last
    ``window_ns``. In the first window there is no ``previous``
    (``previous is None``) and the rate is ``current`` over the time since the
    user appeared (at least one horizon).
    """

    __slots__ = (
        "batches",
        "current",
        "demand",
        "drawn_expiry_ns",
        "held",
        "idle_check",
        "in_flight",
        "last_claim_ns",
        "last_take_ns",
        "low_water",
        "not_before_ns",
        "previous",
        "unmet",
        "window_start_ns",
    )

    def __init__(self, now_ns: int) -> None:
        #: [expires_ns, tokens left], oldest first (expiry order = landing order).
        self.batches: deque[list[int]] = deque()
        self.held = 0
        self.window_start_ns = now_ns
        self.current = 0
        #: The tokens the scheduler last asked for at once (a step's worth: the
        #: user's streams here): the next claim goes out before fewer are held.
        self.demand = 0
        #: What the scheduler's last take asked for and did not get, less what
        #: landed since (claimed for with ``covers_unmet``).
        self.unmet = 0
        self.previous: int | None = None
        self.last_take_ns = now_ns
        #: When its last claim was planned (``None``: never).
        self.last_claim_ns: int | None = None
        #: Wanting while ``held <= low_water`` (set by ``plan``).
        self.low_water = 0
        self.in_flight = False
        #: The store said no token is free before then (a partial grant).
        self.not_before_ns = now_ns
        #: Expiry of the batch last spent from: where refunded tokens go back.
        self.drawn_expiry_ns = now_ns
        #: The sequence number of its one pending idleness check.
        self.idle_check = 0


class ClaimedBalances:
    """Per-user balances of tokens claimed from a global store, spent as the
    scheduler's budget source; see the module docstring.

    ``rates`` gives each user's limit. The store's cells use the single-engine
    burst as their tolerance (``rates.burst_ns``: see ``store.cell`` for why),
    which also caps claim sizes.
    """

    def __init__(
        self,
        rates: Rates,
        *,
        lease_ns: int = DEFAULT_LEASE_NS,
        horizon_ns: int = DEFAULT_HORIZON_NS,
        window_ns: int = DEFAULT_WINDOW_NS,
        assumed_engines: int | None = None,
        covers_unmet: bool = False,
    ) -> None:
        for name, value in (
            ("lease_ns", lease_ns),
            ("horizon_ns", horizon_ns),
            ("window_ns", window_ns),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self._rates = rates
        self.lease_ns = lease_ns
        self.horizon_ns = horizon_ns
        self.window_ns = window_ns
        #: Whether a claim covers at least the user's *unmet demand* (see the
        #: module docstring; the prompt balances' setting).
        self.covers_unmet = covers_unmet
        self._accounts: dict[str, _Account] = {}
        self._wanting: set[str] = set()
        self._returns: dict[str, int] = {}
        #: (when, sequence number, user): a batch of the user's expires then, or
        #: (the account's ``idle_check``) its account is checked for idleness.
        self._checks: list[tuple[int, int, str]] = []
        self._sequence = 0
        self._shrinks = 0
        #: Set when a user starts wanting a claim; the claimer clears it. The
        #: scheduler may read it after a step to poke the claimer.
        self.wants_claims = False
        #: Live engines the store last reported (1 until it has reported).
        self.live_engines = 1
        #: The fleet's stated size, assumed until the store's count is whole
        #: (``None``: none stated).
        self.assumed_engines = assumed_engines
        #: Whether the store has reported a whole count (``record_store_ok``).
        self.engines_counted = False
        #: When the store stopped answering; ``None`` while it answers.
        self.store_down_since_ns: int | None = None
        #: user -> (global TAT lead, when read): see *cell reading*.
        self._cells: dict[str, tuple[int, int]] = {}

    # -- the budget source (the scheduler's side: no I/O) --------------------

    @property
    def limit_changes(self) -> int:
        """Bumped whenever a user's budget may have shrunk other than by a take:
        a limit change, or a batch expiring with tokens left."""
        return self._rates.limit_changes + self._shrinks

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        """Spends up to ``most`` of ``user``'s unexpired tokens at ``now_ns``;
        returns ``(taken, still available)``. A user seen for the first time
        starts with nothing and becomes wanting."""
        if self._rates.rate_of(user) == 0:
            return most, UNLIMITED - most
        account = self._account(user, now_ns)
        if account.batches and account.batches[0][0] <= now_ns:
            self._expire(user, account, now_ns)
        taken = self._spend(user, account, most, now_ns)
        return taken, account.held

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """Charges every user in ``counts`` its count, which the caller knows it
        has (the scheduler's charge after dispatch), and returns what each still
        has available. Tokens dispatched against a batch that expired in the
        meantime are charged to it all the same (its expiry is enforced by the
        next take or plan), so nothing is overdrawn."""
        rate_of = self._rates.rate_of
        remaining: dict[str, int] = {}
        for user, count in counts.items():
            if rate_of(user) == 0:
                remaining[user] = UNLIMITED
                continue
            account = self._account(user, now_ns)
            self._spend(user, account, count, now_ns)
            remaining[user] = account.held
        return remaining

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Gives back ``count`` tokens spent from ``user``'s balance that were not
        used (charged, then not dispatched). They return to the batch they were
        most likely drawn from and keep its expiry (never a longer lease); when
        that batch has expired they go back to the store."""
        account = self._accounts.get(user)
        if account is None or count <= 0:
            return
        account.current = max(0, account.current - count)
        expiry = account.drawn_expiry_ns
        if expiry <= now_ns:
            self._returns[user] = self._returns.get(user, 0) + count
            return
        batches = account.batches
        if batches and batches[0][0] == expiry:
            batches[0][1] += count
        else:
            batches.appendleft([expiry, count])
        account.held += count

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens ``user`` may take at ``now_ns``: its unexpired balance
        (``UNLIMITED`` when it is not limited). Changes nothing."""
        if self._rates.rate_of(user) == 0:
            return UNLIMITED
        return self.held(user, now_ns)

    def held(self, user: str, now_ns: int) -> int:
        """The tokens this engine holds for ``user`` at ``now_ns``: claimed,
        not spent, lease not ended (0 without an account). Changes nothing."""
        account = self._accounts.get(user)
        if account is None:
            return 0
        held = account.held
        for expires, tokens in account.batches:
            if expires > now_ns:
                break
            held -= tokens
        return held

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """``now_ns`` while ``user`` has tokens; else when it may have some
        again without a claim landing, which wakes the engine by itself: no
        sooner than the store said (a partial grant's wait), and not before one
        horizon, so an engine idle-waits that long between checks."""
        if self.available(user, now_ns):
            return now_ns
        account = self._accounts.get(user)
        not_before = now_ns if account is None else account.not_before_ns
        return max(now_ns + self.horizon_ns, not_before)

    def end_user(self, user: str, now_ns: int) -> None:
        """``user``'s last request on this engine ended: its whole balance goes
        back to the store and its account is dropped (a claim still in flight
        goes back too when it lands). No ``limit_changes``: the scheduler holds
        no budget for a user without requests."""
        account = self._accounts.pop(user, None)
        self._wanting.discard(user)
        if account is not None and account.held:
            self._returns[user] = self._returns.get(user, 0) + account.held
        self._retire_cell(user, now_ns)

    def active_users(self) -> int:
        """How many users hold an account (took tokens within the last lease,
        or hold some)."""
        return len(self._accounts)

    # -- the claimer's side ------------------------------------------------------

    def plan(self, now_ns: int) -> Plan:
        """What to send to the store now: a claim for every wanting user with no
        claim in flight whom the store did not ask to wait, sized by
        ``claim_size``; and every pending return (expired batches included).
        Marks the planned claims in flight; the caller must answer each with
        ``landed`` or ``claims_failed``."""
        self.wants_claims = False
        self._run_checks(now_ns)
        rate_of = self._rates.rate_of
        plan = Plan()
        for user in list(self._wanting):
            account = self._accounts[user]
            if account.in_flight or now_ns < account.not_before_ns:
                continue
            rate = rate_of(user)
            if rate == 0:  # not limited: needs no claims
                self._wanting.discard(user)
                continue
            size = self.claim_size(user, now_ns)
            # Half a claim, or a step's worth less one if more: with claims of
            # 1 token and 2 streams, waiting for an empty balance would leave
            # a step without tokens at every claim's round trip.
            account.low_water = max(size // 2, account.demand - 1)
            if account.held > account.low_water:
                self._wanting.discard(user)
                continue
            if self.covers_unmet and account.unmet > size:
                size = min(account.unmet, burst_tokens(rate, self._rates.burst_ns))
            plan.claims[user] = Request(size, rate)
            account.in_flight = True
            account.last_claim_ns = now_ns
        returns, self._returns = self._returns, {}
        for user, count in returns.items():
            rate = rate_of(user)
            if rate:  # a user no longer limited has nothing to give back
                plan.returns[user] = Request(count, rate)
        return plan

    def landed(self, user: str, granted: int, retry_after_ns: int, now_ns: int) -> None:
        """A claim for ``user`` came back with ``granted`` tokens, usable until
        ``now_ns + lease_ns``; the store grants no more before
        ``retry_after_ns`` from now (0: it could have granted more). The tokens
        go back to the store when the user has no claim in flight: it ended
        meanwhile (a new account of the same user waits for a claim of its own)."""
        account = self._accounts.get(user)
        if account is None or not account.in_flight:
            if granted:
                self._returns[user] = self._returns.get(user, 0) + granted
            return
        account.in_flight = False
        account.not_before_ns = now_ns + retry_after_ns
        account.unmet = max(0, account.unmet - granted)
        if granted:
            expires = now_ns + self.lease_ns
            account.batches.append([expires, granted])
            account.held += granted
            self._check(expires, user)

    def claims_failed(self, users: Iterable[str]) -> None:
        """The claims for ``users`` got no answer: they may be planned again.
        (Their tokens, if the store granted them, are lost to everyone until
        the cell's debt decays: the safe side.)"""
        for user in users:
            account = self._accounts.get(user)
            if account is not None:
                account.in_flight = False

    def record_cell(self, user: str, tat_lead_ns: int, now_ns: int) -> None:
        """The store answered a claim or return for ``user`` at ``now_ns``: its
        cell's TAT then ran ``tat_lead_ns`` ahead (its debt as time at the
        request's rate). Replaces the user's earlier reading."""
        self._cells[user] = (max(0, tat_lead_ns), now_ns)
        if user not in self._accounts:
            self._retire_cell(user, now_ns)

    def cell_reading(self, user: str, now_ns: int) -> CellReading | None:
        """``user``'s last cell reading seen from ``now_ns``: its lead less the
        time since (the TAT stays put while nobody claims), never below 0;
        ``None`` when there is none. Changes nothing."""
        reading = self._cells.get(user)
        if reading is None:
            return None
        lead_ns, read_ns = reading
        age_ns = max(0, now_ns - read_ns)
        return CellReading(max(0, lead_ns - age_ns), age_ns)

    def record_store_ok(
        self, live_engines: int | None = None, *, whole: bool = True
    ) -> None:
        """The store answered; ``live_engines``, when it said, is the engines'
        count it holds heartbeats for, ``whole`` when every live engine has
        had the time to beat into it since this engine first heard it."""
        self.store_down_since_ns = None
        if live_engines is not None:
            self.live_engines = max(1, live_engines)
            self.engines_counted = self.engines_counted or whole

    @property
    def share_divisor(self) -> int | None:
        """What the fallback share divides a limit by: the store's count once
        it has been whole; before that the larger of the stated fleet size and
        any count heard; ``None`` when no size was stated (no share: limited
        users wait for the store)."""
        if self.engines_counted:
            return self.live_engines
        if self.assumed_engines is None:
            return None
        return max(self.assumed_engines, self.live_engines)

    def record_store_failure(self, now_ns: int) -> None:
        """The store did not answer at ``now_ns`` (the first failure in a row
        starts the outage)."""
        if self.store_down_since_ns is None:
            self.store_down_since_ns = now_ns

    def claim_size(self, user: str, now_ns: int) -> int:
        """The claim ``user`` would make at ``now_ns``: its recent consumption
        on this engine over ``horizon_ns`` or, if longer, the time since its
        last claim (at most ``window_ns``), rounded up, at least 1, at most
        ``burst_tokens`` of its rate (0 for a user who is not limited)."""
        rate = self._rates.rate_of(user)
        if rate == 0:
            return 0
        account = self._accounts.get(user)
        used = 0
        if account is not None:
            self._record(account, 0, now_ns)  # rolls the window to now
            window = self.window_ns
            cover = self.horizon_ns
            if account.last_claim_ns is not None:
                cover = min(max(cover, now_ns - account.last_claim_ns), window)
            if account.previous is None:
                span = max(now_ns - account.window_start_ns, self.horizon_ns)
                used = -(-account.current * cover // span)
            else:
                elapsed = min(max(now_ns - account.window_start_ns, 0), window)
                spent = account.previous * (window - elapsed) + account.current * window
                used = -(-spent * cover // (window * window))
        return min(max(used, 1), burst_tokens(rate, self._rates.burst_ns))

    # -- helpers -------------------------------------------------------------------

    def _account(self, user: str, now_ns: int) -> _Account:
        account = self._accounts.get(user)
        if account is None:
            account = self._accounts[user] = _Account(now_ns)
            account.idle_check = self._check(now_ns + self.lease_ns, user)
        return account

    def _check(self, when_ns: int, user: str) -> int:
        """Schedules a check of ``user``'s account at ``when_ns``; returns its
        sequence number."""
        self._sequence += 1
        heapq.heappush(self._checks, (when_ns, self._sequence, user))
        return self._sequence

    def _spend(self, user: str, account: _Account, most: int, now_ns: int) -> int:
        """Spends up to ``most`` tokens, oldest batch first, and records them;
        makes the user wanting when its balance runs low."""
        batches = account.batches
        taken = 0
        while taken < most and batches:
            batch = batches[0]
            use = min(most - taken, batch[1])
            batch[1] -= use
            taken += use
            account.drawn_expiry_ns = batch[0]
            if batch[1] == 0:
                batches.popleft()
        account.held -= taken
        account.last_take_ns = now_ns
        account.demand = most
        account.unmet = most - taken
        self._record(account, taken, now_ns)
        if account.held <= account.low_water and user not in self._wanting:
            self._wanting.add(user)
            self.wants_claims = True
        return taken

    def _record(self, account: _Account, count: int, now_ns: int) -> None:
        """Adds ``count`` spent tokens at ``now_ns`` to the consumption windows."""
        elapsed = now_ns - account.window_start_ns
        if elapsed >= self.window_ns:
            windows = elapsed // self.window_ns
            account.previous = account.current if windows == 1 else 0
            account.current = 0
            account.window_start_ns += windows * self.window_ns
        account.current += count

    def _expire(self, user: str, account: _Account, now_ns: int) -> None:
        """Moves ``user``'s batches whose lease ended by ``now_ns`` to the
        returns (a shrink the scheduler must hear of: ``limit_changes``)."""
        batches = account.batches
        expired = 0
        while batches and batches[0][0] <= now_ns:
            expired += batches.popleft()[1]
        if expired:
            account.held -= expired
            self._returns[user] = self._returns.get(user, 0) + expired
            self._shrinks += 1

    def _run_checks(self, now_ns: int) -> None:
        """Expires the batches whose lease ended by ``now_ns`` and forgets the
        accounts with nothing held, nothing in flight and no take for a lease (a
        user the scheduler stopped asking about without ``end_user``), and the
        cell readings due (``_retire_cell``). Each account has one idleness
        check pending, plus one check per batch; a reading of a user without an
        account has one too."""
        checks = self._checks
        while checks and checks[0][0] <= now_ns:
            _, sequence, user = heapq.heappop(checks)
            account = self._accounts.get(user)
            if account is None:  # a forgotten account's, or a cell reading's
                self._forget_cell(user, now_ns)
                continue
            self._expire(user, account, now_ns)
            if sequence != account.idle_check:
                continue
            idle_until = account.last_take_ns + self.lease_ns
            if account.batches or account.in_flight or idle_until > now_ns:
                account.idle_check = self._check(
                    max(idle_until, now_ns + self.lease_ns // 4), user
                )
            else:
                del self._accounts[user]
                self._wanting.discard(user)
                self._retire_cell(user, now_ns)

    def _retire_cell(self, user: str, now_ns: int) -> None:
        """``user`` has no account (any more): its cell reading is forgotten
        when it is due (``_cell_due_ns``), checked then. Each reading of a user
        without an account has such a check pending, so readings stay bounded."""
        reading = self._cells.get(user)
        if reading is None:
            return
        due_ns = self._cell_due_ns(reading)
        if due_ns <= now_ns:
            del self._cells[user]
        else:
            self._check(due_ns, user)

    def _forget_cell(self, user: str, now_ns: int) -> None:
        """Forgets the cell reading of ``user`` (who has no account) if it is
        due by ``now_ns`` (a newer one has its own check pending)."""
        reading = self._cells.get(user)
        if reading is not None and self._cell_due_ns(reading) <= now_ns:
            del self._cells[user]

    def _cell_due_ns(self, reading: tuple[int, int]) -> int:
        """When a reading ``(lead, read at)`` of a user without an account is
        forgotten: its lead has run out, and it is a lease old (so that the
        answer to a user's last return stays visible for a while)."""
        lead_ns, read_ns = reading
        return read_ns + max(lead_ns, self.lease_ns)
