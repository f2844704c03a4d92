"""The operator's policy as one frozen value: the mode, the fair-share switch, a
default, users and groups, every rate holder carrying the same ``Limits``.

A *group* is a named rate holder with members; its *kind* says what the rate
means: a ``tier``'s rate is each member's (``pacing.limits``), a ``team``'s is
shared by its members (``pacing.teams``). A user is a member of at most one
group of each kind. Which attributes each holder may set is ``ATTRIBUTES``;
an attribute added to ``Limits`` and listed there is valid for that holder
everywhere (the document, the runtime tables) at once.

The value is checked by ``pacing.policy.document``; the runtime tables are
built from it here (``limit_table``, ``team_table``, ``share_policy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Final, Literal

from pacing.bands import BandTable, validate_band
from pacing.fair_share import validate_weight
from pacing.fair_share_policy import SharePolicy
from pacing.limits import LimitTable, validate_rate
from pacing.modes import Mode
from pacing.policy.errors import PathPart, PolicyError, shown
from pacing.teams import TeamTable

GroupKind = Literal["tier", "team"]
#: The kinds of group, in the order documents list them.
KINDS: Final[tuple[GroupKind, ...]] = ("tier", "team")
#: The document's key of each kind's groups.
GROUP_KEYS: Final[Mapping[GroupKind, str]] = {"tier": "tiers", "team": "teams"}


def validate_flag(value: object, *, field: str | Sequence[PathPart]) -> bool:
    """``value`` if it is a boolean."""
    if not isinstance(value, bool):
        raise PolicyError(f"must be true or false, got {shown(value)}", field)
    return value


#: Each ``Limits`` attribute -> the one rule its value follows (raises
#: ``PolicyError`` at ``field``): a new attribute is declared here and in
#: ``Limits``, and is then read, checked and written wherever a policy is.
RULES: Final[Mapping[str, Callable[..., object]]] = {
    "tokens_per_second": validate_rate,
    "exempt": validate_flag,
    "weight": validate_weight,
    "prompt_tokens_per_second": validate_rate,
    "ceiling_tokens_per_second": validate_rate,
    "band": validate_band,
}
#: Holder -> the ``Limits`` attributes it may set.
ATTRIBUTES: Final[Mapping[str, tuple[str, ...]]] = {
    "default": (
        "tokens_per_second",
        "prompt_tokens_per_second",
        "ceiling_tokens_per_second",
        "band",
    ),
    "user": (
        "tokens_per_second",
        "exempt",
        "weight",
        "prompt_tokens_per_second",
        "ceiling_tokens_per_second",
        "band",
    ),
    "tier": (
        "tokens_per_second",
        "exempt",
        "weight",
        "prompt_tokens_per_second",
        "ceiling_tokens_per_second",
        "band",
    ),
    "team": (
        "tokens_per_second",
        "weight",
        "prompt_tokens_per_second",
        "ceiling_tokens_per_second",
        "band",
    ),
}


@dataclass(frozen=True)
class Limits:
    """What a rate holder is given: its output rate in tokens per second
    (``None``: none of its own), whether it is exempt (unlimited, the rate kept
    for when the exemption is lifted), its fair-share weight (``None``: none of
    its own), its prompt rate: the uncached prompt tokens the engine computes
    for it per second (``None``: none of its own; ``pacing.prompt_budget``),
    its ceiling: the output rate it may borrow up to from capacity nobody else
    waits for (``None``: none of its own; ``pacing.ceilings``), its band: one
    of the policy's ``bands`` (``None``: none of its own; ``pacing.bands``)."""

    tokens_per_second: int | None = None
    exempt: bool = False
    weight: float | None = None
    prompt_tokens_per_second: int | None = None
    ceiling_tokens_per_second: int | None = None
    band: str | None = None

    def check(self, field: str | Sequence[PathPart] = ()) -> Limits:
        """These limits if their attributes agree with each other (a ceiling
        is at least the rate it lifts), else ``PolicyError`` at ``field``."""
        ceiling, rate = self.ceiling_tokens_per_second, self.tokens_per_second
        if ceiling is not None and rate is not None and ceiling < rate:
            name = "ceiling_tokens_per_second"
            raise PolicyError(
                f"must be at least tokens_per_second ({rate}), got {ceiling}",
                (f"{field}.{name}" if field else name)
                if isinstance(field, str)
                else (*field, name),
            )
        return self

    def __bool__(self) -> bool:
        return self != _NO_LIMITS

    def overlaid(self, top: Limits) -> Limits:
        """These limits with each attribute ``top`` sets instead."""
        return replace(
            self, **{name: getattr(top, name) for name in top.set_attributes()}
        )

    def set_attributes(self) -> tuple[str, ...]:
        """The names of the attributes that differ from their default."""
        return tuple(
            item.name
            for item in fields(self)
            if getattr(self, item.name) != getattr(_NO_LIMITS, item.name)
        )


