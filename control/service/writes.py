"""Changes of one part of the limits table, or of the mode: the default, one
entry (its weight and team included), one tier (its weight included), one team
(its weight included), the mode and the fair-share switch. Changes of the whole
table are in ``table_writes``.

Each change checks its request's own fields first (``write_requests``), then,
holding ``commits.changes``, checks it against the table in force (existence,
etag, room, tiers) and commits the whole new table through
``TableCommits.commit``.

Invariant: every check runs before ``TableCommits.commit``, so a refused
change leaves the table, the mode and their etags as they were; and no change
leaves a user in a tier or team that does not exist, nor a weight for one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from control import names
from control.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from control.resources import (
    NO_ENTRY,
    EntryFields,
    Limit,
    PacingMode,
    Team,
    Tier,
    check_etag,
    entry,
    entry_fields,
    no_limit,
    no_team,
    no_tier,
    pacing_mode,
)
from control.service.commits import TableCommits
from control.service.write_requests import (
    LIMIT_FIELDS,
    MODE_FIELDS,
    RATE_FIELD,
    TEAM_FIELDS,
    TIER_FIELDS,
    WEIGHT_FIELD,
    entry_rate,
    mask_fields,
    set_fields,
)
from control.table import (
    MAX_EXPLICIT_LIMITS,
    MAX_TIERS,
    TableDocument,
    check_rate,
    check_team,
    check_tier,
    check_user,
    check_weight,
    shown,
)
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.errors import unknown_group
from pacing.teams import Teams


def update_default_limit(
    commits: TableCommits, name: str, tokens_per_second: int, update_mask: Sequence[str]
) -> int:
    """Sets the default limit; returns it."""
    names.check_singleton(name, names.DEFAULT_LIMIT, field="default_limit.name")
    mask_fields(update_mask, (RATE_FIELD,), {RATE_FIELD})
    rate = check_rate(tokens_per_second, field="default_limit.tokens_per_second")
    with commits.changes:
        doc = dataclasses.replace(commits.current(), default_rate=rate)
        commits.commit(doc, lambda limiter, now: limiter.set_default_rate(rate, now))
    return rate


def create_limit(
    commits: TableCommits,
    limit_id: str,
    tokens_per_second: int,
    *,
    tier: str,
    exempt: bool,
    weight: float = 0.0,
    team: str = "",
) -> Limit:
    """Gives user ``limit_id`` an entry; AlreadyExists if it has one."""
    user = check_user(limit_id, field="limit_id")
    own_weight = check_weight(weight, field="limit.weight")
    rate = entry_rate(
        tokens_per_second,
        bool(tier) or bool(team) or exempt or own_weight is not None,
        "limit",
    )
    tier_id = names.parse_tier(tier, field="limit.tier") if tier else None
    team_id = names.parse_team(team, field="limit.team") if team else None
    with commits.changes:
        doc = commits.current()
        if user in doc.users():
            raise AlreadyExists(
                f"{shown(names.limit_name(user))} exists; use UpdateLimit"
            )
        _check_tier_exists(doc, tier_id, field="limit.tier")
        _check_team_exists(doc, team_id, field="limit.team")
        _check_room(len(doc.users()) + 1)
        return _commit_entry(
            commits, doc, user, (rate, tier_id, exempt, own_weight, team_id)
        )


def update_limit(
    commits: TableCommits,
    name: str,
    tokens_per_second: int,
    update_mask: Sequence[str],
    *,
    allow_missing: bool,
    tier: str,
    exempt: bool,
    etag: str,
    weight: float = 0.0,
    team: str = "",
) -> Limit:
    """Changes the fields of entry ``name`` that ``update_mask`` selects
    (empty: those set, see the proto); creates it with ``allow_missing``. An
    update that leaves nothing removes the entry."""
    user = names.parse_user(name, names.LIMITS, field="limit.name")
    given = set_fields(
        {
            RATE_FIELD: tokens_per_second != 0,
            "tier": bool(tier),
            "exempt": exempt,
            WEIGHT_FIELD: weight != 0,
            "team": bool(team),
        }
    )
    fields = mask_fields(update_mask, LIMIT_FIELDS, given)
    rate: int | None = None
    if RATE_FIELD in fields:
        # 0 clears the rate only when the mask names it: an empty mask with
        # nothing set means the rate, which must then be valid.
        rate = entry_rate(tokens_per_second, bool(update_mask), "limit")
    tier_id = None
    if "tier" in fields and tier:
        tier_id = names.parse_tier(tier, field="limit.tier")
    own_weight = None
    if WEIGHT_FIELD in fields:
        own_weight = check_weight(weight, field="limit.weight")
    team_id = None
    if "team" in fields and team:
        team_id = names.parse_team(team, field="limit.team")
    with commits.changes:
        doc = commits.current()
        current = entry_fields(doc, user)
        if current is None and not allow_missing:
            raise no_limit(user)
        check_etag(etag, commits.etags.limit(user, current), names.limit_name(user))
        old_rate, old_tier, old_exempt, old_weight, old_team = current or NO_ENTRY
        new = (
            rate if RATE_FIELD in fields else old_rate,
            tier_id if "tier" in fields else old_tier,
            exempt if "exempt" in fields else old_exempt,
            own_weight if WEIGHT_FIELD in fields else old_weight,
            team_id if "team" in fields else old_team,
        )
        _check_tier_exists(doc, new[1], field="limit.tier")
        _check_team_exists(doc, new[4], field="limit.team")
        if current is None:
            if new == NO_ENTRY:
                return Limit(user, 0)  # nothing to create
            _check_room(len(doc.users()) + 1)
        return _commit_entry(commits, doc, user, new)


def delete_limit(
    commits: TableCommits, name: str, *, allow_missing: bool, etag: str
) -> None:
    """Removes the entry ``name`` (the default applies again)."""
    user = names.parse_user(name, names.LIMITS, field="name")
    with commits.changes:
        doc = commits.current()
        current = entry_fields(doc, user)
        if current is None:
            if allow_missing:
                return
            raise no_limit(user)
        check_etag(etag, commits.etags.limit(user, current), names.limit_name(user))
        _commit_entry(commits, doc, user, NO_ENTRY)


def create_tier(
    commits: TableCommits,
    tier_id: str,
    tokens_per_second: int,
    exempt: bool,
    weight: float = 0.0,
) -> Tier:
    """Creates tier ``tier_id``; AlreadyExists if it exists."""
    tier = check_tier(tier_id, field="tier_id")
    own_weight = check_weight(weight, field="tier.weight")
    rate = entry_rate(tokens_per_second, exempt, "tier")
    with commits.changes:
        doc = commits.current()
        if tier in doc.tiers:
            raise AlreadyExists(
                f"{shown(names.tier_name(tier))} exists; use UpdateTier"
            )
        _check_tier_room(doc)
        return _commit_tier(commits, doc, tier, rate, exempt, own_weight)


def update_tier(
    commits: TableCommits,
    name: str,
    tokens_per_second: int,
    exempt: bool,
    update_mask: Sequence[str],
    *,
    allow_missing: bool,
    etag: str,
    weight: float = 0.0,
) -> Tier:
    """Changes the fields of tier ``name`` that ``update_mask`` selects
    (empty: those set, see the proto); creates it with ``allow_missing``. An
    update that leaves neither a rate nor an exemption removes the tier and
    its weight; one that also sets a weight is refused (a weight alone does
    not make a tier)."""
    tier = names.parse_tier(name, field="tier.name")
    given = set_fields(
        {
            RATE_FIELD: tokens_per_second != 0,
            "exempt": exempt,
            WEIGHT_FIELD: weight != 0,
        }
    )
    fields = mask_fields(update_mask, TIER_FIELDS, given)
    rate: int | None = None
    if RATE_FIELD in fields:
        rate = entry_rate(tokens_per_second, bool(update_mask), "tier")
    own_weight = None
    if WEIGHT_FIELD in fields:
        own_weight = check_weight(weight, field="tier.weight")
    with commits.changes:
        doc = commits.current()
        exists = tier in doc.tiers
        if not exists:
            if not allow_missing:
                raise no_tier(tier)
            _check_tier_room(doc)
        current = (
            doc.tier_rates.get(tier),
            tier in doc.exempt_tiers,
            doc.tier_weights.get(tier),
        )
        check_etag(
            etag,
            commits.etags.tier(tier, *current) if exists else "",
            names.tier_name(tier),
        )
        new_rate = rate if RATE_FIELD in fields else current[0]
        new_exempt = exempt if "exempt" in fields else current[1]
        new_weight = own_weight if WEIGHT_FIELD in fields else current[2]
        if new_rate is None and not new_exempt:
            if own_weight is not None:
                raise InvalidArgument(
                    f"tier.weight: a weight alone does not make a tier: give "
                    f"{shown(names.tier_name(tier))} tokens_per_second or exempt"
                )
            if not exists:
                return Tier(tier, 0, False)  # nothing to create
            new_weight = None  # the tier goes, and its weight with it
        return _commit_tier(commits, doc, tier, new_rate, new_exempt, new_weight)


def delete_tier(
    commits: TableCommits, name: str, *, allow_missing: bool, etag: str
) -> None:
    """Removes tier ``name``; FailedPrecondition while it has members."""
    tier = names.parse_tier(name, field="name")
    with commits.changes:
        doc = commits.current()
        if tier not in doc.tiers:
            if allow_missing:
                return
            raise no_tier(tier)
        current = commits.etags.tier(
            tier,
            doc.tier_rates.get(tier),
            tier in doc.exempt_tiers,
            doc.tier_weights.get(tier),
        )
        check_etag(etag, current, names.tier_name(tier))
        _commit_tier(commits, doc, tier, None, False, None)


def create_team(
    commits: TableCommits, team_id: str, tokens_per_second: int, weight: float = 0.0
) -> Team:
    """Creates team ``team_id``; AlreadyExists if it exists."""
    team = check_team(team_id, field="team_id")
    own_weight = check_weight(weight, field="team.weight")
    rate = check_rate(tokens_per_second, field="team.tokens_per_second")
    with commits.changes:
        doc = commits.current()
        if team in doc.team_rates:
            raise AlreadyExists(
                f"{shown(names.team_name(team))} exists; use UpdateTeam"
            )
        _check_team_room(doc)
        return _commit_team(commits, doc, team, rate, own_weight)


def update_team(
    commits: TableCommits,
    name: str,
    tokens_per_second: int,
    update_mask: Sequence[str],
    *,
    allow_missing: bool,
    etag: str,
    weight: float = 0.0,
) -> Team:
    """Changes the fields of team ``name`` that ``update_mask`` selects
    (empty: those set, see the proto); creates it with ``allow_missing``. The
    rate cannot be cleared (DeleteTeam removes a team)."""
    team = names.parse_team(name, field="team.name")
    given = set_fields({RATE_FIELD: tokens_per_second != 0, WEIGHT_FIELD: weight != 0})
    fields = mask_fields(update_mask, TEAM_FIELDS, given)
    rate: int | None = None
    if RATE_FIELD in fields:
        rate = check_rate(tokens_per_second, field="team.tokens_per_second")
    own_weight = None
    if WEIGHT_FIELD in fields:
        own_weight = check_weight(weight, field="team.weight")
    with commits.changes:
        doc = commits.current()
        current_rate = doc.team_rates.get(team)
        current_weight = doc.team_weights.get(team)
        if current_rate is None:
            if not allow_missing:
                raise no_team(team)
            _check_team_room(doc)
        check_etag(
            etag,
            ""
            if current_rate is None
            else commits.etags.team(team, current_rate, current_weight),
            names.team_name(team),
        )
        new_rate = rate if rate is not None else current_rate
        if new_rate is None:
            raise InvalidArgument(
                f"team.tokens_per_second: {shown(names.team_name(team))} does not "
                "exist; creating it needs a rate"
            )
        new_weight = own_weight if WEIGHT_FIELD in fields else current_weight
        return _commit_team(commits, doc, team, new_rate, new_weight)


def delete_team(
    commits: TableCommits, name: str, *, allow_missing: bool, etag: str
) -> None:
    """Removes team ``name``; FailedPrecondition while it has members."""
    team = names.parse_team(name, field="name")
    with commits.changes:
        doc = commits.current()
        rate = doc.team_rates.get(team)
        if rate is None:
            if allow_missing:
                return
            raise no_team(team)
        current = commits.etags.team(team, rate, doc.team_weights.get(team))
        check_etag(etag, current, names.team_name(team))
        _commit_team(commits, doc, team, None, None)


def update_pacing_mode(
    commits: TableCommits,
    name: str,
    mode: Mode | None,
    update_mask: Sequence[str],
    *,
    etag: str,
    fair_share: bool,
    mode_set: bool,
) -> PacingMode:
    """Switches the pacing mode and fair share as ``update_mask`` selects
    (empty: those set; ``mode_set``: the request holds a mode, ``None`` when it
    is not one we know, refused). Switching fair share on where the engine
    cannot run it: FailedPrecondition."""
    names.check_singleton(name, names.PACING_MODE, field="pacing_mode.name")
    given = set_fields({"mode": mode_set, "fair_share": fair_share})
    fields = mask_fields(update_mask, MODE_FIELDS, given)
    if "mode" in fields and mode is None:
        raise InvalidArgument("pacing_mode.mode must be ENFORCE, SHADOW or OFF")
    with commits.changes:
        doc = commits.current()
        assert doc.mode is not None  # current() always reads the mode
        assert doc.fair_share is not None  # and the switch
        check_etag(
            etag, commits.etags.mode(doc.mode, doc.fair_share), names.PACING_MODE
        )
        new_mode = mode if mode is not None and "mode" in fields else doc.mode
        switch = fair_share if "fair_share" in fields else doc.fair_share
        new = dataclasses.replace(doc, mode=new_mode, fair_share=switch)
        commits.commit(new, None, table=False)
    return pacing_mode(commits.etags, new_mode, switch)


def _commit_entry(
    commits: TableCommits, doc: TableDocument, user: str, fields: EntryFields
) -> Limit:
    """Commits ``user``'s new entry (all None/False: removed). Requires
    commits.changes."""
    rate, tier, exempt, weight, team = fields
    users, memberships = dict(doc.user_rates), dict(doc.memberships)
    weights, team_members = dict(doc.user_weights), dict(doc.team_members)
    exempt_users = set(doc.exempt_users)
    _put(users, user, rate)
    _put(memberships, user, tier)
    _put(weights, user, weight)
    _put(team_members, user, team)
    if exempt:
        exempt_users.add(user)
    else:
        exempt_users.discard(user)
    new = dataclasses.replace(
        doc,
        user_rates=users,
        memberships=memberships,
        exempt_users=frozenset(exempt_users),
        user_weights=weights,
        team_members=team_members,
    )

    def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
        # Exempt first and lift last: the user is never briefly limited.
        if exempt:
            limiter.set_user_exempt(user, True, now_ns)
        limiter.set_rate(user, rate, now_ns)
        limiter.set_membership(user, tier, now_ns)
        if not exempt:
            limiter.set_user_exempt(user, False, now_ns)

    def apply_team(teams: Teams, now_ns: int) -> None:
        teams.set_membership(user, team, now_ns)

    moved = doc.team_members.get(user) != team
    commits.commit(new, apply, teams=apply_team if moved else None)
    return entry(commits.etags, user, fields) or Limit(user, 0)


def _commit_team(
    commits: TableCommits,
    doc: TableDocument,
    team: str,
    rate: int | None,
    weight: float | None,
) -> Team:
    """Commits ``team``'s new rate and weight (None and None: removed;
    FailedPrecondition while it has members). Requires commits.changes."""
    members = sum(1 for t in doc.team_members.values() if t == team)
    if rate is None and members:
        raise FailedPrecondition(
            f"{shown(names.team_name(team))} has {members} member(s): move "
            "them to another team (or take them out of it) first"
        )
    rates, weights = dict(doc.team_rates), dict(doc.team_weights)
    _put(rates, team, rate)
    _put(weights, team, weight)
    new = dataclasses.replace(doc, team_rates=rates, team_weights=weights)

    def apply(teams: Teams, now_ns: int) -> None:
        teams.set_rate(team, rate, now_ns)

    changed = doc.team_rates.get(team) != rate
    commits.commit(new, None, teams=apply if changed else None)
    if rate is None:
        return Team(team, 0)
    etag = commits.etags.team(team, rate, weight)
    return Team(team, rate, weight or 0.0, members, etag)


def _commit_tier(
    commits: TableCommits,
    doc: TableDocument,
    tier: str,
    rate: int | None,
    exempt: bool,
    weight: float | None,
) -> Tier:
    """Commits ``tier``'s new rate, exemption and weight (None, False and None:
    removed; FailedPrecondition while it has members). Requires
    commits.changes."""
    members = sum(1 for t in doc.memberships.values() if t == tier)
    if rate is None and not exempt and members:
        raise FailedPrecondition(
            f"{shown(names.tier_name(tier))} has {members} member(s): move "
            "them to another tier (or remove their tier) first"
        )
    rates, weights = dict(doc.tier_rates), dict(doc.tier_weights)
    _put(rates, tier, rate)
    _put(weights, tier, weight)
    exempt_tiers = set(doc.exempt_tiers)
    if exempt:
        exempt_tiers.add(tier)
    else:
        exempt_tiers.discard(tier)
    new = dataclasses.replace(
        doc,
        tier_rates=rates,
        exempt_tiers=frozenset(exempt_tiers),
        tier_weights=weights,
    )

    def apply(limiter: OutputRateLimiter, now_ns: int) -> None:
        # Additions before removals: the tier never stops existing midway.
        if exempt:
            limiter.set_tier_exempt(tier, True, now_ns)
        if rate is not None or tier in limiter.tier_rates:
            limiter.set_tier_rate(tier, rate, now_ns)
        if not exempt and tier in limiter.exempt_tiers:
            limiter.set_tier_exempt(tier, False, now_ns)

    commits.commit(new, apply)
    if rate is None and not exempt:
        return Tier(tier, 0, False)
    etag = commits.etags.tier(tier, rate, exempt, weight)
    return Tier(tier, rate or 0, exempt, members, etag, weight or 0.0)


def _put(mapping: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``mapping[key]``, or removes it for ``None``."""
    if value is None:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def _check_room(count: int) -> None:
    if count > MAX_EXPLICIT_LIMITS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_EXPLICIT_LIMITS} users with a "
            "limit, tier or exemption; delete some first"
        )


def _check_tier_exists(doc: TableDocument, tier: str | None, *, field: str) -> None:
    if tier is not None and tier not in doc.tiers:
        raise FailedPrecondition(str(unknown_group("tier", tier, field)))


def _check_team_exists(doc: TableDocument, team: str | None, *, field: str) -> None:
    if team is not None and team not in doc.team_rates:
        raise FailedPrecondition(str(unknown_group("team", team, field)))


def _check_team_room(doc: TableDocument) -> None:
    if len(doc.team_rates) >= MAX_TIERS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_TIERS} teams; delete some first"
        )


def _check_tier_room(doc: TableDocument) -> None:
    if len(doc.tiers) >= MAX_TIERS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_TIERS} tiers; delete some first"
        )
