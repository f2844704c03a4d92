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
from pacing.modes import Mode
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
    ("SOURCE", "limit_source"),
    ("TIER", "tier"),
    ("RECENT/S", "recent_tokens_per_second"),
    ("NEXT_IN", "next_token_in_s"),
    ("TAT_LEAD", "tat_lead_s"),
    ("CHARGED", "tokens_charged"),
    ("REFUNDS", "refunds"),
    ("SKIPS", "throttled_skips"),
    ("SHADOW", "shadow_skips"),
    ("PREEMPTED", "throttled_preemptions"),
    ("RUNNING", "running_requests"),
    ("THROTTLED", "throttled_requests"),
    ("LATE", "engine_late_s"),
)
#: Added to the states' table when the engine has a global store (``store``).
_STORE_COLUMNS = (
    ("HELD", "store_held_tokens"),
    ("GLOBAL_TAT", "store_global_tat_lead_s"),
    ("READ_AGO", "store_global_tat_read_age_s"),
    ("STORE", "store_health"),
)
#: The keys of ``_store_dict`` (``store_`` and one of them name a store column).
_STORE_KEYS = ("held_tokens", "global_tat_lead_s", "global_tat_read_age_s", "health")
_LIMIT_COLUMNS = (
    ("USER", "user"),
    ("TOKENS/S", "tokens_per_second"),
    ("TIER", "tier"),
    ("EXEMPT", "exempt"),
)
_TIER_COLUMNS = (
    ("TIER", "tier"),
    ("TOKENS/S", "tokens_per_second"),
    ("EXEMPT", "exempt"),
    ("MEMBERS", "member_count"),
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
    _emit(out, args, limits, _LIMIT_COLUMNS)
    return EXIT_OK


def _emit_limit(out: TextIO, args: argparse.Namespace, limit: _pb2.Limit) -> None:
    _emit(out, args, [_limit_dict(limit)], _LIMIT_COLUMNS, single=True)


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
        limit = _update_entry(client, args.user, "tokens_per_second", args.rate)
    _emit_limit(out, args, limit)
    return EXIT_OK


def _update_entry(
    client: _Client, user: str, field: str, value: Any, *, allow_missing: bool = True
) -> _pb2.Limit:
    """Changes one field of ``user``'s entry, keeping the others."""
    limit = _pb2.Limit(name=names.limit_name(user))
    setattr(limit, field, value)
    request = _pb2.UpdateLimitRequest(limit=limit, allow_missing=allow_missing)
    request.update_mask.paths.append(field)
    response: _pb2.Limit = client.call("UpdateLimit", request)
    return response


def _entry_change(
    field: str, value: Callable[[argparse.Namespace], Any], *, allow_missing: bool
) -> Callable[[_Client, argparse.Namespace, TextIO], int]:
    """A command setting one field of the user's entry to ``value(args)``; it
    reports the entry, or that none is left."""

    def run(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
        limit = _update_entry(
            client, args.user, field, value(args), allow_missing=allow_missing
        )
        if limit.tokens_per_second or limit.tier or limit.exempt:
            _emit_limit(out, args, limit)
        elif args.json:
            _print_json(out, {"deleted": args.user})
        else:
            print(f"{args.user} has no entry left (the default applies)", file=out)
        return EXIT_OK

    return run


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
        print(
            f"deleted the entry of {args.user}: limit, tier and exemption "
            "(the default applies)",
            file=out,
        )
    return EXIT_OK


def _list_tiers(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.ListTiersRequest(page_size=MAX_PAGE_SIZE)
    tiers = [_tier_dict(tier) for tier in client.pages("ListTiers", request, "tiers")]
    _emit(out, args, tiers, _TIER_COLUMNS)
    return EXIT_OK


def _emit_tier(out: TextIO, args: argparse.Namespace, tier: _pb2.Tier) -> None:
    _emit(out, args, [_tier_dict(tier)], _TIER_COLUMNS, single=True)


def _get_tier(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    tier = client.call("GetTier", _pb2.GetTierRequest(name=names.tier_name(args.tier)))
    _emit_tier(out, args, tier)
    return EXIT_OK


def _create_tier(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.rate is None and not args.exempt:
        raise _UsageError("create-tier needs a RATE, --exempt or both")
    tier = client.call(
        "CreateTier",
        _pb2.CreateTierRequest(
            tier_id=args.tier,
            tier=_pb2.Tier(tokens_per_second=args.rate or 0, exempt=args.exempt),
        ),
    )
    _emit_tier(out, args, tier)
    return EXIT_OK


def _update_tier(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    tier = _pb2.Tier(name=names.tier_name(args.tier))
    request = _pb2.UpdateTierRequest(tier=tier, allow_missing=args.allow_missing)
    if args.rate is not None:  # --rate N, or --no-rate (0)
        request.tier.tokens_per_second = args.rate
        request.update_mask.paths.append("tokens_per_second")
    if args.exempt is not None:
        request.tier.exempt = args.exempt
        request.update_mask.paths.append("exempt")
    if not request.update_mask.paths:
        raise _UsageError(
            "update-tier needs --rate, --no-rate, --exempt or --no-exempt"
        )
    updated = client.call("UpdateTier", request)
    if updated.tokens_per_second or updated.exempt:
        _emit_tier(out, args, updated)
    elif args.json:
        _print_json(out, {"deleted_tier": args.tier})
    else:
        print(
            f"tier {args.tier} has neither rate nor exemption left: deleted", file=out
        )
    return EXIT_OK


def _delete_tier(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    client.call(
        "DeleteTier",
        _pb2.DeleteTierRequest(
            name=names.tier_name(args.tier), allow_missing=args.allow_missing
        ),
    )
    if args.json:
        _print_json(out, {"deleted_tier": args.tier})
    else:
        print(f"deleted tier {args.tier}", file=out)
    return EXIT_OK


def _get_mode(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    _emit_mode(out, args, client.call("GetPacingMode", _pb2.GetPacingModeRequest()))
    return EXIT_OK


def _set_mode(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.UpdatePacingModeRequest(
        pacing_mode=_pb2.PacingMode(mode=args.mode.upper())
    )
    _emit_mode(out, args, client.call("UpdatePacingMode", request))
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
        _emit_states(client, out, args, [_state_dict(state)], single=True)
        return EXIT_OK
    request = _pb2.ListUserStatesRequest(
        order_by=args.order_by, page_size=min(args.top or 1000, 1000)
    )
    states: list[dict[str, Any]] = []
    for state in client.pages("ListUserStates", request, "user_states"):
        if args.top and len(states) == args.top:
            break
        states.append(_state_dict(state))
    _emit_states(client, out, args, states)
    return EXIT_OK


def _emit_states(
    client: _Client,
    out: TextIO,
    args: argparse.Namespace,
    states: list[dict[str, Any]],
    *,
    single: bool = False,
) -> None:
    """States as JSON, or as a table under a line with the pacing mode (read
    with the states, or asked for when there are none)."""
    if args.json:
        _print_json(out, states[0] if single else states)
        return
    if states:
        mode = states[0]["pacing_mode"]
    else:
        mode = _mode_name(client.call("GetPacingMode", _pb2.GetPacingModeRequest()))
    print(f"pacing mode: {mode}", file=out)
    if any(state["store"] for state in states):
        rows = [_with_store_columns(state) for state in states]
        _print_table(out, rows, _STATE_COLUMNS + _STORE_COLUMNS)
    else:
        _print_table(out, states, _STATE_COLUMNS)


def _with_store_columns(state: dict[str, Any]) -> dict[str, Any]:
    store = state["store"] or {}
    return {**state, **{f"store_{key}": store.get(key) for key in _STORE_KEYS}}


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
            _emit_states(client, out, args, states)
            print(file=out)
        out.flush()
        if args.count and count >= args.count:
            break
    return EXIT_OK


def _export(client: _Client, args: argparse.Namespace, out: TextIO) -> int:
    table = client.call("GetLimitsTable", _pb2.GetLimitsTableRequest())
    entries = [_limit_dict(limit) for limit in table.limits]
    tiers = [_tier_dict(tier) for tier in table.tiers]
    doc = TableDocument(
        default_rate=table.default_tokens_per_second or None,
        user_rates={
            e["user"]: e["tokens_per_second"]
            for e in entries
            if e["tokens_per_second"] is not None
        },
        etag=table.etag,
        tier_rates={
            t["tier"]: t["tokens_per_second"]
            for t in tiers
            if t["tokens_per_second"] is not None
        },
        exempt_tiers=frozenset(t["tier"] for t in tiers if t["exempt"]),
        memberships={e["user"]: e["tier"] for e in entries if e["tier"] is not None},
        exempt_users=frozenset(e["user"] for e in entries if e["exempt"]),
    )
    if args.file in (None, "-"):
        out.write(dumps(doc, "json"))
    else:
        text = dumps(doc, format_of(args.file))
        try:
            Path(args.file).write_text(text)
        except OSError as exc:
            raise _UsageError(f"cannot write {args.file}: {exc.strerror}") from None
        print(
            f"exported {len(entries)} entries and {len(tiers)} tiers to {args.file}",
            file=sys.stderr,
        )
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
                    _pb2.Limit(
                        name=names.limit_name(user),
                        tokens_per_second=doc.user_rates.get(user, 0),
                        tier=(
                            names.tier_name(doc.memberships[user])
                            if user in doc.memberships
                            else ""
                        ),
                        exempt=user in doc.exempt_users,
                    )
                    for user in sorted(doc.users())
                ],
                tiers=[
                    _pb2.Tier(
                        name=names.tier_name(tier),
                        tokens_per_second=doc.tier_rates.get(tier, 0),
                        exempt=tier in doc.exempt_tiers,
                    )
                    for tier in sorted(doc.tiers)
                ],
                etag=etag,
            )
        ),
    )
    if doc.mode is not None:  # the mode is not part of the table and its etag
        _print_error(
            f"note: {source} names mode {doc.mode}, which import leaves as it "
            "is; use set-mode to change it"
        )
    entries, tiers = len(table.limits), len(table.tiers)
    if args.json:
        _print_json(out, {"imported": entries, "tiers": tiers, "etag": table.etag})
    else:
        print(
            f"imported {entries} entries and {tiers} tiers; etag {table.etag}",
            file=out,
        )
    return EXIT_OK


# -- output -------------------------------------------------------------------


def _limit_dict(limit: _pb2.Limit) -> dict[str, Any]:
    return {
        "user": names.limit_user(limit.name),
        "tokens_per_second": limit.tokens_per_second or None,
        "tier": names.tier_id(limit.tier) or None,
        "exempt": limit.exempt,
    }


def _tier_dict(tier: _pb2.Tier) -> dict[str, Any]:
    return {
        "tier": names.tier_id(tier.name),
        "tokens_per_second": tier.tokens_per_second or None,
        "exempt": tier.exempt,
        "member_count": tier.member_count,
    }


def _mode_name(mode: _pb2.PacingMode) -> str:
    return _pb2.PacingMode.Mode.Name(mode.mode).lower()


def _emit_mode(out: TextIO, args: argparse.Namespace, mode: _pb2.PacingMode) -> None:
    if args.json:
        _print_json(out, {"pacing_mode": _mode_name(mode)})
    else:
        print(f"pacing mode: {_mode_name(mode)}", file=out)


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
        "limit_source": _pb2.UserState.LimitSource.Name(state.limit_source).lower(),
        "tier": names.tier_id(state.tier) or None,
        "shadow_skips": state.shadow_skips,
        "pacing_mode": _pb2.PacingMode.Mode.Name(state.pacing_mode).lower(),
        "engine_late_s": state.engine_late.ToNanoseconds() / 1e9,
        "store": _store_dict(state.store) if state.HasField("store") else None,
    }


def _store_dict(view: _pb2.StoreView) -> dict[str, Any]:
    age = view.global_tat_read_age
    return {
        "held_tokens": view.held_tokens,
        "global_tat_lead_s": view.global_tat_lead.ToNanoseconds() / 1e9,
        "global_tat_read_age_s": age.ToNanoseconds() / 1e9
        if view.HasField("global_tat_read_age")
        else None,
        "health": _pb2.StoreView.Health.Name(view.health).lower(),
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
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
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


def _tier(raw: str) -> str:
    try:
        return validate_user(raw, field="the tier id")
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
        description=(
            "Read and change per-user output-token limits, tiers, exemptions and "
            "the pacing mode of a vLLM engine."
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

    sub = command("list", _list, "list user entries: own limit, tier, exemption")
    sub.add_argument(
        "--page-size",
        type=_whole(1, MAX_PAGE_SIZE),
        default=MAX_PAGE_SIZE,
        help="limits per request (default %(default)s)",
    )
    command("get", _get, "show one user's entry").add_argument("user", type=_user)
    sub = command("set", _set, "set one user's limit (creates it if missing)")
    sub.add_argument("user", type=_user)
    sub.add_argument("rate", type=_whole(1, MAX_RATE), help="tokens per second")
    sub.add_argument(
        "--create", action="store_true", help="fail if the user has a limit already"
    )
    unset = _entry_change("tokens_per_second", lambda _: 0, allow_missing=False)
    command(
        "unset", unset, "remove one user's own limit (its tier or the default applies)"
    ).add_argument("user", type=_user)
    sub = command(
        "delete",
        _delete,
        "delete one user's entry: limit, tier, exemption (the default applies again)",
    )
    sub.add_argument("user", type=_user)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    assign = _entry_change(
        "tier", lambda args: names.tier_name(args.tier), allow_missing=True
    )
    sub = command("assign", assign, "make a user a member of a tier")
    sub.add_argument("user", type=_user)
    sub.add_argument("tier", type=_tier)
    unassign = _entry_change("tier", lambda _: "", allow_missing=False)
    command("unassign", unassign, "take a user out of its tier").add_argument(
        "user", type=_user
    )
    exempt = _entry_change("exempt", lambda _: True, allow_missing=True)
    command("exempt", exempt, "make a user unlimited").add_argument("user", type=_user)
    unexempt = _entry_change("exempt", lambda _: False, allow_missing=False)
    command(
        "unexempt", unexempt, "lift a user's exemption (its limit applies again)"
    ).add_argument("user", type=_user)
    command("list-tiers", _list_tiers, "list tiers with their member counts")
    command("get-tier", _get_tier, "show one tier").add_argument("tier", type=_tier)
    sub = command(
        "create-tier", _create_tier, "create a tier: a rate, --exempt or both"
    )
    sub.add_argument("tier", type=_tier)
    sub.add_argument(
        "rate", nargs="?", type=_whole(1, MAX_RATE), help="tokens per second"
    )
    sub.add_argument(
        "--exempt",
        action="store_true",
        help="members without a limit of their own are unlimited",
    )
    sub = command(
        "update-tier",
        _update_tier,
        "change a tier's rate or exemption (members follow at the next step)",
    )
    sub.add_argument("tier", type=_tier)
    rate = sub.add_mutually_exclusive_group()
    rate.add_argument(
        "--rate", type=_whole(1, MAX_RATE), metavar="N", help="tokens per second"
    )
    rate.add_argument(
        "--no-rate", dest="rate", action="store_const", const=0, help="remove the rate"
    )
    exemption = sub.add_mutually_exclusive_group()
    exemption.add_argument("--exempt", action="store_const", const=True)
    exemption.add_argument(
        "--no-exempt", dest="exempt", action="store_const", const=False
    )
    sub.add_argument(
        "--allow-missing", action="store_true", help="create the tier if there is none"
    )
    sub = command(
        "delete-tier", _delete_tier, "delete a tier (refused while it has members)"
    )
    sub.add_argument("tier", type=_tier)
    sub.add_argument(
        "--allow-missing", action="store_true", help="succeed if there is none"
    )
    command("get-mode", _get_mode, "show the pacing mode")
    command(
        "set-mode", _set_mode, "switch the pacing mode now (enforce, shadow, off)"
    ).add_argument("mode", choices=[mode.value for mode in Mode])
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
    sub = command(
        "export", _export, "write the limits table and tiers as JSON (with its etag)"
    )
    sub.add_argument("file", nargs="?", help="output file (default: stdout)")
    sub = command(
        "import",
        _import,
        "replace the limits table and tiers from a file (not the mode)",
    )
    sub.add_argument("file", help="as written by export; - for stdin")
    sub.add_argument(
        "--force",
        action="store_true",
        help="replace even if the table changed since the export",
    )
    return parser
