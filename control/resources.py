"""The resources the limits service returns (``Holder`` of each kind,
``LimitsTable``, ``PacingMode``, ``UserState``, ``TeamState``) and takes
(``HolderSpec``), their etags, and their views of a ``Policy``.

A *holder* is one user entry, tier or team (``control.kinds``): a user's entry
is what the policy holds for it (its own limits, its groups, any of them); a
group exists while it has what its kind needs (``Kind.exists_with``).

Invariant: the etag of a holder or the mode is a digest of its fields and this
process's epoch only, so the same fields read twice in one process give the same
etag, and no etag from before a restart matches. (The table's etag counts
committed tables instead: ``control.service.commits``.)
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from control.errors import Aborted, NotFound
from control.kinds import ALL, Kind
from control.table import shown
from pacing.budget import StoreView
from pacing.limiter import LimitSource
from pacing.modes import Mode
from pacing.policy.model import GroupKind, Limits, Policy
from pacing.shared import UserSnapshot


@dataclass(frozen=True)
class Holder:
    """One rate holder of a kind (``control.kinds``): its limits, its groups
    (users: one per group kind), its member count (groups), its etag."""

    kind: Kind
    id: str
    limits: Limits = field(default_factory=Limits)
    groups: Mapping[GroupKind, str] = field(default_factory=dict)
    member_count: int = 0
    etag: str = ""

    @property
    def name(self) -> str:
        return self.kind.name(self.id)

    def wire(self) -> dict[str, object]:
        """Each field of its kind as the API carries it (``Kind.wire``)."""
        return self.kind.wire(self.limits, self.groups)


@dataclass(frozen=True)
class HolderSpec:
    """One holder of a table to replace, as received: its resource name and
    the wire value of each field of its kind (0, false or "": not set)."""

    name: str
    values: Mapping[str, object]


@dataclass(frozen=True)
class LimitsTable:
    """The default and every holder of every kind (sorted), with the etag."""

    default_tokens_per_second: int  #: 0 while pacing is off
    holders: Mapping[Kind, list[Holder]] = field(default_factory=dict)
    etag: str = ""
    #: The default with every attribute it holds.
    default: Limits = field(default_factory=Limits)
    #: The priority bands, highest first (none: one band).
    bands: tuple[str, ...] = ()
    #: The gateway's objective -> its band.
    objectives: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PacingMode:
    """The pacing mode and the fair-share switch, with their etag."""

    mode: Mode
    etag: str
    fair_share: bool = False


@dataclass(frozen=True)
class FairShareState:
    """One user's standing under fair share, read with its limiter state."""

    weight: float  #: the weight that applies (own, tier's, default)
    service: float  #: cumulative weighted service
    preemptions: int  #: requests that yielded their slot for fair share
    enabled: bool  #: fair share was on
    backlogged: bool  #: backlogged and eligible at the last step
    lead: float  #: counter above the backlogged minimum (0: not backlogged)


@dataclass(frozen=True)
class CeilingState:
    """One user's ceiling (``pacing.ceilings``), read with its limiter state."""

    ceiling: int  #: the ceiling that applies (own, tier's, default's); 0: none
    borrowed_tokens: int  #: cumulative tokens borrowed above the rate
    #: the engine was spare for the user at its last step (false: no ceilings)
    may_borrow: bool


@dataclass(frozen=True)
class UserState:
    """One user's limiter state plus where its limit comes from, read at one
    instant."""

    snapshot: UserSnapshot
    source: LimitSource
    tier: str | None  #: the user's tier, whichever rule decided
    shadow_skips: int
    mode: Mode
    engine_late_ns: int
    fair_share: FairShareState
    ceiling: CeilingState
    #: With a global store, the user's budget there as this engine sees it.
    store: StoreView | None = None
    #: The priority band that applies to the user (``pacing.bands``); "":
    #: no bands.
    band: str = ""