_NO_LIMITS: Final = Limits()


@dataclass(frozen=True)
class User:
    """A user's own limits and the group it is a member of, per kind."""

    limits: Limits = _NO_LIMITS
    groups: Mapping[GroupKind, str] = field(default_factory=dict)

    def group(self, kind: GroupKind) -> str | None:
        return self.groups.get(kind)


def _no_groups() -> Mapping[GroupKind, Mapping[str, Limits]]:
    return {kind: {} for kind in KINDS}


@dataclass(frozen=True)
class Policy:
    """The operator's policy. ``mode`` and ``fair_share`` are ``None`` where the
    policy does not say (the flags' or the engine's then hold); a ``default``
    without a rate gives none. ``bands``: the priority bands, highest first
    (none: one band); ``objectives``: the gateway's objective -> its band."""

    mode: Mode | None = None
    fair_share: bool | None = None
    default: Limits = _NO_LIMITS
    groups: Mapping[GroupKind, Mapping[str, Limits]] = field(default_factory=_no_groups)
    users: Mapping[str, User] = field(default_factory=dict)
    bands: tuple[str, ...] = ()
    objectives: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every kind present, so that readers index without a default.
        object.__setattr__(
            self,
            "groups",
            {kind: dict(self.groups.get(kind, {})) for kind in KINDS},
        )
        object.__setattr__(self, "users", dict(self.users))
        object.__setattr__(self, "bands", tuple(self.bands))
        object.__setattr__(self, "objectives", dict(self.objectives))

    @property
    def default_rate(self) -> int | None:
        return self.default.tokens_per_second

    def same_table(self, other: Policy) -> bool:
        """Whether ``other`` holds the same default, groups and users (the mode
        and the fair-share switch aside)."""
        return (
            self.default,
            self.groups,
            self.users,
            self.bands,
            self.objectives,
        ) == (other.default, other.groups, other.users, other.bands, other.objectives)

    def overlaid(self, top: Policy) -> Policy:
        """This policy with ``top`` over it: what ``top`` sets wins, attribute
        by attribute and membership by membership; what it leaves unset stays
        (an exemption is kept from either)."""
        groups = {
            kind: _overlaid(self.groups[kind], top.groups[kind]) for kind in KINDS
        }
        users: dict[str, User] = dict(self.users)
        for user, entry in top.users.items():
            below = users.get(user, User())
            users[user] = User(
                below.limits.overlaid(entry.limits), {**below.groups, **entry.groups}
            )
        return Policy(
            mode=self.mode if top.mode is None else top.mode,
            fair_share=self.fair_share if top.fair_share is None else top.fair_share,
            default=self.default.overlaid(top.default),
            groups=groups,
            users=users,
            bands=top.bands or self.bands,
            objectives={**self.objectives, **top.objectives},
        )

    def members(self, kind: GroupKind) -> dict[str, str]:
        """User -> the group of ``kind`` it is a member of."""
        return {
            user: group
            for user, entry in self.users.items()
            if (group := entry.groups.get(kind)) is not None
        }

    # -- the runtime tables --------------------------------------------------

    def limit_table(self, rate: str = "tokens_per_second") -> LimitTable:
        """The users' own limits, the tiers, memberships and exemptions, for
        the rate attribute ``rate`` (the output rate, or the prompt rate): a
        tier with neither that rate nor an exemption is not in the table, and
        its members get the default."""
        tiers = {
            tier: limits
            for tier, limits in self.groups["tier"].items()
            if getattr(limits, rate) is not None or limits.exempt
        }
        return LimitTable(
            {
                user: value
                for user, entry in self.users.items()
                if (value := getattr(entry.limits, rate)) is not None
            },
            {
                tier: value
                for tier, limits in tiers.items()
                if (value := getattr(limits, rate)) is not None
            },
            {
                user: tier
                for user, tier in self.members("tier").items()
                if tier in tiers
            },
            [user for user, entry in self.users.items() if entry.limits.exempt],
            [tier for tier, limits in tiers.items() if limits.exempt],
        )

    def team_table(self, rate: str = "tokens_per_second") -> TeamTable:
        """The teams' rates (attribute ``rate``) and members: a team without
        that rate is not in the table."""
        rates = {
            team: value
            for team, limits in self.groups["team"].items()
            if (value := getattr(limits, rate)) is not None
        }
        return TeamTable(
            rates,
            {
                user: team
                for user, team in self.members("team").items()
                if team in rates
            },
        )

    def band_table(self) -> BandTable:
        """The bands and each holder's band, as indices."""
        index = {name: i for i, name in enumerate(self.bands)}

        def of(holders: Mapping[str, Limits]) -> dict[str, int]:
            return {
                name: index[limits.band]
                for name, limits in holders.items()
                if limits.band in index
            }

        return BandTable(
            self.bands,
            index.get(self.default.band or "", 0),
            of({user: entry.limits for user, entry in self.users.items()}),
            of(self.groups["tier"]),
            of(self.groups["team"]),
            {o: index[band] for o, band in self.objectives.items() if band in index},
        )

    def share_policy(self, enabled: bool = False) -> SharePolicy:
        """The fair-share switch (the policy's, else ``enabled``) and the
        weights of users, tiers and teams."""
        return SharePolicy(
            enabled if self.fair_share is None else self.fair_share,
            _weights({user: entry.limits for user, entry in self.users.items()}),
            _weights(self.groups["tier"]),
            _weights(self.groups["team"]),
        )


