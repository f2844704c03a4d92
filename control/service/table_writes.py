"""Changes of the whole limits table: replacing it (``ReplaceLimitsTable``) and
reloading it from the config file.

A replacement is checked on its own first (``parse_table``: by the policy's one
validator, ids, duplicates,
rates, memberships of tiers and teams, sizes), then against the table etag under
``commits.changes``, and committed as one new table; a reload is applied
without being persisted, since it came from the config file.

Invariant: the limiter and the teams take a new whole table in one apply under
``shared.lock`` (``_replace_with``, ``_replace_teams``), so no read sees part
of an old table and part of a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from control import names
from control.errors import Aborted, InvalidArgument
from control.resources import LimitSpec, LimitsTable, TeamSpec, TierSpec, table_of
from control.service.commits import Apply, TableCommits, TeamsApply
from control.table import TableDocument, shown
from pacing.limiter import OutputRateLimiter
from pacing.policy.document import (
    DEFAULT_RATE_KEY,
    FAIR_SHARE_KEY,
    RATE_KEY,
    USERS_KEY,
    parse,
)
from pacing.policy.errors import PolicyError
from pacing.policy.model import GROUP_KEYS, GroupKind
from pacing.teams import Teams, TeamTable


def parse_table(
    default_tokens_per_second: int,
    limits: Iterable[LimitSpec],
    tiers: Iterable[TierSpec],
    teams: Iterable[TeamSpec] = (),
) -> TableDocument:
    """The table a ``ReplaceLimitsTable`` request holds, checked on its own by
    the policy's one validator (``pacing.policy.document``) once its resource
    names are parsed; an error names the request's field
    (``limits_table.limits[3].team: unknown team 'x'``). Its mode and
    fair-share switch are None. A 0 stands for a field not set, as everywhere
    in the API."""
    fields: dict[tuple[str, str], str] = {}
    tree: dict[str, Any] = {
        DEFAULT_RATE_KEY: default_tokens_per_second,
        GROUP_KEYS["tier"]: {},
        GROUP_KEYS["team"]: {},
        USERS_KEY: {},
    }
    for index, tier in enumerate(tiers):
        where = f"limits_table.tiers[{index}]"
        name = names.parse_tier(tier.name, field=f"{where}.name")
        _add(tree, fields, "tier", name, where, _set_fields(tier, tier.exempt))
    for index, team in enumerate(teams):
        where = f"limits_table.teams[{index}]"
        name = names.parse_team(team.name, field=f"{where}.name")
        _add(tree, fields, "team", name, where, _set_fields(team, False))
    for index, entry in enumerate(limits):
        where = f"limits_table.limits[{index}]"
        user = names.parse_user(entry.name, names.LIMITS, field=f"{where}.name")
        if user in tree[USERS_KEY]:
            raise InvalidArgument(
                f"{where}.name: {shown(names.limit_name(user))} appears more than once"
            )
        fields[(USERS_KEY, user)] = where
        others = bool(entry.tier or entry.team or entry.exempt or entry.weight)
        own = _set_fields(entry, others)
        if entry.tier:
            own["tier"] = names.parse_tier(entry.tier, field=f"{where}.tier")
        if entry.team:
            own["team"] = names.parse_team(entry.team, field=f"{where}.team")
        tree[USERS_KEY][user] = own
    try:
        document = parse(tree)
    except PolicyError as error:
        raise InvalidArgument(_in_request(error, fields)) from None
    return TableDocument.from_document(document)


def _add(
    tree: dict[str, Any],
    fields: dict[tuple[str, str], str],
    kind: GroupKind,
    name: str,
    where: str,
    limits: dict[str, Any],
) -> None:
    """Puts group ``name``'s limits in ``tree``, refusing a second one."""
    key = GROUP_KEYS[kind]
    if name in tree[key]:
        resource = names.tier_name(name) if kind == "tier" else names.team_name(name)
        raise InvalidArgument(f"{where}.name: {shown(resource)} appears more than once")
    fields[(key, name)] = where
    tree[key][name] = limits


def _set_fields(
    spec: LimitSpec | TierSpec | TeamSpec, optional_rate: bool
) -> dict[str, Any]:
    """The limits a spec sets: 0 and false stand for not set, but for a rate
    that nothing else stands in for (checked as a rate then)."""
    given: dict[str, Any] = {}
    if spec.tokens_per_second or not optional_rate:
        given[RATE_KEY] = spec.tokens_per_second
    if getattr(spec, "exempt", False):
        given["exempt"] = True
    if spec.weight:
        given["weight"] = spec.weight
    return given


def _in_request(error: PolicyError, fields: Mapping[tuple[str, str], str]) -> str:
    """``error``'s message at the request's field that holds its path."""
    parts = error.parts
    if isinstance(parts, str) or not parts:
        return str(error)
    if parts[0] == DEFAULT_RATE_KEY:
        return f"limits_table.default_tokens_per_second: {error.message}"
    if parts[0] in (GROUP_KEYS["tier"], GROUP_KEYS["team"]) and len(parts) == 1:
        field = f"limits_table.{parts[0]}"
        return f"{field}: {error.message}"
    where = fields.get((str(parts[0]), str(parts[1]))) if len(parts) > 1 else None
    if where is None:
        return f"limits_table: {error}"
    rest = "".join(f".{part}" for part in parts[2:])
    return f"{where}{rest}: {error.message}"


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
