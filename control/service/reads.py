"""Reads of the limits table: the default, one entry or a page of them, one
tier or a page of them, one team or a page of them, the pacing mode with the
fair-share switch, the whole table.

Invariant: each read takes what it returns from the limiter under one hold of
``shared.lock``, so it never shows half of a change; a list copies the table
there and sorts it after releasing the lock.
"""

from __future__ import annotations

import heapq
from collections import Counter

from control import names
from control.pagination import PageTokens
from control.resources import (
    Limit,
    LimitsTable,
    PacingMode,
    Team,
    Tier,
    entry,
    entry_of,
    no_limit,
    no_team,
    no_tier,
    pacing_mode,
    table_of,
    team_of,
    tier_of,
)
from control.service.commits import TableCommits
from control.service.ordering import page_size, resume


def get_default_limit(commits: TableCommits, name: str) -> int:
    """The default limit in tokens/s (0 while pacing is off)."""
    names.check_singleton(name, names.DEFAULT_LIMIT, field="name")
    with commits.shared.lock:
        return commits.shared.limiter.default_rate or 0


def get_limit(commits: TableCommits, name: str) -> Limit:
    """The entry named ``limits/{user}``; NotFound without one."""
    user = names.parse_user(name, names.LIMITS, field="name")
    with commits.shared.lock:
        limiter = commits.shared.limiter
        limit = entry(
            commits.etags,
            user,
            (
                limiter.user_rates.get(user),
                limiter.tier_of(user),
                user in limiter.exempt_users,
                commits.shared.fair_share.weights.users.get(user),
                commits.shared.teams.table.team_of(user),
            ),
        )
    if limit is None:
        raise no_limit(user)
    return limit


def list_limits(
    commits: TableCommits, tokens: PageTokens, requested_size: int, page_token: str
) -> tuple[list[Limit], str]:
    """One page of entries in user id order, and the next page's token (""
    on the last page)."""
    size = page_size(requested_size)
    after = resume(tokens, "limits", page_token)
    with commits.shared.lock:
        doc = commits.current_locked()  # copies: sort off the lock
    users = doc.users()
    candidates = users if after is None else (u for u in users if u > after[0])
    page = heapq.nsmallest(size + 1, candidates)
    token = ""
    if len(page) > size:
        page = page[:size]
        token = tokens.encode("limits", [page[-1]])
    return [entry_of(commits.etags, doc, user) for user in page], token


def get_tier(commits: TableCommits, name: str) -> Tier:
    """The tier named ``tiers/{tier}``; NotFound without one."""
    tier = names.parse_tier(name, field="name")
    with commits.shared.lock:
        doc = commits.current_locked()
    if tier not in doc.tiers:
        raise no_tier(tier)
    return tier_of(commits.etags, doc, tier, Counter(doc.memberships.values()))


def list_tiers(
    commits: TableCommits, tokens: PageTokens, requested_size: int, page_token: str
) -> tuple[list[Tier], str]:
    """One page of tiers in tier id order, and the next page's token (""
    on the last page)."""
    size = page_size(requested_size)
    after = resume(tokens, "tiers", page_token)
    with commits.shared.lock:
        doc = commits.current_locked()
    tiers = sorted(t for t in doc.tiers if after is None or t > after[0])
    page = tiers[:size]
    token = tokens.encode("tiers", [page[-1]]) if len(tiers) > size else ""
    members = Counter(doc.memberships.values())
    return [tier_of(commits.etags, doc, tier, members) for tier in page], token


def get_team(commits: TableCommits, name: str) -> Team:
    """The team named ``teams/{team}``; NotFound without one."""
    team = names.parse_team(name, field="name")
    with commits.shared.lock:
        doc = commits.current_locked()
    if team not in doc.team_rates:
        raise no_team(team)
    return team_of(commits.etags, doc, team, Counter(doc.team_members.values()))


def list_teams(
    commits: TableCommits, tokens: PageTokens, requested_size: int, page_token: str
) -> tuple[list[Team], str]:
    """One page of teams in team id order, and the next page's token (""
    on the last page)."""
    size = page_size(requested_size)
    after = resume(tokens, "teams", page_token)
    with commits.shared.lock:
        doc = commits.current_locked()
    teams = sorted(t for t in doc.team_rates if after is None or t > after[0])
    page = teams[:size]
    token = tokens.encode("teams", [page[-1]]) if len(teams) > size else ""
    members = Counter(doc.team_members.values())
    return [team_of(commits.etags, doc, team, members) for team in page], token


def get_pacing_mode(commits: TableCommits, name: str) -> PacingMode:
    """The pacing mode and the fair-share switch, with their etag."""
    names.check_singleton(name, names.PACING_MODE, field="name")
    with commits.shared.lock:
        mode = commits.shared.mode
        fair_share = commits.shared.fair_share.enabled
    return pacing_mode(commits.etags, mode, fair_share)


def get_limits_table(commits: TableCommits, name: str) -> LimitsTable:
    """The default, every entry and every tier, with the current etag."""
    names.check_singleton(name, names.LIMITS_TABLE, field="name")
    with commits.shared.lock:
        doc = commits.current_locked()
        etag = commits.etag()
    return table_of(commits.etags, doc, etag)
