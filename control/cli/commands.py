"""The ``output-rate-ctl`` commands: build the request from the parsed
arguments, call the control plane, print the result. The five verbs are one
function each for every kind of rate holder (``control.kinds``), given the kind
(a user entry's update is ``update``; its other commands change one field each).

Invariant: a command is a ``Command``, ``(client, args, out) -> exit status``;
it sends only arguments the parser has checked, prints its result to ``out``
(notes and progress to stderr) and reports a failure by raising it:
``grpc.RpcError`` from the server, ``ControlError`` from a local check of an
import file, ``UsageError`` for the command line or a local file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from google.protobuf import duration_pb2 as _duration_pb2

from control import names
from control.cli import spelling
from control.cli.client import EXIT_OK, Client, UsageError
from control.cli.render import (
    TEAM_STATE_COLUMNS,
    emit,
    emit_default,
    emit_holder,
    emit_mode,
    holder_columns,
    holder_dict,
    mode_name,
    print_json,
    print_states,
    state_dict,
    team_state_dict,
)
from control.kinds import BY_HOLDER, TEAMS, TIERS, USERS, Kind
from control.service.ordering import MAX_PAGE_SIZE
from pacing.policy.model import ATTRIBUTES
from protos.outputrate.v1 import output_rate_pb2 as _pb2

Command = Callable[[Client, argparse.Namespace, TextIO], int]


# -- every kind: list, get, create, update, delete ----------------------------


def list_holders(
    kind: Kind, client: Client, args: argparse.Namespace, out: TextIO
) -> int:
    request = _request(
        kind, "List", page_size=getattr(args, "page_size", MAX_PAGE_SIZE)
    )
    pages = client.pages(f"List{kind.title}s", request, kind.collection)
    emit(out, args, [holder_dict(kind, one) for one in pages], holder_columns(kind))
    return EXIT_OK


def get_holder(
    kind: Kind, client: Client, args: argparse.Namespace, out: TextIO
) -> int:
    request = _request(kind, "Get", name=kind.name(_id(kind, args)))
    emit_holder(out, args, kind, client.call(f"Get{kind.title}", request))
    return EXIT_OK


def create_holder(
    kind: Kind, client: Client, args: argparse.Namespace, out: TextIO
) -> int:
    """Creates the holder with the attributes given; one of those that make it
    exist must be."""
    values = _given(kind, args)
    if not any(field in values for field in kind.makes_exist):
        needs = spelling.creates_with(kind)
        raise UsageError(f"{spelling.command(kind, 'create')} needs {needs}")
    emit_holder(out, args, kind, _create(client, kind, _id(kind, args), values))
    return EXIT_OK


def update_holder(
    kind: Kind, client: Client, args: argparse.Namespace, out: TextIO
) -> int:
    """Changes the fields given (a clear option gives the field's zero) in one
    update, keeping the others; reports the holder, or that the change removed
    it. A user entry's ``update`` too: its attributes and memberships."""
    values = _given(kind, args, flags_set=False)
    if not values:
        options = spelling.either(spelling.update_options(kind))
        raise UsageError(f"{spelling.command(kind, 'update')} needs {options}")
    holder_id = _id(kind, args)
    updated = _update(client, kind, holder_id, values, args.allow_missing)
    _report(out, args, kind, holder_id, updated)
    return EXIT_OK


def delete_holder(
    kind: Kind, client: Client, args: argparse.Namespace, out: TextIO
) -> int:
    holder_id = _id(kind, args)
    request = _request(
        kind, "Delete", name=kind.name(holder_id), allow_missing=args.allow_missing
    )
    client.call(f"Delete{kind.title}", request)
    _report_gone(out, args, kind, holder_id)
    return EXIT_OK


def _request(kind: Kind, verb: str, **fields: Any) -> Any:
    """``{verb}{Title}Request`` (``List{Title}sRequest``) with ``fields``."""
    plural = "s" if verb == "List" else ""
    return getattr(_pb2, f"{verb}{kind.title}{plural}Request")(**fields)


def _id(kind: Kind, args: argparse.Namespace) -> str:
    """The holder's id, the positional named for the holder (``tier``)."""
    holder_id: str = getattr(args, kind.holder)
    return holder_id


def _given(
    kind: Kind, args: argparse.Namespace, *, flags_set: bool = True
) -> dict[str, Any]:
    """The fields on the command line (``dest`` is the field), in the kind's
    order; a membership as the group's resource name (``""``: none). With
    ``flags_set``, a flag only when set (a create's ``--exempt``)."""
    values = {field: getattr(args, field) for field in kind.fields}
    return {
        field: _wire(field, value) if field in kind.references else value
        for field, value in values.items()
        if value is not None and not (flags_set and value is False)
    }


def _wire(group_kind: str, group_id: str) -> str:
    """A membership as the API carries it: ``tiers/{id}``, ``""`` for none."""
    return BY_HOLDER[group_kind].name(group_id) if group_id else ""


def _create(client: Client, kind: Kind, holder_id: str, values: dict[str, Any]) -> Any:
    message = getattr(_pb2, kind.title)(**values)
    request = _request(
        kind, "Create", **{f"{kind.resource}_id": holder_id, kind.resource: message}
    )
    return client.call(f"Create{kind.title}", request)


def _update(
    client: Client,
    kind: Kind,
    holder_id: str,
    values: dict[str, Any],
    allow_missing: bool,
) -> Any:
    """Sets ``values`` (masked, in the kind's order), keeping the others."""
    message = getattr(_pb2, kind.title)(name=kind.name(holder_id), **values)
    request = _request(
        kind, "Update", **{kind.resource: message}, allow_missing=allow_missing
    )
    request.update_mask.paths.extend(values)
    return client.call(f"Update{kind.title}", request)


def _report(
    out: TextIO, args: argparse.Namespace, kind: Kind, holder_id: str, holder: Any
) -> None:
    """The holder an update left, or that it left none (no field that makes
    one exist)."""
    if any(getattr(holder, field) for field in kind.makes_exist):
        emit_holder(out, args, kind, holder)
    else:
        _report_gone(out, args, kind, holder_id, emptied=True)


def _report_gone(
    out: TextIO,
    args: argparse.Namespace,
    kind: Kind,
    holder_id: str,
    *,
    emptied: bool = False,
) -> None:
    """That the holder is gone: deleted, or ``emptied`` by an update."""
    if args.json:
        key = f"deleted_{kind.holder}" if kind.is_group else "deleted"
        print_json(out, {key: holder_id})
    elif kind.is_group and emptied:
        nouns = [spelling.noun(field) for field in kind.makes_exist]
        print(
            f"{kind.holder} {holder_id} has {spelling.neither(nouns)} left: deleted",
            file=out,
        )
    elif kind.is_group:
        print(f"deleted {kind.holder} {holder_id}", file=out)
    elif emptied:
        print(f"{holder_id} has no entry left (the default applies)", file=out)
    else:
        print(
            f"deleted the entry of {holder_id}: limit, tier, team and exemption "
            "(the default applies)",
            file=out,
        )


# -- user entries: one field each ---------------------------------------------


def set_limit(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    values = {"tokens_per_second": args.rate}
    if args.create:
        limit = _create(client, USERS, args.user, values)
    else:
        limit = _update(client, USERS, args.user, values, allow_missing=True)
    emit_holder(out, args, USERS, limit)
    return EXIT_OK


def _entry_change(
    field: str, value: Callable[[argparse.Namespace], Any], *, allow_missing: bool
) -> Command:
    """A command setting one field of the user's entry to ``value(args)``; it
    reports the entry, or that none is left."""

    def run(client: Client, args: argparse.Namespace, out: TextIO) -> int:
        values = {field: value(args)}
        limit = _update(client, USERS, args.user, values, allow_missing)
        _report(out, args, USERS, args.user, limit)
        return EXIT_OK

    return run


unset_limit = _entry_change("tokens_per_second", lambda _: 0, allow_missing=False)
assign = _entry_change("tier", lambda args: TIERS.name(args.tier), allow_missing=True)
unassign = _entry_change("tier", lambda _: "", allow_missing=False)
exempt = _entry_change("exempt", lambda _: True, allow_missing=True)
unexempt = _entry_change("exempt", lambda _: False, allow_missing=False)
join_team = _entry_change(
    "team", lambda args: TEAMS.name(args.team), allow_missing=True
)
leave_team = _entry_change("team", lambda _: "", allow_missing=False)
set_weight = _entry_change("weight", lambda args: args.weight, allow_missing=True)
unset_weight = _entry_change("weight", lambda _: 0.0, allow_missing=False)


# -- teams' state -------------------------------------------------------------


def team_state(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.team is not None:
        one = client.call(
            "GetTeamState",
            _pb2.GetTeamStateRequest(name=names.team_state_name(args.team)),
        )
        emit(out, args, [team_state_dict(one)], TEAM_STATE_COLUMNS, single=True)
        return EXIT_OK
    request = _pb2.ListTeamStatesRequest(page_size=MAX_PAGE_SIZE)
    states = [
        team_state_dict(s)
        for s in client.pages("ListTeamStates", request, "team_states")
    ]
    emit(out, args, states, TEAM_STATE_COLUMNS)
    return EXIT_OK


# -- mode and default ---------------------------------------------------------


def get_mode(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    emit_mode(out, args, client.call("GetPacingMode", _pb2.GetPacingModeRequest()))
    return EXIT_OK


def set_mode(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.UpdatePacingModeRequest(
        pacing_mode=_pb2.PacingMode(mode=args.mode.upper())
    )
    request.update_mask.paths.append("mode")
    emit_mode(out, args, client.call("UpdatePacingMode", request))
    return EXIT_OK


def set_fair_share(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.UpdatePacingModeRequest(
        pacing_mode=_pb2.PacingMode(fair_share=args.switch == "on")
    )
    request.update_mask.paths.append("fair_share")
    emit_mode(out, args, client.call("UpdatePacingMode", request))
    return EXIT_OK


def get_default(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    default = client.call("GetDefaultLimit", _pb2.GetDefaultLimitRequest())
    emit_default(out, args, default)
    return EXIT_OK


def set_default(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    default = client.call(
        "UpdateDefaultLimit",
        _pb2.UpdateDefaultLimitRequest(
            default_limit=_pb2.DefaultLimit(tokens_per_second=args.rate)
        ),
    )
    emit_default(out, args, default)
    return EXIT_OK


def update_default(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    """Changes the default's attributes given (a clear option gives the
    field's zero) in one update, keeping the others."""
    values = {
        field: value
        for field in ATTRIBUTES["default"]
        if (value := getattr(args, field)) is not None
    }
    if not values:
        options = spelling.either(spelling.default_update_options())
        raise UsageError(f"update-default needs {options}")
    request = _pb2.UpdateDefaultLimitRequest(default_limit=_pb2.DefaultLimit(**values))
    request.update_mask.paths.extend(values)
    emit_default(out, args, client.call("UpdateDefaultLimit", request))
    return EXIT_OK


# -- limiter state ------------------------------------------------------------


def state(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.user is not None:
        one = client.call(
            "GetUserState",
            _pb2.GetUserStateRequest(name=names.user_state_name(args.user)),
        )
        _emit_states(client, out, args, [state_dict(one)], single=True)
        return EXIT_OK
    request = _pb2.ListUserStatesRequest(
        order_by=args.order_by, page_size=min(args.top or 1000, 1000)
    )
    states: list[dict[str, Any]] = []
    for each in client.pages("ListUserStates", request, "user_states"):
        if args.top and len(states) == args.top:
            break
        states.append(state_dict(each))
    _emit_states(client, out, args, states)
    return EXIT_OK


def _emit_states(
    client: Client,
    out: TextIO,
    args: argparse.Namespace,
    states: list[dict[str, Any]],
    *,
    single: bool = False,
) -> None:
    """States as JSON, or as a table under a line with the pacing mode (read
    with the states, or asked for when there are none)."""
    if args.json:
        print_json(out, states[0] if single else states)
        return
    if states:
        mode = states[0]["pacing_mode"]
    else:
        mode = mode_name(client.call("GetPacingMode", _pb2.GetPacingModeRequest()))
    print_states(out, mode, states)


def watch(client: Client, args: argparse.Namespace, out: TextIO) -> int:
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
        states = [state_dict(s) for s in update.user_states]
        if args.json:
            print_json(out, {"user_states": states}, indent=None)
        else:
            if clear:
                out.write("\x1b[H\x1b[2J")
            _emit_states(client, out, args, states)
            print(file=out)
        out.flush()
        if args.count and count >= args.count:
            break
    return EXIT_OK
