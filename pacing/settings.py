"""Every setting of per-user output pacing, in one object: ``OutputRateSettings``,
its command-line flags, and its one home in vLLM's ``additional_config`` (the
field vLLM carries to the engine-core process for plugins).

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
      "user_source": "xargs",          # or "header:NAME", "openai-user"
      "require_user": false,           # true: no id is a 401, not __anonymous__
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
file (``pacing.store_settings``), which the process that connects reads.

The keys of earlier versions, ``output_rate_control`` and ``output_rate_metrics``,
are refused with an error that names their new place.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pacing.identity import (
    XARGS_SOURCE,
    UserSource,
    parse_user_source,
    validate_user,
)
from pacing.limiter import OutputRateLimiter, validate_rate
from pacing.modes import Mode, parse_mode
from pacing.store_settings import (
    DEFAULT_FAILURE_AFTER_S,
    DEFAULT_TIMEOUT_MS,
    FAILURE_AFTER_FLAG,
    FAILURE_MODE_FLAG,
    MAX_TIMEOUT_MS,
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    TIMEOUT_FLAG,
    FailureMode,
    StoreSettings,
    parse_failure_mode,
    validate_failure_after,
    validate_timeout_ms,
    validate_url,
)

#: Key of our settings inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "output_rate"
#: Keys of earlier versions -> the entry of ``output_rate`` that replaced them.
_MOVED_KEYS = {"output_rate_control": "control", "output_rate_metrics": "metrics"}

DEFAULT_RATE_FLAG = "--default-user-output-tokens-per-second"
USER_RATES_FLAG = "--user-output-tokens-per-second"
MODE_FLAG = "--output-rate-mode"
TIERS_FLAG = "--output-rate-tiers"
TIER_MEMBERS_FLAG = "--output-rate-tier-members"
EXEMPT_USERS_FLAG = "--output-rate-exempt-users"
EXEMPT_TIERS_FLAG = "--output-rate-exempt-tiers"
USER_SOURCE_FLAG = "--output-rate-user-source"
REQUIRE_USER_FLAG = "--output-rate-require-user"
ADDRESS_FLAG = "--output-rate-control-address"
CONFIG_FLAG = "--user-output-rate-config"
TOKEN_FILE_FLAG = "--output-rate-control-token-file"
TLS_CERT_FLAG = "--output-rate-control-tls-cert"
TLS_KEY_FLAG = "--output-rate-control-tls-key"
TLS_CLIENT_CA_FLAG = "--output-rate-control-tls-client-ca"

DEFAULT_ADDRESS = "127.0.0.1:50151"
#: ``--output-rate-control-address`` value that runs no control plane.
ADDRESS_OFF = "off"
#: Environment variable holding the control plane's bearer token when no token
#: file is given (read by the control plane and by ``output-rate-ctl``).
TOKEN_ENV = "OUTPUT_RATE_CONTROL_TOKEN"
#: Default cap on users with their own ``user`` metrics label.
DEFAULT_MAX_LABELLED_USERS = 100


class SettingsError(ValueError):
    """A setting is invalid; the message names the flag or the key."""


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
    control plane (``None``: none asked for), the metrics, and the global store
    that makes the limits hold across engines (``None``: none, each engine
    paces alone)."""

    default_rate: int | None = None
    user_rates: Mapping[str, int] = field(default_factory=dict)
    mode: Mode = Mode.ENFORCE
    tier_rates: Mapping[str, int] = field(default_factory=dict)
    memberships: Mapping[str, str] = field(default_factory=dict)  # user -> tier
    exempt_users: frozenset[str] = frozenset()
    exempt_tiers: frozenset[str] = frozenset()
    user_source: UserSource = XARGS_SOURCE
    require_user: bool = False
    control: ControlSettings | None = None
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    store: StoreSettings | None = None

    def __post_init__(self) -> None:
        # Normalised so that equality and ``.value`` hold for a mode given by
        # name and for names given as any array.
        for name in ("exempt_users", "exempt_tiers"):
            object.__setattr__(self, name, _names(getattr(self, name), _TABLE[name]))
        try:
            object.__setattr__(self, "mode", parse_mode(self.mode, field=MODE_FLAG))
            source = parse_user_source(self.user_source, field=USER_SOURCE_FLAG)
            object.__setattr__(self, "user_source", source)
            if self.default_rate is not None:
                validate_rate(self.default_rate, field=DEFAULT_RATE_FLAG)
            for name in _TABLE:
                _check_table_part(name, getattr(self, name))
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
        if self.default_rate is None:
            given = [flag for name, flag in _TABLE.items() if getattr(self, name)]
            if self.mode is not Mode.ENFORCE:
                given.append(MODE_FLAG)
            if self.user_source != XARGS_SOURCE:
                given.append(USER_SOURCE_FLAG)
            if self.require_user:
                given.append(REQUIRE_USER_FLAG)
            if self.store is not None:
                given.append(STORE_FLAG)
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

    @classmethod
    def from_cli_args(
        cls,
        args: argparse.Namespace,
        additional_config: Mapping[str, Any] | None = None,
    ) -> OutputRateSettings:
        """Reads the flags ``add_cli_args`` added. With pacing on they set the
        limits, the mode, the control plane and the store; the metrics, which
        have no flags, come from ``additional_config`` (as the operator passed
        it), if it has them. Without ``DEFAULT_RATE_FLAG``: pacing off, no
        control plane (and any other limit flag, a store flag or a mode other
        than enforce is an error).

        With a store it also reads the files the store's settings name (the
        password file, the URL's TLS files), so that an unreadable one ends the
        start in the API process; their contents go nowhere."""
        default_rate = getattr(args, _dest(DEFAULT_RATE_FLAG))
        store = _store_from_cli_args(args)
        table = {
            name: _parse_json(getattr(args, _dest(flag)), flag)
            for name, flag in _TABLE.items()
        }
        mode = getattr(args, _dest(MODE_FLAG))
        identity = {
            "user_source": getattr(args, _dest(USER_SOURCE_FLAG)),
            "require_user": getattr(args, _dest(REQUIRE_USER_FLAG)),
        }
        if default_rate is None:
            return cls(mode=mode, **table, **identity, store=store)
        if store is not None:
            try:
                store.check_files()
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        control = ControlSettings(
            **{name: getattr(args, _dest(flag)) for name, flag in _FLAGS.items()}
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
        _check_keys(entry, where, _fields(cls))
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
        require_user = entry.get("require_user")
        if require_user is not None and not isinstance(require_user, bool):
            raise SettingsError(f"{where}['require_user'] must be a boolean")
        control = None
        if (control_entry := entry.get("control")) is not None:
            _check_keys(control_entry, f"{where}['control']", _fields(ControlSettings))
            control = ControlSettings(**control_entry)
        metrics = entry.get("metrics")
        metrics = {} if metrics is None else metrics
        _check_keys(metrics, f"{where}['metrics']", _fields(MetricsSettings))
        store = None
        if (store_entry := entry.get("store")) is not None:
            _check_keys(store_entry, f"{where}['store']", _fields(StoreSettings))
            if "url" not in store_entry:
                raise SettingsError(f"{where}['store'] needs a 'url'")
            try:
                store = StoreSettings(**store_entry)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        return cls(
            default_rate=entry.get("default_rate"),
            user_rates=dict(user_rates),
            mode=Mode.ENFORCE if mode is None else mode,
            tier_rates=_object_entry(entry, "tier_rates", where),
            memberships=_object_entry(entry, "memberships", where),
            exempt_users=_names_entry(entry, "exempt_users", where),
            exempt_tiers=_names_entry(entry, "exempt_tiers", where),
            user_source=XARGS_SOURCE if user_source is None else user_source,
            require_user=bool(require_user),
            control=control,
            metrics=MetricsSettings(**metrics),
            store=store,
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
        if self.control is not None:
            entry["control"] = asdict(self.control)
        if self.store is not None:
            entry["store"] = {
                **asdict(self.store),
                "failure_mode": self.store.failure_mode.value,
            }
        return entry


def add_cli_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds every flag to ``group`` (a parser or an argument group); values are
    checked as they are parsed, so a bad one is an argparse error."""
    group.add_argument(
        DEFAULT_RATE_FLAG,
        type=_rate_arg,
        default=None,
        help="Enables pacing: output tokens/s shared by all requests of a user "
        "without an explicit limit. Unset: the scheduler behaves as upstream.",
    )
    group.add_argument(
        USER_RATES_FLAG,
        type=_json_arg(USER_RATES_FLAG),
        default=None,
        help="Per-user limits as a JSON object, e.g. '{\"user-a\": 100}'.",
    )
    group.add_argument(
        MODE_FLAG,
        type=_mode_arg,
        default=Mode.ENFORCE,
        metavar="{" + ",".join(mode.value for mode in Mode) + "}",
        help="What pacing does with its decisions: enforce them (default); "
        "shadow: compute and export everything enforce would, throttle nobody; "
        "off: the kill switch (limits kept, nothing recorded).",
    )
    group.add_argument(
        TIERS_FLAG,
        type=_json_arg(TIERS_FLAG),
        default=None,
        help='Named rate classes as a JSON object, e.g. \'{"free": 20, "pro": 200}\' '
        "(tokens/s for each member).",
    )
    group.add_argument(
        TIER_MEMBERS_FLAG,
        type=_json_arg(TIER_MEMBERS_FLAG),
        default=None,
        help='Tier of each user as a JSON object, e.g. \'{"user-b": "pro"}\'. A '
        "user's own limit wins over its tier's.",
    )
    group.add_argument(
        EXEMPT_USERS_FLAG,
        type=_json_arg(EXEMPT_USERS_FLAG),
        default=None,
        help="Users never throttled, as a JSON array, e.g. '[\"ops\"]'.",
    )
    group.add_argument(
        EXEMPT_TIERS_FLAG,
        type=_json_arg(EXEMPT_TIERS_FLAG),
        default=None,
        help="Tiers whose members (those without a limit of their own) are never "
        "throttled, as a JSON array, e.g. '[\"staff\"]'.",
    )
    group.add_argument(
        USER_SOURCE_FLAG,
        type=_user_source_arg,
        default=XARGS_SOURCE,
        metavar="{xargs,header:NAME,openai-user}",
        help="Where a request's user id comes from: vllm_xargs.output_rate_user "
        "(xargs, the default; the client sets it), request header NAME (set by "
        "a trusted gateway), or the OpenAI `user` field. With header:NAME or "
        "openai-user a client-sent vllm_xargs.output_rate_user is refused (400).",
    )
    group.add_argument(
        REQUIRE_USER_FLAG,
        action="store_true",
        help="Refuse (401) a request that names no user, instead of charging it "
        "to __anonymous__.",
    )
    group.add_argument(
        ADDRESS_FLAG,
        default=DEFAULT_ADDRESS,
        help="host:port of the gRPC control plane (limits, per-user state); "
        f"'{ADDRESS_OFF}' runs none. Non-loopback addresses need a token or mTLS.",
    )
    group.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="PATH",
        help="JSON or YAML file of limits, loaded at start (it wins over the "
        "flags), rewritten after every change, watched for edits.",
    )
    group.add_argument(
        TOKEN_FILE_FLAG,
        default=None,
        metavar="PATH",
        help=f"File holding the bearer token clients must send (default: "
        f"${TOKEN_ENV}, if set).",
    )
    group.add_argument(
        TLS_CERT_FLAG,
        default=None,
        metavar="PEM",
        help="Server certificate chain (enables TLS).",
    )
    group.add_argument(
        TLS_KEY_FLAG, default=None, metavar="PEM", help="Server private key."
    )
    group.add_argument(
        TLS_CLIENT_CA_FLAG,
        default=None,
        metavar="PEM",
        help="CA of client certificates; clients without one are refused (mTLS).",
    )
    group.add_argument(
        STORE_FLAG,
        type=_store_url_arg,
        default=None,
        metavar="URL",
        help="Redis server holding every user's global budget, so that a "
        "user's limit holds across engines (replicas, --data-parallel-size): "
        "redis://HOST:PORT/DB, rediss://... (TLS; ?ssl_ca_certs=PEM), "
        "unix:///PATH?db=N. Never a password in it. Unset: each engine paces "
        "alone.",
    )
    group.add_argument(
        PASSWORD_FILE_FLAG,
        default=None,
        metavar="PATH",
        help=f"File holding the store's password (default: ${PASSWORD_ENV}, if set).",
    )
    group.add_argument(
        FAILURE_MODE_FLAG,
        type=_failure_mode_arg,
        default=None,
        metavar="{" + ",".join(mode.value for mode in FailureMode) + "}",
        help="What an engine does once the store has been unreachable for "
        f"{FAILURE_AFTER_FLAG}: keep pacing each user at its local share "
        "(default), fail-open (stop limiting) or fail-closed (pause every paced "
        "user).",
    )
    group.add_argument(
        FAILURE_AFTER_FLAG,
        type=_seconds_arg,
        default=None,
        metavar="SECONDS",
        help="Seconds of store outage before the failure mode applies "
        f"(default {DEFAULT_FAILURE_AFTER_S:g}).",
    )
    group.add_argument(
        TIMEOUT_FLAG,
        type=_timeout_arg,
        default=None,
        metavar="MS",
        help="Longest a store call may take before it counts as a failure "
        f"(default {DEFAULT_TIMEOUT_MS}).",
    )


def parse_user_rates(raw: str | None) -> dict[str, int]:
    """Parses ``--user-output-tokens-per-second`` JSON: ``{"user": rate, ...}``."""
    rates: dict[str, int] = _parse_json(raw, USER_RATES_FLAG)
    return rates


#: JSON flag -> (the JSON type of its value, what it is, an example).
_JSON_FLAGS: dict[str, tuple[type, str, str]] = {
    USER_RATES_FLAG: (
        dict,
        "object mapping user names to tokens per second",
        '{"user-a": 100}',
    ),
    TIERS_FLAG: (
        dict,
        "object mapping tier names to tokens per second",
        '{"free": 20}',
    ),
    TIER_MEMBERS_FLAG: (
        dict,
        "object mapping user names to tier names",
        '{"user-b": "pro"}',
    ),
    EXEMPT_USERS_FLAG: (list, "array of user names", '["ops"]'),
    EXEMPT_TIERS_FLAG: (list, "array of tier names", '["staff"]'),
}


def _parse_json(raw: str | None, flag: str) -> Any:
    """``flag``'s JSON value, checked to be of the flag's JSON type; empty when
    the flag is absent or blank."""
    kind, what, example = _JSON_FLAGS[flag]
    if raw is None or raw.strip() == "":
        return kind()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(
            f"{flag} is not valid JSON ({exc.msg} at position {exc.pos}); "
            f"expected a JSON {what} like {example}"
        ) from None
    if not isinstance(value, kind):
        raise SettingsError(f"{flag} must be a JSON {what}, got {type(value).__name__}")
    return value


def _names(value: object, where: str) -> frozenset[str]:
    """``value`` (an array of names) as a set; each name is validated later."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(
        value, list | tuple | set | frozenset
    ):
        raise SettingsError(
            f"{where} must be an array of names, got {type(value).__name__}"
        )
    for name in value:
        if not isinstance(name, str):
            raise SettingsError(
                f"{where} must hold names (strings), got {name!r} of type "
                f"{type(name).__name__}"
            )
    return frozenset(value)


def _object_entry(entry: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """``entry[key]`` as a dict (absent or null: empty)."""
    value = entry.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SettingsError(f"{where}[{key!r}] must be an object")
    return dict(value)


def _names_entry(entry: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
    """``entry[key]`` as a set of names (absent or null: empty)."""
    value = entry.get(key)
    return frozenset() if value is None else _names(value, f"{where}[{key!r}]")


#: Limit-table field of ``OutputRateSettings`` -> its flag.
_TABLE = {
    "user_rates": USER_RATES_FLAG,
    "tier_rates": TIERS_FLAG,
    "memberships": TIER_MEMBERS_FLAG,
    "exempt_users": EXEMPT_USERS_FLAG,
    "exempt_tiers": EXEMPT_TIERS_FLAG,
}


def _check_table_part(name: str, value: Any) -> None:
    """Validates the names and rates of limit-table field ``name`` on its own,
    raising ValueError naming its flag: pacing.limits' rules (tier names follow
    the user-id rule, as in ``validate_tier``). ``OutputRateSettings`` checks
    the rules across fields."""
    flag = _TABLE[name]
    if name == "user_rates":
        for user, rate in value.items():
            validate_user(user, field=f"user name in {flag}")
            validate_rate(rate, field=f"{flag} rate of {user!r}")
    elif name == "tier_rates":
        for tier, rate in value.items():
            validate_user(tier, field=f"tier name in {flag}")
            validate_rate(rate, field=f"{flag} rate of {tier!r}")
    elif name == "memberships":
        for user, tier in value.items():
            validate_user(user, field=f"user name in {flag}")
            validate_user(tier, field=f"tier of {user!r} in {flag}")
    elif name == "exempt_users":
        for user in value:
            validate_user(user, field=f"user name in {flag}")
    else:
        for tier in value:
            validate_user(tier, field=f"tier name in {flag}")


#: ``ControlSettings`` field -> its flag.
_FLAGS = {
    "address": ADDRESS_FLAG,
    "config_path": CONFIG_FLAG,
    "token_file": TOKEN_FILE_FLAG,
    "tls_cert": TLS_CERT_FLAG,
    "tls_key": TLS_KEY_FLAG,
    "tls_client_ca": TLS_CLIENT_CA_FLAG,
}


#: ``StoreSettings`` field -> its flag; the URL's flag turns the store on.
_STORE_FLAGS = {
    "password_file": PASSWORD_FILE_FLAG,
    "failure_mode": FAILURE_MODE_FLAG,
    "failure_after_s": FAILURE_AFTER_FLAG,
    "timeout_ms": TIMEOUT_FLAG,
}


def _store_from_cli_args(args: argparse.Namespace) -> StoreSettings | None:
    """The store's flags as settings (flags not given: their defaults); ``None``
    without ``STORE_FLAG``, when any other store flag is an error."""
    url = getattr(args, _dest(STORE_FLAG))
    given = {
        name: value
        for name, flag in _STORE_FLAGS.items()
        if (value := getattr(args, _dest(flag))) is not None
    }
    if url is None:
        if given:
            flag = _STORE_FLAGS[next(iter(given))]
            raise SettingsError(f"{flag} needs {STORE_FLAG}")
        return None
    try:
        return StoreSettings(url, **given)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _fields(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _dest(flag: str) -> str:
    """The attribute argparse stores ``flag``'s value under (its ``dest``)."""
    return flag.lstrip("-").replace("-", "_")


def _check_keys(entry: object, where: str, known: set[str]) -> None:
    if not isinstance(entry, Mapping):
        raise SettingsError(f"{where} must be an object")
    unknown = set(entry) - known
    if unknown:
        raise SettingsError(
            f"{where} has unknown keys {sorted(unknown)}; expected "
            f"{', '.join(sorted(known))}"
        )


def _rate_arg(raw: str) -> int:
    try:
        return validate_rate(int(raw), field="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer (tokens per second), got {raw!r}: {exc}"
        ) from None


def _mode_arg(raw: str) -> Mode:
    try:
        return parse_mode(raw, field="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _user_source_arg(raw: str) -> UserSource:
    try:
        return parse_user_source(raw, field="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_url_arg(raw: str) -> str:
    try:
        return validate_url(raw)
    except ValueError as exc:  # the message never holds the URL
        raise argparse.ArgumentTypeError(str(exc)) from None


def _failure_mode_arg(raw: str) -> FailureMode:
    try:
        return parse_failure_mode(raw, field="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_arg(raw: str) -> float:
    try:
        return validate_failure_after(float(raw), field="value")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a non-negative number of seconds, got {raw!r}"
        ) from None


def _timeout_arg(raw: str) -> int:
    try:
        return validate_timeout_ms(int(raw), field="value")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of milliseconds in 1..{MAX_TIMEOUT_MS}, "
            f"got {raw!r}"
        ) from None


def _json_arg(flag: str) -> Callable[[str], str]:
    """The argparse ``type`` of JSON flag ``flag``: checks the value on its own
    (rules across flags are checked once all are parsed) and keeps the text."""
    name = next(name for name, table_flag in _TABLE.items() if table_flag == flag)

    def check(raw: str) -> str:
        try:
            value = _parse_json(raw, flag)
            if isinstance(value, list):
                value = _names(value, flag)
            _check_table_part(name, value)
        except ValueError as exc:  # SettingsError included
            raise argparse.ArgumentTypeError(str(exc)) from None
        return raw

    return check
