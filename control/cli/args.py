"""``output-rate-ctl``'s command line: the parser, its subcommands and the
argument types that check every value.

Invariant: every argument's value is checked here, before anything is sent:
numbers against the range the proto field holds and the server accepts, user
and tier ids by the one rule of ``pacing.identity.validate_user``, strings as
well-formed Unicode (the combinations that create-tier and update-tier need
are checked by those commands, and the token by ``control.cli.client``, also
before sending); a usage error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from control.cli import commands, import_export
from control.cli.client import EXIT_USAGE
from control.cli.commands import Command
from control.cli.render import encodes, print_error
from control.service.ordering import MAX_PAGE_SIZE
from control.service.user_states import (
    MAX_WATCH_INTERVAL_NS,
    MIN_WATCH_INTERVAL_NS,
    MOST_THROTTLED_FIRST,
)
from pacing.fair_share import validate_weight
from pacing.identity import validate_user
from pacing.limits import validate_rate
from pacing.modes import Mode
from pacing.policy.errors import PolicyError
from pacing.settings.flags import DEFAULT_ADDRESS, TOKEN_ENV

#: Longest --timeout: far beyond any call, far below where gRPC's deadline
#: arithmetic overflows (about 1e10 s).
MAX_TIMEOUT_S = 86_400.0


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (argparse prints the usage first); subcommand
    parsers are of this class, too (``add_subparsers`` uses the parent's)."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(EXIT_USAGE)


def _shown(raw: str, limit: int = 32) -> str:
    """An argument for an error message: quoted, escaped, cut after ``limit``."""
    return repr(raw) if len(raw) <= limit else repr(raw[:limit]) + "..."


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in ``low..high`` (no upper bound: None)."""
    bounds = f", at least {low}" if high is None else f" between {low} and {high}"

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:  # also for more than 4300 digits
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be a whole number{bounds}, got {_shown(raw)}"
            )
        return value

    return parse


def _seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds in ``low..high`` (not nan or inf)."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # false for nan
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds between {low:g} and {high:g}, "
                f"got {_shown(raw)}"
            )
        return value

    return parse


def _rate(raw: str) -> int:
    """A rate, in the words of the rule (``pacing.limits.validate_rate``)."""
    try:
        value: int | str = int(raw)
    except ValueError:  # no whole number (or over 4300 digits): shown as typed
        value = raw
    try:
        return validate_rate(value)
    except PolicyError as error:
        raise argparse.ArgumentTypeError(error.message) from None


def _weight(raw: str) -> float:
    """A fair-share weight, in the words of the rule
    (``pacing.fair_share.validate_weight``)."""
    try:
        value: float | str = float(raw)
    except ValueError:  # no number: shown as typed
        value = raw
    try:
        return validate_weight(value)
    except PolicyError as error:
        raise argparse.ArgumentTypeError(error.message) from None


