"""The limits table as a document: validation of user ids, tier ids and rates,
and the JSON/YAML format shared by the config file and the CLI's import/export.

Format (YAML shown; JSON is the same tree)::

    mode: enforce                  # enforce, shadow or off
    fair_share: true               # weighted fair share on (or false)
    default_tokens_per_second: 100
    tiers:                         # tier id -> rate and/or exemption
      free: {tokens_per_second: 20}
      pro: {tokens_per_second: 200}
      staff: {exempt: true}
    users:                         # user id -> its own limit (wins over its tier)
      user-a: 500
    memberships:                   # user id -> tier id
      user-b: free
      user-c: pro
    exempt_users: [ops-bot]        # unlimited, whatever their limit or tier
    teams:                         # team id -> rate shared by its members
      acme: {tokens_per_second: 600}
    team_members:                  # user id -> team id
      user-a: acme
    weights:                       # fair-share weights, as --output-rate-weights
      users: {user-d: 2}           # a user's own weight (no limit needed)
      tiers: {pro: 4}              # each member's without a weight of its own
      teams: {acme: 2}             # the team's among teams
    etag: "..."
    store_version: "7/9f2c..."     # written by engines that share a store

- ``mode``: optional; the pacing mode (``pacing.modes``). ``false`` counts as
  ``off``: YAML 1.1 reads an unquoted ``mode: off`` so.
- ``fair_share``: optional; ``true`` or ``false``, whether weighted fair share
  orders admissions (``pacing.fair_share``).
- ``default_tokens_per_second``: optional; an integer in 1..1000000.
- ``tiers``: optional; each tier has ``tokens_per_second`` (an integer in
  1..1000000), ``exempt: true``, or both (the rate applies again once the
  exemption is lifted). At most ``MAX_TIERS``.
- ``users``: optional; user id -> integer tokens/s. User ids and tier ids follow
  the one rule of ``pacing.identity.validate_user`` (1..256 UTF-8 bytes of
  well-formed Unicode without control, format or separator characters).
- ``memberships``: optional; user id -> the id of a tier in ``tiers``.
- ``exempt_users``: optional; a list of user ids, each at most once.
- ``teams``: optional; each team has ``tokens_per_second`` (an integer in
  1..1000000), the output rate all its members share (``pacing.teams``). Team
  ids follow the user-id rule. At most ``MAX_TIERS``.
- ``team_members``: optional; user id -> the id of a team in ``teams`` (a user
  is a member of at most one team).
- ``weights``: optional; ``users`` (user id -> weight), ``tiers`` (the id of
  a tier in ``tiers`` -> weight) and ``teams`` (the id of a team in ``teams``
  -> weight), each weight a number in (0, 1000000]. A user with a weight and
  nothing else has an entry (its weight) and no limit of its own.
- ``etag``: optional; written by ``output-rate-ctl export`` so that ``import``
  fails when the table changed in between. The config file ignores it.
- ``store_version``: optional; with ``--output-rate-store``, the engine writes
  the store version (``pacing.global_limits.LimitsVersion``) of the table it
  saved, which decides whether this file or the store's table is newer
  (``store.limits_sync``). Written by the engine, not by hand; ``import``
  ignores it.

Which limit applies to a user is ``pacing.limits``' rule: own exemption, own
limit, exempt tier, tier rate, default. At most ``MAX_EXPLICIT_LIMITS`` users
may appear in ``users``, ``memberships``, ``exempt_users``, ``team_members``
and the users' weights together.

Anything else (unknown keys, fractional or boolean rates, duplicate keys, a
membership of a tier not in ``tiers`` or of a team not in ``teams``) is an
error naming the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from control.errors import InvalidArgument
from pacing.fair_share import validate_weight
from pacing.fair_share_policy import SharePolicy
from pacing.global_limits import LimitsVersion
from pacing.identity import validate_user
from pacing.limiter import LimitTable, validate_rate
from pacing.modes import Mode, parse_mode
from pacing.table_caps import MAX_EXPLICIT_LIMITS as MAX_EXPLICIT_LIMITS
from pacing.table_caps import MAX_TIERS as MAX_TIERS
from pacing.table_caps import validate_tier_count, validate_user_count
from pacing.teams import TeamTable

MODE_KEY = "mode"
FAIR_SHARE_KEY = "fair_share"
DEFAULT_KEY = "default_tokens_per_second"
TIERS_KEY = "tiers"
USERS_KEY = "users"
MEMBERSHIPS_KEY = "memberships"
EXEMPT_USERS_KEY = "exempt_users"
TEAMS_KEY = "teams"
TEAM_MEMBERS_KEY = "team_members"
ETAG_KEY = "etag"
STORE_VERSION_KEY = "store_version"
WEIGHTS_KEY = "weights"
#: Keys of the weights object.
WEIGHT_USERS_KEY = "users"
WEIGHT_TIERS_KEY = "tiers"
WEIGHT_TEAMS_KEY = "teams"
#: Keys of one tier's object.
RATE_KEY = "tokens_per_second"
EXEMPT_KEY = "exempt"

Format = Literal["json", "yaml"]


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


def check_user(value: object, *, field: str) -> str:
    """Returns ``value`` if it is a valid user id, else raises InvalidArgument."""
    try:
        return validate_user(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def shown(value: object, limit: int = 64) -> str:
    """``value`` for an error message: quoted, escaped (``repr`` escapes every
    unprintable character, surrogates included, so the result always encodes),
    cut after ``limit`` characters (messages must not echo unbounded input)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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


