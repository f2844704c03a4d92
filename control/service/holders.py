"""The verbs of every kind of rate holder (``control.kinds``: user entries,
tiers, teams): get, list, create, update, delete, the same functions for each.

A request carries each field of its kind as the wire does: 0, false or "" for
not set. An attribute set is checked by the policy's rule for it
(``pacing.policy.model.RULES``), a band against the policy's bands, a
membership names a group that must exist. A
holder exists while it has one of the fields of ``Kind.exists_with``: an
update that leaves none removes it, one that would leave only other fields
(a tier's weight) is refused. A change builds the new policy and commits it
whole (``TableCommits.commit_table``).

Invariant: every check runs before the commit, so a refused change leaves the
table and its etags as they were; no change leaves a user in a group that does
not exist, nor a group with members removed.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any, cast

from control.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from control.kinds import BY_HOLDER, Kind
from control.pagination import PageTokens
from control.resources import (
    Holder,
    check_etag,
    holder_of,
    holders_of,
    member_counts,
    not_found,
)
from control.service.commits import TableCommits, TeamsApply
from control.service.ordering import page_size, resume
from control.service.write_requests import mask_fields
from control.table import MAX_EXPLICIT_LIMITS, MAX_TIERS, check_band, shown
from pacing.policy.errors import PolicyError, unknown_group
from pacing.policy.model import RULES, GroupKind, Limits, Policy, User

#: A holder's own limits and, for a user, its groups.
Value = tuple[Limits, Mapping[GroupKind, str]]


def get(commits: TableCommits, kind: Kind, name: str) -> Holder:
    """The holder named ``{collection}/{id}``; NotFound without one."""
    holder_id = kind.parse(name, field="name")
    holder = holder_of(commits.etags, _policy(commits), kind, holder_id)
    if holder is None:
        raise not_found(kind, holder_id)
    return holder


def list_page(
    commits: TableCommits,
    kind: Kind,
    tokens: PageTokens,
    requested_size: int,
    page_token: str,
) -> tuple[list[Holder], str]:
    """One page of holders in id order, and the next page's token (""  on the
    last page)."""
    size = page_size(requested_size)
    after = resume(tokens, kind.collection, page_token)
    policy = _policy(commits)
    ids = holders_of(policy, kind)
    candidates = ids if after is None else (i for i in ids if i > after[0])
    page = heapq.nsmallest(size + 1, candidates)
    token = ""
    if len(page) > size:
        page = page[:size]
        token = tokens.encode(kind.collection, [page[-1]])
    members = member_counts(policy, kind)
    found = (holder_of(commits.etags, policy, kind, i, members) for i in page)
    return [holder for holder in found if holder is not None], token


def create(
    commits: TableCommits, kind: Kind, holder_id: str, values: Mapping[str, object]
) -> Holder:
    """Creates holder ``holder_id`` with the fields ``values`` sets;
    AlreadyExists if it exists."""
    holder_id = kind.check_id(holder_id, field=f"{kind.resource}_id")
    given = _given(kind, values)
    if not given & set(kind.makes_exist):
        given.add(kind.makes_exist[0])  # checked, so that its rule says why
    changes = _changes(kind, values, given | set(kind.required))
    with commits.changes:
        policy = commits.current()
        if holder_id in holders_of(policy, kind):
            raise AlreadyExists(
                f"{shown(kind.name(holder_id))} exists; use Update{kind.title}"
            )
        _check_room(policy, kind)
        _check_band(policy, kind, changes)
        new = _merged(kind, (Limits(), {}), changes)
        return _commit(commits, policy, kind, holder_id, new)


def update(
    commits: TableCommits,
    kind: Kind,
    name: str,
    values: Mapping[str, object],
    update_mask: Sequence[str],
    *,
    allow_missing: bool,
    etag: str,
) -> Holder:
    """Changes the fields of holder ``name`` that ``update_mask`` selects
    (empty: those set, see the proto); creates it with ``allow_missing``. An
    update that leaves nothing that makes the holder exist removes it."""
    holder_id = kind.parse(name, field=f"{kind.resource}.name")
    given = _given(kind, values)
    fields = mask_fields(update_mask, kind.fields, given)
    # A zero clears a field only where the mask names it; an empty mask with
    # nothing set means the first field, which must then be valid.
    checked = set(kind.required) | (set() if update_mask or given else fields)
    changes = _changes(kind, values, fields, checked=checked)
    with commits.changes:
        policy = commits.current()
        current = holder_of(commits.etags, policy, kind, holder_id)
        if current is None:
            if not allow_missing:
                raise not_found(kind, holder_id)
            _check_room(policy, kind)
        check_etag(etag, "" if current is None else current.etag, name)
        _check_band(policy, kind, changes)
        old: Value = (Limits(), {}) if current is None else _value(current)
        new = _merged(kind, old, changes)
        if not _exists(kind, new):
            _check_removable(kind, holder_id, new, changes, created=current is None)
            if current is None:
                return Holder(kind, holder_id)  # nothing to create
        return _commit(commits, policy, kind, holder_id, new)


def delete(
    commits: TableCommits, kind: Kind, name: str, *, allow_missing: bool, etag: str
) -> None:
    """Removes holder ``name`` (for a user: the default applies again);
    FailedPrecondition while a group has members."""
    holder_id = kind.parse(name, field="name")
    with commits.changes:
        policy = commits.current()
        current = holder_of(commits.etags, policy, kind, holder_id)
        if current is None:
            if allow_missing:
                return
            raise not_found(kind, holder_id)
        check_etag(etag, current.etag, kind.name(holder_id))
        _commit(commits, policy, kind, holder_id, (Limits(), {}))


def _policy(commits: TableCommits) -> Policy:
    with commits.shared.lock:
        return commits.current_locked()


def _given(kind: Kind, values: Mapping[str, object]) -> set[str]:
    """The fields a request sets (values other than 0, false and "")."""
    return {name for name in kind.fields if values.get(name)}


def _changes(
    kind: Kind,
    values: Mapping[str, object],
    fields: set[str],
    *,
    checked: set[str] | None = None,
) -> dict[str, object]:
    """Field -> its new value (``None``: cleared) for each of ``fields``;
    those of ``checked`` (default: all) follow their rule even at zero."""
    always = fields if checked is None else checked
    changes: dict[str, object] = {}
    for name in kind.fields:
        if name not in fields:
            continue
        value = values.get(name)
        where = f"{kind.resource}.{name}"
        if name in kind.references:
            group = BY_HOLDER[name]
            changes[name] = group.parse(str(value), field=where) if value else None
        elif value or name in always:
            changes[name] = _checked(name, value, where)
        else:
            changes[name] = None
    return changes


def _checked(attribute: str, value: object, where: str) -> object:
    try:
        return RULES[attribute](value, field=where)
    except PolicyError as error:
        raise InvalidArgument(str(error)) from None


def _check_band(policy: Policy, kind: Kind, changes: Mapping[str, object]) -> None:
    """InvalidArgument naming the field when the band a change sets is not
    one of ``policy``'s bands (none: no band may be set)."""
    band = changes.get("band")
    if band is not None:
        check_band(str(band), policy.bands, field=f"{kind.resource}.band")


