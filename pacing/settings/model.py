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
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.document import (
    WEIGHT_KEYS,
    WEIGHTS_KEY,
    Document,
    check_keys,
    to_tree,
)
from pacing.policy.errors import PolicyError
from pacing.policy.model import Policy
from pacing.settings.checks import (
    SettingsError,
    check_entry_keys,
    field_names,
    name_set,
    names_entry,
    parse_json,
)
from pacing.settings.cli import dest, store_from_cli_args
from pacing.settings.fair_share import (
    config_entry,
    config_from_flag,
    parse_fair_share_config,
)
from pacing.settings.flags import (
    ADDRESS_FLAG,
    ADDRESS_OFF,
    ALLOW_UNATTRIBUTED_FLAG,
    CONFIG_FLAG,
    CONTROL_FLAGS,
    DEFAULT_ADDRESS,
    DEFAULT_RATE_FLAG,
    FAIR_SHARE_CONFIG_FLAG,
    POLICY_ALIASES,
    POLICY_FLAG,
    REQUIRE_USER_FLAG,
    SETTING_FLAGS,
    TEAM_SOURCE_FLAG,
    TLS_CERT_FLAG,
    TLS_CLIENT_CA_FLAG,
    TLS_KEY_FLAG,
    TOKEN_FILE_FLAG,
    USER_SOURCE_FLAG,
    WEIGHTS_FLAG,
)
from pacing.settings.policy import policy_of_entry, policy_of_flag, policy_of_pieces
from pacing.settings.store import STORE_FLAG, STORE_FLAGS, StoreSettings
from pacing.teams import Teams

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

    def add(flag: str, key: str) -> None:
        if key not in keys.get(flag, ()):
            keys[flag] = (*keys.get(flag, ()), key)

    for name, flag in SETTING_FLAGS.items():
        add(flag, name)
    for flag in POLICY_ALIASES.values():  # an alias builds the policy
        add(flag, "policy")
    for name, flag in CONTROL_FLAGS.items():
        add(flag, f"control.{name}")
    for name, flag in STORE_FLAGS.items():
        add(flag, f"store.{name}")
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
        if not self.enabled:
            for flag, value in (
                (TOKEN_FILE_FLAG, self.token_file),
                (TLS_CERT_FLAG, self.tls_cert),
                (TLS_KEY_FLAG, self.tls_key),
                (TLS_CLIENT_CA_FLAG, self.tls_client_ca),
            ):
                if value is not None:
                    raise SettingsError(
                        f"{flag} cannot take effect with {ADDRESS_FLAG} "
                        f"{ADDRESS_OFF}: no control plane listens"
                    )
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
    """What the operator asked for, validated: the start-up policy
    (``pacing.policy``: the default limit, users, tiers, teams, exemptions,
    weights, the mode and the fair-share switch, from ``--output-rate-policy``
    or its aliases), where the HTTP guard takes a request's user id and team
    from and whether a request must name one, the control plane and the limits
    file (``None``: none asked for), the metrics, the global store that makes
    the limits hold across engines (``None``: each engine paces alone) and
    fair share's pricing (``pacing.fair_share``).

    Pacing is on when the policy has a default limit or a limits file is given
    (``enabled``): a policy given in any form is enforced."""

    policy: Policy = field(default_factory=Policy)
    user_source: UserSource = XARGS_SOURCE
    require_user: bool = False
    #: Serve routes no user id can reach (charged to ``__anonymous__``) with a
    #: gateway source; refused by default (``engine_ext.http_guard``).
    allow_unattributed: bool = False
    control: ControlSettings | None = None
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    store: StoreSettings | None = None
    fair_share_config: FairShareSettings = field(default_factory=FairShareSettings)
    team_source: TeamSource = TABLE_TEAM_SOURCE

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise SettingsError(
                f"policy must be a pacing.policy.model.Policy, got "
                f"{type(self.policy).__name__}"
            )
        try:
            source = parse_user_source(self.user_source, field=USER_SOURCE_FLAG)
            object.__setattr__(self, "user_source", source)
            team_source = parse_team_source(self.team_source, field=TEAM_SOURCE_FLAG)
            object.__setattr__(self, "team_source", team_source)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
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
        if not self.enabled:
            given = self._given_without_pacing()
            if given:
                raise SettingsError(f"{given} {_NEEDS_DEFAULT}")

    def _given_without_pacing(self) -> str | None:
        """What was asked for that only pacing can do, if anything."""
        if self.policy != Policy():
            return "the policy"
        for flag, given in (
            (USER_SOURCE_FLAG, self.user_source != XARGS_SOURCE),
            (TEAM_SOURCE_FLAG, self.team_source != TABLE_TEAM_SOURCE),
            (REQUIRE_USER_FLAG, self.require_user),
            (STORE_FLAG, self.store is not None),
            (FAIR_SHARE_CONFIG_FLAG, self.fair_share_config != FairShareSettings()),
        ):
            if given:
                return flag
        return None

    @property
    def enabled(self) -> bool:
        """Whether pacing is on: the policy has a default limit, or a limits
        file (which must give one if the policy does not) is given."""
        return self.policy.default_rate is not None or self.config_path is not None

    @property
    def config_path(self) -> str | None:
        """The limits file, if one is given."""
        return None if self.control is None else self.control.config_path

    @property
    def mode(self) -> Mode:
        """The start-up mode: the policy's, else enforce."""
        return Mode.ENFORCE if self.policy.mode is None else self.policy.mode

    @property
    def fair_share(self) -> bool:
        """Whether fair share is on at start."""
        return bool(self.policy.fair_share)

    def build_limiter(self) -> OutputRateLimiter:
        """A limiter holding the policy's default and limit table."""
        table = self.policy.limit_table()
        return OutputRateLimiter(
            self.policy.default_rate,
            table.user_rates,
            tier_rates=table.tier_rates,
            memberships=table.memberships,
            exempt_users=table.exempt_users,
            exempt_tiers=table.exempt_tiers,
        )

    def build_fair_share(self) -> FairShare:
        """The fair-share ledger: the policy's weights and switch, this pricing."""
        share = self.policy.share_policy()
        return FairShare(
            self.fair_share_config,
            Weights(share.users, share.tiers, share.teams),
            enabled=share.enabled,
        )

    def build_teams(self) -> Teams:
        """The teams: their rates and members (``pacing.teams``)."""
        return Teams(self.policy.team_table())

    @classmethod
    def from_cli_args(
        cls,
        args: argparse.Namespace,
        additional_config: Mapping[str, Any] | None = None,
    ) -> OutputRateSettings:
        """Reads the flags ``pacing.settings.cli.add_cli_args`` added: the
        policy (``POLICY_FLAG``, or its aliases, never both), the identity
        sources, the control plane and the limits file, the store. The metrics,
        which have no flags, come from ``additional_config`` (as the operator
        passed it), if it has them. Pacing is on with a default limit or a
        limits file; without either, any other flag is an error.

        With a store it also reads the files the store's settings name (the
        password file, the URL's TLS files), so that an unreadable one ends the
        start in the API process; their contents go nowhere."""
        store = store_from_cli_args(args)
        config_path = getattr(args, dest(CONFIG_FLAG))
        policy, aliases = _policy_from_cli_args(args, config_path)
        identity = {
            "user_source": getattr(args, dest(USER_SOURCE_FLAG)),
            "team_source": getattr(args, dest(TEAM_SOURCE_FLAG)),
            "require_user": getattr(args, dest(REQUIRE_USER_FLAG)),
            "allow_unattributed": getattr(args, dest(ALLOW_UNATTRIBUTED_FLAG)),
            "fair_share_config": config_from_flag(
                getattr(args, dest(FAIR_SHARE_CONFIG_FLAG))
            ),
        }
        if policy.default_rate is None and config_path is None:
            given = next(iter(aliases), None) or _control_flag_given(args)
            if given is not None:
                raise SettingsError(f"{given} {_NEEDS_DEFAULT}")
            return cls(policy, **identity, store=store)
        if store is not None:
            try:
                store.check_files()
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        control = ControlSettings(
            **{name: getattr(args, dest(flag)) for name, flag in CONTROL_FLAGS.items()}
        )
        metrics = cls.from_additional_config(additional_config).metrics
        return cls(policy, **identity, control=control, metrics=metrics, store=store)

    @classmethod
    def from_additional_config(cls, additional_config: object) -> OutputRateSettings:
        """Reads our entry of ``additional_config`` (absent: pacing off). Every
        consumer reads the settings through this one function. vLLM also takes a
        hashable object other than a dict there, which has no entry of ours.

        The policy is the entry's ``policy`` (a policy document) or, as in
        earlier versions, its pieces under their own keys (``POLICY_ALIASES``),
        never both."""
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
        check_entry_keys(entry, where, field_names(cls) | set(POLICY_ALIASES))
        pieces = {key: entry[key] for key in POLICY_ALIASES if key in entry}
        if entry.get("policy") is not None:
            if pieces:
                raise SettingsError(
                    f"{where}['policy'] holds the whole policy: {where}"
                    f"[{next(iter(pieces))!r}] cannot be given with it"
                )
            policy = policy_of_entry(entry["policy"], source=f"{where}['policy']")
        else:
            for key in ("exempt_users", "exempt_tiers"):
                pieces[key] = names_entry(entry, key, where)
            policy = policy_of_pieces(pieces, source=where)
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
            check_entry_keys(
                control_entry, f"{where}['control']", field_names(ControlSettings)
            )
            control = ControlSettings(**control_entry)
        metrics = entry.get("metrics")
        metrics = {} if metrics is None else metrics
        check_entry_keys(metrics, f"{where}['metrics']", field_names(MetricsSettings))
        store = None
        if (store_entry := entry.get("store")) is not None:
            check_entry_keys(
                store_entry, f"{where}['store']", field_names(StoreSettings)
            )
            if "url" not in store_entry:
                raise SettingsError(f"{where}['store'] needs a 'url'")
            try:
                store = StoreSettings(**store_entry)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        return cls(
            policy=policy,
            user_source=XARGS_SOURCE if user_source is None else user_source,
            require_user=bool(require_user),
            allow_unattributed=bool(allow_unattributed),
            control=control,
            metrics=MetricsSettings(**metrics),
            store=store,
            fair_share_config=parse_fair_share_config(
                entry.get("fair_share_config"), f"{where}['fair_share_config']"
            ),
            team_source=TABLE_TEAM_SOURCE if team_source is None else team_source,
        )

    def to_additional_config(self) -> dict[str, Any]:
        """Our entry for ``additional_config`` (JSON-serialisable, no secrets)."""
        entry: dict[str, Any] = {
            "policy": to_tree(Document(self.policy)),
            "user_source": self.user_source.spec,
            "require_user": self.require_user,
            "metrics": asdict(self.metrics),
        }
        # Only when used: the entry of an operator who uses none stays as it was.
        if self.allow_unattributed:
            entry["allow_unattributed"] = True
        if self.fair_share_config != FairShareSettings():
            entry["fair_share_config"] = config_entry(self.fair_share_config)
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


