"""``output-rate-ctl``'s command line: the parser, its subcommands and the
argument types that check every value.

Invariant: every argument's value is checked here, before anything is sent:
numbers against the range the proto field holds and the server accepts, user
and tier ids by the one rule of ``pacing.identity.validate_user``, strings as
well-formed Unicode (the combinations that a create or an update needs are
checked by those commands, and the token by ``control.cli.client``, also
before sending); a usage error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn

from google.protobuf.descriptor import FieldDescriptor

from control.cli import commands, import_export, spelling
from control.cli.client import EXIT_USAGE
from control.cli.commands import Command
from control.cli.render import encodes, print_error
from control.kinds import ALL, TEAMS, TIERS, USERS, Kind
from control.service.ordering import MAX_PAGE_SIZE
from control.service.user_states import (
    MAX_WATCH_INTERVAL_NS,
    MIN_WATCH_INTERVAL_NS,
    MOST_THROTTLED_FIRST,
)
from pacing.identity import validate_user
from pacing.modes import Mode
from pacing.policy.errors import PolicyError
from pacing.policy.model import ATTRIBUTES, RULES
from pacing.settings.flags import DEFAULT_ADDRESS, TOKEN_ENV
from protos.outputrate.v1 import output_rate_pb2 as _pb2

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


def _by_rule(message: str, field: str) -> Callable[[str], Any]:
    """An argparse type: a value of the attribute ``field``, a whole number, a
    number or a name as the message named ``message`` (a kind's title,
    ``DefaultLimit``) holds it, checked in the words of its rule
    (``pacing.policy.model.RULES``: ``validate_rate``, ``validate_weight``,
    ``validate_band``)."""
    rule = RULES[field]
    cpp_type = _field(message, field).cpp_type
    number: Callable[[str], object] = (
        str
        if cpp_type == FieldDescriptor.CPPTYPE_STRING
        else float
        if cpp_type in _REALS
        else int
    )

    def parse(raw: str) -> Any:
        try:
            value: object = number(raw)
        except ValueError:  # no number (or over 4300 digits): shown as typed
            value = raw
        try:
            return rule(value)
        except PolicyError as error:
            raise argparse.ArgumentTypeError(error.message) from None

    return parse


def _field(message: str, field: str) -> FieldDescriptor:
    """``field`` of the message named ``message`` (a kind's title)."""
    fields = getattr(_pb2, message).DESCRIPTOR.fields_by_name
    descriptor: FieldDescriptor = fields[field]
    return descriptor


def _holder_id(holder: str) -> Callable[[str], str]:
    """An argparse type: the id of a ``holder`` (``user``, ``tier``, ``team``),
    by the user-id rule."""

    def parse(raw: str) -> str:
        try:
            return validate_user(raw, field=f"the {holder} id")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


_REALS = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)
_rate = _by_rule(USERS.title, "tokens_per_second")
_weight = _by_rule(USERS.title, "weight")
_user, _tier, _team = (_holder_id(kind.holder) for kind in ALL)


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


_Add = Callable[[str, Command, str], argparse.ArgumentParser]


def _adder(subcommands: argparse._SubParsersAction[_Parser]) -> _Add:
    """Adds a subcommand (name, its ``Command``, its one-line summary)."""

    def command(name: str, run: Command, summary: str) -> argparse.ArgumentParser:
        sub = subcommands.add_parser(name, help=summary, description=summary)
        sub.set_defaults(run=run)
        return sub

    return command