def check_mode(value: object, *, field: str) -> Mode:
    """``value`` as a ``Mode``, else InvalidArgument naming ``field``."""
    try:
        return parse_mode(value, field=field)
    except ValueError:
        choices = ", ".join(mode.value for mode in Mode)
        raise InvalidArgument(
            f"{field} must be one of {choices}, got {shown(value)}"
        ) from None


def check_weight(value: object, *, field: str) -> float | None:
    """A fair-share weight as a request gives it: ``None`` for 0 (none), else
    a valid weight; InvalidArgument naming ``field``."""
    if value == 0 and not isinstance(value, bool):
        return None
    try:
        return validate_weight(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_table_size(count: int) -> None:
    """Raises InvalidArgument when a table would name more than
    ``MAX_EXPLICIT_LIMITS`` users."""
    try:
        validate_user_count(count)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_tier_count(count: int) -> None:
    """Raises InvalidArgument when a table would hold more than ``MAX_TIERS``."""
    try:
        validate_tier_count(count)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def parse_document(doc: object, *, source: str) -> TableDocument:
    """Validates a decoded document (see the module docstring); errors name
    ``source`` and the field."""
    if not isinstance(doc, Mapping):
        raise InvalidArgument(
            f"{source}: must be an object with {DEFAULT_KEY!r} and {USERS_KEY!r}, "
            f"got {type(doc).__name__}"
        )
    _check_keys(doc, _KEYS, f"{source}:")
    fair_share = doc.get(FAIR_SHARE_KEY)
    if fair_share is not None and not isinstance(fair_share, bool):
        raise InvalidArgument(
            f"{source}: {FAIR_SHARE_KEY} must be true or false, got {shown(fair_share)}"
        )
    mode = doc.get(MODE_KEY)
    if mode is False:  # YAML 1.1 reads an unquoted `mode: off` as false
        mode = Mode.OFF
    elif mode is not None:
        mode = check_mode(mode, field=f"{source}: {MODE_KEY}")
    default = doc.get(DEFAULT_KEY)
    if default is not None:
        default = check_rate(default, field=f"{source}: {DEFAULT_KEY}")
    tier_rates, exempt_tiers = _parse_tiers(doc.get(TIERS_KEY) or {}, source)
    tiers = tier_rates.keys() | exempt_tiers
    users = _mapping(doc, USERS_KEY, "user ids to tokens per second", source)
    rates = {
        check_user(user, field=f"{source}: user id {shown(user)}"): check_rate(
            rate, field=f"{source}: {USERS_KEY}[{shown(user)}]"
        )
        for user, rate in users.items()
    }
    members = _mapping(doc, MEMBERSHIPS_KEY, "user ids to tiers", source)
    memberships: dict[str, str] = {}
    for user, tier in members.items():
        where = f"{source}: {MEMBERSHIPS_KEY}[{shown(user)}]"
        user = check_user(user, field=f"{source}: user id {shown(user)}")
        memberships[user] = check_tier(tier, field=where)
        if tier not in tiers:
            raise InvalidArgument(f"{where}: tier {shown(tier)} is not in {TIERS_KEY}")
    exempt_users = _parse_exempt_users(doc.get(EXEMPT_USERS_KEY) or [], source)
    team_rates = _parse_teams(doc.get(TEAMS_KEY) or {}, source)
    team_members: dict[str, str] = {}
    teams = _mapping(doc, TEAM_MEMBERS_KEY, "user ids to teams", source)
    for user, team in teams.items():
        where = f"{source}: {TEAM_MEMBERS_KEY}[{shown(user)}]"
        user = check_user(user, field=f"{source}: user id {shown(user)}")
        team_members[user] = check_team(team, field=where)
        if team not in team_rates:
            raise InvalidArgument(f"{where}: team {shown(team)} is not in {TEAMS_KEY}")
    user_weights, tier_weights, team_weights = _parse_weights(
        doc.get(WEIGHTS_KEY) or {}, tiers, team_rates.keys(), source
    )
    check_table_size(
        len(
            rates.keys()
            | memberships.keys()
            | exempt_users
            | user_weights.keys()
            | team_members.keys()
        )
    )
    etag = doc.get(ETAG_KEY)
    if etag is not None and not isinstance(etag, str):
        raise InvalidArgument(f"{source}: {ETAG_KEY} must be a string")
    store_version = _parse_store_version(doc.get(STORE_VERSION_KEY), source)
    return TableDocument(
        default_rate=default,
        user_rates=rates,
        etag=etag,
        tier_rates=tier_rates,
        exempt_tiers=exempt_tiers,
        memberships=memberships,
        exempt_users=exempt_users,
        mode=mode,
        user_weights=user_weights,
        tier_weights=tier_weights,
        fair_share=fair_share,
        team_rates=team_rates,
        team_members=team_members,
        team_weights=team_weights,
        store_version=store_version,
    )


def _parse_store_version(value: object, source: str) -> LimitsVersion | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return LimitsVersion.parse(value)
        except ValueError:
            pass
    raise InvalidArgument(
        f"{source}: {STORE_VERSION_KEY} must be a version as the engine writes "
        f"it (counter/stamp), got {shown(value)}"
    )


def _check_keys(tree: Mapping[Any, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(key) for key in tree if key not in keys)
    if unknown:
        listed = ", ".join(map(shown, unknown[:_MAX_LISTED]))
        if len(unknown) > _MAX_LISTED:
            listed += f" and {len(unknown) - _MAX_LISTED} more"
        raise InvalidArgument(
            f"{where} unknown field(s) {listed}; expected {', '.join(map(repr, keys))}"
        )


def _mapping(
    doc: Mapping[Any, Any], key: str, what: str, source: str
) -> Mapping[Any, Any]:
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(
            f"{source}: {key} must be an object mapping {what}, "
            f"got {type(value).__name__}"
        )
    return value


def _parse_tiers(tree: object, source: str) -> tuple[dict[str, int], frozenset[str]]:
    """(tier rates, exempt tiers) of the ``tiers`` object."""
    if not isinstance(tree, Mapping):
        raise InvalidArgument(
            f"{source}: {TIERS_KEY} must be an object mapping tier ids to "
            f"{{{RATE_KEY}, {EXEMPT_KEY}}}, got {type(tree).__name__}"
        )
    check_tier_count(len(tree))
    rates: dict[str, int] = {}
    exempt: set[str] = set()
    for tier, spec in tree.items():
        where = f"{source}: {TIERS_KEY}[{shown(tier)}]"
        tier = check_tier(tier, field=f"{source}: tier id {shown(tier)}")
        if not isinstance(spec, Mapping):
            raise InvalidArgument(
                f"{where} must be an object with {RATE_KEY!r} and/or {EXEMPT_KEY!r}, "
                f"got {type(spec).__name__}"
            )
        _check_keys(spec, (RATE_KEY, EXEMPT_KEY), where)
        is_exempt = spec.get(EXEMPT_KEY, False)
        if not isinstance(is_exempt, bool):
            raise InvalidArgument(
                f"{where}.{EXEMPT_KEY} must be true or false, got {shown(is_exempt)}"
            )
        if RATE_KEY in spec:
            rates[tier] = check_rate(spec[RATE_KEY], field=f"{where}.{RATE_KEY}")
        elif not is_exempt:
            raise InvalidArgument(f"{where} needs {RATE_KEY} or {EXEMPT_KEY}: true")
        if is_exempt:
            exempt.add(tier)
    return rates, frozenset(exempt)


def _parse_teams(tree: object, source: str) -> dict[str, int]:
    """Team -> rate of the ``teams`` object."""
    if not isinstance(tree, Mapping):
        raise InvalidArgument(
            f"{source}: {TEAMS_KEY} must be an object mapping team ids to "
            f"{{{RATE_KEY}}}, got {type(tree).__name__}"
        )
    check_tier_count(len(tree))
    rates: dict[str, int] = {}
    for team, spec in tree.items():
        where = f"{source}: {TEAMS_KEY}[{shown(team)}]"
        team = check_team(team, field=f"{source}: team id {shown(team)}")
        if not isinstance(spec, Mapping):
            raise InvalidArgument(
                f"{where} must be an object with {RATE_KEY!r}, "
                f"got {type(spec).__name__}"
            )
        _check_keys(spec, (RATE_KEY,), where)
        if RATE_KEY not in spec:
            raise InvalidArgument(f"{where} needs {RATE_KEY}")
        rates[team] = check_rate(spec[RATE_KEY], field=f"{where}.{RATE_KEY}")
    return rates


def _parse_weights(
    tree: object, tiers: Set[str], teams: Set[str], source: str
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(user weights, tier weights, team weights) of the ``weights`` object;
    each tier one of ``tiers``, each team one of ``teams``."""
    if not isinstance(tree, Mapping):
        raise InvalidArgument(
            f"{source}: {WEIGHTS_KEY} must be an object with {WEIGHT_USERS_KEY!r}, "
            f"{WEIGHT_TIERS_KEY!r} and/or {WEIGHT_TEAMS_KEY!r}, "
            f"got {type(tree).__name__}"
        )
    where = f"{source}: {WEIGHTS_KEY}"
    _check_keys(
        tree, (WEIGHT_USERS_KEY, WEIGHT_TIERS_KEY, WEIGHT_TEAMS_KEY), f"{where}:"
    )
    users = _mapping(tree, WEIGHT_USERS_KEY, "user ids to weights", where)
    user_weights = {
        check_user(user, field=f"{where}: user id {shown(user)}"): _weight(
            weight, f"{where}.{WEIGHT_USERS_KEY}[{shown(user)}]"
        )
        for user, weight in users.items()
    }
    tier_weights: dict[str, float] = {}
    for tier, weight in _mapping(
        tree, WEIGHT_TIERS_KEY, "tier ids to weights", where
    ).items():
        field_ = f"{where}.{WEIGHT_TIERS_KEY}[{shown(tier)}]"
        if tier not in tiers:
            raise InvalidArgument(f"{field_}: tier {shown(tier)} is not in {TIERS_KEY}")
        tier_weights[tier] = _weight(weight, field_)
    team_weights: dict[str, float] = {}
    for team, weight in _mapping(
        tree, WEIGHT_TEAMS_KEY, "team ids to weights", where
    ).items():
        field_ = f"{where}.{WEIGHT_TEAMS_KEY}[{shown(team)}]"
        if team not in teams:
            raise InvalidArgument(f"{field_}: team {shown(team)} is not in {TEAMS_KEY}")
        team_weights[team] = _weight(weight, field_)
    return user_weights, tier_weights, team_weights


def _weight(value: object, field: str) -> float:
    """A weight of the file: a number in (0, ``MAX_WEIGHT``] (0 is refused:
    leave the user or tier out instead)."""
    try:
        return validate_weight(value, field=field)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _parse_exempt_users(tree: object, source: str) -> frozenset[str]:
    if not isinstance(tree, list):
        raise InvalidArgument(
            f"{source}: {EXEMPT_USERS_KEY} must be a list of user ids, "
            f"got {type(tree).__name__}"
        )
    check_table_size(len(tree))
    users: set[str] = set()
    for index, user in enumerate(tree):
        where = f"{source}: {EXEMPT_USERS_KEY}[{index}]"
        if check_user(user, field=where) in users:
            raise InvalidArgument(f"{where}: {shown(user)} appears more than once")
        users.add(user)
    return frozenset(users)


def loads(text: str, fmt: Format, *, source: str) -> TableDocument:
    """Decodes and validates a document in ``fmt``."""
    try:
        if fmt == "json":
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            doc = yaml.load(text, Loader=_UniqueKeySafeLoader)
    except _DuplicateKey as exc:
        raise InvalidArgument(f"{source}: duplicate key {exc.args[0]!r}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"{source}: not valid {fmt.upper()}: {exc}") from None
    return parse_document(doc, source=source)


def dumps(doc: TableDocument, fmt: Format) -> str:
    """Encodes ``doc`` in ``fmt``, users, tiers and teams sorted by id,
    ``mode``, the default, ``etag`` and ``store_version`` only when set, the
    teams' keys only when there is a team."""
    tree: dict[str, Any] = {}
    if doc.mode is not None:
        tree[MODE_KEY] = doc.mode.value
    if doc.fair_share is not None:
        tree[FAIR_SHARE_KEY] = doc.fair_share
    if doc.default_rate is not None:
        tree[DEFAULT_KEY] = doc.default_rate
    tiers: dict[str, dict[str, Any]] = {}
    for tier in sorted(doc.tiers):
        spec: dict[str, Any] = {}
        if tier in doc.tier_rates:
            spec[RATE_KEY] = doc.tier_rates[tier]
        if tier in doc.exempt_tiers:
            spec[EXEMPT_KEY] = True
        tiers[tier] = spec
    tree[TIERS_KEY] = tiers
    tree[USERS_KEY] = dict(sorted(doc.user_rates.items()))
    tree[MEMBERSHIPS_KEY] = dict(sorted(doc.memberships.items()))
    tree[EXEMPT_USERS_KEY] = sorted(doc.exempt_users)
    if doc.team_rates:
        tree[TEAMS_KEY] = {
            team: {RATE_KEY: rate} for team, rate in sorted(doc.team_rates.items())
        }
        tree[TEAM_MEMBERS_KEY] = dict(sorted(doc.team_members.items()))
    tree[WEIGHTS_KEY] = {
        WEIGHT_USERS_KEY: dict(sorted(doc.user_weights.items())),
        WEIGHT_TIERS_KEY: dict(sorted(doc.tier_weights.items())),
    }
    if doc.team_weights:
        tree[WEIGHTS_KEY][WEIGHT_TEAMS_KEY] = dict(sorted(doc.team_weights.items()))
    if doc.etag is not None:
        tree[ETAG_KEY] = doc.etag
    if doc.store_version is not None:
        tree[STORE_VERSION_KEY] = str(doc.store_version)
    if fmt == "json":
        return json.dumps(tree, indent=2, ensure_ascii=False) + "\n"
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


def format_of(path: str) -> Format:
    """The format a file name implies: ``.json`` is JSON, ``.yaml``/``.yml`` YAML."""
    lowered = path.lower()
    if lowered.endswith(".json"):
        return "json"
    if lowered.endswith((".yaml", ".yml")):
        return "yaml"
    raise InvalidArgument(
        f"{path}: cannot tell the format; name the file *.json, *.yaml or *.yml"
    )


_KEYS = (
    MODE_KEY,
    FAIR_SHARE_KEY,
    DEFAULT_KEY,
    TIERS_KEY,
    USERS_KEY,
    MEMBERSHIPS_KEY,
    EXEMPT_USERS_KEY,
    TEAMS_KEY,
    TEAM_MEMBERS_KEY,
    WEIGHTS_KEY,
    ETAG_KEY,
    STORE_VERSION_KEY,
)
#: Unknown fields named in one error message.
_MAX_LISTED = 5


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _UniqueKeySafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate mapping keys (it would keep the
    last one silently, hiding a typo'd table)."""

    def construct_mapping(
        self, node: yaml.MappingNode, deep: bool = False
    ) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str):  # other keys fail validation anyway
                if key in seen:
                    raise _DuplicateKey(key)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)