#: The end of the error for a setting given with pacing off.
_NEEDS_DEFAULT = (
    f"needs a default limit ({DEFAULT_RATE_FLAG}, default_tokens_per_second in "
    f"{POLICY_FLAG}) or a limits file ({CONFIG_FLAG}): they turn per-user output "
    "pacing on"
)


def _policy_from_cli_args(
    args: argparse.Namespace, config_path: str | None
) -> tuple[Policy, list[str]]:
    """The start-up policy: ``POLICY_FLAG``'s, or its aliases' (never both), and
    the alias flags given. A policy given without a default limit needs a
    limits file that gives one."""
    aliases = {
        name: getattr(args, dest(flag))
        for name, flag in POLICY_ALIASES.items()
        if flag != WEIGHTS_FLAG
    }
    for name in _OBJECT_ALIASES:
        aliases[name] = parse_json(aliases[name], POLICY_ALIASES[name])
    for name in ("exempt_users", "exempt_tiers"):
        flag = POLICY_ALIASES[name]
        aliases[name] = name_set(parse_json(aliases[name], flag), flag)
    weights = parse_json(getattr(args, dest(WEIGHTS_FLAG)), WEIGHTS_FLAG)
    try:
        check_keys(weights, tuple(WEIGHT_KEYS.values()), (WEIGHTS_KEY,))
    except PolicyError as error:
        raise SettingsError(str(error.at(WEIGHTS_FLAG))) from None
    for holder, key in WEIGHT_KEYS.items():
        aliases[f"{holder}_weights"] = weights.get(key)
    given = [
        POLICY_ALIASES[name]
        for name, piece in aliases.items()
        if piece not in (None, False, {}, frozenset())
    ]
    value = getattr(args, dest(POLICY_FLAG))
    if value is None:
        return policy_of_pieces(aliases), given
    if given:
        raise SettingsError(
            f"{given[0]} is an alias of a piece of {POLICY_FLAG}, which holds the "
            "whole policy: give it there instead"
        )
    policy = policy_of_flag(value)
    if policy.default_rate is None and config_path is None:
        raise SettingsError(
            f"{POLICY_FLAG}: default_tokens_per_second: required (the limit of "
            f"every user the policy does not name), unless {CONFIG_FLAG} gives one"
        )
    return policy, []


#: The aliases whose value is a JSON object.
_OBJECT_ALIASES = (
    "user_rates",
    "tier_rates",
    "memberships",
    "team_rates",
    "team_members",
)


def _control_flag_given(args: argparse.Namespace) -> str | None:
    """The first control-plane flag given, other than its defaults."""
    for name, flag in CONTROL_FLAGS.items():
        value = getattr(args, dest(flag))
        if value is not None and not (name == "address" and value == DEFAULT_ADDRESS):
            return flag
    return None
