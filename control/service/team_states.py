"""Per-team state reads: one team, or a page of teams in team id order.

A team's state joins its budget (``SharedLimiter.teams.budget``: its cell, or
with a store its claimed balance and the global cell's TAT lead),
its counters (``Teams.charged``, ``Teams.throttled_steps``) and its members'
live requests and fair-share service (the scheduler's request counts and the
accounting, as user states read them).

Invariant: each state is read under one hold of ``shared.lock`` (one
``Reading``, one instant); a page holds at most ``MAX_PAGE_SIZE`` teams of at
most ``MAX_TIERS`` in all, so a hold is short.
"""

from __future__ import annotations

from control import names
from control.errors import NotFound
from control.pagination import PageTokens
from control.resources import TeamState
from control.service.ordering import page_size, resume
from control.table import shown
from pacing.budget import StoreViews
from pacing.shared import Reading, SharedLimiter


def get_team_state(shared: SharedLimiter, name: str) -> TeamState:
    """The state of the team named ``teamStates/{team}``; NotFound when there
    is no such team."""
    team = names.parse_team(name, names.TEAM_STATES, field="name")
    with shared.lock:
        if shared.teams.table.rate_of(team) is None:
            raise NotFound(f"{shown(names.team_state_name(team))}: no such team")
        return _state(shared, shared.read(), team)


def list_team_states(
    shared: SharedLimiter, tokens: PageTokens, requested_size: int, page_token: str
) -> tuple[list[TeamState], str]:
    """One page of team states in team id order, and the next page's token
    ("" on the last page)."""
    size = page_size(requested_size)
    after = resume(tokens, "teamStates", page_token)
    with shared.lock:
        teams = sorted(
            t for t in shared.teams.table.rates if after is None or t > after[0]
        )
        reading = shared.read()
        states = [_state(shared, reading, team) for team in teams[:size]]
    token = tokens.encode("teamStates", [teams[size - 1]]) if len(teams) > size else ""
    return states, token


def _state(shared: SharedLimiter, reading: Reading, team: str) -> TeamState:
    """``team``'s state at ``reading``'s instant. Requires shared.lock."""
    teams = shared.teams
    now_ns = reading.now_ns
    budget = teams.budget  # the team cells, or their claimed balances
    members = teams.table.members(team)
    running = throttled = 0
    service = 0.0
    for user in members:
        live, skipped = reading.counts.get(user, (0, 0))
        running += live > 0
        throttled += skipped > 0
        counters = reading.counters.get(user)
        if counters is not None:
            service += counters.fair_share_service
    rate = teams.table.rate_of(team)
    assert rate is not None  # the caller checked the team exists
    return TeamState(
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
        running_members=running,
        throttled_members=throttled,
        tokens_charged=teams.charged.get(team, 0),
        throttled_steps=teams.throttled_steps.get(team, 0),
        fair_share_service=service,
    )
