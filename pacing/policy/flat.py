"""The policy's flat form: its pieces under their own names, as the flags give
them, as earlier ``additional_config`` entries held them and as the store's
table document holds them (``default_rate``, ``user_rates``, ``tier_rates``,
``memberships``, ``exempt_users``, ``exempt_tiers``, ``team_rates``,
``team_members``, ``user_weights``, ``tier_weights``, ``team_weights``,
``mode``, ``fair_share``, ``bands``, ``objectives``: the last two the
document's own keys, as the store's table holds them).

``tree_of`` turns the pieces into the policy document, so that the one
validator (``pacing.policy.document``) checks them; ``piece_of`` says which
piece an error of that document is about, for messages that name where the
operator wrote it.

The pieces carry the attributes of ``CARRIED``; any other attribute of a
holder travels beside them in the document's own object form
(``attributes_of``, merged back by ``with_attributes``), so that a new
attribute needs no piece of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pacing.policy.document import (
    BANDS_KEY,
    DEFAULT_KEY,
    DEFAULT_RATE_KEY,
    EXEMPT_USERS_KEY,
    FAIR_SHARE_KEY,
    MEMBERSHIPS_KEY,
    MODE_KEY,
    OBJECTIVES_KEY,
    RATE_KEY,
    TEAM_MEMBERS_KEY,
    USERS_KEY,
    WEIGHT_KEYS,
    WEIGHTS_KEY,
    check_id,
    check_list,
    check_object,
)
from pacing.policy.errors import PolicyError, shown
from pacing.policy.model import GROUP_KEYS, KINDS, Limits, Policy

#: The key of the attributes beside the pieces (``attributes_of``).
ATTRIBUTES_KEY: Final = "attributes"
#: The ``Limits`` attributes the pieces carry.
CARRIED: Final = ("tokens_per_second", "exempt", "weight")
#: The pieces, in the order of their document keys.
PIECES: Final = (
    "default_rate",
    "mode",
    "fair_share",
    "tier_rates",
    "exempt_tiers",
    "team_rates",
    "user_rates",
    "memberships",
    "exempt_users",
    "team_members",
    "user_weights",
    "tier_weights",
    "team_weights",
    BANDS_KEY,
    OBJECTIVES_KEY,
)
#: The document's top-level key -> the piece that fills it (tiers: two).
_PIECE_OF_KEY: Final = {
    DEFAULT_RATE_KEY: "default_rate",
    MODE_KEY: "mode",
    FAIR_SHARE_KEY: "fair_share",
    GROUP_KEYS["team"]: "team_rates",
    USERS_KEY: "user_rates",
    MEMBERSHIPS_KEY: "memberships",
    EXEMPT_USERS_KEY: "exempt_users",
    TEAM_MEMBERS_KEY: "team_members",
}


def tree_of(pieces: Mapping[str, Any]) -> dict[str, Any]:
    """The policy document the pieces say; a piece that is ``None`` or empty
    says nothing. ``PolicyError`` (at the piece's name) for a piece of the
    wrong shape."""
    tree: dict[str, Any] = {}
    if pieces.get("default_rate") is not None:
        tree[DEFAULT_RATE_KEY] = pieces["default_rate"]
    if pieces.get("mode") is not None:
        tree[MODE_KEY] = getattr(pieces["mode"], "value", pieces["mode"])
    if pieces.get("fair_share") not in (None, False):
        tree[FAIR_SHARE_KEY] = pieces["fair_share"]
    tiers: dict[str, dict[str, Any]] = {
        tier: {RATE_KEY: rate} for tier, rate in _object(pieces, "tier_rates").items()
    }
    for index, tier in enumerate(_list(pieces, "exempt_tiers")):
        tier = check_id(tier, "tier", ("exempt_tiers", index))
        tiers.setdefault(tier, {})["exempt"] = True
    teams = {
        team: {RATE_KEY: rate} for team, rate in _object(pieces, "team_rates").items()
    }
    for key, value in (
        (GROUP_KEYS["tier"], tiers),
        (GROUP_KEYS["team"], teams),
        (USERS_KEY, _object(pieces, "user_rates")),
        (MEMBERSHIPS_KEY, _object(pieces, "memberships")),
        (TEAM_MEMBERS_KEY, _object(pieces, "team_members")),
        (EXEMPT_USERS_KEY, _list(pieces, "exempt_users")),
    ):
        if value:
            tree[key] = value
    weights = {
        WEIGHT_KEYS[holder]: part
        for holder in WEIGHT_KEYS
        if (part := _object(pieces, f"{holder}_weights"))
    }
    if weights:
        tree[WEIGHTS_KEY] = weights
    for key in (BANDS_KEY, OBJECTIVES_KEY):  # the document's keys, as they are
        given: Any = pieces.get(key)
        if given:
            tree[key] = list(given) if isinstance(given, tuple) else given
    return tree


def piece_of(error: PolicyError, pieces: Mapping[str, Any]) -> str:
    """The piece of ``pieces`` that ``error`` (of ``tree_of(pieces)``) is about."""
    parts = error.parts
    if isinstance(parts, str) or not parts:
        return parts if isinstance(parts, str) and parts in PIECES else ""
    top = parts[0]
    if top in PIECES:
        return str(top)
    if top == GROUP_KEYS["tier"]:
        in_rates = len(parts) > 1 and parts[1] in (pieces.get("tier_rates") or {})
        return "tier_rates" if in_rates or len(parts) == 1 else "exempt_tiers"
    if top == WEIGHTS_KEY:
        holder = next((h for h, k in WEIGHT_KEYS.items() if parts[1:2] == (k,)), "user")
        return f"{holder}_weights"
    return _PIECE_OF_KEY.get(str(top), "")


def _object(pieces: Mapping[str, Any], name: str) -> dict[Any, Any]:
    value = pieces.get(name)
    return {} if value is None else dict(check_object(value, "", (name,)))


def _list(pieces: Mapping[str, Any], name: str) -> list[Any]:
    value = pieces.get(name)
    if value is None:
        return []
    if isinstance(value, set | frozenset | tuple):
        value = sorted(value) if all(isinstance(v, str) for v in value) else list(value)
    return check_list(value, "ids", (name,))


def attributes_of(policy: Policy, carried: tuple[str, ...] = CARRIED) -> dict[str, Any]:
    """The attributes ``policy``'s holders set that the pieces do not carry
    (all but ``carried``), in the document's object form: ``default``,
    ``users``, ``tiers``, ``teams``, each holder with none left out; empty
    when there are none."""
    tree: dict[str, Any] = {}
    default = _beyond(policy.default, carried)
    if default:
        tree[DEFAULT_KEY] = default
    holders: list[tuple[str, Mapping[str, Limits]]] = [
        (USERS_KEY, {user: entry.limits for user, entry in policy.users.items()}),
        *((GROUP_KEYS[kind], policy.groups[kind]) for kind in KINDS),
    ]
    for key, limits_of in holders:
        part = {
            name: own
            for name, limits in limits_of.items()
            if (own := _beyond(limits, carried))
        }
        if part:
            tree[key] = part
    return tree


def with_attributes(tree: Mapping[str, Any], attributes: Any) -> dict[str, Any]:
    """``tree`` (of ``tree_of``) with ``attributes`` (of ``attributes_of``)
    merged into its holders' objects; ``PolicyError`` at ``attributes`` for
    one of the wrong shape."""
    merged = dict(tree)
    given = check_object(attributes, "of holders' attributes", (ATTRIBUTES_KEY,))
    for key, part in given.items():
        where = (ATTRIBUTES_KEY, str(key))
        if key == DEFAULT_KEY:
            merged[DEFAULT_KEY] = dict(check_object(part, "", where))
            continue
        if key not in (USERS_KEY, *GROUP_KEYS.values()):
            raise PolicyError(f"unknown holders {shown(key)}", where)
        holders = dict(merged.get(key) or {})
        for name, own in check_object(part, "", where).items():
            own = check_object(own, "", (*where, str(name)))
            below = holders.get(name, {})
            if not isinstance(below, Mapping):  # a user's number shorthand
                below = {RATE_KEY: below}
            holders[name] = {**below, **own}
        merged[key] = holders
    return merged


def _beyond(limits: Limits, carried: tuple[str, ...]) -> dict[str, Any]:
    return {
        name: getattr(limits, name)
        for name in limits.set_attributes()
        if name not in carried
    }
