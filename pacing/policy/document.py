"""The policy document, one JSON/YAML tree, and its codec: ``parse`` (tree to
``Document``: every rule of the policy, checked once) and ``to_tree``.

The tree (YAML shown)::

    mode: enforce                  # enforce, shadow or off (false reads as off)
    fair_share: true
    default: {tokens_per_second: 100}   # or default_tokens_per_second: 100
    tiers:                         # tier id -> its limits
      free: {tokens_per_second: 20, weight: 2}
      staff: {exempt: true}
    teams:                         # team id -> its limits (the rate is shared)
      acme: {tokens_per_second: 600}
    users:                         # user id -> a rate, or its limits and groups
      user-a: 500
      user-b: {tokens_per_second: 50, exempt: true, weight: 2, tier: free, team: acme}
    bands: [interactive, standard, batch]   # priority bands, highest first
    objectives: {chat: interactive}  # the gateway's objective -> its band
    etag: "..."                    # export's; the file ignores it
    store_version: "7/9f2c..."     # written by engines that share a store

Each holder may set the attributes ``pacing.policy.model.ATTRIBUTES`` gives
it. The keys of earlier files say the same things and stay valid, each an
alias of one attribute: ``default_tokens_per_second`` (``default``),
``memberships`` (user -> tier), ``team_members`` (user -> team),
``exempt_users`` (a list), ``weights: {users, tiers, teams}``. One attribute
given in two places is an error naming both. ``to_tree`` writes those keys for
the attributes they hold, so that a file written here reads where they are
all that is known; an attribute without an alias is written in its holder's
object.

Rules, each failing as one ``PolicyError`` naming the path of the mistake:
ids follow ``pacing.identity.validate_user``; a rate is an integer in
1..``MAX_RATE`` (``pacing.limits.validate_rate``); a weight a number
in (0, ``MAX_WEIGHT``] (``pacing.fair_share.validate_weight``); a tier needs a
rate or an exemption, a team a rate; a member or a weight names a group that
exists; no unknown keys; at most ``MAX_TIERS`` groups of each kind and
``MAX_EXPLICIT_LIMITS`` users; bands are distinct names (at most
``MAX_BANDS``), every ``band`` and objective names one of them, and the
default names one once there are any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pacing.bands import MAX_BANDS, validate_band
from pacing.fair_share import validate_weight
from pacing.global_limits import LimitsVersion
from pacing.identity import validate_user
from pacing.limits import validate_rate
from pacing.modes import Mode
from pacing.policy.errors import (
    PathPart,
    PolicyError,
    render_path,
    shown,
    unknown_group,
)
from pacing.policy.model import (
    ATTRIBUTES,
    GROUP_KEYS,
    KINDS,
    RULES,
    GroupKind,
    Limits,
    Policy,
    User,
    validate_flag,
)
from pacing.table_caps import MAX_EXPLICIT_LIMITS, MAX_TIERS

MODE_KEY: Final = "mode"
FAIR_SHARE_KEY: Final = "fair_share"
DEFAULT_KEY: Final = "default"
DEFAULT_RATE_KEY: Final = "default_tokens_per_second"
USERS_KEY: Final = "users"
MEMBERSHIPS_KEY: Final = "memberships"
TEAM_MEMBERS_KEY: Final = "team_members"
EXEMPT_USERS_KEY: Final = "exempt_users"
WEIGHTS_KEY: Final = "weights"
BANDS_KEY: Final = "bands"
OBJECTIVES_KEY: Final = "objectives"
ETAG_KEY: Final = "etag"
STORE_VERSION_KEY: Final = "store_version"
RATE_KEY: Final = "tokens_per_second"
#: Alias keys of memberships: kind -> the top-level key.
MEMBER_KEYS: Final[Mapping[GroupKind, str]] = {
    "tier": MEMBERSHIPS_KEY,
    "team": TEAM_MEMBERS_KEY,
}
#: Keys of the ``weights`` alias: holder -> key.
WEIGHT_KEYS: Final[Mapping[str, str]] = {
    "user": "users",
    "tier": "tiers",
    "team": "teams",
}

TOP_KEYS: Final = (
    MODE_KEY,
    FAIR_SHARE_KEY,
    DEFAULT_KEY,
    DEFAULT_RATE_KEY,
    *GROUP_KEYS.values(),
    USERS_KEY,
    MEMBERSHIPS_KEY,
    EXEMPT_USERS_KEY,
    TEAM_MEMBERS_KEY,
    WEIGHTS_KEY,
    BANDS_KEY,
    OBJECTIVES_KEY,
    ETAG_KEY,
    STORE_VERSION_KEY,
)
#: Unknown fields named in one message.
_MAX_LISTED = 5


@dataclass(frozen=True)
class Document:
    """A checked document: the policy, and the export's etag and the store
    version an engine saved it at (each ``None`` when absent)."""

    policy: Policy
    etag: str | None = None
    store_version: LimitsVersion | None = None


def parse(tree: object, *, source: str | None = None) -> Document:
    """The document ``tree`` holds; ``PolicyError`` (said of ``source``) for
    the first rule it breaks."""
    try:
        return _Reader().read(tree)
    except PolicyError as error:
        raise error if source is None else error.at(source) from None


def to_tree(document: Document) -> dict[str, Any]:
    """``document`` as a tree ``parse`` reads back to it: ids sorted, the mode,
    the switch, the default, the teams, ``etag`` and ``store_version`` only when
    set."""
    policy = document.policy
    tree: dict[str, Any] = {}
    if policy.mode is not None:
        tree[MODE_KEY] = policy.mode.value
    if policy.fair_share is not None:
        tree[FAIR_SHARE_KEY] = policy.fair_share
    if policy.default_rate is not None:
        tree[DEFAULT_RATE_KEY] = policy.default_rate
    if beyond := _attributes(policy.default, aliased=(RATE_KEY,)):
        tree[DEFAULT_KEY] = beyond
    weights: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        groups = dict(sorted(policy.groups[kind].items()))
        if kind == "team" and not groups:
            continue
        tree[GROUP_KEYS[kind]] = {
            name: _attributes(limits, aliased=("weight",))
            for name, limits in groups.items()
        }
        weights[WEIGHT_KEYS[kind]] = _weights(groups)
    users = dict(sorted(policy.users.items()))
    tree[USERS_KEY] = {
        user: entry for user, entry in _user_entries(users).items() if entry != {}
    }
    tree[MEMBERSHIPS_KEY] = _members(users, "tier")
    tree[EXEMPT_USERS_KEY] = [user for user, e in users.items() if e.limits.exempt]
    if policy.groups["team"]:
        tree[TEAM_MEMBERS_KEY] = _members(users, "team")
    tree[WEIGHTS_KEY] = {
        WEIGHT_KEYS["user"]: _weights({u: e.limits for u, e in users.items()}),
        WEIGHT_KEYS["tier"]: weights[WEIGHT_KEYS["tier"]],
    }
    if team_weights := weights.get(WEIGHT_KEYS["team"]):
        tree[WEIGHTS_KEY][WEIGHT_KEYS["team"]] = team_weights
    if policy.bands:
        tree[BANDS_KEY] = list(policy.bands)
    if policy.objectives:
        tree[OBJECTIVES_KEY] = dict(sorted(policy.objectives.items()))
    if document.etag is not None:
        tree[ETAG_KEY] = document.etag
    if document.store_version is not None:
        tree[STORE_VERSION_KEY] = str(document.store_version)
    return tree


def _attributes(limits: Limits, *, aliased: tuple[str, ...]) -> dict[str, Any]:
    return {
        name: getattr(limits, name)
        for name in limits.set_attributes()
        if name not in aliased
    }


def _user_entries(users: Mapping[str, User]) -> dict[str, Any]:
    """A user's own attributes without an alias: its rate as a number, or an
    object where another attribute is set."""
    entries: dict[str, Any] = {}
    for user, entry in users.items():
        own = _attributes(entry.limits, aliased=("exempt", "weight"))
        entries[user] = own[RATE_KEY] if set(own) == {RATE_KEY} else own
    return entries


def _members(users: Mapping[str, User], kind: GroupKind) -> dict[str, str]:
    return {
        user: group
        for user, entry in users.items()
        if (group := entry.group(kind)) is not None
    }


def _weights(holders: Mapping[str, Limits]) -> dict[str, float]:
    return {
        name: limits.weight
        for name, limits in holders.items()
        if limits.weight is not None
    }


# -- the rules --------------------------------------------------------------


def known_band(band: str, bands: Sequence[str], path: Sequence[PathPart] | str) -> str:
    """``band`` if it is one of ``bands``, else ``PolicyError`` at ``path``."""
    if band not in bands:
        listed = ", ".join(bands) if bands else "none are set"
        raise PolicyError(f"unknown band {shown(band)} (bands: {listed})", path)
    return band


def check_id(value: object, kind: str, path: Sequence[PathPart]) -> str:
    """``value`` if it is a valid id of a ``kind`` (user, tier, team)."""
    try:
        return validate_user(value, field=f"{kind} id")
    except ValueError as error:
        raise PolicyError(str(error), path) from None


def check_mode(value: object, path: Sequence[PathPart]) -> Mode:
    """A pacing mode by name (``false``: off, as YAML 1.1 reads ``off``)."""
    if value is False:
        return Mode.OFF
    for mode in Mode:
        if value == mode.value:
            return mode
    choices = ", ".join(mode.value for mode in Mode)
    raise PolicyError(f"must be one of {choices}, got {shown(value)}", path)


def check_keys(
    tree: Mapping[Any, Any], keys: Sequence[str], path: Sequence[PathPart]
) -> None:
    unknown = sorted(str(key) for key in tree if key not in keys)
    if unknown:
        listed = ", ".join(map(shown, unknown[:_MAX_LISTED]))
        if len(unknown) > _MAX_LISTED:
            listed += f" and {len(unknown) - _MAX_LISTED} more"
        raise PolicyError(
            f"unknown field(s) {listed}; expected {', '.join(map(repr, keys))}", path
        )


def check_object(
    value: object, what: str, path: Sequence[PathPart]
) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        described = f"must be an object {what}" if what else "must be an object"
        raise PolicyError(f"{described}, got {type(value).__name__}", path)
    return value


def check_list(value: object, what: str, path: Sequence[PathPart]) -> list[Any]:
    if not isinstance(value, list):
        raise PolicyError(f"must be a list of {what}, got {type(value).__name__}", path)
    return value


def check_count(count: int, most: int, what: str, path: Sequence[PathPart]) -> None:
    if count > most:
        raise PolicyError(f"a policy holds at most {most} {what}, got {count}", path)


class _Reader:
    """One pass over a tree: each attribute of each holder is taken from the
    one place it is given (``_set`` refuses a second)."""

    def __init__(self) -> None:
        self._given: dict[tuple[str, str, str], tuple[PathPart, ...]] = {}
        self._holders: dict[tuple[str, str], dict[str, Any]] = {}

    def read(self, tree: object) -> Document:
        doc = check_object(tree, "(a policy document)", ())
        check_keys(doc, TOP_KEYS, ())
        mode = fair_share = None
        if doc.get(MODE_KEY) is not None:
            mode = check_mode(doc[MODE_KEY], (MODE_KEY,))
        if doc.get(FAIR_SHARE_KEY) is not None:
            fair_share = validate_flag(doc[FAIR_SHARE_KEY], field=(FAIR_SHARE_KEY,))
        self._read_default(doc)
        groups = {kind: self._read_groups(doc, kind) for kind in KINDS}
        self._read_users(doc)
        self._read_aliases(doc, groups)
        for kind in KINDS:
            for name in groups[kind]:
                self._check_group(kind, name)
        users = self._users()
        check_count(len(users), MAX_EXPLICIT_LIMITS, "users", ())
        bands = self._read_bands(doc)
        objectives = self._read_objectives(doc, bands)
        self._check_bands(bands)
        policy = Policy(
            mode=mode,
            fair_share=fair_share,
            default=Limits(**self._holders.get(("default", ""), {})).check(
                (DEFAULT_KEY,)
            ),
            groups={
                kind: {
                    name: Limits(**self._attributes_of(kind, name)).check(
                        (GROUP_KEYS[kind], name)
                    )
                    for name in groups[kind]
                }
                for kind in KINDS
            },
            users=users,
            bands=bands,
            objectives=objectives,
        )
        return Document(policy, self._etag(doc), self._store_version(doc))

    # -- bands ------------------------------------------------------------

    @staticmethod
    def _read_bands(doc: Mapping[Any, Any]) -> tuple[str, ...]:
        listed = check_list(doc.get(BANDS_KEY) or [], "band names", (BANDS_KEY,))
        check_count(len(listed), MAX_BANDS, "bands", (BANDS_KEY,))
        bands: list[str] = []
        for index, name in enumerate(listed):
            path = (BANDS_KEY, index)
            name = validate_band(name, field=path)
            if name in bands:
                raise PolicyError(f"{shown(name)} appears more than once", path)
            bands.append(name)
        return tuple(bands)

    @staticmethod
    def _read_objectives(
        doc: Mapping[Any, Any], bands: tuple[str, ...]
    ) -> dict[str, str]:
        tree = check_object(
            doc.get(OBJECTIVES_KEY) or {},
            "mapping objective names to bands",
            (OBJECTIVES_KEY,),
        )
        check_count(len(tree), MAX_TIERS, OBJECTIVES_KEY, (OBJECTIVES_KEY,))
        objectives: dict[str, str] = {}
        for name, band in tree.items():
            path = (OBJECTIVES_KEY, str(name))
            name = check_id(name, "objective", path)
            objectives[name] = known_band(validate_band(band, field=path), bands, path)
        return objectives

    def _check_bands(self, bands: tuple[str, ...]) -> None:
        """Every holder's band is one of ``bands``; the default names one
        once there are any."""
        for (holder, name, attribute), path in self._given.items():
            if attribute == "band":
                known_band(self._holders[(holder, name)]["band"], bands, path)
        if bands and "band" not in self._attributes_of("default", ""):
            raise PolicyError(
                "needs band (one of bands: the band of users no holder puts in one)",
                (DEFAULT_KEY,),
            )

    # -- holders ----------------------------------------------------------

    def _set(
        self,
        holder: str,
        name: str,
        attribute: str,
        value: Any,
        path: tuple[PathPart, ...],
    ) -> None:
        key = (holder, name, attribute)
        if (earlier := self._given.get(key)) is not None:
            raise PolicyError(f"also given at {render_path(earlier)}", path)
        self._given[key] = path
        self._holders.setdefault((holder, name), {})[attribute] = value

    def _attributes_of(self, holder: str, name: str) -> dict[str, Any]:
        return self._holders.get((holder, name), {})

    def _read_limits(
        self,
        spec: Mapping[Any, Any],
        holder: str,
        name: str,
        path: tuple[PathPart, ...],
    ) -> None:
        """The ``Limits`` attributes of ``spec`` that ``holder`` may set."""
        for attribute in ATTRIBUTES[holder]:
            if attribute in spec:
                where = (*path, attribute)
                value = RULES[attribute](spec[attribute], field=where)
                self._set(holder, name, attribute, value, where)

    def _read_default(self, doc: Mapping[Any, Any]) -> None:
        if doc.get(DEFAULT_KEY) is not None:
            spec = check_object(doc[DEFAULT_KEY], f"with {RATE_KEY!r}", (DEFAULT_KEY,))
            check_keys(spec, ATTRIBUTES["default"], (DEFAULT_KEY,))
            self._read_limits(spec, "default", "", (DEFAULT_KEY,))
        if doc.get(DEFAULT_RATE_KEY) is not None:
            path = (DEFAULT_RATE_KEY,)
            self._set(
                "default",
                "",
                RATE_KEY,
                validate_rate(doc[DEFAULT_RATE_KEY], field=path),
                path,
            )

    def _read_groups(self, doc: Mapping[Any, Any], kind: GroupKind) -> list[str]:
        key = GROUP_KEYS[kind]
        tree = check_object(
            doc.get(key) or {}, f"mapping {kind} ids to their limits", (key,)
        )
        check_count(len(tree), MAX_TIERS, key, (key,))
        names = []
        for name, spec in tree.items():
            path = (key, str(name))
            name = check_id(name, kind, path)
            attributes = ATTRIBUTES[kind]
            spec = check_object(
                spec, "with any of " + ", ".join(map(repr, attributes)), path
            )
            check_keys(spec, attributes, path)
            self._read_limits(spec, kind, name, path)
            names.append(name)
        return names

    def _check_group(self, kind: GroupKind, name: str) -> None:
        given = self._attributes_of(kind, name)
        path = (GROUP_KEYS[kind], name)
        if kind == "tier" and RATE_KEY not in given and not given.get("exempt"):
            raise PolicyError(f"needs {RATE_KEY} or exempt: true", path)
        if kind == "team" and RATE_KEY not in given:
            raise PolicyError(f"needs {RATE_KEY}", path)

    def _read_users(self, doc: Mapping[Any, Any]) -> None:
        users = check_object(
            doc.get(USERS_KEY) or {},
            "mapping user ids to a rate or their limits",
            (USERS_KEY,),
        )
        check_count(len(users), MAX_EXPLICIT_LIMITS, "users", (USERS_KEY,))
        keys = (*ATTRIBUTES["user"], *KINDS)
        for user, spec in users.items():
            path = (USERS_KEY, str(user))
            user = check_id(user, "user", path)
            if not isinstance(spec, Mapping):
                self._set("user", user, RATE_KEY, validate_rate(spec, field=path), path)
                continue
            check_keys(spec, keys, path)
            if not any(key in spec for key in keys):
                raise PolicyError(
                    "an entry must set at least one of " + ", ".join(keys), path
                )
            self._read_limits(spec, "user", user, path)
            for kind in KINDS:
                if kind in spec:
                    where = (*path, kind)
                    self._set(
                        "user", user, kind, check_id(spec[kind], kind, where), where
                    )

    def _read_aliases(
        self, doc: Mapping[Any, Any], groups: Mapping[GroupKind, list[str]]
    ) -> None:
        for kind, key in MEMBER_KEYS.items():
            self._read_members(doc, kind, key)
        self._read_exempt_users(doc)
        self._read_weights(doc, groups)
        for (holder, name, attribute), path in self._given.items():
            for kind in KINDS:
                if holder == "user" and attribute == kind:
                    group = self._holders[(holder, name)][kind]
                    if group not in groups[kind]:
                        raise unknown_group(kind, group, path)

    def _read_members(self, doc: Mapping[Any, Any], kind: GroupKind, key: str) -> None:
        members = check_object(
            doc.get(key) or {}, f"mapping user ids to {kind} ids", (key,)
        )
        check_count(len(members), MAX_EXPLICIT_LIMITS, "users", (key,))
        for user, group in members.items():
            path = (key, str(user))
            user = check_id(user, "user", path)
            self._set("user", user, kind, check_id(group, kind, path), path)

    def _read_exempt_users(self, doc: Mapping[Any, Any]) -> None:
        exempt = check_list(
            doc.get(EXEMPT_USERS_KEY) or [], "user ids", (EXEMPT_USERS_KEY,)
        )
        check_count(len(exempt), MAX_EXPLICIT_LIMITS, "users", (EXEMPT_USERS_KEY,))
        listed: set[str] = set()
        for index, user in enumerate(exempt):
            path = (EXEMPT_USERS_KEY, index)
            user = check_id(user, "user", path)
            if user in listed:
                raise PolicyError(f"{shown(user)} appears more than once", path)
            listed.add(user)
            self._set("user", user, "exempt", True, path)

    def _read_weights(
        self, doc: Mapping[Any, Any], groups: Mapping[GroupKind, list[str]]
    ) -> None:
        weights = check_object(
            doc.get(WEIGHTS_KEY) or {},
            "with " + ", ".join(map(repr, WEIGHT_KEYS.values())),
            (WEIGHTS_KEY,),
        )
        check_keys(weights, tuple(WEIGHT_KEYS.values()), (WEIGHTS_KEY,))
        holders: tuple[tuple[str, GroupKind | None], ...] = (
            ("user", None),
            *((kind, kind) for kind in KINDS),
        )
        for holder, kind in holders:
            key = WEIGHT_KEYS[holder]
            where = (WEIGHTS_KEY, key)
            part = check_object(
                weights.get(key) or {}, f"mapping {holder} ids to weights", where
            )
            for name, weight in part.items():
                path = (*where, str(name))
                name = check_id(name, holder, path)
                if kind is not None and name not in groups[kind]:
                    raise unknown_group(kind, name, path)
                self._set(
                    holder, name, "weight", validate_weight(weight, field=path), path
                )

    def _users(self) -> dict[str, User]:
        users: dict[str, User] = {}
        for (holder, name), given in self._holders.items():
            if holder != "user":
                continue
            limits = {key: value for key, value in given.items() if key not in KINDS}
            memberships = {kind: given[kind] for kind in KINDS if kind in given}
            users[name] = User(Limits(**limits).check((USERS_KEY, name)), memberships)
        return users

    # -- metadata ---------------------------------------------------------

    @staticmethod
    def _etag(doc: Mapping[Any, Any]) -> str | None:
        etag = doc.get(ETAG_KEY)
        if etag is not None and not isinstance(etag, str):
            raise PolicyError(f"must be a string, got {shown(etag)}", (ETAG_KEY,))
        return etag

    @staticmethod
    def _store_version(doc: Mapping[Any, Any]) -> LimitsVersion | None:
        value = doc.get(STORE_VERSION_KEY)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                return LimitsVersion.parse(value)
            except ValueError:
                pass
        raise PolicyError(
            "must be a version as the engine writes it (counter/stamp), "
            f"got {shown(value)}",
            (STORE_VERSION_KEY,),
        )
