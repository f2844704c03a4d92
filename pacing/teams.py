"""Teams: one output rate shared by a group of users, split among the members
by weight while it binds (pure: no vLLM, no clock).

Vocabulary:

- *team*: a named group (user-id rule for its name) with a rate in output
  tokens per second that all its members share: one GCRA cell per team, with
  the users' burst (``pacing.limiter``). A user is a *member* of at most one
  team. Tiers stay what they are, a rate class applied to each member on its
  own; a user's own cap (user > tier > default) and its team's both hold.
- *charge*: a member's token costs one from its own budget and one from its
  team's; refunds go back to both. A user the limiter does not limit (exempt,
  itself or through its tier) is exempt from its team's cap too: its tokens
  are charged to no team.
- *team grant*: in a paced step, the scheduler asks for all of a team's
  members with demand at once (``TeamBudget.take_team``); each gets what both
  budgets allow. When the team has less than the members ask for, it *binds*
  and its tokens are handed out one at a time by a per-team fair queue:
- *virtual time* ``vt[u]``: tokens member ``u`` was granted in team grants
  (less those refunded) over its weight (``--output-rate-weights``: the
  user's, else its tier's, else 1); tokens charged after the fact in a step
  nobody could be refused in are not counted, as the team did not bind. The next
  token goes to the member with the smallest ``vt + 1/w`` (its finish tag)
  that still wants one, so stream count does not matter, a member below its
  part goes first, and one whose own cap gives it less than its part leaves
  the rest to the others (work-conserving). A member that enters the team's
  backlog (first demand, or back from its own cap) is lifted to the smallest
  virtual time of the members already in it: service missed while idle is not
  owed back.

Guarantee (measured in ``tests/scheduling/test_scheduler_teams.py``): after every team
grant, two members that both asked for more than they were given differ in
virtual time by at most ``max(1/w_i, 1/w_j)`` (each token went to a smallest
finish tag). Between grants, tokens granted and not dispatched are refunded,
which only lowers the refunded member's virtual time.

*Promises*: the scheduler keeps a user's remaining budget as a lower bound
until its next charge (``pacing.budget``), but a member's budget also shrinks
when another member spends from the team. So a member is told at most its
*promise*: the team's remaining tokens after a grant, split among the members
by weight, reduced by what it spends. The promises of a team never add up to
more than the team has, so every bound the scheduler holds stays true; a
charge beyond a promise (it cannot happen through the scheduler) bumps
``limit_changes``, which makes the scheduler forget every bound.

Not thread-safe; the owner serialises access (the shared limiter's lock).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pacing.budget import BudgetSource
from pacing.identity import validate_user
from pacing.limiter import DEFAULT_BURST_NS, MAX_RATE, OutputRateLimiter
from pacing.limits import validate_rate
from pacing.policy.errors import unknown_group

if TYPE_CHECKING:
    from pacing.ceilings import TeamLending

#: A member's weight inside its team when it has none (``pacing.fair_share``).
DEFAULT_MEMBER_WEIGHT = 1.0


def validate_team(name: object) -> str:
    """``name`` if it is a valid team name (the user-id rule), else ValueError."""
    return validate_user(name, field="team name")


class TeamTable:
    """Team rates and memberships, validated before anything changes.

    A team exists while it has a rate; a user joins only a team that exists,
    and a team with members cannot be removed (the table never holds a
    membership that resolves to nothing).
    """

    __slots__ = ("_members", "_rates", "_team_of")

    def __init__(
        self,
        rates: Mapping[str, int] | None = None,
        memberships: Mapping[str, str] | None = None,
    ) -> None:
        rates = dict(rates or {})
        memberships = dict(memberships or {})
        for team, rate in rates.items():
            validate_team(team)
            validate_rate(rate, field=f"rate of team {team!r}")
        for user, team in memberships.items():
            validate_user(user, field="member name")
            if team not in rates:
                raise unknown_group("team", team, ("team_members", user))
        self._rates = rates
        self._team_of = memberships
        self._members: dict[str, set[str]] = {}
        for user, team in memberships.items():
            self._members.setdefault(team, set()).add(user)

    def copy(self) -> TeamTable:
        return TeamTable(self._rates, self._team_of)

    def __bool__(self) -> bool:
        return bool(self._rates)

    @property
    def rates(self) -> dict[str, int]:
        """A copy of team -> tokens/s."""
        return dict(self._rates)

    @property
    def memberships(self) -> dict[str, str]:
        """A copy of user -> team."""
        return dict(self._team_of)

    def team_of(self, user: str) -> str | None:
        """The team ``user`` is a member of, or ``None`` (one lookup)."""
        return self._team_of.get(user)

    def rate_of(self, team: str) -> int | None:
        return self._rates.get(team)

    def members(self, team: str) -> frozenset[str]:
        return frozenset(self._members.get(team, ()))

    def set_rate(self, team: str, rate: int | None) -> None:
        """Sets ``team``'s rate, creating it; ``None`` removes the team
        (ValueError while it has members)."""
        validate_team(team)
        if rate is None:
            count = len(self._members.get(team, ()))
            if count:
                raise ValueError(
                    f"team {team!r} has {count} member(s): move them out before "
                    "removing it"
                )
            self._rates.pop(team, None)
        else:
            self._rates[team] = validate_rate(rate, field=f"rate of team {team!r}")

    def set_membership(self, user: str, team: str | None) -> None:
        """Moves ``user`` into ``team`` (``None``: out of any team); ValueError
        for a team that does not exist."""
        if team is not None and team not in self._rates:
            raise unknown_group("team", team, ("team_members", user))
        previous = self._team_of.pop(user, None)
        if previous is not None:
            members = self._members[previous]
            members.discard(user)
            if not members:
                del self._members[previous]
        if team is not None:
            self._team_of[user] = team
            self._members.setdefault(team, set()).add(user)


def charged_team(
    table: TeamTable, gateway_teams: Mapping[str, tuple[str, int]], user: str
) -> str | None:
    """The team ``user`` is charged to: the one its gateway named for its live
    requests (``Teams.gateway_teams``) while that team exists, else its
    membership in the operator's ``table``."""
    named = gateway_teams.get(user)
    if named is not None and table.rate_of(named[0]) is not None:
        return named[0]
    return table.team_of(user)


