"""``output-rate-ctl``: the operator's client of the control plane.

Exit status: 0 success, 1 the server (or a local check of an import file)
refused the request, the status code name printed to stderr, 2 usage errors.
Every argument is checked before anything is sent (numbers against the range
the proto field holds and the server accepts, user ids by the one rule of
``pacing.identity.validate_user``); each error is reported in one line on
stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import grpc
from google.protobuf import duration_pb2 as _duration_pb2

from control import names
from control.errors import ControlError, InvalidArgument
from control.server import MAX_MESSAGE_BYTES
from control.service import (
    MAX_PAGE_SIZE,
    MAX_WATCH_INTERVAL_NS,
    MIN_WATCH_INTERVAL_NS,
    MOST_THROTTLED_FIRST,
)
from control.table import TableDocument, dumps, format_of, loads
from pacing.identity import validate_user
from pacing.limiter import MAX_RATE
from pacing.settings import DEFAULT_ADDRESS, TOKEN_ENV
from protos.outputrate.v1 import output_rate_pb2 as _pb2
from protos.outputrate.v1 import output_rate_pb2_grpc as _pb2_grpc

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Longest --timeout: far beyond any call, far below where gRPC's deadline
#: arithmetic overflows (about 1e10 s).
MAX_TIMEOUT_S = 86_400.0
_STATE_COLUMNS = (
    ("USER", "user"),
    ("LIMIT/S", "limit_tokens_per_second"),
    ("RECENT/S", "recent_tokens_per_second"),
    ("NEXT_IN", "next_token_in_s"),
    ("TAT_LEAD", "tat_lead_s"),
    ("CHARGED", "tokens_charged"),
    ("REFUNDS", "refunds"),
    ("SKIPS", "throttled_skips"),
    ("PREEMPTED", "throttled_preemptions"),
    ("RUNNING", "running_requests"),
    ("THROTTLED", "throttled_requests"),
)


class _Client:
    """The stub plus what every call carries (credentials, deadline)."""

    def __init__(self, channel: grpc.Channel, token: str | None, timeout: float):
        self.stub = _pb2_grpc.OutputRateControlStub(channel)
        self._metadata = (
            () if token is None else (("authorization", f"Bearer {token}"),)
        )
        self._timeout = timeout

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(
            request, metadata=self._metadata, timeout=self._timeout
        )

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        responses: Iterator[Any] = getattr(self.stub, method)(
            request, metadata=self._metadata
        )
        return responses

    def pages(self, method: str, request: Any, field: str) -> Iterator[Any]:
        """Every item of a paginated list, page after page."""
        while True:
            response = self.call(method, request)
            yield from getattr(response, field)
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        with _channel(args) as channel:
            client = _Client(channel, args.token, args.timeout)
            run: Callable[[_Client, argparse.Namespace, TextIO], int] = args.run
            return run(client, args, sys.stdout)
    except grpc.RpcError as exc:
        _print_error(f"error: {exc.code().name}: {exc.details()}")
        return EXIT_FAILED
    except ControlError as exc:  # a local check, reported as the server would
        _print_error(f"error: {exc.code}: {exc}")
        return EXIT_FAILED
    except _UsageError as exc:
        _print_error(f"{parser.prog}: error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:  # ends a watch
        return EXIT_OK


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


# -- commands -----------------------------------------------------------------


def _list(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.ListLimitsRequest(page_size=args.page_size)
    limits = [
        _limit_dict(limit) for limit in client.pages("ListLimits", request, "limits")
    ]
    _emit(out, args, limits, [("USER", "user"), ("TOKENS/S", "tokens_per_second")])
    return EXIT_OK


def _emit_limit(out: TextIO, args: argparse.Namespace, limit: _pb2.Limit) -> None:
    _emit(
        out,
        args,
        [_limit_dict(limit)],
        [("USER", "user"), ("TOKENS/S", "tokens_per_second")],
        single=True,
    )


def _get(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    limit = client.call(
        "GetLimit", _pb2.GetLimitRequest(name=names.limit_name(args.user))
    )
    _emit_limit(out, args, limit)
    return EXIT_OK


def _set(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.create:
        limit = client.call(
            "CreateLimit",
            _pb2.CreateLimitRequest(
                limit_id=args.user, limit=_pb2.Limit(tokens_per_second=args.rate)
            ),
        )
    else:
        limit = client.call(
            "UpdateLimit",
            _pb2.UpdateLimitRequest(
                limit=_pb2.Limit(
                    name=names.limit_name(args.user), tokens_per_second=args.rate
                ),
                allow_missing=True,
            ),
        )
    _emit_limit(out, args, limit)
    return EXIT_OK


def _delete(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    client.call(
        "DeleteLimit",
        _pb2.DeleteLimitRequest(
            name=names.limit_name(args.user), allow_missing=args.allow_missing
        ),
    )
    if args.json:
        _print_json(out, {"deleted": args.user})
    else:
        print(f"deleted the limit of {args.user} (the default applies)", file=out)
    return EXIT_OK


def _get_default(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    default = client.call("GetDefaultLimit", _pb2.GetDefaultLimitRequest())
    _emit_default(out, args, default)
    return EXIT_OK


def _set_default(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    default = client.call(
        "UpdateDefaultLimit",
        _pb2.UpdateDefaultLimitRequest(
            default_limit=_pb2.DefaultLimit(tokens_per_second=args.rate)
        ),
    )
    _emit_default(out, args, default)
    return EXIT_OK


def _state(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.user is not None:
        state = client.call(
            "GetUserState",
            _pb2.GetUserStateRequest(name=names.user_state_name(args.user)),
        )
        _emit(out, args, [_state_dict(state)], _STATE_COLUMNS, single=True)
        return EXIT_OK
    request = _pb2.ListUserStatesRequest(
        order_by=args.order_by, page_size=min(args.top or 1000, 1000)
    )
    states: list[dict[str, Any]] = []
    for state in client.pages("ListUserStates", request, "user_states"):
        if args.top and len(states) == args.top:
            break
        states.append(_state_dict(state))
    _emit(out, args, states, _STATE_COLUMNS)
    return EXIT_OK


def _watch(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    interval = _duration_pb2.Duration()
    interval.FromNanoseconds(round(args.interval * 1e9))
    request = _pb2.WatchUserStatesRequest(
        interval=interval,
        names=[names.user_state_name(user) for user in args.users],
        order_by=args.order_by,
        max_users=args.top,
    )
    clear = not args.json and out.isatty()
    for count, update in enumerate(client.stream("WatchUserStates", request), 1):
        states = [_state_dict(s) for s in update.user_states]
        if args.json:
            _print_json(out, {"user_states": states}, indent=None)
        else:
            if clear:
                out.write("\x1b[H\x1b[2J")
            _print_table(out, states, _STATE_COLUMNS)
            print(file=out)
        out.flush()
        if args.count and count >= args.count:
            break
    return EXIT_OK


def _export(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    table = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
    doc = TableDocument(
        default_rate=table.default_tokens_per_second or None,
        user_rates={
            row["user"]: row["tokens_per_second"]
            for row in map(_limit_dict, table.limits)
        },
        etag=table.etag,
    )
    if args.file in (None, "-"):
        out.write(dumps(doc, "json"))
    else:
        text = dumps(doc, format_of(args.file))
        try:
            Path(args.file).write_text(text)
        except OSError as exc:
            raise _UsageError(f"cannot write {args.file}: {exc.strerror}") from None
        print(f"exported {len(doc.user_rates)} limits to {args.file}", file=sys.stderr)
    return EXIT_OK


def _import(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    source = "stdin" if args.file == "-" else args.file
    fmt = "json" if args.file == "-" else format_of(args.file)
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as exc:
        raise _UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{source}: not UTF-8 ({exc.reason})") from None
    try:
        doc = loads(text, fmt, source=source)
    except RecursionError:  # e.g. 100k "[": the parsers recurse per level
        raise InvalidArgument(
            f"{source}: not valid {fmt.upper()}: nested too deeply"
        ) from None
    if doc.etag is not None and not _encodes(doc.etag):
        raise InvalidArgument(f"{source}: etag must be well-formed Unicode")
    etag = "" if args.force else (doc.etag or "")
    default = doc.default_rate
    if default is None:  # keep the current default, as read with its etag
        current = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
        default = current.default_tokens_per_second
        etag = etag or ("" if args.force else current.etag)
    table = client.call(
        "ReplaceLimitsTable",
        _pb2.ReplaceLimitsTableRequest(
            limits_table=_pb2.LimitsTable(
                default_tokens_per_second=default,
                limits=[
                    _pb2.Limit(name=names.limit_name(user), tokens_per_second=rate)
                    for user, rate in doc.user_rates.items()
                ],
                etag=etag,
            )
        ),
    )
    if args.json:
        _print_json(out, {"imported": len(table.limits), "etag": table.etag})
    else:
        print(f"imported {len(table.limits)} limits; etag {table.etag}", file=out)
    return EXIT_OK


# -- output -------------------------------------------------------------------


def _limit_dict(limit: _pb2.Limit) -> dict[str, Any]:
    return {
        "user": names.limit_user(limit.name),
        "tokens_per_second": limit.tokens_per_second,
    }


def _state_dict(state: _pb2.UserState) -> dict[str, Any]:
    return {
        "user": state.user,
        "limit_tokens_per_second": state.limit_tokens_per_second,
        "tat_lead_s": state.tat_lead.ToNanoseconds() / 1e9,
        "next_token_in_s": state.next_token_in.ToNanoseconds() / 1e9,
        "tokens_charged": state.tokens_charged,
        "refunds": state.refunds,
        "throttled_skips": state.throttled_skips,
        "throttled_preemptions": state.throttled_preemptions,
        "running_requests": state.running_requests,
        "throttled_requests": state.throttled_requests,
        "recent_tokens_per_second": state.recent_tokens_per_second,
    }


def _emit_default(
    out: TextIO, args: argparse.Namespace, default: _pb2.DefaultLimit
) -> None:
    if args.json:
        _print_json(out, {"default_tokens_per_second": default.tokens_per_second})
    else:
        print(f"default: {default.tokens_per_second} tokens/s", file=out)


def _emit(
    out: TextIO,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    single: bool = False,
) -> None:
    """Rows as JSON (one object when ``single``) or as an aligned table."""
    if args.json:
        _print_json(out, rows[0] if single else rows)
    else:
        _print_table(out, rows, columns)


def _print_json(out: TextIO, value: Any, indent: int | None = 2) -> None:
    print(json.dumps(value, indent=indent, ensure_ascii=False), file=out)


def _print_error(line: str) -> None:
    print(_one_line(line), file=sys.stderr)


def _one_line(text: str) -> str:
    """``text`` on one printable line: multi-line messages (YAML errors) joined,
    other unprintable characters (lone surrogates too) escaped."""
    joined = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return "".join(
        ch if ch.isprintable() and _encodes(ch) else ascii(ch)[1:-1] for ch in joined
    )


def _encodes(text: str) -> bool:
    """Whether ``text`` is well-formed Unicode (protobuf strings must be)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _print_table(
    out: TextIO, rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]
) -> None:
    cells = [[title for title, _ in columns]]
    cells += [[_cell(key, row[key]) for _, key in columns] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        # The first column (user ids) is left-aligned, numbers right-aligned.
        line = [row[0].ljust(widths[0])]
        line += [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(line).rstrip(), file=out)


def _cell(key: str, value: Any) -> str:
    if key.endswith("_s"):
        return f"{value * 1000:.0f}ms" if value < 10 else f"{value:.1f}s"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


# -- command line -------------------------------------------------------------


class _UsageError(Exception):
    """A problem with the command line or a local file (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (argparse prints the usage first); subcommand
    parsers are of this class, too (``add_subparsers`` uses the parent's)."""

    def error(self, message: str) -> NoReturn:
        _print_error(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(EXIT_USAGE)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    if (args.tls_cert is None) != (args.tls_key is None):
        # gRPC aborts the process on a certificate without its key.
        raise _UsageError("--tls-cert and --tls-key go together")
    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(args.address, options=options)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_optional(args.tls_ca),
            private_key=_read_optional(args.tls_key),
            certificate_chain=_read_optional(args.tls_cert),
        )
    except OSError as exc:
        raise _UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.secure_channel(args.address, credentials, options=options)


def _read_optional(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


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


def _user(raw: str) -> str:
    try:
        return validate_user(raw, field="the user id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _text(raw: str) -> str:
    """Any well-formed Unicode (argv may hold lone surrogates: undecodable bytes)."""
    if not _encodes(raw):
        raise argparse.ArgumentTypeError("must be well-formed Unicode")
    return raw


def _token(raw: str) -> str:
    """A bearer token: printable ASCII, as a gRPC metadata value must be."""
    if not all(" " <= ch <= "~" for ch in raw):
        raise argparse.ArgumentTypeError(
            f"the token (from --token or ${TOKEN_ENV}) must be printable ASCII"
        )
    return raw


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="output-rate-ctl",
        description="Read and change per-user output-token limits of a vLLM engine.",
        epilog="Exit status: 0 ok, 1 request refused (status code on stderr), 2 usage.",
    )
    parser.add_argument(
        "--address",
        type=_text,
        default=DEFAULT_ADDRESS,
        help="host:port (default %(default)s)",
    )
    parser.add_argument(
        "--token",
        type=_token,
        default=os.environ.get(TOKEN_ENV),
        help=f"bearer token (default: ${TOKEN_ENV})",
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, run: Callable[..., int], summary: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary)
        sub.set_defaults(run=run)
        return sub

    sub = command("list", _list, "list explicit per-user limits")
    sub.add_argument(
        "--page-size",
        type=_whole(1, MAX_PAGE_SIZE),
        default=MAX_PAGE_SIZE,
        help="limits per request (default %(default)s)",
    )
    command("get", _get, "show one user's explicit limit").add_argument(
        "user", type=_user
    )
    sub = command("set", _set, "set one user's limit (creates it if missing)")
    sub.add_argument("user", type=_user)
    sub.add_argument("rate", type=_whole(1, MAX_RATE), help="tokens per second")
    sub.add_argument(
        "--create", action="store_true", help="fail if the user has a limit already"
    )
    sub = command(
        "delete", _delete, "delete one user's limit (the default applies again)"
    )
    sub.add_argument("user", type=_user)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    command("get-default", _get_default, "show the default limit")
    command("set-default", _set_default, "set the default limit").add_argument(
        "rate", type=_whole(1, MAX_RATE), help="tokens per second"
    )
    sub = command("state", _state, "show limiter state of one user, or of all users")
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
    sub = command("watch", _watch, "show limiter state live")
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
    sub = command("export", _export, "write the limits table as JSON (with its etag)")
    sub.add_argument("file", nargs="?", help="output file (default: stdout)")
    sub = command("import", _import, "replace the limits table from a JSON file")
    sub.add_argument("file", help="as written by export; - for stdin")
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace even if the table changed since the export",
    )
    return parser
