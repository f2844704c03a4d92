"""The resources the limits service returns (``Limit``, ``Tier``,
``LimitsTable``, ``PacingMode``, ``UserState``) and takes (``LimitSpec``,
``TierSpec``), their etags, and their views of a ``TableDocument``.

A user's *entry* (``Limit``) is what the table holds for it: its own limit, its
tier, its exemption, its fair-share weight, any of them; a *tier* exists while
it has a rate or an exemption (its weight alone does not make one).

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
#: weight (None: none).
EntryFields = tuple[int | None, str | None, bool, float | None]
#: The fields of no entry.
NO_ENTRY: EntryFields = (None, None, False, None)


@dataclass(frozen=True)
class Limit:
    """One user's entry: own limit (0: none), tier, exemption, own weight (0:
    none)."""

    user: str
    tokens_per_second: int
    tier: str | None = None
    exempt: bool = False
    etag: str = ""
    weight: float = 0.0

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


class LimitSpec(NamedTuple):
    """One entry of a table to replace, as received (``name`` is ``limits/{user}``,
    ``tier`` is ``tiers/{tier}`` or empty)."""

    name: str
    tokens_per_second: int
    tier: str = ""
    exempt: bool = False
    weight: float = 0.0


class TierSpec(NamedTuple):
    """One tier of a table to replace, as received (``name`` is ``tiers/{tier}``)."""

    name: str
    tokens_per_second: int
    exempt: bool = False
    weight: float = 0.0


@dataclass(frozen=True)
class LimitsTable:
    """The default, all entries and all tiers (sorted), with the etag."""

    default_tokens_per_second: int  #: 0 while pacing is off
    limits: list[Limit] = field(default_factory=list)
    etag: str = ""
    tiers: list[Tier] = field(default_factory=list)


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


class Etags:
    """The etags of single resources (entries, tiers, the mode), computed from
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
    rate, tier, exempt, weight = fields
    etag = etags.limit(user, fields)
    return Limit(user, rate or 0, tier, exempt, etag, weight or 0.0)


def entry_fields(doc: TableDocument, user: str) -> EntryFields | None:
    """``user``'s entry in ``doc``, or None without one."""
    fields = (
        doc.user_rates.get(user),
        doc.memberships.get(user),
        user in doc.exempt_users,
        doc.user_weights.get(user),
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


def pacing_mode(etags: Etags, mode: Mode, fair_share: bool) -> PacingMode:
    """The pacing mode resource of ``mode`` and the fair-share switch."""
    return PacingMode(mode, etags.mode(mode, fair_share), fair_share)


def table_of(etags: Etags, doc: TableDocument, etag: str) -> LimitsTable:
    """The whole of ``doc`` as a ``LimitsTable`` with the table etag ``etag``."""
    members = Counter(doc.memberships.values())
    return LimitsTable(
        default_tokens_per_second=doc.default_rate or 0,
        limits=[entry_of(etags, doc, user) for user in sorted(doc.users())],
        etag=etag,
        tiers=[tier_of(etags, doc, tier, members) for tier in sorted(doc.tiers)],
    )


def no_limit(user: str) -> NotFound:
    return NotFound(
        f"{shown(names.limit_name(user))} does not exist: the user has no "
        "entry (the default applies)"
    )


def no_tier(tier: str) -> NotFound:
    return NotFound(f"{shown(names.tier_name(tier))} does not exist")