@runtime_checkable
class TeamGrants(Protocol):
    """A budget source that knows teams (``isinstance`` tells): the scheduler
    grants a team's members together."""

    def team_of(self, user: str) -> str | None:
        """The team whose cap applies to ``user`` (None: none applies)."""
        ...

    def take_team(
        self, team: str, demands: Mapping[str, int], now_ns: int
    ) -> dict[str, tuple[int, int]]:
        """Grants each member of ``team`` in ``demands`` up to its demand;
        returns user -> ``(taken, still available)``."""
        ...


class Teams:
    """The team table, one GCRA cell per team, and the in-team fair queue."""

    __slots__ = (
        "backlogged",
        "budget",
        "cells",
        "changes",
        "charged",
        "gateway_teams",
        "table",
        "throttled_steps",
        "vt",
        "weight_of",
    )

    def __init__(
        self,
        table: TeamTable | None = None,
        burst_ns: int = DEFAULT_BURST_NS,
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.table = table or TeamTable()
        #: One GCRA cell per team, keyed by team name (every team in the table
        #: has a rate of its own; the default is never used).
        self.cells = OutputRateLimiter(MAX_RATE, self.table.rates, burst_ns)
        #: Where teams' tokens are spent from: ``cells`` on one engine, the
        #: teams' claimed balances with a global store (``store.runtime``),
        #: which take their rates from ``cells``.
        self.budget: BudgetSource = self.cells
        #: Bumped by every change of the table (the budget forgets its bounds).
        self.changes = 0
        #: A member's weight inside its team (the fair-share weights).
        self.weight_of: Callable[[str], float] = weight_of or (
            lambda user: DEFAULT_MEMBER_WEIGHT
        )
        #: member -> tokens charged over its weight (lifted); see the module.
        self.vt: dict[str, float] = {}
        #: team -> members that asked for tokens at its last grant and could
        #: take some (the lift is measured against them).
        self.backlogged: dict[str, set[str]] = {}
        #: team -> net tokens charged to it (charged minus refunds).
        self.charged: dict[str, int] = {}
        #: team -> grants in which it bound (members got less than they asked).
        self.throttled_steps: dict[str, int] = {}
        #: user -> (team its gateway named, live requests that named it)
        #: (``--output-rate-team-source header:NAME``); never in ``table``.
        self.gateway_teams: dict[str, tuple[str, int]] = {}

    # -- changing the table ------------------------------------------------

    def set_rate(self, team: str, rate: int | None, now_ns: int) -> None:
        """Sets or removes a team's rate; the team's debt is kept across a
        change (``OutputRateLimiter.set_rate``)."""
        self.table.set_rate(team, rate)
        self.cells.set_rate(team, rate, now_ns)
        self.changes += 1

    def set_membership(self, user: str, team: str | None, now_ns: int) -> None:
        self.table.set_membership(user, team)
        self.vt.pop(user, None)
        self.changes += 1

    def use_budget(self, budget: BudgetSource | None) -> None:
        """Makes ``budget`` what teams spend from (``None``: ``cells``)."""
        self.budget = self.cells if budget is None else budget
        self.changes += 1

    def team_of(self, user: str) -> str | None:
        """The team ``user`` is charged to (``charged_team``)."""
        return charged_team(self.table, self.gateway_teams, user)

    def join_request(self, user: str, team: str) -> str | None:
        """Charges ``user`` to ``team`` for one more live request whose trusted
        gateway header named it (``--output-rate-team-source header:NAME``),
        storing nothing in the table; ``leave_request`` ends it. Returns why
        the request is refused instead, changing nothing: a team the operator
        never defined must not lift a cap, and one user's live requests are
        charged to one team at a time."""
        if self.table.rate_of(team) is None:
            return f"its gateway named an {unknown_group('team', team, ()).message}"
        named, live = self.gateway_teams.get(user, (team, 0))
        if named != team:
            return (
                f"its gateway named team {team!r} while {live} live request(s) "
                f"of {user!r} are charged to team {named!r}"
            )
        self.gateway_teams[user] = (team, live + 1)
        if not live and self.table.team_of(user) != team:
            self.vt.pop(user, None)
            self.changes += 1
        return None

    def leave_request(self, user: str) -> None:
        """One request ``join_request`` admitted for ``user`` ended; with the
        last one the user is back to its table membership."""
        team, live = self.gateway_teams.pop(user)
        if live > 1:
            self.gateway_teams[user] = (team, live - 1)
        elif self.table.team_of(user) != team:
            self.vt.pop(user, None)
            self.changes += 1

    def replace(self, table: TeamTable, now_ns: int) -> None:
        """Makes ``table`` the team table, keeping each remaining team's debt."""
        for team in self.table.rates.keys() - table.rates.keys():
            self.cells.set_rate(team, None, now_ns)
        for team, rate in table.rates.items():
            self.cells.set_rate(team, rate, now_ns)
        self.table = table
        self.vt = {u: v for u, v in self.vt.items() if self.team_of(u) is not None}
        self.changes += 1

    # -- the fair queue ----------------------------------------------------

    def split(self, team: str, wants: Mapping[str, int], tokens: int) -> dict[str, int]:
        """Hands ``tokens`` (fewer than ``wants`` add up to) to the members of
        ``team`` one at a time, smallest finish tag first; returns user ->
        tokens given (virtual times are advanced when charged, not here)."""
        vt = self.vt
        weight_of = self.weight_of
        given = dict.fromkeys(wants, 0)
        heap: list[tuple[float, int, str, float]] = []
        for rank, (user, want) in enumerate(wants.items()):
            if want > 0:
                step = 1.0 / weight_of(user)
                heap.append((vt.get(user, 0.0) + step, rank, user, step))
        heapq.heapify(heap)
        while tokens > 0 and heap:
            tag, rank, user, step = heap[0]
            given[user] += 1
            tokens -= 1
            if given[user] < wants[user]:
                heapq.heapreplace(heap, (tag + step, rank, user, step))
            else:
                heapq.heappop(heap)
        self.throttled_steps[team] = self.throttled_steps.get(team, 0) + 1
        return given

    def lift(self, team: str, eligible: Iterable[str]) -> None:
        """Members of ``team`` entering its backlog are lifted to the smallest
        virtual time of those already in it."""
        eligible = set(eligible)
        before = self.backlogged.get(team, set())
        staying = eligible & before
        entering = eligible - before
        vt = self.vt
        if entering and staying:
            floor = min(vt.get(u, 0.0) for u in staying)
            for user in entering:
                if vt.get(user, 0.0) < floor:
                    vt[user] = floor
        self.backlogged[team] = eligible

    def record(self, user: str, team: str, count: int) -> None:
        """``count`` tokens (negative: refunded) charged to ``user`` in ``team``."""
        self.vt[user] = self.vt.get(user, 0.0) + count / self.weight_of(user)
        self.charged[team] = self.charged.get(team, 0) + count

    def forget_idle(self, live: Mapping[str, int]) -> None:
        """Drops the virtual times of members without live requests that the
        lift would replace anyway (at or below their team's smallest backlogged
        one, or all of a team nobody in which is backlogged)."""
        floors: dict[str, float] = {}
        for team, members in self.backlogged.items():
            alive = [self.vt.get(u, 0.0) for u in members if u in live]
            if alive:
                floors[team] = min(alive)
        team_of = self.team_of
        kept: dict[str, float] = {}
        for user, value in self.vt.items():
            member_of = team_of(user)
            if member_of is None:
                continue
            if user in live or value > floors.get(member_of, float("inf")):
                kept[user] = value
        self.vt = kept
        self.backlogged = {
            team: {u for u in members if u in live}
            for team, members in self.backlogged.items()
            if team in floors
        }


class TeamBudget:
    """``BudgetSource`` that charges a member to its own budget (``base``) and
    to its team's cell; see the module docstring. Users without a team, and
    users the limiter does not limit, go to ``base`` alone."""

    __slots__ = ("_bumps", "base", "lending", "promised", "rate_of", "teams")

    def __init__(
        self,
        base: BudgetSource,
        teams: Teams,
        rate_of: Callable[[str], int],
        lending: TeamLending | None = None,
    ) -> None:
        self.base = base
        self.teams = teams
        #: The user's own limit (0: not limited, so not charged to a team).
        self.rate_of = rate_of
        #: The teams' borrow cells (``pacing.ceilings``) while a team has a
        #: ceiling: spent once a team's own cell is, while it is spare.
        self.lending = lending
        #: member -> tokens of its team it may still spend without a new grant.
        self.promised: dict[str, int] = {}
        self._bumps = 0

    @property
    def limit_changes(self) -> int:
        teams = self.teams
        changes = self.base.limit_changes + teams.changes + self._bumps
        if teams.budget is not teams.cells:  # claimed balances over the cells
            changes += teams.cells.limit_changes
        return changes + teams.budget.limit_changes

    def team_of(self, user: str) -> str | None:
        team = self.teams.team_of(user)
        if team is None or not self.rate_of(user):
            return None
        return team

    def take_team(
        self, team: str, demands: Mapping[str, int], now_ns: int
    ) -> dict[str, tuple[int, int]]:
        base = self.base
        teams = self.teams
        results: dict[str, tuple[int, int]] = {}
        wants: dict[str, int] = {}
        for user, most in demands.items():
            if self.team_of(user) != team:
                results[user] = self.take_up_to(user, most, now_ns)
            else:
                wants[user] = min(most, base.available(user, now_ns))
        if not wants:
            return results
        teams.lift(team, [u for u, want in wants.items() if want > 0])
        cells = teams.budget
        lending = self.lending
        lendable = 0 if lending is None else lending.lendable(team, now_ns)
        tokens = cells.available(team, now_ns) + lendable
        grants = (
            wants if sum(wants.values()) <= tokens else teams.split(team, wants, tokens)
        )
        user_left: dict[str, int] = {}
        total = 0
        for user, grant in grants.items():
            taken, left = base.take_up_to(user, grant, now_ns)
            grants[user] = taken
            user_left[user] = left
            total += taken
            if taken:
                teams.record(user, team, taken)
        # Asked even for 0 tokens: a store-backed budget learns of the demand
        # (the team is then due a claim) only from a take.
        own, team_left = cells.take_up_to(team, total, now_ns)
        if lendable:
            assert lending is not None
            borrowed = lending.take(team, total - own, now_ns) if total > own else 0
            lending.record(_shares(borrowed, grants))
            team_left += lendable - borrowed
        promises = self._promise(team_left, list(grants))
        for user, taken in grants.items():
            promise = promises[user]
            self.promised[user] = promise
            results[user] = (taken, min(user_left[user], promise))
        return results

    def _promise(self, tokens: int, members: list[str]) -> dict[str, int]:
        """``tokens`` split among ``members`` by weight, rounded down."""
        weight_of = self.teams.weight_of
        weights = {user: weight_of(user) for user in members}
        total = sum(weights.values())
        return {user: int(tokens * w / total) for user, w in weights.items()}

    def take_up_to(self, user: str, most: int, now_ns: int) -> tuple[int, int]:
        team = self.team_of(user)
        if team is None:
            return self.base.take_up_to(user, most, now_ns)
        return self.take_team(team, {user: most}, now_ns)[user]

    def take_each(self, counts: Mapping[str, int], now_ns: int) -> dict[str, int]:
        """Charges each user and each member's team; a member is told at most
        what is left of its promise. Virtual times are not advanced: a
        charge decided after the fact comes from a step nobody could be
        refused in, so the team did not bind (the fair queue orders members
        only while it does)."""
        remaining = self.base.take_each(counts, now_ns)
        team_of = self.teams.team_of
        rate_of = self.rate_of
        promised = self.promised
        totals: dict[str, int] = {}
        for user, count in counts.items():
            team = team_of(user)
            if team is None or not rate_of(user):
                continue
            totals[team] = totals.get(team, 0) + count
            promise = promised.get(user, 0) - count
            if promise < 0:
                # Spent beyond its promise: the others' bounds may not hold.
                self._bumps += 1
                promise = 0
            promised[user] = promise
            if promise < remaining[user]:
                remaining[user] = promise
        if totals:
            self._charge_teams(totals, counts, now_ns)
            charged = self.teams.charged
            for team, total in totals.items():
                charged[team] = charged.get(team, 0) + total
        return remaining

    def _charge_teams(
        self, totals: dict[str, int], counts: Mapping[str, int], now_ns: int
    ) -> None:
        """Charges each team its total: what its own cell lacks to its borrow
        cell while it may borrow, recorded as borrowed by the members
        (``counts``) in proportion."""
        budget = self.teams.budget
        lending = self.lending
        if lending is not None:
            team_of = self.teams.team_of
            for team, total in totals.items():
                if not lending.lendable(team, now_ns):
                    continue
                has = budget.available(team, now_ns)
                if has < total:
                    lent = total - has
                    totals[team] = has
                    lending.charge(team, lent, now_ns)
                    members = {
                        user: count
                        for user, count in counts.items()
                        if count and team_of(user) == team and self.rate_of(user)
                    }
                    lending.record(_shares(lent, members))
        budget.take_each(totals, now_ns)

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        self.base.refund(user, now_ns, count)
        team = self.team_of(user)
        if team is not None and count:
            back = 0
            if self.lending is not None:  # to the borrow cell first
                back = self.lending.refund(team, count, now_ns)
                self.lending.record({user: -back})
            if count > back:
                self.teams.budget.refund(team, now_ns, count - back)
            self.teams.record(user, team, -count)
            self.promised[user] = self.promised.get(user, 0) + count

    def available(self, user: str, now_ns: int) -> int:
        available = self.base.available(user, now_ns)
        if self.team_of(user) is None:
            return available
        return min(available, self.promised.get(user, 0))

    def end_user(self, user: str, now_ns: int) -> None:
        self.base.end_user(user, now_ns)
        self.promised.pop(user, None)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        ready = self.base.ready_at_ns(user, now_ns)
        team = self.team_of(user)
        if team is None:
            return ready
        team_ready = self.teams.budget.ready_at_ns(team, now_ns)
        if team_ready > now_ns and self.lending is not None:
            lent_ready = self.lending.ready_at_ns(team, now_ns)
            if lent_ready is not None:
                team_ready = min(team_ready, lent_ready)
        return max(ready, team_ready)


def _shares(tokens: int, weights: Mapping[str, int]) -> dict[str, int]:
    """``tokens`` split over ``weights``' keys in proportion, rounded down, the
    rest one each from the largest weight on."""
    total = sum(weights.values())
    if not tokens or not total:
        return {}
    shares = {user: tokens * w // total for user, w in weights.items()}
    rest = tokens - sum(shares.values())
    for user in sorted(weights, key=weights.__getitem__, reverse=True)[:rest]:
        shares[user] += 1
    return shares