def _overlaid(
    below: Mapping[str, Limits], top: Mapping[str, Limits]
) -> dict[str, Limits]:
    merged = dict(below)
    for name, limits in top.items():
        merged[name] = merged.get(name, Limits()).overlaid(limits)
    return merged


def _weights(holders: Mapping[str, Limits]) -> dict[str, float]:
    return {
        name: limits.weight
        for name, limits in holders.items()
        if limits.weight is not None
    }


def policy_of(
    *,
    default_rate: int | None,
    table: LimitTable,
    teams: TeamTable,
    share: SharePolicy,
    mode: Mode | None = None,
    fair_share: bool | None = None,
) -> Policy:
    """The policy the runtime tables hold (the inverse of ``limit_table``,
    ``team_table`` and ``share_policy``)."""
    tier_rates, exempt_tiers = table.tier_rates, table.exempt_tiers
    tiers = {
        tier: Limits(tier_rates.get(tier), tier in exempt_tiers, share.tiers.get(tier))
        for tier in table.tiers
    }
    team_rates = teams.rates
    groups: dict[GroupKind, dict[str, Limits]] = {
        "tier": tiers,
        "team": {
            team: Limits(rate, weight=share.teams.get(team))
            for team, rate in team_rates.items()
        },
    }
    rates, exempt = table.user_rates, table.exempt_users
    tier_of, team_of = table.memberships, teams.memberships
    users: dict[str, User] = {}
    for user in (*rates, *exempt, *share.users, *tier_of, *team_of):
        if user in users:
            continue
        memberships: dict[GroupKind, str] = {}
        if (tier := tier_of.get(user)) is not None:
            memberships["tier"] = tier
        if (team := team_of.get(user)) is not None:
            memberships["team"] = team
        users[user] = User(
            Limits(rates.get(user), user in exempt, share.users.get(user)),
            memberships,
        )
    return Policy(
        mode=mode,
        fair_share=fair_share,
        default=Limits(default_rate),
        groups=groups,
        users=users,
    )
