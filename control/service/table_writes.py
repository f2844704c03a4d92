"""Changes of the whole limits table: replacing it (``ReplaceLimitsTable``) and
reloading it from the config file.

A replacement is checked on its own first (``parse_table``: by the policy's one
validator, ids, duplicates, rates, memberships of tiers and teams, sizes, the
bands and objectives and every band named), then against the table etag under
``commits.changes``, and committed as one new table; a reload is applied
without being persisted, since it came from the config file.

Invariant: the limiter and the teams take a new whole table in one apply under
``shared.lock`` (``commits.replace_with``, ``commits.replace_teams``), so no
read sees part of an old table and part of a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from control.errors import Aborted, InvalidArgument
from control.kinds import ALL, BY_HOLDER, Kind
from control.resources import HolderSpec, LimitsTable, table_of
from control.service.commits import TableCommits, replace_teams, replace_with
from control.table import check_user, shown
from pacing.policy.document import (
    BANDS_KEY,
    DEFAULT_KEY,
    DEFAULT_RATE_KEY,
    FAIR_SHARE_KEY,
    OBJECTIVES_KEY,
    RATE_KEY,
    USERS_KEY,
    parse,
)
from pacing.policy.errors import PolicyError, render_path
from pacing.policy.model import GROUP_KEYS, Policy


def parse_table(
    default_tokens_per_second: int,
    holders: Mapping[Kind, Iterable[HolderSpec]],
    default: Mapping[str, object] | None = None,
    *,
    bands: Sequence[str] = (),
    objectives: Sequence[tuple[str, str]] = (),
) -> Policy:
    """The table a ``ReplaceLimitsTable`` request holds, checked on its own by
    the policy's one validator (``pacing.policy.document``) once its resource
    names are parsed; an error names the request's field
    (``limits_table.limits[3].team: unknown team 'x'``,
    ``limits_table.objectives[0].band: unknown band 'x' (bands: ...)``). Its
    mode and fair-share switch are None. A 0 (or "") stands for a field not
    set, as everywhere in the API; ``objectives`` are (name, band) pairs in the
    request's order."""
    fields: dict[tuple[str, str], str] = {}
    given = {name: value for name, value in (default or {}).items() if value}
    rate = given.pop(RATE_KEY, None)
    if rate is not None and default_tokens_per_second not in (0, rate):
        raise InvalidArgument(
            f"limits_table.default.{RATE_KEY}: {shown(rate)} differs from "
            f"limits_table.default_tokens_per_second ({default_tokens_per_second})"
        )
    tree: dict[str, Any] = {DEFAULT_RATE_KEY: default_tokens_per_second or rate or 0}
    if given:
        tree[DEFAULT_KEY] = given
    if bands:
        tree[BANDS_KEY] = list(bands)
    if objectives:
        tree[OBJECTIVES_KEY] = _objectives_tree(objectives, fields)
    for kind in sorted(ALL, key=lambda kind: not kind.is_group):  # groups first
        key = GROUP_KEYS[kind.holder] if kind.is_group else USERS_KEY  # type: ignore[index]
        part: dict[str, Any] = tree.setdefault(key, {})
        for index, spec in enumerate(holders.get(kind, ())):
            where = f"limits_table.{kind.collection}[{index}]"
            holder_id = kind.parse(spec.name, field=f"{where}.name")
            if holder_id in part:
                raise InvalidArgument(
                    f"{where}.name: {shown(kind.name(holder_id))} appears more "
                    "than once"
                )
            fields[(key, holder_id)] = where
            part[holder_id] = _holder_tree(kind, spec.values, where)
    try:
        return parse(tree).policy
    except PolicyError as error:
        raise InvalidArgument(_in_request(error, fields)) from None


def _objectives_tree(
    objectives: Sequence[tuple[str, str]], fields: dict[tuple[str, str], str]
) -> dict[str, str]:
    """The document's ``objectives`` of the request's (name, band) pairs,
    each name checked and unique; ``fields`` learns the field of each
    objective, for errors of its band."""
    tree: dict[str, str] = {}
    for index, (name, band) in enumerate(objectives):
        where = f"limits_table.{OBJECTIVES_KEY}[{index}]"
        check_user(name, field=f"objective id in {where}.name")
        if name in tree:
            raise InvalidArgument(f"{where}.name: {shown(name)} appears more than once")
        fields[(OBJECTIVES_KEY, name)] = f"{where}.band"
        tree[name] = band
    return tree


