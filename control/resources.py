"""The resources the limits service returns (``Limit``, ``Tier``, ``Team``,
``LimitsTable``, ``PacingMode``, ``UserState``, ``TeamState``) and takes
(``LimitSpec``, ``TierSpec``, ``TeamSpec``), their etags, and their views of a
``TableDocument``.

A user's *entry* (``Limit``) is what the table holds for it: its own limit, its
tier, its exemption, its fair-share weight, its team, any of them; a *tier*
exists while it has a rate or an exemption (its weight alone does not make
one); a *team* exists while it has a rate.

Invariant: the etag of an entry, a tier or the mode is a digest of its fields
and this process's epoch only, so the same fields read twice in one process give
the same etag, and no etag from before a restart matches. (The table's etag
counts committed tables instead: ``control.service.commits``.)
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from control import names
from control.errors import Aborted, NotFound
from control.table import TableDocument, shown
from pacing.budget import StoreView
from pacing.limiter import LimitSource
from pacing.modes import Mode
from pacing.shared import UserSnapshot

#: An entry's fields: own rate (None: none), tier (None: none), exempt, own
#: weight (None: none), team (None: none).
EntryFields = tuple[int | None, str | None, bool, float | None, str | None]
#: The fields of no entry.
NO_ENTRY: EntryFields = (None, None, False, None, None)


@dataclass(frozen=True)
class Limit:
    """One user's entry: own limit (0: none), tier, exemption, own weight (0:
    none), team."""

    user: str
    tokens_per_second: int
    tier: str | None = None
    exempt: bool = False
    etag: str = ""
    weight: float = 0.0
    team: str | None = None

    @property
    def name(self) -> str:
        return names.limit_name(self.user)


@dataclass(frozen=True)
class Tier:
    """One tier: rate (0: none), exemption, member count, weight (0: none)."""

    tier: str
    tokens_per_second: int
    exempt: bool
    member_count: int = 0
    etag: str = ""
    weight: float = 0.0

    @property
    def name(self) -> str:
        return names.tier_name(self.tier)


@dataclass(frozen=True)
class Team:
    """One team: rate, weight (0: none), member count."""

    team: str
    tokens_per_second: int
    weight: float = 0.0
    member_count: int = 0
    etag: str = ""

    @property
    def name(self) -> str:
        return names.team_name(self.team)


class LimitSpec(NamedTuple):
    """One entry of a table to replace, as received (``name`` is ``limits/{user}``,
    ``tier`` is ``tiers/{tier}`` or empty, ``team`` is ``teams/{team}`` or
    empty)."""

    name: str
    tokens_per_second: int
    tier: str = ""
    exempt: bool = False
    weight: float = 0.0
    team: str = ""


class TierSpec(NamedTuple):
    """One tier of a table to replace, as received (``name`` is ``tiers/{tier}``)."""

    name: str
    tokens_per_second: int
    exempt: bool = False
    weight: float = 0.0


class TeamSpec(NamedTuple):
    """One team of a table to replace, as received (``name`` is ``teams/{team}``)."""

    name: str
    tokens_per_second: int
    weight: float = 0.0


@dataclass(frozen=True)
class LimitsTable:
    """The default, all entries, all tiers and all teams (sorted), with the
    etag."""

    default_tokens_per_second: int  #: 0 while pacing is off
    limits: list[Limit] = field(default_factory=list)
    etag: str = ""
    tiers: list[Tier] = field(default_factory=list)
    teams: list[Team] = field(default_factory=list)


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
    #: With a global store, the user's budget there as this engine sees it.
    store: StoreView | None = None


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


class Etags:
    """The etags of single resources (entries, tiers, teams, the mode), computed from
    their fields and ``epoch`` (random per process)."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch

    def digest(self, *fields: object) -> str:
        """An etag computed from a resource's fields (and this process's epoch)."""
        text = repr((self.epoch, *fields)).encode()  # repr escapes any surrogate
        return f"{self.epoch}-{hashlib.sha256(text).hexdigest()[:16]}"

    def limit(self, user: str, entry: EntryFields | None) -> str:
        return "" if entry is None else self.digest("limit", user, *entry)

    def tier(
        self, tier: str, rate: int | None, exempt: bool, weight: float | None
    ) -> str:
        return self.digest("tier", tier, rate, exempt, weight)

    def team(self, team: str, rate: int, weight: float | None) -> str:
        return self.digest("team", team, rate, weight)

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


def entry(etags: Etags, user: str, fields: EntryFields) -> Limit | None:
    """``user``'s entry with these fields, or None when it has none of them."""
    if fields == NO_ENTRY:
        return None
    rate, tier, exempt, weight, team = fields
    etag = etags.limit(user, fields)
    return Limit(user, rate or 0, tier, exempt, etag, weight or 0.0, team)


def entry_fields(doc: TableDocument, user: str) -> EntryFields | None:
    """``user``'s entry in ``doc``, or None without one."""
    fields = (
        doc.user_rates.get(user),
        doc.memberships.get(user),
        user in doc.exempt_users,
        doc.user_weights.get(user),
        doc.team_members.get(user),
    )
    return None if fields == NO_ENTRY else fields


def entry_of(etags: Etags, doc: TableDocument, user: str) -> Limit:
    """The entry ``doc`` holds for ``user``, one of ``doc.users()``."""
    limit = entry(etags, user, entry_fields(doc, user) or NO_ENTRY)
    assert limit is not None  # ``user`` is one of doc.users()
    return limit


def tier_of(etags: Etags, doc: TableDocument, tier: str, members: Counter[str]) -> Tier:
    """Tier ``tier`` of ``doc``; ``members`` counts each tier's members."""
    rate = doc.tier_rates.get(tier)
    exempt = tier in doc.exempt_tiers
    weight = doc.tier_weights.get(tier)
    etag = etags.tier(tier, rate, exempt, weight)
    return Tier(tier, rate or 0, exempt, members[tier], etag, weight or 0.0)


def team_of(etags: Etags, doc: TableDocument, team: str, members: Counter[str]) -> Team:
    """Team ``team`` of ``doc``; ``members`` counts each team's members."""
    rate = doc.team_rates[team]
    weight = doc.team_weights.get(team)
    etag = etags.team(team, rate, weight)
    return Team(team, rate, weight or 0.0, members[team], etag)


def pacing_mode(etags: Etags, mode: Mode, fair_share: bool) -> PacingMode:
    """The pacing mode resource of ``mode`` and the fair-share switch."""
    return PacingMode(mode, etags.mode(mode, fair_share), fair_share)


def table_of(etags: Etags, doc: TableDocument, etag: str) -> LimitsTable:
    """The whole of ``doc`` as a ``LimitsTable`` with the table etag ``etag``."""
    members = Counter(doc.memberships.values())
    team_members = Counter(doc.team_members.values())
    return LimitsTable(
        default_tokens_per_second=doc.default_rate or 0,
        limits=[entry_of(etags, doc, user) for user in sorted(doc.users())],
        etag=etag,
        tiers=[tier_of(etags, doc, tier, members) for tier in sorted(doc.tiers)],
        teams=[
            team_of(etags, doc, team, team_members) for team in sorted(doc.team_rates)
        ],
    )


def no_limit(user: str) -> NotFound:
    return NotFound(
        f"{shown(names.limit_name(user))} does not exist: the user has no "
        "entry (the default applies)"
    )


def no_tier(tier: str) -> NotFound:
    return NotFound(f"{shown(names.tier_name(tier))} does not exist")


def no_team(team: str) -> NotFound:
    return NotFound(f"{shown(names.team_name(team))} does not exist")