#: The summaries of a group kind's create and update; the other verbs' are
#: the same words for every kind (``_add_holder_commands``).
_SUMMARIES: Mapping[tuple[str, str], str] = {
    ("tier", "create"): "create a tier: a rate, --exempt or both",
    ("tier", "update"): (
        "change a tier's rate or exemption (members follow at the next step)"
    ),
    ("team", "create"): "create a team: a rate its members share",
    ("team", "update"): (
        "change a team's rate or weight (members share it from the next step)"
    ),
}
#: The help of an attribute's argument, by (holder, field, role: ``create``,
#: ``update`` or ``clear``), where it is not the field's words (``tokens per
#: second``) or, to clear it, ``remove the`` its noun (``remove the rate``).
_HELP: Mapping[tuple[str, str, str], str | None] = {
    ("tier", "exempt", "create"): "members without a limit of their own are unlimited",
    ("tier", "exempt", "update"): None,
    ("tier", "exempt", "clear"): None,
    ("tier", "weight", "create"): (
        "fair-share weight of members without one of their own"
    ),
    ("tier", "weight", "update"): "fair-share weight of members",
    ("tier", "weight", "clear"): "remove the weight (members weigh 1)",
    ("team", "weight", "create"): "fair-share weight among teams",
    ("team", "weight", "update"): "fair-share weight among teams",
    ("team", "weight", "clear"): "remove the weight (the team weighs 1)",
    ("user", "tokens_per_second", "clear"): (
        "remove the user's own limit (its tier or the default applies)"
    ),
    ("user", "exempt", "update"): "make the user unlimited",
    ("user", "exempt", "clear"): "lift the exemption (its limit applies again)",
    ("user", "weight", "update"): "fair-share weight (default 1)",
    ("user", "weight", "clear"): "remove the user's own weight (its tier's, else 1)",
    ("user", "tier", "update"): "make the user a member of the tier",
    ("user", "tier", "clear"): "take the user out of its tier",
    ("user", "team", "update"): "make the user a member of the team",
    ("user", "team", "clear"): "take the user out of its team",
    ("user", "prompt_tokens_per_second", "update"): (
        "the user's own prompt rate: uncached prompt tokens computed per second"
    ),
    ("user", "prompt_tokens_per_second", "clear"): (
        "remove the user's own prompt rate (its tier's or the default's applies)"
    ),
    ("tier", "prompt_tokens_per_second", "create"): (
        "prompt rate (uncached prompt tokens computed per second) of members "
        "without one of their own"
    ),
    ("tier", "prompt_tokens_per_second", "update"): (
        "prompt rate (uncached prompt tokens computed per second) of members"
    ),
    ("tier", "prompt_tokens_per_second", "clear"): (
        "remove the prompt rate (the default's applies to members)"
    ),
    ("team", "prompt_tokens_per_second", "create"): (
        "uncached prompt tokens computed per second, shared by the members"
    ),
    ("team", "prompt_tokens_per_second", "update"): (
        "uncached prompt tokens computed per second, shared by the members"
    ),
    ("team", "prompt_tokens_per_second", "clear"): (
        "remove the prompt rate (members keep their own prompt rates only)"
    ),
    ("user", "ceiling_tokens_per_second", "update"): (
        "the user's own ceiling: output tokens per second it may borrow up to "
        "while nobody else within its rate waits (at least its own rate)"
    ),
    ("user", "ceiling_tokens_per_second", "clear"): (
        "remove the user's own ceiling (its tier's or the default's applies)"
    ),
    ("tier", "ceiling_tokens_per_second", "create"): (
        "ceiling (output tokens per second borrowed up to while nobody else "
        "waits; at least the rate) of members without one of their own"
    ),
    ("tier", "ceiling_tokens_per_second", "update"): (
        "ceiling (output tokens per second borrowed up to while nobody else "
        "waits; at least the rate) of members"
    ),
    ("tier", "ceiling_tokens_per_second", "clear"): (
        "remove the ceiling (the default's applies to members)"
    ),
    ("team", "ceiling_tokens_per_second", "create"): (
        "output tokens per second the members may reach together, borrowing "
        "above the rate only while no user outside the team waits (at least "
        "the rate)"
    ),
    ("team", "ceiling_tokens_per_second", "update"): (
        "output tokens per second the members may reach together, borrowing "
        "above the rate only while no user outside the team waits (at least "
        "the rate)"
    ),
    ("team", "ceiling_tokens_per_second", "clear"): (
        "remove the team's ceiling (its rate holds)"
    ),
    ("default", "tokens_per_second", "update"): (
        "tokens per second of users without a limit of their own or their tier's"
    ),
    ("default", "prompt_tokens_per_second", "update"): (
        "uncached prompt tokens computed per second for users without a prompt "
        "rate of their own or their tier's"
    ),
    ("default", "prompt_tokens_per_second", "clear"): (
        "remove the default prompt rate (prompts of such users are not paced)"
    ),
    ("default", "ceiling_tokens_per_second", "update"): (
        "output tokens per second users without a ceiling of their own or their "
        "tier's may borrow up to while nobody else waits (at least the rate)"
    ),
    ("default", "ceiling_tokens_per_second", "clear"): (
        "remove the default ceiling (such users are held to their rate)"
    ),
    ("user", "band", "update"): (
        "the user's own priority band (one of the table's bands)"
    ),
    ("user", "band", "clear"): (
        "remove the user's own band (its tier's, its team's or the default's applies)"
    ),
    ("tier", "band", "create"): (
        "priority band (one of the table's bands) of members without one of their own"
    ),
    ("tier", "band", "update"): "priority band (one of the table's bands) of members",
    ("tier", "band", "clear"): (
        "remove the band (the members' team's or the default's applies)"
    ),
    ("team", "band", "create"): (
        "priority band (one of the table's bands) of members without one of "
        "their own or their tier's"
    ),
    ("team", "band", "update"): "priority band (one of the table's bands) of members",
    ("team", "band", "clear"): "remove the band (the default's applies to members)",
    ("default", "band", "update"): (
        "priority band of users without one of their own, their tier's or their "
        "team's (one of the table's bands; required once there are bands)"
    ),
    ("default", "band", "clear"): (
        "remove the default band (only while the table has no bands)"
    ),
}
#: The default's message (``update-default``'s options are its attributes).
_DEFAULT_MESSAGE = "DefaultLimit"
#: Option metavars other than ``N``.
_METAVARS = {"weight": "W", "band": "NAME"}