def _user(raw: str) -> str:
    try:
        return validate_user(raw, field="the user id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tier(raw: str) -> str:
    try:
        return validate_user(raw, field="the tier id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _team(raw: str) -> str:
    try:
        return validate_user(raw, field="the team id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _text(raw: str) -> str:
    """Any well-formed Unicode (argv may hold lone surrogates: undecodable bytes)."""
    if not encodes(raw):
        raise argparse.ArgumentTypeError("must be well-formed Unicode")
    return raw


class _RefuseToken(argparse.Action):
    """``--token``, refused: a token on the command line is in the process list
    (``ps``, ``/proc/PID/cmdline``) for every local user to read."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"argument --token: a token on the command line is readable by every "
            f"local user in the process list; put it in ${TOKEN_ENV} or in a "
            "file named by --token-file"
        )


def _add_team_commands(teams: argparse.ArgumentParser) -> None:
    """The subcommands of ``output-rate-ctl teams``."""
    subcommands = teams.add_subparsers(
        dest="teams_command", required=True, metavar="TEAMS_COMMAND"
    )

    def command(name: str, run: Command, summary: str) -> argparse.ArgumentParser:
        sub = subcommands.add_parser(name, help=summary, description=summary)
        sub.set_defaults(run=run)
        return sub

    command("list", commands.list_teams, "list teams with their member counts")
    command("get", commands.get_team, "show one team").add_argument("team", type=_team)
    sub = command(
        "create", commands.create_team, "create a team: a rate its members share"
    )
    sub.add_argument("team", type=_team)
    sub.add_argument("rate", type=_rate, help="tokens per second")
    sub.add_argument(
        "--weight", type=_weight, metavar="W", help="fair-share weight among teams"
    )
    sub = command(
        "update",
        commands.update_team,
        "change a team's rate or weight (members share it from the next step)",
    )
    sub.add_argument("team", type=_team)
    sub.add_argument("--rate", type=_rate, metavar="N", help="tokens per second")
    weight = sub.add_mutually_exclusive_group()
    weight.add_argument(
        "--weight", type=_weight, metavar="W", help="fair-share weight among teams"
    )
    weight.add_argument(
        "--no-weight",
        dest="weight",
        action="store_const",
        const=0.0,
        help="remove the weight (the team weighs 1)",
    )
    sub.add_argument(
        "--allow-missing",
        action="store_true",
        help="create the team if there is none (needs --rate)",
    )
    sub = command(
        "delete", commands.delete_team, "delete a team (refused while it has members)"
    )
    sub.add_argument("team", type=_team)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    command(
        "state",
        commands.team_state,
        "show the budget and members of one team, or of all teams",
    ).add_argument("team", nargs="?", type=_team)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``output-rate-ctl``: each subcommand's ``run`` is its
    ``Command``."""
    parser = _Parser(
        prog="output-rate-ctl",
        description=(
            "Read and change per-user output-token limits, tiers, teams, exemptions, "
            "fair-share weights, the pacing mode and fair share of a vLLM engine."
        ),
        epilog="Exit status: 0 ok, 1 request refused (status code on stderr), 2 usage.",
    )
    parser.add_argument(
        "--address",
        type=_text,
        default=DEFAULT_ADDRESS,
        help="host:port (default %(default)s)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file holding the bearer token (default: ${TOKEN_ENV})",
    )
    parser.add_argument(
        "--token",
        nargs="?",
        action=_RefuseToken,
        help=f"refused: use ${TOKEN_ENV} or --token-file",
    )
    parser.add_argument(
        "--tls-ca", metavar="PEM", help="CA of the server certificate (enables TLS)"
    )
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate chain (mTLS)"
    )
    parser.add_argument("--tls-key", metavar="PEM", help="client private key (mTLS)")
    parser.add_argument(
        "--tls-server-name",
        type=_text,
        metavar="NAME",
        help="expected name in the server certificate",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds(0.001, MAX_TIMEOUT_S),
        default=10.0,
        help="seconds per call (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    subcommands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND"
    )

    def command(name: str, run: Command, summary: str) -> argparse.ArgumentParser:
        sub = subcommands.add_parser(name, help=summary, description=summary)
        sub.set_defaults(run=run)
        return sub

    sub = command(
        "list",
        commands.list_limits,
        "list user entries: own limit, tier, exemption",
    )
    sub.add_argument(
        "--page-size",
        type=_whole(1, MAX_PAGE_SIZE),
        default=MAX_PAGE_SIZE,
        help="limits per request (default %(default)s)",
    )
    command("get", commands.get_limit, "show one user's entry").add_argument(
        "user", type=_user
    )
    sub = command(
        "set", commands.set_limit, "set one user's limit (creates it if missing)"
    )
    sub.add_argument("user", type=_user)
    sub.add_argument("rate", type=_rate, help="tokens per second")
    sub.add_argument(
        "--create", action="store_true", help="fail if the user has a limit already"
    )
    command(
        "unset",
        commands.unset_limit,
        "remove one user's own limit (its tier or the default applies)",
    ).add_argument("user", type=_user)
    sub = command(
        "delete",
        commands.delete_entry,
        "delete one user's entry: limit, tier, exemption (the default applies again)",
    )
    sub.add_argument("user", type=_user)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    sub = command("assign", commands.assign, "make a user a member of a tier")
    sub.add_argument("user", type=_user)
    sub.add_argument("tier", type=_tier)
    command("unassign", commands.unassign, "take a user out of its tier").add_argument(
        "user", type=_user
    )
    command("exempt", commands.exempt, "make a user unlimited").add_argument(
        "user", type=_user
    )
    command(
        "unexempt",
        commands.unexempt,
        "lift a user's exemption (its limit applies again)",
    ).add_argument("user", type=_user)
    sub = command(
        "set-weight",
        commands.set_weight,
        "set one user's fair-share weight (creates its entry if missing)",
    )
    sub.add_argument("user", type=_user)
    sub.add_argument("weight", type=_weight, help="(0, 1000000]; default weight 1")
    command(
        "unset-weight",
        commands.unset_weight,
        "remove one user's own weight (its tier's, else 1, applies)",
    ).add_argument("user", type=_user)
    command("list-tiers", commands.list_tiers, "list tiers with their member counts")
    command("get-tier", commands.get_tier, "show one tier").add_argument(
        "tier", type=_tier
    )
    sub = command(
        "create-tier",
        commands.create_tier,
        "create a tier: a rate, --exempt or both",
    )
    sub.add_argument("tier", type=_tier)
    sub.add_argument("rate", nargs="?", type=_rate, help="tokens per second")
    sub.add_argument(
        "--exempt",
        action="store_true",
        help="members without a limit of their own are unlimited",
    )
    sub.add_argument(
        "--weight",
        type=_weight,
        metavar="W",
        help="fair-share weight of members without one of their own",
    )
    sub = command(
        "update-tier",
        commands.update_tier,
        "change a tier's rate or exemption (members follow at the next step)",
    )
    sub.add_argument("tier", type=_tier)
    rate = sub.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_rate, metavar="N", help="tokens per second")
    rate.add_argument(
        "--no-rate", dest="rate", action="store_const", const=0, help="remove the rate"
    )
    exemption = sub.add_mutually_exclusive_group()
    exemption.add_argument("--exempt", action="store_const", const=True)
    exemption.add_argument(
        "--no-exempt", dest="exempt", action="store_const", const=False
    )
    weight = sub.add_mutually_exclusive_group()
    weight.add_argument(
        "--weight", type=_weight, metavar="W", help="fair-share weight of members"
    )
    weight.add_argument(
        "--no-weight",
        dest="weight",
        action="store_const",
        const=0.0,
        help="remove the weight (members weigh 1)",
    )
    sub.add_argument(
        "--allow-missing", action="store_true", help="create the tier if there is none"
    )
    sub = command(
        "delete-tier",
        commands.delete_tier,
        "delete a tier (refused while it has members)",
    )
    sub.add_argument("tier", type=_tier)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    sub = command("join", commands.join_team, "make a user a member of a team")
    sub.add_argument("user", type=_user)
    sub.add_argument("team", type=_team)
    command("leave", commands.leave_team, "take a user out of its team").add_argument(
        "user", type=_user
    )
    teams = subcommands.add_parser(
        "teams",
        help="list, show, create, change and delete teams; show their state",
        description="Teams: a rate shared by their members (see join, leave).",
    )
    _add_team_commands(teams)
    command("get-mode", commands.get_mode, "show the pacing mode")
    command(
        "set-mode",
        commands.set_mode,
        "switch the pacing mode now (enforce, shadow, off)",
    ).add_argument("mode", choices=[mode.value for mode in Mode])
    command(
        "set-fair-share",
        commands.set_fair_share,
        "switch weighted fair share on or off now",
    ).add_argument("switch", choices=["on", "off"])
    command("get-default", commands.get_default, "show the default limit")
    command("set-default", commands.set_default, "set the default limit").add_argument(
        "rate", type=_rate, help="tokens per second"
    )
    sub = command(
        "state", commands.state, "show limiter state of one user, or of all users"
    )
    sub.add_argument("user", nargs="?", type=_user)
    sub.add_argument(
        "--order-by",
        type=_text,
        default=MOST_THROTTLED_FIRST,
        help="default: %(default)s",
    )
    sub.add_argument(
        "--top", type=_whole(0), default=0, help="show at most N users (0: all)"
    )
    sub = command("watch", commands.watch, "show limiter state live")
    sub.add_argument(
        "users",
        nargs="*",
        type=_user,
        help="users to watch (default: the top ones)",
    )
    sub.add_argument(
        "--interval",
        type=_seconds(MIN_WATCH_INTERVAL_NS / 1e9, MAX_WATCH_INTERVAL_NS / 1e9),
        default=1.0,
        help="seconds between updates (default %(default)s)",
    )
    sub.add_argument(
        "--order-by",
        type=_text,
        default=MOST_THROTTLED_FIRST,
        help="default: %(default)s",
    )
    sub.add_argument(
        "--top",
        type=_whole(1, MAX_PAGE_SIZE),
        default=20,
        help="users per update without USERS (default %(default)s)",
    )
    sub.add_argument(
        "--count", type=_whole(0), default=0, help="stop after N updates (0: never)"
    )
    sub = command(
        "export",
        import_export.export,
        "write the limits table and tiers as JSON (with its etag)",
    )
    sub.add_argument("file", nargs="?", help="output file (default: stdout)")
    sub = command(
        "import",
        import_export.import_table,
        "replace the limits table and tiers from a file (not the mode)",
    )
    sub.add_argument("file", help="as written by export; - for stdin")
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace even if the table changed since the export",
    )
    return parser