@dataclass(frozen=True)
class TeamState:
    """One team's budget, members and counters: its own fields of one instant,
    its members' sums (running, throttled, service) added up over a few holds
    of the lock (``control.service.team_states``)."""

    team: str
    tokens_per_second: int
    weight: float  #: the weight that applies (own, else the default)
    budget_tokens: int  #: whole tokens the team's cell holds now
    tat_lead_ns: int
    next_token_in_ns: int
    member_count: int
    running_members: int  #: members with requests in the engine
    throttled_members: int  #: of those, skipped for lack of budget last step
    tokens_charged: int  #: net (refunds subtracted)
    throttled_steps: int  #: grants in which the team's rate bound
    fair_share_service: float  #: the members' weighted service, summed
    #: the team's prompt rate (``pacing.prompt_budget``); 0: none
    prompt_tokens_per_second: int


class Etags:
    """The etags of single resources (holders, the mode), computed from their
    fields and ``epoch`` (random per process)."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch

    def digest(self, *fields: object) -> str:
        """An etag computed from a resource's fields (and this process's epoch)."""
        text = repr((self.epoch, *fields)).encode()  # repr escapes any surrogate
        return f"{self.epoch}-{hashlib.sha256(text).hexdigest()[:16]}"

    def holder(
        self,
        kind: Kind,
        holder_id: str,
        limits: Limits,
        groups: Mapping[GroupKind, str],
    ) -> str:
        return self.digest(kind.holder, holder_id, limits, sorted(groups.items()))

    def mode(self, mode: Mode, fair_share: bool) -> str:
        return self.digest("mode", mode.value, fair_share)


def check_etag(etag: str, current: str, name: str) -> None:
    """Aborted when ``etag`` is given and differs from ``current`` (empty:
    resource ``name`` does not exist)."""
    if etag and etag != current:
        raise Aborted(
            f"etag {shown(etag)} is not current: {shown(name)} changed "
            "since it was read; read it again and retry"
        )


def holders_of(policy: Policy, kind: Kind) -> Mapping[str, Limits]:
    """Each holder of ``kind`` in ``policy`` -> its own limits."""
    if kind.is_group:
        return policy.groups[cast(GroupKind, kind.holder)]
    return {user: entry.limits for user, entry in policy.users.items()}


def holder_of(
    etags: Etags,
    policy: Policy,
    kind: Kind,
    holder_id: str,
    members: Counter[str] | None = None,
) -> Holder | None:
    """Holder ``holder_id`` of ``kind`` in ``policy``, None when it has none;
    ``members`` counts each group's members (counted here when not given)."""
    if kind.is_group:
        limits = policy.groups[cast(GroupKind, kind.holder)].get(holder_id)
        if limits is None:
            return None
        if members is None:
            members = member_counts(policy, kind)
        etag = etags.holder(kind, holder_id, limits, {})
        return Holder(kind, holder_id, limits, {}, members[holder_id], etag)
    user = policy.users.get(holder_id)
    if user is None:
        return None
    etag = etags.holder(kind, holder_id, user.limits, user.groups)
    return Holder(kind, holder_id, user.limits, dict(user.groups), 0, etag)


def member_counts(policy: Policy, kind: Kind) -> Counter[str]:
    """Group -> its members, for a group kind (empty for users)."""
    if not kind.is_group:
        return Counter()
    return Counter(policy.members(cast(GroupKind, kind.holder)).values())


def pacing_mode(etags: Etags, mode: Mode, fair_share: bool) -> PacingMode:
    """The pacing mode resource of ``mode`` and the fair-share switch."""
    return PacingMode(mode, etags.mode(mode, fair_share), fair_share)


def table_of(etags: Etags, policy: Policy, etag: str) -> LimitsTable:
    """The whole of ``policy`` as a ``LimitsTable`` with the table etag ``etag``."""
    holders: dict[Kind, list[Holder]] = {}
    for kind in ALL:
        members = member_counts(policy, kind)
        found = (
            holder_of(etags, policy, kind, holder_id, members)
            for holder_id in sorted(holders_of(policy, kind))
        )
        holders[kind] = [holder for holder in found if holder is not None]
    return LimitsTable(
        policy.default_rate or 0,
        holders,
        etag,
        policy.default,
        policy.bands,
        dict(sorted(policy.objectives.items())),
    )


def not_found(kind: Kind, holder_id: str) -> NotFound:
    """NotFound for holder ``holder_id`` of ``kind``."""
    name = shown(kind.name(holder_id))
    if kind.is_group:
        return NotFound(f"{name} does not exist")
    return NotFound(
        f"{name} does not exist: the user has no entry (the default applies)"
    )
