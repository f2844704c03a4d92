"""The limits table as the control plane holds it (``TableDocument``), and the
policy document's text (``pacing.policy``: the one format and rules of the
config file and the CLI's import/export), with the control plane's checks of
single values: the pure rules' words, raised as ``InvalidArgument``.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from control.errors import InvalidArgument
from pacing.fair_share import validate_weight
from pacing.fair_share_policy import SharePolicy
from pacing.global_limits import LimitsVersion
from pacing.identity import validate_user
from pacing.limiter import LimitTable, validate_rate
from pacing.modes import Mode
from pacing.policy import text
from pacing.policy.document import Document
from pacing.policy.errors import PolicyError
from pacing.policy.errors import shown as shown
from pacing.policy.model import Policy, policy_of
from pacing.policy.text import Format as Format
from pacing.shared import SharedLimiter
from pacing.table_caps import MAX_EXPLICIT_LIMITS as MAX_EXPLICIT_LIMITS
from pacing.table_caps import MAX_TIERS as MAX_TIERS
from pacing.teams import TeamTable


@dataclass(frozen=True)
class TableDocument:
    """A validated table document; ``default_rate``, ``mode`` and
    ``fair_share`` are ``None`` when absent. Every membership and every tier
    weight names a tier of ``tier_rates`` or ``exempt_tiers``; every team
    membership and team weight a team of ``team_rates``."""

    default_rate: int | None = None
    user_rates: Mapping[str, int] = field(default_factory=dict)
    etag: str | None = None
    tier_rates: Mapping[str, int] = field(default_factory=dict)
    exempt_tiers: Set[str] = frozenset()
    memberships: Mapping[str, str] = field(default_factory=dict)
    exempt_users: Set[str] = frozenset()
    mode: Mode | None = None
    user_weights: Mapping[str, float] = field(default_factory=dict)
    tier_weights: Mapping[str, float] = field(default_factory=dict)
    fair_share: bool | None = None
    #: Teams (``pacing.teams``): team -> tokens/s, user -> team, team -> weight.
    team_rates: Mapping[str, int] = field(default_factory=dict)
    team_members: Mapping[str, str] = field(default_factory=dict)
    team_weights: Mapping[str, float] = field(default_factory=dict)
    #: The store version this table was saved at (a store's engines only).
    store_version: LimitsVersion | None = None

    @property
    def tiers(self) -> set[str]:
        """The tiers that exist: those with a rate or an exemption."""
        return set(self.tier_rates) | set(self.exempt_tiers)

    def users(self) -> set[str]:
        """Every user with an entry: a limit, a tier, an exemption, a team or
        a weight."""
        return (
            set(self.user_rates)
            | set(self.memberships)
            | set(self.exempt_users)
            | set(self.user_weights)
            | set(self.team_members)
        )

    def same_table(self, other: TableDocument) -> bool:
        """Whether ``other`` holds the same default, entries, tiers and
        teams, weights included (the etag, the mode and the fair-share switch
        aside)."""
        return self._table_fields() == other._table_fields()

    def _table_fields(self) -> tuple[Any, ...]:
        return (
            self.default_rate,
            dict(self.user_rates),
            dict(self.tier_rates),
            frozenset(self.exempt_tiers),
            dict(self.memberships),
            frozenset(self.exempt_users),
            dict(self.user_weights),
            dict(self.tier_weights),
            dict(self.team_rates),
            dict(self.team_members),
            dict(self.team_weights),
        )

    def share_policy(self, enabled: bool) -> SharePolicy:
        """The switch (``fair_share``, else ``enabled``) and the weights."""
        return SharePolicy(
            enabled if self.fair_share is None else self.fair_share,
            self.user_weights,
            self.tier_weights,
            self.team_weights,
        )

    def limit_table(self) -> LimitTable:
        """The pure core's table of these entries and tiers (ValueError if they
        are inconsistent, which a validated document never is)."""
        return LimitTable(
            self.user_rates,
            self.tier_rates,
            self.memberships,
            self.exempt_users,
            self.exempt_tiers,
        )

    def team_table(self) -> TeamTable:
        """The pure core's team table of these teams and memberships."""
        return TeamTable(self.team_rates, self.team_members)

    @classmethod
    def from_document(cls, document: Document) -> TableDocument:
        """The table a checked policy document holds."""
        return cls.of_policy(document.policy, document.etag, document.store_version)

    @classmethod
    def of_policy(
        cls,
        policy: Policy,
        etag: str | None = None,
        store_version: LimitsVersion | None = None,
    ) -> TableDocument:
        """The table ``policy`` holds."""
        table, teams = policy.limit_table(), policy.team_table()
        share = policy.share_policy()
        return cls(
            default_rate=policy.default_rate,
            user_rates=table.user_rates,
            etag=etag,
            tier_rates=table.tier_rates,
            exempt_tiers=table.exempt_tiers,
            memberships=table.memberships,
            exempt_users=table.exempt_users,
            mode=policy.mode,
            user_weights=dict(share.users),
            tier_weights=dict(share.tiers),
            fair_share=policy.fair_share,
            team_rates=teams.rates,
            team_members=teams.memberships,
            team_weights=dict(share.teams),
            store_version=store_version,
        )

    def to_document(self) -> Document:
        """This table as a policy document."""
        return Document(self.policy(), self.etag, self.store_version)

    def policy(self) -> Policy:
        """This table as the policy value."""
        return policy_of(
            default_rate=self.default_rate,
            table=self.limit_table(),
            teams=self.team_table(),
            share=SharePolicy(
                False, self.user_weights, self.tier_weights, self.team_weights
            ),
            mode=self.mode,
            fair_share=self.fair_share,
        )