def _help(holder: str, field: str, role: str) -> str | None:
    key = (holder, field, role)
    if key in _HELP:
        return _HELP[key]
    if role == "clear":
        return f"remove the {spelling.noun(field)}"
    return field.replace("_", " ")


def _add_holder_commands(add: _Add, kind: Kind) -> None:
    """A group kind's list, get, create, update and delete, named as
    ``spelling.command`` says (the last word: within ``add``'s parser); each
    attribute of the kind is an argument of create and update."""
    holder_id = _holder_id(kind.holder)

    def command(verb: str, run: Command, summary: str) -> argparse.ArgumentParser:
        sub = add(spelling.command(kind, verb).split()[-1], run, summary)
        if verb != "list":
            sub.add_argument(kind.holder, type=holder_id)
        return sub

    command(
        "list",
        partial(commands.list_holders, kind),
        f"list {kind.collection} with their member counts",
    )
    command("get", partial(commands.get_holder, kind), f"show one {kind.holder}")
    sub = command(
        "create",
        partial(commands.create_holder, kind),
        _SUMMARIES.get((kind.holder, "create"), f"create a {kind.holder}"),
    )
    for field in kind.attributes:
        _add_create_argument(sub, kind, field)
    sub = command(
        "update",
        partial(commands.update_holder, kind),
        _SUMMARIES.get((kind.holder, "update"), f"change a {kind.holder}"),
    )
    required = [spelling.option(field) for field in kind.required]
    needs = f" (needs {spelling.either(required)})" if required else ""
    _add_update_options(sub, kind, f"create the {kind.holder} if there is none{needs}")
    sub = command(
        "delete",
        partial(commands.delete_holder, kind),
        f"delete a {kind.holder} (refused while it has members)",
    )
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )


def _add_create_argument(sub: argparse.ArgumentParser, kind: Kind, field: str) -> None:
    """``field`` when creating: the rate is a positional, a flag is set by its
    option, any other value is an option's; required if the holder cannot lack
    it."""
    help_text = _help(kind.holder, field, "create")
    required = field in kind.required
    if field == spelling.POSITIONAL:
        sub.add_argument(
            field,
            metavar=spelling.name(field),
            type=_by_rule(kind.title, field),
            nargs=None if required else "?",
            help=help_text,
        )
    elif _field(kind.title, field).cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        sub.add_argument(
            spelling.option(field), dest=field, action="store_true", help=help_text
        )
    else:
        _add_value_option(sub, kind.title, field, help_text, required=required)