def _merged(kind: Kind, old: Value, changes: Mapping[str, object]) -> Value:
    """``old`` with ``changes`` made (``None``: the field's default)."""
    limits, groups = old
    defaults = Limits()
    attributes: dict[str, Any] = {
        name: getattr(defaults, name) if value is None else value
        for name, value in changes.items()
        if name not in kind.references
    }
    merged = dict(groups)
    for group_kind in kind.references:
        if group_kind in changes:
            group = changes[group_kind]
            if group is None:
                merged.pop(group_kind, None)
            else:
                merged[group_kind] = str(group)
    try:
        new = dataclasses.replace(limits, **attributes).check(kind.resource)
    except PolicyError as error:
        raise InvalidArgument(str(error)) from None
    return new, merged


def _value(holder: Holder) -> Value:
    return holder.limits, dict(holder.groups)


def _exists(kind: Kind, value: Value) -> bool:
    limits, groups = value
    return any(
        name in groups if name in kind.references else name in limits.set_attributes()
        for name in kind.makes_exist
    )


def _check_removable(
    kind: Kind,
    holder_id: str,
    value: Value,
    changes: Mapping[str, object],
    *,
    created: bool,
) -> None:
    """InvalidArgument when an update leaves a holder without what makes it
    exist and yet sets other fields, or would create one without a required
    field."""
    name = shown(kind.name(holder_id))
    if created and kind.required:
        field = kind.required[0]
        raise InvalidArgument(
            f"{kind.resource}.{field}: {name} does not exist; creating it needs {field}"
        )
    limits = value[0]
    for field in changes:
        if field not in kind.makes_exist and field in limits.set_attributes():
            raise InvalidArgument(
                f"{kind.resource}.{field}: a {field} alone does not make a "
                f"{kind.holder}: give {name} {' or '.join(kind.makes_exist)}"
            )


