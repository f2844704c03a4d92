"""The command-line side of the settings: ``add_cli_args`` adds every flag to a
vLLM parser, each with an argparse ``type`` that checks its value as it is
parsed, and ``dest`` and ``store_from_cli_args`` read the parsed values back.

A bad value on its own is an argparse error; the rules across flags are checked
once all are parsed, by ``OutputRateSettings.from_cli_args``
(``pacing.settings.model``), which this module does not import.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pacing.identity import (
    TABLE_TEAM_SOURCE,
    XARGS_SOURCE,
    TeamSource,
    UserSource,
    parse_team_source,
    parse_user_source,
)
from pacing.limiter import validate_rate
from pacing.modes import Mode, parse_mode
from pacing.settings.checks import (
    SettingsError,
    name_set,
    parse_json,
)
from pacing.settings.fair_share import config_from_flag
from pacing.settings.flags import (
    ADDRESS_FLAG,
    ADDRESS_OFF,
    ALLOW_UNATTRIBUTED_FLAG,
    CONFIG_FLAG,
    DEFAULT_ADDRESS,
    DEFAULT_RATE_FLAG,
    EXEMPT_TIERS_FLAG,
    EXEMPT_USERS_FLAG,
    FAIR_SHARE_CONFIG_FLAG,
    FAIR_SHARE_FLAG,
    MODE_FLAG,
    POLICY_FLAG,
    REQUIRE_USER_FLAG,
    TEAM_MEMBERS_FLAG,
    TEAM_SOURCE_FLAG,
    TEAMS_FLAG,
    TIER_MEMBERS_FLAG,
    TIERS_FLAG,
    TLS_CERT_FLAG,
    TLS_CLIENT_CA_FLAG,
    TLS_KEY_FLAG,
    TOKEN_ENV,
    TOKEN_FILE_FLAG,
    USER_RATES_FLAG,
    USER_SOURCE_FLAG,
    WEIGHTS_FLAG,
)
from pacing.settings.store import (
    DEFAULT_FAILURE_AFTER_S,
    DEFAULT_TIMEOUT_MS,
    EXPECTED_ENGINES_FLAG,
    FAILURE_AFTER_FLAG,
    FAILURE_MODE_FLAG,
    FLEET_FLAG,
    MAX_EXPECTED_ENGINES,
    MAX_TIMEOUT_MS,
    PASSWORD_ENV,
    PASSWORD_FILE_FLAG,
    STORE_FLAG,
    STORE_FLAGS,
    TIMEOUT_FLAG,
    FailureMode,
    StoreSettings,
    parse_failure_mode,
    validate_expected_engines,
    validate_failure_after,
    validate_fleet,
    validate_timeout_ms,
    validate_url,
)


def add_cli_args(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds every flag to ``group`` (a parser or an argument group); values are
    checked as they are parsed, so a bad one is an argparse error."""
    group.add_argument(
        POLICY_FLAG,
        default=None,
        metavar="PATH|JSON",
        help="The whole start-up policy as one document (the limits file's "
        "format: default, users, tiers, teams, weights, mode, fair_share), "
        "inline as JSON or the path of a JSON or YAML file, read once at start. "
        "It enables pacing; the flags that give pieces of it (the default, user "
        "limits, tiers, teams, members, exemptions, weights, mode, fair share) "
        "are its aliases and cannot be given with it.",
    )
    group.add_argument(
        DEFAULT_RATE_FLAG,
        type=_rate_arg,
        default=None,
        metavar="N",
        help="Enables pacing: output tokens/s shared by all requests of a user "
        "without an explicit limit. Unset: the scheduler behaves as upstream.",
    )
    group.add_argument(
        USER_RATES_FLAG,
        type=_json_arg(USER_RATES_FLAG),
        default=None,
        metavar="JSON",
        help="Per-user limits as a JSON object, e.g. '{\"user-a\": 100}'.",
    )
    group.add_argument(
        MODE_FLAG,
        type=_mode_arg,
        default=None,
        metavar="{" + ",".join(mode.value for mode in Mode) + "}",
        help="What pacing does with its decisions: enforce them (default); "
        "shadow: compute and export everything enforce would, throttle nobody; "
        "off: the kill switch (limits kept, nothing recorded).",
    )
    group.add_argument(
        TIERS_FLAG,
        type=_json_arg(TIERS_FLAG),
        default=None,
        metavar="JSON",
        help='Named rate classes as a JSON object, e.g. \'{"free": 20, "pro": 200}\' '
        "(tokens/s for each member).",
    )
    group.add_argument(
        TIER_MEMBERS_FLAG,
        type=_json_arg(TIER_MEMBERS_FLAG),
        default=None,
        metavar="JSON",
        help='Tier of each user as a JSON object, e.g. \'{"user-b": "pro"}\'. A '
        "user's own limit wins over its tier's.",
    )
    group.add_argument(
        TEAMS_FLAG,
        type=_json_arg(TEAMS_FLAG),
        default=None,
        metavar="JSON",
        help="Teams as a JSON object, e.g. '{\"acme\": 600}' (tokens/s shared by "
        "all members of the team, split among them by weight while it binds).",
    )
    group.add_argument(
        TEAM_MEMBERS_FLAG,
        type=_json_arg(TEAM_MEMBERS_FLAG),
        default=None,
        metavar="JSON",
        help='Team of each user as a JSON object, e.g. \'{"user-a": "acme"}\'. A '
        "member's own limit and its team's both hold.",
    )
    group.add_argument(
        EXEMPT_USERS_FLAG,
        type=_json_arg(EXEMPT_USERS_FLAG),
        default=None,
        metavar="JSON",
        help="Users never throttled, as a JSON array, e.g. '[\"ops\"]'.",
    )
    group.add_argument(
        EXEMPT_TIERS_FLAG,
        type=_json_arg(EXEMPT_TIERS_FLAG),
        default=None,
        metavar="JSON",
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
        TEAM_SOURCE_FLAG,
        type=_team_source_arg,
        default=TABLE_TEAM_SOURCE,
        metavar="{table,header:NAME}",
        help="Where a request's team comes from: the membership table "
        "(--output-rate-team-members; the default), or request header NAME set "
        "by the trusted gateway (needs a gateway --output-rate-user-source; a "
        "team that does not exist refuses the request).",
    )
    group.add_argument(
        REQUIRE_USER_FLAG,
        action="store_true",
        help="Refuse (401) a request that names no user, instead of charging it "
        "to __anonymous__.",
    )
    group.add_argument(
        ALLOW_UNATTRIBUTED_FLAG,
        action="store_true",
        help="With a gateway --output-rate-user-source: serve the routes that "
        "cannot carry a user id to the scheduler (/generative_scoring, "
        "/v1/systemone, /cohere/v2/chat, pooling routes, the /v1/realtime "
        "websocket), charged to __anonymous__. Refused (403) by default, so that "
        "no tenant can spend the anonymous budget by choosing a route.",
    )
    group.add_argument(
        FAIR_SHARE_FLAG,
        action="store_true",
        help="Weighted fair share when the engine is saturated: among users with "
        "budget, slots and admission go to the user with the least weighted "
        "service (prompt and output tokens computed); caps stay as they are. "
        "Live-switchable through the control plane.",
    )
    group.add_argument(
        WEIGHTS_FLAG,
        type=_json_arg(WEIGHTS_FLAG),
        default=None,
        metavar="JSON",
        help='Fair-share weights as JSON, e.g. \'{"users": {"alice": 2}, "tiers": '
        '{"pro": 4}, "teams": {"acme": 2}}\' (a user\'s own weight wins over its '
        "tier's; default 1). A user's weight splits its team's share; a team's "
        "weight counts among teams.",
    )
    group.add_argument(
        FAIR_SHARE_CONFIG_FLAG,
        type=_checked(config_from_flag),
        default=None,
        metavar="JSON",
        help="Fair-share pricing as JSON: prompt_price (1) and output_price (2) "
        "per token computed, hysteresis (1024 weighted units a user must be "
        "ahead before its request yields a slot) and min_run_tokens (16 tokens "
        "a request samples after each admission before it may yield again).",
    )
    group.add_argument(
        ADDRESS_FLAG,
        default=DEFAULT_ADDRESS,
        metavar="HOST:PORT",
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
    group.add_argument(
        FLEET_FLAG,
        type=_fleet_arg,
        default=None,
        metavar="NAME",
        help="Fleet name prefixed to every store key and channel, so that fleets "
        "sharing one Redis stay apart (1-64 of A-Z a-z 0-9 _ . -; or ?fleet=NAME "
        "in the URL). Unset: the keys of a store without fleets.",
    )
    group.add_argument(
        EXPECTED_ENGINES_FLAG,
        type=_expected_engines_arg,
        default=None,
        metavar="N",
        help="Engines the fleet runs, assumed until the store has told this "
        "engine their count: while the store is unreachable each user's local "
        "share is R/N. Unset: until then, limited users wait for the store.",
    )


def dest(flag: str) -> str:
    """The attribute argparse stores ``flag``'s value under (its ``dest``)."""
    return flag.lstrip("-").replace("-", "_")


#: ``StoreSettings`` field -> its flag, but the URL's (which turns the store on).
_STORE_FLAGS = {name: flag for name, flag in STORE_FLAGS.items() if flag != STORE_FLAG}


def store_from_cli_args(args: argparse.Namespace) -> StoreSettings | None:
    """The store's flags as settings (flags not given: their defaults); ``None``
    without ``STORE_FLAG``, when any other store flag is an error."""
    url = getattr(args, dest(STORE_FLAG))
    given = {
        name: value
        for name, flag in _STORE_FLAGS.items()
        if (value := getattr(args, dest(flag))) is not None
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


def _team_source_arg(raw: str) -> TeamSource:
    try:
        return parse_team_source(raw, field="value")
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


def _fleet_arg(raw: str) -> str:
    try:
        return validate_fleet(raw, field="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _expected_engines_arg(raw: str) -> int:
    try:
        return validate_expected_engines(int(raw), field="value")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of engines in 1..{MAX_EXPECTED_ENGINES}, "
            f"got {raw!r}"
        ) from None


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse ``type`` that checks a JSON value with ``parse`` and keeps
    the text (rules across flags are checked once all are parsed)."""

    def check(raw: str) -> str:
        try:
            parse(raw)
        except ValueError as exc:  # SettingsError included
            raise argparse.ArgumentTypeError(str(exc)) from None
        return raw

    return check


def _json_arg(flag: str) -> Callable[[str], str]:
    """The argparse ``type`` of JSON flag ``flag``: checks that the value is
    JSON of the flag's type and keeps the text (the policy's rules are checked
    once all flags are parsed, on the document they build)."""

    def check(raw: str) -> str:
        try:
            value = parse_json(raw, flag)
            if isinstance(value, list):
                name_set(value, flag)
        except ValueError as exc:  # SettingsError included
            raise argparse.ArgumentTypeError(str(exc)) from None
        return raw

    return check