def table_in_force(shared: SharedLimiter) -> TableDocument:
    """The table, mode and fair-share switch ``shared`` holds, as a document of
    copies (default None while pacing is off). Requires ``shared.lock``."""
    limiter, ledger, teams = shared.limiter, shared.fair_share, shared.teams.table
    return TableDocument(
        default_rate=limiter.default_rate,
        user_rates=limiter.user_rates,
        tier_rates=limiter.tier_rates,
        exempt_tiers=limiter.exempt_tiers,
        memberships=limiter.memberships,
        exempt_users=limiter.exempt_users,
        mode=shared.mode,
        user_weights=dict(ledger.weights.users),
        tier_weights=dict(ledger.weights.tiers),
        fair_share=ledger.enabled,
        team_rates=teams.rates,
        team_members=teams.memberships,
        team_weights=dict(ledger.weights.teams),
    )


def check_user(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid user id, else raises InvalidArgument."""
    try:
        return validate_user(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_rate(value: object, *, field: str) -> int:
    """Returns ``value`` if it is a valid tokens/s limit (an integer in
    1..``MAX_RATE``), else raises InvalidArgument."""
    try:
        return validate_rate(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_tier(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid tier id (the user-id rule), else
    raises InvalidArgument."""
    return check_user(value, field=field)


def check_team(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid team id (the user-id rule), else
    raises InvalidArgument."""
    return check_user(value, field=field)


def check_weight(value: object, *, field: str) -> float | None:
    """A fair-share weight as a request gives it: ``None`` for 0 (none), else
    a valid weight; InvalidArgument naming ``field``."""
    if value == 0 and not isinstance(value, bool):
        return None
    try:
        return validate_weight(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def loads(content: str, fmt: Format, *, source: str) -> TableDocument:
    """Decodes and checks a document in ``fmt``."""
    try:
        return TableDocument.from_document(text.loads(content, fmt, source=source))
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None


def dumps(doc: TableDocument, fmt: Format) -> str:
    """Encodes ``doc`` in ``fmt`` (``pacing.policy.document.to_tree``)."""
    return text.dumps(doc.to_document(), fmt)


def format_of(path: str) -> Format:
    """The format a file name implies: ``.json`` is JSON, ``.yaml``/``.yml`` YAML."""
    try:
        return text.format_of(path)
    except PolicyError as exc:
        raise InvalidArgument(str(exc)) from None