def _check_room(policy: Policy, kind: Kind) -> None:
    count = len(holders_of(policy, kind))
    if kind.is_group and count >= MAX_TIERS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_TIERS} {kind.collection}; delete some first"
        )
    if not kind.is_group and count + 1 > MAX_EXPLICIT_LIMITS:
        raise ResourceExhausted(
            f"the table holds at most {MAX_EXPLICIT_LIMITS} users with a "
            "limit, tier or exemption; delete some first"
        )


def _commit(
    commits: TableCommits, policy: Policy, kind: Kind, holder_id: str, value: Value
) -> Holder:
    """Commits holder ``holder_id``'s new value (none: removed) and returns the
    holder. Requires commits.changes."""
    limits, groups = value
    present = _exists(kind, value)
    for group_kind, group in groups.items():
        if group not in policy.groups[group_kind]:
            field = f"{kind.resource}.{group_kind}"
            raise FailedPrecondition(str(unknown_group(group_kind, group, field)))
    if kind.is_group:
        group_kind = cast(GroupKind, kind.holder)
        members = member_counts(policy, kind)[holder_id]
        if not present and members:
            raise FailedPrecondition(
                f"{shown(kind.name(holder_id))} has {members} member(s): move "
                f"them to another {kind.holder} (or take them out of it) first"
            )
        new_groups = {k: dict(v) for k, v in policy.groups.items()}
        if present:
            new_groups[group_kind][holder_id] = limits
        else:
            new_groups[group_kind].pop(holder_id, None)
        new = dataclasses.replace(policy, groups=new_groups)
    else:
        entries = dict(policy.users)
        if present:
            entries[holder_id] = User(limits, groups)
        else:
            entries.pop(holder_id, None)
        new = dataclasses.replace(policy, users=entries)
    users, teams = _what_differs(policy, new, kind, holder_id)
    commits.commit_table(new, users=users, teams=teams)
    holder = holder_of(commits.etags, new, kind, holder_id)
    return Holder(kind, holder_id) if holder is None else holder


def _what_differs(
    old: Policy, new: Policy, kind: Kind, holder_id: str
) -> tuple[list[str], TeamsApply | None]:
    """The users whose limit a change of one holder may move (the user, or the
    group's members), and its change of the teams: applied under the
    scheduler's lock, so bounded by the holder, never the table."""
    if not kind.is_group:
        team = new.users.get(holder_id, User()).group("team")
        if team == old.users.get(holder_id, User()).group("team"):
            return [holder_id], None
        return [holder_id], lambda teams, now_ns: teams.set_membership(
            holder_id, team, now_ns
        )
    group_kind = cast(GroupKind, kind.holder)
    members = [u for u, g in old.members(group_kind).items() if g == holder_id]
    if group_kind != "team":
        return members, None
    rate = new.groups["team"].get(holder_id, Limits()).tokens_per_second
    if rate == old.groups["team"].get(holder_id, Limits()).tokens_per_second:
        return [], None
    return [], lambda teams, now_ns: teams.set_rate(holder_id, rate, now_ns)
