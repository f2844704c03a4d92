"""Which limit applies to a user: explicit user limits, tiers, memberships and
exemptions, resolved in one fixed order.

Vocabulary:

- *limit*: a rate in tokens per second, an ``int`` in ``1..MAX_RATE``.
- *tier*: a named rate class (``free: 20``, ``pro: 200``). A user is a *member*
  of at most one tier.
- *exemption*: a mark that makes a user, or every member of a tier, unlimited.
  It is distinct from having no entry (which lets the next rule decide), and it
  does not erase the limit under it: lifting it brings that limit back.

Resolution, first match wins (``LimitTable.source``):

1. the user is exempt: unlimited;
2. the user has a limit of its own: that limit;
3. the user is a member of an exempt tier: unlimited;
4. the user is a member of a tier with a rate: the tier's rate;
5. otherwise the default, which the limiter holds (it also decides that nothing
   is limited while there is no default).

So a user's own limit wins over its tier, the tier's exemption included:
exempting a tier frees the members without a limit of their own, and an
operator who pinned one member's limit keeps it pinned.

A tier exists while it has a rate or an exemption. A user joins only a tier
that exists, and a tier with members cannot stop existing: the table never
holds a membership that resolves to nothing.

Tier names follow the user-id rule (``pacing.identity.validate_user``). User ids
are not checked here, as in ``OutputRateLimiter.set_rate``: the entry points
validate them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pacing.identity import validate_user
from pacing.policy.errors import PathPart, PolicyError, shown, unknown_group

#: Rates above this are rejected as misconfiguration (no engine samples this fast
#: for one user, and a typo like an extra few zeros should fail loudly).
MAX_RATE = 1_000_000

#: Where a user's effective limit comes from; see ``LimitSource``.
SourceKind = Literal["off", "exempt", "user", "tier", "default"]


def validate_rate(rate: object, *, field: str | Sequence[PathPart] = "rate") -> int:
    """Return ``rate`` if it is a valid tokens-per-second limit, else raise
    ``PolicyError`` (a ValueError) at ``field``, in the one words of this rule.

    Valid: an ``int`` (not ``bool``) in ``1..MAX_RATE``.
    """
    if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= MAX_RATE:
        raise PolicyError(
            f"must be an integer in 1..{MAX_RATE} (tokens per second), "
            f"got {shown(rate)}",
            field,
        )
    return rate


def validate_tier(name: object) -> str:
    """Returns ``name`` if it is a valid tier name (the user-id rule), else raises
    ValueError."""
    return validate_user(name, field="tier name")


@dataclass(frozen=True)
class LimitSource:
    """Where a user's effective limit comes from.

    ``kind`` is the rule that decided: ``"off"`` (no default rate: nothing is
    limited), ``"exempt"``, ``"user"`` (its own limit), ``"tier"`` or
    ``"default"``. ``tier`` names the tier when the tier decided (``"tier"``, or
    ``"exempt"`` through an exempt tier), else it is ``None``.
    """

    kind: SourceKind
    tier: str | None = None


OFF = LimitSource("off")
DEFAULT = LimitSource("default")
USER = LimitSource("user")
USER_EXEMPT = LimitSource("exempt")


class LimitTable:
    """The explicit limit entries: user limits, tiers, memberships, exemptions.

    Every change is validated before anything changes, and returns the users
    whose resolution may have changed (the limiter rescales their state).

    ``overrides`` is the resolution compiled for the hot path: user -> tokens/s
    for every user whom rules 1-4 decide, 0 meaning unlimited; a user missing
    from it gets the default. It is one dict for the table's lifetime, so a
    reader may keep a reference to it.
    """

    def __init__(
        self,
        user_rates: Mapping[str, int] | None = None,
        tier_rates: Mapping[str, int] | None = None,
        memberships: Mapping[str, str] | None = None,
        exempt_users: Iterable[str] = (),
        exempt_tiers: Iterable[str] = (),
    ) -> None:
        user_rates = dict(user_rates or {})
        tier_rates = dict(tier_rates or {})
        memberships = dict(memberships or {})
        exempt_tiers = set(exempt_tiers)
        for user, rate in user_rates.items():
            validate_rate(rate, field=f"rate of user {user!r}")
        for tier, rate in tier_rates.items():
            validate_tier(tier)
            validate_rate(rate, field=f"rate of tier {tier!r}")
        for tier in exempt_tiers:
            validate_tier(tier)
        for user, tier in memberships.items():
            validate_tier(tier)
            if tier not in tier_rates and tier not in exempt_tiers:
                raise unknown_group("tier", tier, ("memberships", user))
        self._user_rates = user_rates
        self._tier_rates = tier_rates
        self._tier_of = memberships
        self._members: dict[str, set[str]] = {}
        for user, tier in memberships.items():
            self._members.setdefault(tier, set()).add(user)
        self._exempt_users = set(exempt_users)
        self._exempt_tiers = exempt_tiers
        self._overrides: dict[str, int] = {}
        for user in {*user_rates, *memberships, *self._exempt_users}:
            self._refresh(user)

    def copy(self) -> LimitTable:
        """An independent copy (edit it, then hand it to
        ``OutputRateLimiter.replace_limits`` to apply many changes at once)."""
        return LimitTable(
            self._user_rates,
            self._tier_rates,
            self._tier_of,
            self._exempt_users,
            self._exempt_tiers,
        )

    # -- reading -----------------------------------------------------------------

    @property
    def overrides(self) -> Mapping[str, int]:
        return self._overrides

    @property
    def user_rates(self) -> dict[str, int]:
        """A copy of the users' own limits."""
        return dict(self._user_rates)

    @property
    def tier_rates(self) -> dict[str, int]:
        """A copy of the tiers' rates (an exempt tier may have none)."""
        return dict(self._tier_rates)

    @property
    def memberships(self) -> dict[str, str]:
        """A copy of user -> tier."""
        return dict(self._tier_of)

    @property
    def exempt_users(self) -> frozenset[str]:
        return frozenset(self._exempt_users)

    @property
    def exempt_tiers(self) -> frozenset[str]:
        return frozenset(self._exempt_tiers)

    @property
    def tiers(self) -> frozenset[str]:
        """The tiers that exist: those with a rate or an exemption."""
        return frozenset(self._tier_rates.keys() | self._exempt_tiers)

    def tier_of(self, user: str) -> str | None:
        """The tier ``user`` is a member of, or ``None``."""
        return self._tier_of.get(user)

    def members(self, tier: str) -> frozenset[str]:
        """The members of ``tier`` (empty for a tier that does not exist)."""
        return frozenset(self._members.get(tier, ()))

    def source(self, user: str) -> LimitSource:
        """Which of the rules 1-5 (module docstring) decides ``user``'s limit;
        never ``"off"``, which is the limiter's to say."""
        if user in self._exempt_users:
            return USER_EXEMPT
        if user in self._user_rates:
            return USER
        tier = self._tier_of.get(user)
        if tier is None:
            return DEFAULT
        if tier in self._exempt_tiers:
            return LimitSource("exempt", tier)
        return LimitSource("tier", tier)

    # -- changing ----------------------------------------------------------------

    def set_user_rate(self, user: str, rate: int | None) -> Collection[str]:
        """Sets ``user``'s own limit; ``None`` removes it."""
        if rate is None:
            self._user_rates.pop(user, None)
        else:
            self._user_rates[user] = validate_rate(rate, field=f"rate of user {user!r}")
        return self._refresh(user)

    def set_user_exempt(self, user: str, exempt: bool) -> Collection[str]:
        """Marks ``user`` unlimited, or lifts the mark."""
        if exempt:
            self._exempt_users.add(user)
        else:
            self._exempt_users.discard(user)
        return self._refresh(user)

    def set_membership(self, user: str, tier: str | None) -> Collection[str]:
        """Makes ``user`` a member of ``tier`` (leaving its previous tier);
        ``None`` leaves any tier. Raises ValueError for a tier that does not
        exist."""
        if tier is not None:
            validate_tier(tier)
            if tier not in self._tier_rates and tier not in self._exempt_tiers:
                raise unknown_group("tier", tier, ("memberships", user))
        previous = self._tier_of.pop(user, None)
        if previous is not None:
            members = self._members[previous]
            members.discard(user)
            if not members:
                del self._members[previous]
        if tier is not None:
            self._tier_of[user] = tier
            self._members.setdefault(tier, set()).add(user)
        return self._refresh(user)

    def set_tier_rate(self, tier: str, rate: int | None) -> Collection[str]:
        """Sets ``tier``'s rate, creating the tier; ``None`` removes the rate,
        and with it the tier unless it is exempt. Raises ValueError when that
        would remove a tier that has members."""
        validate_tier(tier)
        if rate is None:
            if tier not in self._exempt_tiers:
                self._refuse_removal_with_members(tier)
            self._tier_rates.pop(tier, None)
        else:
            self._tier_rates[tier] = validate_rate(rate, field=f"rate of tier {tier!r}")
        return self._refresh_members(tier)

    def set_tier_exempt(self, tier: str, exempt: bool) -> Collection[str]:
        """Marks ``tier`` unlimited (creating it if needed), or lifts the mark,
        which removes a tier without a rate. Raises ValueError when that would
        remove a tier that has members."""
        validate_tier(tier)
        if exempt:
            self._exempt_tiers.add(tier)
        else:
            if tier not in self._tier_rates:
                self._refuse_removal_with_members(tier)
            self._exempt_tiers.discard(tier)
        return self._refresh_members(tier)

    # -- helpers -----------------------------------------------------------------

    def _refuse_removal_with_members(self, tier: str) -> None:
        count = len(self._members.get(tier, ()))
        if count:
            raise ValueError(
                f"tier {tier!r} has {count} member(s): move them to another tier "
                "before removing it"
            )

    def _refresh_members(self, tier: str) -> Collection[str]:
        """Recompiles the entries of the members whose limit ``tier`` decides
        and returns them (members who are exempt or have a limit of their own
        are not affected).

        O(members), but in set and dict operations that run in C: a tier of
        50,000 members is recompiled in a few milliseconds, under the lock the
        scheduler waits on.
        """
        members = self._members.get(tier)
        if not members:
            return ()
        decided = members.difference(self._exempt_users, self._user_rates)
        # The tier exists: a tier with members cannot stop existing.
        rate = 0 if tier in self._exempt_tiers else self._tier_rates[tier]
        self._overrides.update(dict.fromkeys(decided, rate))
        return decided

    def _refresh(self, user: str) -> tuple[str, ...]:
        """Recompiles ``user``'s entry in ``overrides``; returns ``(user,)``."""
        source = self.source(user)
        if source.kind == "exempt":
            self._overrides[user] = 0
        elif source.kind == "user":
            self._overrides[user] = self._user_rates[user]
        elif source.tier is not None:
            self._overrides[user] = self._tier_rates[source.tier]
        else:
            self._overrides.pop(user, None)
        return (user,)