def _holder_tree(
    kind: Kind, values: Mapping[str, object], where: str
) -> dict[str, Any]:
    """A holder's object in the policy document: the fields set (0, false and
    "" are not set), and a zero rate where nothing else makes the holder
    exist (checked as a rate then)."""
    own: dict[str, Any] = {}
    for name in kind.fields:
        value = values.get(name)
        if not value:
            continue
        if name in kind.references:
            own[name] = BY_HOLDER[name].parse(str(value), field=f"{where}.{name}")
        else:
            own[name] = value
    first = kind.makes_exist[0]
    if first not in own and (
        first in kind.required or not set(own) & set(kind.makes_exist)
    ):
        own[first] = values.get(first, 0)
    return own


def _in_request(error: PolicyError, fields: Mapping[tuple[str, str], str]) -> str:
    """``error``'s message at the request's field that holds its path."""
    parts = error.parts
    if isinstance(parts, str) or not parts:
        return str(error)
    if parts[0] == DEFAULT_RATE_KEY:
        return f"limits_table.default_tokens_per_second: {error.message}"
    if parts[0] == DEFAULT_KEY:
        rest = "".join(f".{part}" for part in parts[1:])
        return f"limits_table.default{rest}: {error.message}"
    if parts[0] == BANDS_KEY or parts == (OBJECTIVES_KEY,):
        return f"limits_table.{render_path(parts)}: {error.message}"
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
    holders: Mapping[Kind, Iterable[HolderSpec]],
    etag: str,
    default: Mapping[str, object] | None = None,
    *,
    bands: Sequence[str] = (),
    objectives: Sequence[tuple[str, str]] = (),
) -> LimitsTable:
    """Replaces the default and every holder of every kind, weights, bands
    and objectives included, at once (not the mode nor the fair-share
    switch); Aborted when ``etag`` is not empty and not the current etag."""
    table = parse_table(
        default_tokens_per_second,
        holders,
        default,
        bands=bands,
        objectives=objectives,
    )
    with commits.changes:
        if etag and etag != commits.etag():
            raise Aborted(
                f"etag {shown(etag)} is not current: the table changed "
                "since it was read; read it again and retry"
            )
        current = commits.current()
        new = dataclasses.replace(
            table, mode=current.mode, fair_share=current.fair_share
        )
        new_etag = commits.commit_table(new)
    return table_of(commits.etags, new, new_etag)


def reload(commits: TableCommits, read: Callable[[], Policy | None]) -> bool:
    """Makes the policy ``read()`` returns the table, mode and fair-share
    switch, without persisting it (it came from the config file); ``None`` or
    an equal document changes nothing, a missing default rate, mode or switch
    keeps the current one. ``read`` runs under the change lock, so no RPC change
    interleaves. Returns whether the table, the mode or the switch changed.
    FailedPrecondition when it switches fair share on where the engine cannot
    run it (nothing applied)."""
    with commits.changes:
        read_policy = read()
        if read_policy is None:
            return False
        current = commits.current()
        new = dataclasses.replace(
            read_policy,
            # The limiter cannot drop its default rate (pacing off): without
            # one the current rate stays, the default's other attributes (its
            # band among them, which bands require) are the document's.
            default=(
                dataclasses.replace(
                    read_policy.default, tokens_per_second=current.default_rate
                )
                if read_policy.default_rate is None
                else read_policy.default
            ),
            mode=current.mode if read_policy.mode is None else read_policy.mode,
            fair_share=(
                current.fair_share
                if read_policy.fair_share is None
                else read_policy.fair_share
            ),
        )
        table_changed = not new.same_table(current)
        if (
            not table_changed
            and new.mode == current.mode
            and new.fair_share == current.fair_share
        ):
            return False
        commits.check_fair_share(new, field=FAIR_SHARE_KEY)
        commits.apply(
            new,
            replace_with(new) if table_changed else None,
            table=table_changed,
            teams=replace_teams(new, current),
        )
    commits.shared.wake()
    return True
