"""The ``output-rate-ctl`` commands, one function each: build the request from
the parsed arguments, call the control plane, print the result.

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
from control.cli.client import EXIT_OK, Client, UsageError
from control.cli.render import (
    LIMIT_COLUMNS,
    TEAM_COLUMNS,
    TEAM_STATE_COLUMNS,
    TIER_COLUMNS,
    emit,
    emit_default,
    emit_limit,
    emit_mode,
    emit_team,
    emit_tier,
    limit_dict,
    mode_name,
    print_json,
    print_states,
    state_dict,
    team_dict,
    team_state_dict,
    tier_dict,
)
from control.service.ordering import MAX_PAGE_SIZE
from protos.outputrate.v1 import output_rate_pb2 as _pb2

Command = Callable[[Client, argparse.Namespace, TextIO], int]


# -- user entries -------------------------------------------------------------


def list_limits(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.ListLimitsRequest(page_size=args.page_size)
    limits = [
        limit_dict(limit) for limit in client.pages("ListLimits", request, "limits")
    ]
    emit(out, args, limits, LIMIT_COLUMNS)
    return EXIT_OK


def get_limit(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    limit = client.call(
        "GetLimit", _pb2.GetLimitRequest(name=names.limit_name(args.user))
    )
    emit_limit(out, args, limit)
    return EXIT_OK


def set_limit(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.create:
        limit = client.call(
            "CreateLimit",
            _pb2.CreateLimitRequest(
                limit_id=args.user, limit=_pb2.Limit(tokens_per_second=args.rate)
            ),
        )
    else:
        limit = _update_entry(client, args.user, "tokens_per_second", args.rate)
    emit_limit(out, args, limit)
    return EXIT_OK


def _update_entry(
    client: Client, user: str, field: str, value: Any, *, allow_missing: bool = True
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
) -> Command:
    """A command setting one field of the user's entry to ``value(args)``; it
    reports the entry, or that none is left."""

    def run(client: Client, args: argparse.Namespace, out: TextIO) -> int:
        limit = _update_entry(
            client, args.user, field, value(args), allow_missing=allow_missing
        )
        if (
            limit.tokens_per_second
            or limit.tier
            or limit.exempt
            or limit.weight
            or limit.team
        ):
            emit_limit(out, args, limit)
        elif args.json:
            print_json(out, {"deleted": args.user})
        else:
            print(f"{args.user} has no entry left (the default applies)", file=out)
        return EXIT_OK

    return run


unset_limit = _entry_change("tokens_per_second", lambda _: 0, allow_missing=False)
assign = _entry_change(
    "tier", lambda args: names.tier_name(args.tier), allow_missing=True
)
unassign = _entry_change("tier", lambda _: "", allow_missing=False)
exempt = _entry_change("exempt", lambda _: True, allow_missing=True)
unexempt = _entry_change("exempt", lambda _: False, allow_missing=False)
join_team = _entry_change(
    "team", lambda args: names.team_name(args.team), allow_missing=True
)
leave_team = _entry_change("team", lambda _: "", allow_missing=False)
set_weight = _entry_change("weight", lambda args: args.weight, allow_missing=True)
unset_weight = _entry_change("weight", lambda _: 0.0, allow_missing=False)


def delete_entry(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    client.call(
        "DeleteLimit",
        _pb2.DeleteLimitRequest(
            name=names.limit_name(args.user), allow_missing=args.allow_missing
        ),
    )
    if args.json:
        print_json(out, {"deleted": args.user})
    else:
        print(
            f"deleted the entry of {args.user}: limit, tier, team and exemption "
            "(the default applies)",
            file=out,
        )
    return EXIT_OK


# -- tiers --------------------------------------------------------------------


def list_tiers(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.ListTiersRequest(page_size=MAX_PAGE_SIZE)
    tiers = [tier_dict(tier) for tier in client.pages("ListTiers", request, "tiers")]
    emit(out, args, tiers, TIER_COLUMNS)
    return EXIT_OK


def get_tier(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    tier = client.call("GetTier", _pb2.GetTierRequest(name=names.tier_name(args.tier)))
    emit_tier(out, args, tier)
    return EXIT_OK


def create_tier(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.rate is None and not args.exempt:
        raise UsageError("create-tier needs a RATE, --exempt or both")
    tier = client.call(
        "CreateTier",
        _pb2.CreateTierRequest(
            tier_id=args.tier,
            tier=_pb2.Tier(
                tokens_per_second=args.rate or 0,
                exempt=args.exempt,
                weight=args.weight or 0.0,
            ),
        ),
    )
    emit_tier(out, args, tier)
    return EXIT_OK


def update_tier(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    tier = _pb2.Tier(name=names.tier_name(args.tier))
    request = _pb2.UpdateTierRequest(tier=tier, allow_missing=args.allow_missing)
    if args.rate is not None:  # --rate N, or --no-rate (0)
        request.tier.tokens_per_second = args.rate
        request.update_mask.paths.append("tokens_per_second")
    if args.exempt is not None:
        request.tier.exempt = args.exempt
        request.update_mask.paths.append("exempt")
    if args.weight is not None:  # --weight W, or --no-weight (0)
        request.tier.weight = args.weight
        request.update_mask.paths.append("weight")
    if not request.update_mask.paths:
        raise UsageError(
            "update-tier needs --rate, --no-rate, --exempt, --no-exempt, "
            "--weight or --no-weight"
        )
    updated = client.call("UpdateTier", request)
    if updated.tokens_per_second or updated.exempt:
        emit_tier(out, args, updated)
    elif args.json:
        print_json(out, {"deleted_tier": args.tier})
    else:
        print(
            f"tier {args.tier} has neither rate nor exemption left: deleted", file=out
        )
    return EXIT_OK


def delete_tier(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    client.call(
        "DeleteTier",
        _pb2.DeleteTierRequest(
            name=names.tier_name(args.tier), allow_missing=args.allow_missing
        ),
    )
    if args.json:
        print_json(out, {"deleted_tier": args.tier})
    else:
        print(f"deleted tier {args.tier}", file=out)
    return EXIT_OK


# -- teams --------------------------------------------------------------------


def list_teams(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    request = _pb2.ListTeamsRequest(page_size=MAX_PAGE_SIZE)
    teams = [team_dict(team) for team in client.pages("ListTeams", request, "teams")]
    emit(out, args, teams, TEAM_COLUMNS)
    return EXIT_OK


def get_team(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    team = client.call("GetTeam", _pb2.GetTeamRequest(name=names.team_name(args.team)))
    emit_team(out, args, team)
    return EXIT_OK


def create_team(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    team = client.call(
        "CreateTeam",
        _pb2.CreateTeamRequest(
            team_id=args.team,
            team=_pb2.Team(tokens_per_second=args.rate, weight=args.weight or 0.0),
        ),
    )
    emit_team(out, args, team)
    return EXIT_OK


def update_team(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    team = _pb2.Team(name=names.team_name(args.team))
    request = _pb2.UpdateTeamRequest(team=team, allow_missing=args.allow_missing)
    if args.rate is not None:
        request.team.tokens_per_second = args.rate
        request.update_mask.paths.append("tokens_per_second")
    if args.weight is not None:  # --weight W, or --no-weight (0)
        request.team.weight = args.weight
        request.update_mask.paths.append("weight")
    if not request.update_mask.paths:
        raise UsageError("teams update needs --rate, --weight or --no-weight")
    emit_team(out, args, client.call("UpdateTeam", request))
    return EXIT_OK


def delete_team(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    client.call(
        "DeleteTeam",
        _pb2.DeleteTeamRequest(
            name=names.team_name(args.team), allow_missing=args.allow_missing
        ),
    )
    if args.json:
        print_json(out, {"deleted_team": args.team})
    else:
        print(f"deleted team {args.team}", file=out)
    return EXIT_OK


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
