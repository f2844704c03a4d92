"""Per-team state reads: one team, or a page of teams in team id order.

A team's state joins its budget (``SharedLimiter.teams.budget``: its cell, or
with a store its claimed balance and the global cell's TAT lead),
its counters (``Teams.charged``, ``Teams.throttled_steps``) and its members'
live requests and fair-share service (the scheduler's request counts and the
accounting, as user states read them).

Invariant: a read never holds ``shared.lock`` for more than
``STATES_PER_HOLD`` teams' own fields (with C-level copies of their member
sets) or ``MEMBERS_PER_HOLD`` members' requests and service
(``control.service.holds``), whatever the number of teams and members. A
team's own fields and members are of one instant (one ``Reading``); its
members' sums are added up hold after hold, so may be of a few consecutive
step boundaries. A team removed between holds is left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from control import names
from control.errors import NotFound
from control.pagination import PageTokens
from control.resources import TeamState
from control.service.holds import MEMBERS_PER_HOLD, STATES_PER_HOLD, let_a_step_in
from control.service.ordering import page_size, resume
from control.table import shown
from pacing.budget import StoreViews
from pacing.shared import Reading, SharedLimiter


def get_team_state(shared: SharedLimiter, name: str) -> TeamState:
    """The state of the team named ``teamStates/{team}``; NotFound when there
    is no such team."""
    team = names.parse_team(name, names.TEAM_STATES, field="name")
    states = _states_in_holds(shared, [team])
    if not states:
        raise NotFound(f"{shown(names.team_state_name(team))}: no such team")
    return states[0]


def list_team_states(
    shared: SharedLimiter, tokens: PageTokens, requested_size: int, page_token: str
) -> tuple[list[TeamState], str]:
    """One page of team states in team id order, and the next page's token
    ("" on the last page)."""
    size = page_size(requested_size)
    after = resume(tokens, "teamStates", page_token)
    with shared.lock:
        ids = shared.teams.table.rates  # a copy, made in C
    teams = sorted(t for t in ids if after is None or t > after[0])
    states = _states_in_holds(shared, teams[:size])
    token = tokens.encode("teamStates", [teams[size - 1]]) if len(teams) > size else ""
    return states, token


@dataclasses.dataclass
class _MemberSums:
    """A team's members with requests in the engine, of those the ones skipped
    last step, and their fair-share service, summed so far."""

    running: int = 0
    throttled: int = 0
    service: float = 0.0

    def add(self, reading: Reading, user: str) -> None:
        """Adds ``user`` as ``reading`` sees it. Requires shared.lock."""
        live, skipped = reading.counts.get(user, (0, 0))
        self.running += live > 0
        self.throttled += skipped > 0
        counters = reading.counters.get(user)
        if counters is not None:
            self.service += counters.fair_share_service


def _states_in_holds(shared: SharedLimiter, teams: Sequence[str]) -> list[TeamState]:
    """The states of those of ``teams`` that exist, in their order: their own
    fields read ``STATES_PER_HOLD`` teams per hold of the lock, then their
    members summed ``MEMBERS_PER_HOLD`` members per hold."""
    heads: list[tuple[TeamState, frozenset[str]]] = []
    for start in range(0, len(teams), STATES_PER_HOLD):
        with shared.lock:
            reading = shared.read()
            heads += [
                _head(shared, reading, team)
                for team in teams[start : start + STATES_PER_HOLD]
                if shared.teams.table.rate_of(team) is not None
            ]
        let_a_step_in()
    sums = [_MemberSums() for _ in heads]
    members = [(sums[i], user) for i, (_, of) in enumerate(heads) for user in of]
    for start in range(0, len(members), MEMBERS_PER_HOLD):
        with shared.lock:
            reading = shared.read()
            for total, user in members[start : start + MEMBERS_PER_HOLD]:
                total.add(reading, user)
        let_a_step_in()
    return [
        dataclasses.replace(
            head,
            running_members=total.running,
            throttled_members=total.throttled,
            fair_share_service=total.service,
        )
        for (head, _), total in zip(heads, sums, strict=True)
    ]


def _head(
    shared: SharedLimiter, reading: Reading, team: str
) -> tuple[TeamState, frozenset[str]]:
    """``team``'s state at ``reading``'s instant with its members' sums left
    at zero, and its members. Requires shared.lock and that ``team`` exists."""
    teams = shared.teams
    now_ns = reading.now_ns
    budget = teams.budget  # the team cells, or their claimed balances
    members = teams.table.members(team)
    rate = teams.table.rate_of(team)
    assert rate is not None  # the caller checked the team exists
    state = TeamState(
        team=team,
        tokens_per_second=rate,
        weight=shared.fair_share.weights.team(team),
        budget_tokens=budget.available(team, now_ns),
        tat_lead_ns=(
            budget.store_view(team, now_ns).global_tat_lead_ns
            if isinstance(budget, StoreViews)
            else teams.cells.lead_ns(team, now_ns)
        ),
        next_token_in_ns=budget.ready_at_ns(team, now_ns) - now_ns,
        member_count=len(members),
        running_members=0,
        throttled_members=0,
        tokens_charged=teams.charged.get(team, 0),
        throttled_steps=teams.throttled_steps.get(team, 0),
        fair_share_service=0.0,
        prompt_tokens_per_second=shared.prompt.teams.table.rate_of(team) or 0,
    )
    return state, members