def _add_update_options(
    sub: argparse.ArgumentParser, kind: Kind, allow_missing: str
) -> None:
    """The options of ``kind``'s update: each field's (``kind.fields``: the
    attributes, then the memberships), then ``--allow-missing`` (its help)."""
    for field in kind.fields:
        _add_update_arguments(sub, kind, field)
    sub.add_argument("--allow-missing", action="store_true", help=allow_missing)


def _add_update_arguments(sub: argparse.ArgumentParser, kind: Kind, field: str) -> None:
    """``field`` when updating: its option and, where it may be removed, the
    option that removes it (sets its zero), the two exclusive. A membership's
    value is the group's id (``--tier TIER``)."""
    clearable = spelling.clearable(kind, field)
    group = sub.add_mutually_exclusive_group() if clearable else sub
    help_text = _help(kind.holder, field, "update")
    descriptor = _field(kind.title, field)
    if field in kind.references:
        group.add_argument(
            spelling.option(field),
            dest=field,
            type=_holder_id(field),
            metavar=field.upper(),
            help=help_text,
        )
    elif descriptor.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        group.add_argument(
            spelling.option(field),
            dest=field,
            action="store_const",
            const=True,
            help=help_text,
        )
    else:
        _add_value_option(group, kind.title, field, help_text)
    if clearable:
        _add_clear_option(group, kind.title, kind.holder, field)


def _add_value_option(
    group: argparse._ActionsContainer,
    message: str,
    field: str,
    help_text: str | None,
    *,
    required: bool = False,
) -> None:
    """``field``'s option, a number or a name checked by its rule
    (``message``: the proto message that holds it)."""
    group.add_argument(
        spelling.option(field),
        dest=field,
        type=_by_rule(message, field),
        metavar=_METAVARS.get(field, "N"),
        required=required,
        help=help_text,
    )


def _add_clear_option(
    group: argparse._ActionsContainer, message: str, holder: str, field: str
) -> None:
    """The option that removes ``field`` (sets the zero ``message`` gives it)."""
    group.add_argument(
        spelling.clear_option(field),
        dest=field,
        action="store_const",
        const=_field(message, field).default_value,
        help=_help(holder, field, "clear"),
    )


def _add_default_options(sub: argparse.ArgumentParser) -> None:
    """The options of ``update-default``: each attribute of the default
    (``ATTRIBUTES['default']``) and, for those it may lack
    (``spelling.clearable_default``), the option that removes it."""
    for field in ATTRIBUTES["default"]:
        clearable = spelling.clearable_default(field)
        group = sub.add_mutually_exclusive_group() if clearable else sub
        help_text = _help("default", field, "update")
        _add_value_option(group, _DEFAULT_MESSAGE, field, help_text)
        if clearable:
            _add_clear_option(group, _DEFAULT_MESSAGE, "default", field)


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
    command = _adder(subcommands)
    sub = command(
        "list",
        partial(commands.list_holders, USERS),
        "list user entries: own limit, tier, exemption",
    )
    sub.add_argument(
        "--page-size",
        type=_whole(1, MAX_PAGE_SIZE),
        default=MAX_PAGE_SIZE,
        help="limits per request (default %(default)s)",
    )
    command(
        "get", partial(commands.get_holder, USERS), "show one user's entry"
    ).add_argument("user", type=_user)
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
    nouns = [spelling.noun(field) for field in USERS.fields]
    sub = command(
        "update",
        partial(commands.update_holder, USERS),
        f"change one user's {spelling.either(nouns)} in one call",
    )
    sub.add_argument("user", type=_user)
    _add_update_options(sub, USERS, "create the user's entry if it has none")
    sub = command(
        "delete",
        partial(commands.delete_holder, USERS),
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
    _add_holder_commands(command, TIERS)
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
    teams_command = _adder(
        teams.add_subparsers(
            dest="teams_command", required=True, metavar="TEAMS_COMMAND"
        )
    )
    _add_holder_commands(teams_command, TEAMS)
    teams_command(
        "state",
        commands.team_state,
        "show the budget and members of one team, or of all teams",
    ).add_argument("team", nargs="?", type=_team)
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
    nouns = [spelling.noun(field) for field in ATTRIBUTES["default"]]
    _add_default_options(
        command(
            "update-default",
            commands.update_default,
            f"change the default's {spelling.either(nouns)} in one call",
        )
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
