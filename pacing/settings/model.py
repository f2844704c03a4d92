"""Every setting of per-user output pacing, in one object: ``OutputRateSettings``,
read from its command-line flags or from its one home in vLLM's
``additional_config`` (the field vLLM carries to the engine-core process for
plugins), and written back there.

A settings object that exists is valid: each one checks itself when built and
raises ``SettingsError`` naming the flag or the key. The flags themselves are
added and parsed in ``pacing.settings.cli``, their names are in
``pacing.settings.flags``, and the checks of single values (and ``SettingsError``)
in ``pacing.settings.checks``.

``additional_config["output_rate"]`` (what the flags produce, and the offline
``LLM(additional_config=...)`` form)::

    {
      "default_rate": 100,             # tokens/s; absent or null: pacing off
      "user_rates": {"user-a": 100},
      "mode": "enforce",               # or "shadow", "off" (pacing.modes)
      "tier_rates": {"free": 20, "pro": 200},
      "memberships": {"user-b": "pro"},
      "exempt_users": ["ops"],
      "exempt_tiers": [],
      "team_rates": {"acme": 600},     # tok/s shared by a team (pacing.teams)
      "team_members": {"user-a": "acme"},
      "user_source": "xargs",          # or "header:NAME", "openai-user"
      "team_source": "table",          # or "header:NAME" (a gateway's)
      "require_user": false,           # true: no id is a 401, not __anonymous__
      "allow_unattributed": false,     # true: serve routes no id reaches (gateway)
      "fair_share": false,             # weighted fair share (pacing.fair_share)
      "fair_share_config": {"prompt_price": 1, "output_price": 2,
                            "hysteresis": 1024, "min_run_tokens": 16},
      "user_weights": {"user-a": 2}, "tier_weights": {"pro": 4},
      "team_weights": {"acme": 2},
      "control": {                     # absent: no control plane
        "address": "127.0.0.1:50151", "config_path": null, "token_file": null,
        "tls_cert": null, "tls_key": null, "tls_client_ca": null
      },
      "metrics": {"emit": false, "max_labelled_users": 100},
      "store": {                       # absent: no store (one engine's limits)
        "url": "redis://127.0.0.1:6379/0", "password_file": null,
        "failure_mode": "keep-local-share", "failure_after_s": 5.0,
        "timeout_ms": 50
      }
    }

The tier and exemption keys hold the limit table of ``pacing.limits`` (a user's
own limit, else its tier's, else the default; exemptions make unlimited). The
flags always give a ``control`` object (``--output-rate-control-address off``
runs none); offline, a control plane runs only where one is asked for. Secrets
never travel here (vLLM logs its config): only the paths of the token and TLS
files, which the control plane reads where it runs, and of the store's password
file (``pacing.settings.store``), which the process that connects reads.

The keys of earlier versions, ``output_rate_control`` and ``output_rate_metrics``,
are refused with an error that names their new place.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pacing.fair_share import FairShare, FairShareSettings, Weights
from pacing.identity import (
    TABLE_TEAM_SOURCE,
    XARGS_SOURCE,
    TeamSource,
    UserSource,
    parse_team_source,
    parse_user_source,
)
from pacing.limiter import OutputRateLimiter, validate_rate
from pacing.modes import Mode, parse_mode
from pacing.settings.checks import (
    SettingsError,
    check_keys,
    check_table_part,
    field_names,
    name_set,
    names_entry,
    object_entry,
    parse_json,
)
from pacing.settings.cli import dest, store_from_cli_args
from pacing.settings.fair_share import (
    config_entry,
    config_from_flag,
    parse_fair_share_config,
    parse_weights,
    weights_from_flag,
)
from pacing.settings.flags import (
    ADDRESS_OFF,
    ALLOW_UNATTRIBUTED_FLAG,
    CONTROL_FLAGS,
    DEFAULT_ADDRESS,
    DEFAULT_RATE_FLAG,
    EXEMPT_TIERS_FLAG,
    FAIR_SHARE_CONFIG_FLAG,
    FAIR_SHARE_FLAG,
    MODE_FLAG,
    REQUIRE_USER_FLAG,
    SETTING_FLAGS,
    TABLE_FLAGS,
    TEAM_MEMBERS_FLAG,
    TEAM_SOURCE_FLAG,
    TEAMS_FLAG,
    TIER_MEMBERS_FLAG,
    TIERS_FLAG,
    TLS_CERT_FLAG,
    TLS_CLIENT_CA_FLAG,
    TLS_KEY_FLAG,
    USER_SOURCE_FLAG,
    WEIGHTS_FLAG,
)
from pacing.settings.store import STORE_FLAG, STORE_FLAGS, StoreSettings
from pacing.teams import Teams, TeamTable

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "DEFAULT_MAX_LABELLED_USERS",
    "FLAG_KEYS",
    "ControlSettings",
    "MetricsSettings",
    "OutputRateSettings",
]


#: Key of our settings inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "output_rate"
#: Keys of earlier versions -> the entry of ``output_rate`` that replaced them.
_MOVED_KEYS = {"output_rate_control": "control", "output_rate_metrics": "metrics"}
#: Default cap on users with their own ``user`` metrics label.
DEFAULT_MAX_LABELLED_USERS = 100


def _flag_keys() -> dict[str, tuple[str, ...]]:
    keys: dict[str, tuple[str, ...]] = {}
    for prefix, flags in (
        ("", {**SETTING_FLAGS, **TABLE_FLAGS}),
        ("control.", CONTROL_FLAGS),
        ("store.", STORE_FLAGS),
    ):
        for name, flag in flags.items():
            keys[flag] = (*keys.get(flag, ()), prefix + name)
    return keys


#: Each flag -> the keys of our ``additional_config`` entry that hold its value
#: (``control.*`` and ``store.*``: inside those objects); what the reference
#: pages show (``tools.reference_docs``).
FLAG_KEYS: dict[str, tuple[str, ...]] = _flag_keys()


@dataclass(frozen=True)
class ControlSettings:
    """Where and how the control plane listens, and its limits file. Paths
    only: the control plane reads the files where it runs."""

    address: str = DEFAULT_ADDRESS
    config_path: str | None = None
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError(
                f"{TLS_CERT_FLAG} and {TLS_KEY_FLAG} must be given together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingsError(
                f"{TLS_CLIENT_CA_FLAG} (mTLS) needs {TLS_CERT_FLAG} and {TLS_KEY_FLAG}"
            )

    @property
    def enabled(self) -> bool:
        """Whether a control plane should run."""
        return self.address != ADDRESS_OFF


@dataclass(frozen=True)
class MetricsSettings:
    """Whether the scheduler emits the metrics payload, and the label cap.

    ``emit`` must be true only when the API process will consume the payload
    (our stat logger is loaded there), because vLLM's own logging stat logger
    crashes on it otherwise; the engine config hook sets it.
    """

    emit: bool = False
    max_labelled_users: int = DEFAULT_MAX_LABELLED_USERS

    def __post_init__(self) -> None:
        where = f"{ADDITIONAL_CONFIG_KEY}.metrics"
        if not isinstance(self.emit, bool):
            raise SettingsError(f"{where}.emit must be a boolean")
        cap = self.max_labelled_users
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise SettingsError(
                f"{where}.max_labelled_users must be a non-negative integer, "
                f"got {cap!r}"
            )


@dataclass(frozen=True)
class OutputRateSettings:
    """What the operator asked for, validated: a default limit (``None`` =
    pacing off) and per-user overrides in output tokens per second, the mode,
    tiers, memberships and exemptions (``pacing.limits``), where the HTTP guard
    takes a request's user id from and whether a request must name one, the
    control plane (``None``: none asked for), the metrics, the global store
    that makes the limits hold across engines (``None``: none, each engine
    paces alone), weighted fair share (``pacing.fair_share``): whether it
    is on at start, its pricing, and the users', tiers' and teams' weights,
    and the teams (``pacing.teams``): their rates and members."""

    default_rate: int | None = None
    user_rates: Mapping[str, int] = field(default_factory=dict)
    mode: Mode = Mode.ENFORCE
    tier_rates: Mapping[str, int] = field(default_factory=dict)
    memberships: Mapping[str, str] = field(default_factory=dict)  # user -> tier
    exempt_users: frozenset[str] = frozenset()
    exempt_tiers: frozenset[str] = frozenset()
    user_source: UserSource = XARGS_SOURCE
    require_user: bool = False
    #: Serve routes no user id can reach (charged to ``__anonymous__``) with a
    #: gateway source; refused by default (``engine_ext.http_guard``).
    allow_unattributed: bool = False
    control: ControlSettings | None = None
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    store: StoreSettings | None = None
    fair_share: bool = False
    fair_share_config: FairShareSettings = field(default_factory=FairShareSettings)
    user_weights: Mapping[str, float] = field(default_factory=dict)
    tier_weights: Mapping[str, float] = field(default_factory=dict)
    team_rates: Mapping[str, int] = field(default_factory=dict)
    team_members: Mapping[str, str] = field(default_factory=dict)  # user -> team
    team_weights: Mapping[str, float] = field(default_factory=dict)
    team_source: TeamSource = TABLE_TEAM_SOURCE

    def __post_init__(self) -> None:
        # Normalised so that equality and ``.value`` hold for a mode given by
        # name and for names given as any array.
        for name in ("exempt_users", "exempt_tiers"):
            object.__setattr__(
                self, name, name_set(getattr(self, name), TABLE_FLAGS[name])
            )
        try:
            object.__setattr__(self, "mode", parse_mode(self.mode, field=MODE_FLAG))
            source = parse_user_source(self.user_source, field=USER_SOURCE_FLAG)
            object.__setattr__(self, "user_source", source)
            team_source = parse_team_source(self.team_source, field=TEAM_SOURCE_FLAG)
            object.__setattr__(self, "team_source", team_source)
            if self.default_rate is not None:
                validate_rate(self.default_rate, field=DEFAULT_RATE_FLAG)
            for name in TABLE_FLAGS:
                check_table_part(name, getattr(self, name))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        for user, tier in self.memberships.items():
            # pacing.limits: a user joins only a tier that exists.
            if tier not in self.tier_rates and tier not in self.exempt_tiers:
                raise SettingsError(
                    f"{TIER_MEMBERS_FLAG} puts {user!r} in tier {tier!r}, which "
                    f"neither {TIERS_FLAG} nor {EXEMPT_TIERS_FLAG} defines"
                )
        if not isinstance(self.require_user, bool):
            raise SettingsError(
                f"{REQUIRE_USER_FLAG} must be a boolean, got {self.require_user!r}"
            )
        if not isinstance(self.allow_unattributed, bool):
            raise SettingsError(
                f"{ALLOW_UNATTRIBUTED_FLAG} must be a boolean, got "
                f"{self.allow_unattributed!r}"
            )
        if self.allow_unattributed and (
            self.user_source == XARGS_SOURCE or self.require_user
        ):
            raise SettingsError(
                f"{ALLOW_UNATTRIBUTED_FLAG} needs a gateway user source "
                f"({USER_SOURCE_FLAG} header:NAME or openai-user) without "
                f"{REQUIRE_USER_FLAG}: only then are those routes refused"
            )
        if not isinstance(self.fair_share, bool):
            raise SettingsError(
                f"{FAIR_SHARE_FLAG} must be a boolean, got {self.fair_share!r}"
            )
        for user, team in self.team_members.items():
            if team not in self.team_rates:
                raise SettingsError(
                    f"{TEAM_MEMBERS_FLAG} puts {user!r} in team {team!r}, which "
                    f"{TEAMS_FLAG} does not define"
                )
        weights = {
            "users": self.user_weights,
            "tiers": self.tier_weights,
            "teams": self.team_weights,
        }
        user_weights, tier_weights, team_weights = parse_weights(weights, WEIGHTS_FLAG)
        object.__setattr__(self, "user_weights", user_weights)
        object.__setattr__(self, "tier_weights", tier_weights)
        object.__setattr__(self, "team_weights", team_weights)
        for team in team_weights:
            if team not in self.team_rates:
                raise SettingsError(
                    f"{WEIGHTS_FLAG} weighs team {team!r}, which {TEAMS_FLAG} "
                    "does not define"
                )
        if self.team_source.header is not None:
            if self.user_source == XARGS_SOURCE:
                raise SettingsError(
                    f"{TEAM_SOURCE_FLAG} {self.team_source.spec} needs a gateway "
                    f"user source ({USER_SOURCE_FLAG} header:NAME or openai-user): "
                    "a team header is trusted only from the gateway that names "
                    "the user"
                )
            if self.team_source.header == self.user_source.header:
                raise SettingsError(
                    f"{TEAM_SOURCE_FLAG} and {USER_SOURCE_FLAG} name the same "
                    f"header ({self.team_source.header})"
                )
        for tier in tier_weights:
            if tier not in self.tier_rates and tier not in self.exempt_tiers:
                raise SettingsError(
                    f"{WEIGHTS_FLAG} weighs tier {tier!r}, which neither "
                    f"{TIERS_FLAG} nor {EXEMPT_TIERS_FLAG} defines"
                )
        if self.default_rate is None:
            given = [flag for name, flag in TABLE_FLAGS.items() if getattr(self, name)]
            if self.mode is not Mode.ENFORCE:
                given.append(MODE_FLAG)
            if self.user_source != XARGS_SOURCE:
                given.append(USER_SOURCE_FLAG)
            if self.team_source != TABLE_TEAM_SOURCE:
                given.append(TEAM_SOURCE_FLAG)
            if self.require_user:
                given.append(REQUIRE_USER_FLAG)
            if self.store is not None:
                given.append(STORE_FLAG)
            if self.fair_share:
                given.append(FAIR_SHARE_FLAG)
            if self.user_weights or self.tier_weights or self.team_weights:
                given.append(WEIGHTS_FLAG)
            if self.fair_share_config != FairShareSettings():
                given.append(FAIR_SHARE_CONFIG_FLAG)
            if given:
                raise SettingsError(
                    f"{given[0]} needs {DEFAULT_RATE_FLAG}: the default limit "
                    "is what turns per-user output pacing on"
                )

    @property
    def enabled(self) -> bool:
        """Whether pacing is on."""
        return self.default_rate is not None

    def build_limiter(self) -> OutputRateLimiter:
        """A limiter holding these limits: the default, the users' own limits,
        tiers, memberships and exemptions."""
        return OutputRateLimiter(
            self.default_rate,
            dict(self.user_rates),
            tier_rates=dict(self.tier_rates),
            memberships=dict(self.memberships),
            exempt_users=self.exempt_users,
            exempt_tiers=self.exempt_tiers,
        )

    def build_fair_share(self) -> FairShare:
        """The fair-share ledger: these weights and pricing, on or off."""
        return FairShare(
            self.fair_share_config,
            Weights(self.user_weights, self.tier_weights, self.team_weights),
            enabled=self.fair_share,
        )

    def build_teams(self) -> Teams:
        """The teams: their rates and members (``pacing.teams``)."""
        return Teams(TeamTable(self.team_rates, self.team_members))

    @classmethod
    def from_cli_args(
        cls,
        args: argparse.Namespace,
        additional_config: Mapping[str, Any] | None = None,
    ) -> OutputRateSettings:
        """Reads the flags ``pacing.settings.cli.add_cli_args`` added. With pacing on
        they set the limits, the mode, the control plane and the store; the
        metrics, which have no flags, come from ``additional_config`` (as the
        operator passed it), if it has them. Without ``DEFAULT_RATE_FLAG``:
        pacing off, no control plane (and any other limit flag, a store flag or
        a mode other than enforce is an error).

        With a store it also reads the files the store's settings name (the
        password file, the URL's TLS files), so that an unreadable one ends the
        start in the API process; their contents go nowhere."""
        default_rate = getattr(args, dest(DEFAULT_RATE_FLAG))
        store = store_from_cli_args(args)
        table = {
            name: parse_json(getattr(args, dest(flag)), flag)
            for name, flag in TABLE_FLAGS.items()
        }
        mode = getattr(args, dest(MODE_FLAG))
        identity = {
            "user_source": getattr(args, dest(USER_SOURCE_FLAG)),
            "team_source": getattr(args, dest(TEAM_SOURCE_FLAG)),
            "require_user": getattr(args, dest(REQUIRE_USER_FLAG)),
            "allow_unattributed": getattr(args, dest(ALLOW_UNATTRIBUTED_FLAG)),
        }
        user_weights, tier_weights, team_weights = weights_from_flag(
            getattr(args, dest(WEIGHTS_FLAG))
        )
        identity.update(
            fair_share=getattr(args, dest(FAIR_SHARE_FLAG)),
            fair_share_config=config_from_flag(
                getattr(args, dest(FAIR_SHARE_CONFIG_FLAG))
            ),
            user_weights=user_weights,
            tier_weights=tier_weights,
            team_weights=team_weights,
        )
        if default_rate is None:
            return cls(mode=mode, **table, **identity, store=store)
        if store is not None:
            try:
                store.check_files()
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        control = ControlSettings(
            **{name: getattr(args, dest(flag)) for name, flag in CONTROL_FLAGS.items()}
        )
        given = cls.from_additional_config(additional_config)
        return cls(
            default_rate,
            mode=mode,
            **table,
            **identity,
            control=control,
            metrics=given.metrics,
            store=store,
        )

    @classmethod
    def from_additional_config(cls, additional_config: object) -> OutputRateSettings:
        """Reads our entry of ``additional_config`` (absent: pacing off). Every
        consumer reads the settings through this one function. vLLM also takes a
        hashable object other than a dict there, which has no entry of ours."""
        if not isinstance(additional_config, Mapping):
            return cls()
        for old, new in _MOVED_KEYS.items():
            if old in additional_config:
                raise SettingsError(
                    f"additional_config[{old!r}] is no longer read: use "
                    f"additional_config[{ADDITIONAL_CONFIG_KEY!r}][{new!r}]"
                )
        entry = additional_config.get(ADDITIONAL_CONFIG_KEY)
        if entry is None:
            return cls()
        where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        check_keys(entry, where, field_names(cls))
        user_rates = entry.get("user_rates") or {}
        if not isinstance(user_rates, Mapping):
            raise SettingsError(
                f"{where}['user_rates'] must be an object mapping user names to "
                "tokens per second"
            )
        mode = entry.get("mode")  # absent or null: the default
        if mode is not None:
            try:
                mode = parse_mode(mode, field=f"{where}['mode']")
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        user_source = entry.get("user_source")  # absent or null: the default
        if user_source is not None:
            try:
                user_source = parse_user_source(
                    user_source, field=f"{where}['user_source']"
                )
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        team_source = entry.get("team_source")  # absent or null: the table
        if team_source is not None:
            try:
                team_source = parse_team_source(
                    team_source, field=f"{where}['team_source']"
                )
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        require_user = entry.get("require_user")
        if require_user is not None and not isinstance(require_user, bool):
            raise SettingsError(f"{where}['require_user'] must be a boolean")
        allow_unattributed = entry.get("allow_unattributed")
        if allow_unattributed is not None and not isinstance(allow_unattributed, bool):
            raise SettingsError(f"{where}['allow_unattributed'] must be a boolean")
        control = None
        if (control_entry := entry.get("control")) is not None:
            check_keys(
                control_entry, f"{where}['control']", field_names(ControlSettings)
            )
            control = ControlSettings(**control_entry)
        metrics = entry.get("metrics")
        metrics = {} if metrics is None else metrics
        check_keys(metrics, f"{where}['metrics']", field_names(MetricsSettings))
        store = None
        if (store_entry := entry.get("store")) is not None:
            check_keys(store_entry, f"{where}['store']", field_names(StoreSettings))
            if "url" not in store_entry:
                raise SettingsError(f"{where}['store'] needs a 'url'")
            try:
                store = StoreSettings(**store_entry)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        fair_share = entry.get("fair_share")
        if fair_share is not None and not isinstance(fair_share, bool):
            raise SettingsError(f"{where}['fair_share'] must be a boolean")
        user_weights, tier_weights, team_weights = parse_weights(
            {
                "users": object_entry(entry, "user_weights", where),
                "tiers": object_entry(entry, "tier_weights", where),
                "teams": object_entry(entry, "team_weights", where),
            },
            f"{where}['user_weights'/'tier_weights'/'team_weights']",
        )
        return cls(
            default_rate=entry.get("default_rate"),
            user_rates=dict(user_rates),
            mode=Mode.ENFORCE if mode is None else mode,
            tier_rates=object_entry(entry, "tier_rates", where),
            memberships=object_entry(entry, "memberships", where),
            exempt_users=names_entry(entry, "exempt_users", where),
            exempt_tiers=names_entry(entry, "exempt_tiers", where),
            user_source=XARGS_SOURCE if user_source is None else user_source,
            require_user=bool(require_user),
            allow_unattributed=bool(allow_unattributed),
            control=control,
            metrics=MetricsSettings(**metrics),
            store=store,
            fair_share=bool(fair_share),
            fair_share_config=parse_fair_share_config(
                entry.get("fair_share_config"), f"{where}['fair_share_config']"
            ),
            user_weights=user_weights,
            tier_weights=tier_weights,
            team_rates=object_entry(entry, "team_rates", where),
            team_members=object_entry(entry, "team_members", where),
            team_weights=team_weights,
            team_source=TABLE_TEAM_SOURCE if team_source is None else team_source,
        )

    def to_additional_config(self) -> dict[str, Any]:
        """Our entry for ``additional_config`` (JSON-serialisable, no secrets)."""
        entry: dict[str, Any] = {
            "default_rate": self.default_rate,
            "user_rates": dict(self.user_rates),
            "mode": self.mode.value,
            "tier_rates": dict(self.tier_rates),
            "memberships": dict(self.memberships),
            "exempt_users": sorted(self.exempt_users),
            "exempt_tiers": sorted(self.exempt_tiers),
            "user_source": self.user_source.spec,
            "require_user": self.require_user,
            "metrics": asdict(self.metrics),
        }
        # Only when used: the entry of an operator who uses none stays as it was.
        if self.allow_unattributed:
            entry["allow_unattributed"] = True
        if self.fair_share:
            entry["fair_share"] = True
        if self.fair_share_config != FairShareSettings():
            entry["fair_share_config"] = config_entry(self.fair_share_config)
        if self.user_weights:
            entry["user_weights"] = dict(self.user_weights)
        if self.tier_weights:
            entry["tier_weights"] = dict(self.tier_weights)
        if self.team_rates:
            entry["team_rates"] = dict(self.team_rates)
            entry["team_members"] = dict(self.team_members)
        if self.team_weights:
            entry["team_weights"] = dict(self.team_weights)
        if self.team_source != TABLE_TEAM_SOURCE:
            entry["team_source"] = self.team_source.spec
        if self.control is not None:
            entry["control"] = asdict(self.control)
        if self.store is not None:
            entry["store"] = {
                **asdict(self.store),
                "failure_mode": self.store.failure_mode.value,
            }
        return entry
