"""Changes of the whole limits table: replacing it (``ReplaceLimitsTable``) and
reloading it from the config file.

A replacement is checked on its own first (``parse_table``: ids, duplicates,
rates, memberships of tiers and teams, sizes), then against the table etag under
``commits.changes``, and committed as one new table; a reload is applied
without being persisted, since it came from the config file.

Invariant: the limiter and the teams take a new whole table in one apply under
``shared.lock`` (``_replace_with``, ``_replace_teams``), so no read sees part
of an old table and part of a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from control import names
from control.errors import Aborted, InvalidArgument
from control.resources import LimitSpec, LimitsTable, TeamSpec, TierSpec, table_of
from control.service.commits import Apply, TableCommits, TeamsApply
from control.service.write_requests import entry_rate
from control.table import (
    FAIR_SHARE_KEY,
    TableDocument,
    check_rate,
    check_table_size,
    check_tier_count,
    check_weight,
    shown,
)
from pacing.limiter import OutputRateLimiter
from pacing.teams import Teams, TeamTable


def parse_table(
    default_tokens_per_second: int,
    limits: Iterable[LimitSpec],
    tiers: Iterable[TierSpec],
    teams: Iterable[TeamSpec] = (),
) -> TableDocument:
    """The table a ``ReplaceLimitsTable`` request holds, checked on its own
    (ids, duplicates, rates, weights, memberships, sizes); its mode and
    fair-share switch are None."""
    default = check_rate(
        default_tokens_per_second, field="limits_table.default_tokens_per_second"
    )
    tier_rates: dict[str, int] = {}
    tier_weights: dict[str, float] = {}
    exempt_tiers: set[str] = set()
    seen_tiers: set[str] = set()
    for index, spec in enumerate(tiers):
        where = f"limits_table.tiers[{index}]"
        tier = names.parse_tier(spec.name, field=f"{where}.name")
        if tier in seen_tiers:
            raise InvalidArgument(
                f"{where}.name: {shown(names.tier_name(tier))} appears more than once"
            )
        seen_tiers.add(tier)
        rate = entry_rate(spec.tokens_per_second, spec.exempt, where)
        if rate is not None:
            tier_rates[tier] = rate
        weight = check_weight(spec.weight, field=f"{where}.weight")
        if weight is not None:
            tier_weights[tier] = weight
        if spec.exempt:
            exempt_tiers.add(tier)
    check_tier_count(len(seen_tiers))
    team_rates: dict[str, int] = {}
    team_weights: dict[str, float] = {}
    for index, team_spec in enumerate(teams):
        where = f"limits_table.teams[{index}]"
        team = names.parse_team(team_spec.name, field=f"{where}.name")
        if team in team_rates:
            raise InvalidArgument(
                f"{where}.name: {shown(names.team_name(team))} appears more than once"
            )
        team_rates[team] = check_rate(
            team_spec.tokens_per_second, field=f"{where}.tokens_per_second"
        )
        team_weight = check_weight(team_spec.weight, field=f"{where}.weight")
        if team_weight is not None:
            team_weights[team] = team_weight
    check_tier_count(len(team_rates))
    team_members: dict[str, str] = {}
    users: dict[str, int] = {}
    user_weights: dict[str, float] = {}
    memberships: dict[str, str] = {}
    exempt_users: set[str] = set()
    seen_users: set[str] = set()
    for index, entry in enumerate(limits):
        where = f"limits_table.limits[{index}]"
        user = names.parse_user(entry.name, names.LIMITS, field=f"{where}.name")
        if user in seen_users:
            raise InvalidArgument(
                f"{where}.name: {shown(names.limit_name(user))} appears more than once"
            )
        seen_users.add(user)
        weight = check_weight(entry.weight, field=f"{where}.weight")
        rate = entry_rate(
            entry.tokens_per_second,
            bool(entry.tier) or bool(entry.team) or entry.exempt or weight is not None,
            where,
        )
        if rate is not None:
            users[user] = rate
        if weight is not None:
            user_weights[user] = weight
        if entry.tier:
            tier = names.parse_tier(entry.tier, field=f"{where}.tier")
            if tier not in seen_tiers:
                raise InvalidArgument(
                    f"{where}.tier: {shown(entry.tier)} is not one of "
                    "limits_table.tiers"
                )
            memberships[user] = tier
        if entry.team:
            team = names.parse_team(entry.team, field=f"{where}.team")
            if team not in team_rates:
                raise InvalidArgument(
                    f"{where}.team: {shown(entry.team)} is not one of "
                    "limits_table.teams"
                )
            team_members[user] = team
        if entry.exempt:
            exempt_users.add(user)
    check_table_size(len(seen_users))
    return TableDocument(
        default_rate=default,
        user_rates=users,
        tier_rates=tier_rates,
        exempt_tiers=frozenset(exempt_tiers),
        memberships=memberships,
        exempt_users=frozenset(exempt_users),
        user_weights=user_weights,
        tier_weights=tier_weights,
        team_rates=team_rates,
        team_members=team_members,
        team_weights=team_weights,
    )


def replace_limits_table(
    commits: TableCommits,
    default_tokens_per_second: int,
    limits: Iterable[LimitSpec],
    etag: str,
    tiers: Iterable[TierSpec],
    teams: Iterable[TeamSpec] = (),
) -> LimitsTable:
    """Replaces the default, all entries, all tiers and all teams, weights
    included, at once (not the mode nor the fair-share switch); Aborted when
    ``etag`` is not empty and not the current etag."""
    table = parse_table(default_tokens_per_second, limits, tiers, teams)
    with commits.changes:
        if etag and etag != commits.etag():
            raise Aborted(
                f"etag {shown(etag)} is not current: the table changed "
                "since it was read; read it again and retry"
            )
        current = commits.current()
        doc = dataclasses.replace(
            table, mode=current.mode, fair_share=current.fair_share
        )
        new_etag = commits.commit(
            doc, _replace_with(doc), teams=_replace_teams(doc, current)
        )
    return table_of(commits.etags, doc, new_etag)


def reload(commits: TableCommits, read: Callable[[], TableDocument | None]) -> bool:
    """Makes the document ``read()`` returns the table, mode and fair-share
    switch, without persisting it (it came from the config file); ``None`` or
    an equal document changes nothing, a missing default, mode or switch keeps
    the current one. ``read`` runs under the change lock, so no RPC change
    interleaves. Returns whether the table, the mode or the switch changed.
    FailedPrecondition when it switches fair share on where the engine cannot
    run it (nothing applied)."""
    with commits.changes:
        doc = read()
        if doc is None:
            return False
        current = commits.current()
        doc = dataclasses.replace(
            doc,
            etag=None,
            default_rate=(
                current.default_rate if doc.default_rate is None else doc.default_rate
            ),
            mode=current.mode if doc.mode is None else doc.mode,
            fair_share=current.fair_share if doc.fair_share is None else doc.fair_share,
        )
        table_changed = not doc.same_table(current)
        if (
            not table_changed
            and doc.mode == current.mode
            and doc.fair_share == current.fair_share
        ):
            return False
        commits.check_fair_share(doc, field=FAIR_SHARE_KEY)
        commits.apply(
            doc,
            _replace_with(doc) if table_changed else None,
            table=table_changed,
            teams=_replace_teams(doc, current),
        )
    commits.shared.wake()
    return True


def _replace_with(doc: TableDocument) -> Apply:
    """Applies the default and the whole table of ``doc`` (the core's table is
    built here, off the scheduler lock)."""
    table = doc.limit_table()
    default = doc.default_rate

    def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
        if default is not None and default != limiter.default_rate:
            limiter.set_default_rate(default, now_ns)
        limiter.replace_limits(table, now_ns)

    return apply


def _replace_teams(doc: TableDocument, current: TableDocument) -> TeamsApply | None:
    """Makes the teams of ``doc`` the teams (the table built here, off the
    scheduler lock); None when they are those of ``current``."""
    if (doc.team_rates, doc.team_members) == (
        current.team_rates,
        current.team_members,
    ):
        return None
    table = TeamTable(doc.team_rates, doc.team_members)

    def apply(teams: Teams, now_ns: int) -> None:
        teams.replace(table, now_ns)

    return apply
