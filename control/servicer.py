"""The ``outputrate.v1.OutputRateControl`` servicer: translates messages to and
from ``LimitsService`` calls, nothing else (errors are mapped by an interceptor).

The RPCs of the rate holders (user entries, tiers, teams) are the same five
verbs for each kind (``control.kinds``), and their messages are read and built
field by field from the kind's fields, so that a new attribute of the policy is
carried by every RPC once the proto has it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf.message import Message

from control import names
from control.errors import ResourceExhausted
from control.kinds import ALL, TEAMS, TIERS, USERS, Kind, attributes_wire
from control.resources import (
    Holder,
    HolderSpec,
    LimitsTable,
    PacingMode,
    TeamState,
    UserState,
)
from control.service.operations import LimitsService
from pacing.budget import Health, StoreView
from pacing.modes import Mode
from pacing.policy.model import ATTRIBUTES, Limits
from protos.outputrate.v1 import output_rate_pb2 as _pb2
from protos.outputrate.v1 import output_rate_pb2_grpc as _pb2_grpc

M = TypeVar("M", bound=Message)
#: Full name of the service, as health checks and reflection list it.
SERVICE_NAME = _pb2.DESCRIPTOR.services_by_name["OutputRateControl"].full_name
#: Concurrent watches allowed: each holds a server worker thread for its life.
MAX_WATCHES = 4
_MODES = {
    Mode.ENFORCE: _pb2.PacingMode.ENFORCE,
    Mode.SHADOW: _pb2.PacingMode.SHADOW,
    Mode.OFF: _pb2.PacingMode.OFF,
}
_MODES_BY_NUMBER = {number: mode for mode, number in _MODES.items()}
_SOURCES = {
    "user": _pb2.UserState.USER,
    "tier": _pb2.UserState.TIER,
    "default": _pb2.UserState.DEFAULT,
    "exempt": _pb2.UserState.EXEMPT,
    "off": _pb2.UserState.OFF,
}
_HEALTHS = {
    Health.GLOBAL: _pb2.StoreView.GLOBAL,
    Health.LOCAL_SHARE: _pb2.StoreView.LOCAL_SHARE,
    Health.FAIL_OPEN: _pb2.StoreView.FAIL_OPEN,
    Health.FAIL_CLOSED: _pb2.StoreView.FAIL_CLOSED,
}


class OutputRateControlServicer(_pb2_grpc.OutputRateControlServicer):
    """Serves ``service`` over gRPC; ``stop_watches()`` ends every open watch."""

    def __init__(self, service: LimitsService, *, max_watches: int = MAX_WATCHES):
        self._service = service
        self._max_watches = max_watches
        self._lock = threading.Lock()
        self._watches: set[threading.Event] = set()
        self._stopping = False

    def GetDefaultLimit(
        self, request: _pb2.GetDefaultLimitRequest, context: grpc.ServicerContext
    ) -> _pb2.DefaultLimit:
        return _default(self._service.get_default(request.name))

    def UpdateDefaultLimit(
        self, request: _pb2.UpdateDefaultLimitRequest, context: grpc.ServicerContext
    ) -> _pb2.DefaultLimit:
        message = request.default_limit
        values = {name: getattr(message, name) for name in ATTRIBUTES["default"]}
        paths = list(request.update_mask.paths)
        return _default(self._service.update_default(message.name, values, paths))

    def GetLimit(
        self, request: _pb2.GetLimitRequest, context: grpc.ServicerContext
    ) -> _pb2.Limit:
        return self._get(USERS, request, _pb2.Limit)

    def ListLimits(
        self, request: _pb2.ListLimitsRequest, context: grpc.ServicerContext
    ) -> _pb2.ListLimitsResponse:
        return self._list(USERS, request, _pb2.ListLimitsResponse)

    def CreateLimit(
        self, request: _pb2.CreateLimitRequest, context: grpc.ServicerContext
    ) -> _pb2.Limit:
        return self._create(USERS, request, _pb2.Limit)

    def UpdateLimit(
        self, request: _pb2.UpdateLimitRequest, context: grpc.ServicerContext
    ) -> _pb2.Limit:
        return self._update(USERS, request, _pb2.Limit)

    def DeleteLimit(
        self, request: _pb2.DeleteLimitRequest, context: grpc.ServicerContext
    ) -> _empty_pb2.Empty:
        return self._delete(USERS, request)

    def GetTier(
        self, request: _pb2.GetTierRequest, context: grpc.ServicerContext
    ) -> _pb2.Tier:
        return self._get(TIERS, request, _pb2.Tier)

    def ListTiers(
        self, request: _pb2.ListTiersRequest, context: grpc.ServicerContext
    ) -> _pb2.ListTiersResponse:
        return self._list(TIERS, request, _pb2.ListTiersResponse)

    def CreateTier(
        self, request: _pb2.CreateTierRequest, context: grpc.ServicerContext
    ) -> _pb2.Tier:
        return self._create(TIERS, request, _pb2.Tier)

    def UpdateTier(
        self, request: _pb2.UpdateTierRequest, context: grpc.ServicerContext
    ) -> _pb2.Tier:
        return self._update(TIERS, request, _pb2.Tier)

    def DeleteTier(
        self, request: _pb2.DeleteTierRequest, context: grpc.ServicerContext
    ) -> _empty_pb2.Empty:
        return self._delete(TIERS, request)

    def GetTeam(
        self, request: _pb2.GetTeamRequest, context: grpc.ServicerContext
    ) -> _pb2.Team:
        return self._get(TEAMS, request, _pb2.Team)

    def ListTeams(
        self, request: _pb2.ListTeamsRequest, context: grpc.ServicerContext
    ) -> _pb2.ListTeamsResponse:
        return self._list(TEAMS, request, _pb2.ListTeamsResponse)

    def CreateTeam(
        self, request: _pb2.CreateTeamRequest, context: grpc.ServicerContext
    ) -> _pb2.Team:
        return self._create(TEAMS, request, _pb2.Team)

    def UpdateTeam(
        self, request: _pb2.UpdateTeamRequest, context: grpc.ServicerContext
    ) -> _pb2.Team:
        return self._update(TEAMS, request, _pb2.Team)

    def DeleteTeam(
        self, request: _pb2.DeleteTeamRequest, context: grpc.ServicerContext
    ) -> _empty_pb2.Empty:
        return self._delete(TEAMS, request)

    # -- the verbs of every kind (``control.kinds``) ---------------------------

    def _get(self, kind: Kind, request: Any, reply: type[M]) -> M:
        return _message(self._service.get(kind, request.name), reply)

    def _list(self, kind: Kind, request: Any, reply: type[M]) -> M:
        holders, token = self._service.list_page(
            kind, request.page_size, request.page_token
        )
        page: list[Message] = [_message(holder) for holder in holders]
        return reply(**{kind.collection: page}, next_page_token=token)

    def _create(self, kind: Kind, request: Any, reply: type[M]) -> M:
        holder_id = getattr(request, f"{kind.resource}_id")
        values = _values(kind, getattr(request, kind.resource))
        return _message(self._service.create(kind, holder_id, values), reply)

    def _update(self, kind: Kind, request: Any, reply: type[M]) -> M:
        message = getattr(request, kind.resource)
        holder = self._service.update(
            kind,
            message.name,
            _values(kind, message),
            list(request.update_mask.paths),
            allow_missing=request.allow_missing,
            etag=message.etag,
        )
        return _message(holder, reply)

    def _delete(self, kind: Kind, request: Any) -> _empty_pb2.Empty:
        self._service.delete(
            kind, request.name, allow_missing=request.allow_missing, etag=request.etag
        )
        return _empty_pb2.Empty()

    def GetTeamState(
        self, request: _pb2.GetTeamStateRequest, context: grpc.ServicerContext
    ) -> _pb2.TeamState:
        return _team_state(self._service.get_team_state(request.name))

    def ListTeamStates(
        self, request: _pb2.ListTeamStatesRequest, context: grpc.ServicerContext
    ) -> _pb2.ListTeamStatesResponse:
        states, token = self._service.list_team_states(
            request.page_size, request.page_token
        )
        return _pb2.ListTeamStatesResponse(
            team_states=[_team_state(s) for s in states], next_page_token=token
        )

    def GetPacingMode(
        self, request: _pb2.GetPacingModeRequest, context: grpc.ServicerContext
    ) -> _pb2.PacingMode:
        return _pacing_mode(self._service.get_pacing_mode(request.name))

    def UpdatePacingMode(
        self, request: _pb2.UpdatePacingModeRequest, context: grpc.ServicerContext
    ) -> _pb2.PacingMode:
        mode = request.pacing_mode
        return _pacing_mode(
            self._service.update_pacing_mode(
                mode.name,
                _MODES_BY_NUMBER.get(mode.mode),
                list(request.update_mask.paths),
                etag=mode.etag,
                fair_share=mode.fair_share,
                mode_set=mode.mode != _pb2.PacingMode.MODE_UNSPECIFIED,
            )
        )

    def GetLimitsTable(
        self, request: _pb2.GetLimitsTableRequest, context: grpc.ServicerContext
    ) -> _pb2.LimitsTable:
        return _table(self._service.get_limits_table(request.name))

    def ReplaceLimitsTable(
        self, request: _pb2.ReplaceLimitsTableRequest, context: grpc.ServicerContext
    ) -> _pb2.LimitsTable:
        table = request.limits_table
        default = {name: getattr(table.default, name) for name in ATTRIBUTES["default"]}
        holders = {
            kind: [
                HolderSpec(message.name, _values(kind, message))
                for message in getattr(table, kind.collection)
            ]
            for kind in ALL
        }
        return _table(
            self._service.replace_limits_table(
                table.default_tokens_per_second,
                holders,
                table.etag,
                default if table.HasField("default") else None,
                bands=tuple(table.bands),
                objectives=[(o.name, o.band) for o in table.objectives],
            )
        )

    def GetUserState(
        self, request: _pb2.GetUserStateRequest, context: grpc.ServicerContext
    ) -> _pb2.UserState:
        return _user_state(self._service.get_user_state(request.name))

    def ListUserStates(
        self, request: _pb2.ListUserStatesRequest, context: grpc.ServicerContext
    ) -> _pb2.ListUserStatesResponse:
        states, token = self._service.list_user_states(
            request.page_size, request.page_token, request.order_by
        )
        return _pb2.ListUserStatesResponse(
            user_states=[_user_state(s) for s in states], next_page_token=token
        )

    def WatchUserStates(
        self, request: _pb2.WatchUserStatesRequest, context: grpc.ServicerContext
    ) -> Iterator[_pb2.WatchUserStatesResponse]:
        plan = self._service.plan_watch(
            request.interval.ToNanoseconds() if request.HasField("interval") else None,
            list(request.names),
            request.order_by,
            request.max_users,
        )
        done = threading.Event()  # set when the client leaves or the server stops
        with self._lock:
            if self._stopping or len(self._watches) >= self._max_watches:
                raise ResourceExhausted(
                    f"at most {self._max_watches} watches may be open at once"
                )
            self._watches.add(done)
        try:
            if not context.add_callback(done.set):
                return  # the call has ended already
            while True:
                states = self._service.watch_states(plan)
                yield _pb2.WatchUserStatesResponse(
                    user_states=[_user_state(s) for s in states]
                )
                if done.wait(plan.interval_ns / 1e9):
                    return
        finally:
            with self._lock:
                self._watches.discard(done)

    def stop_watches(self) -> None:
        """Ends every open watch and refuses new ones (for a graceful stop)."""
        with self._lock:
            self._stopping = True
            for done in self._watches:
                done.set()


def _message(holder: Holder, reply: type[M] | None = None) -> M:
    """``holder`` as its kind's message (``reply``): every field of the kind,
    by name."""
    kind = holder.kind
    fields = holder.wire()
    if kind.is_group:
        fields["member_count"] = holder.member_count
    message = getattr(_pb2, kind.title) if reply is None else reply
    return cast(M, message(name=holder.name, etag=holder.etag, **fields))


def _default(limits: Limits) -> _pb2.DefaultLimit:
    """The default as its message: each of its attributes, 0 for none."""
    fields = attributes_wire(limits, ATTRIBUTES["default"])
    return _pb2.DefaultLimit(name=names.DEFAULT_LIMIT, **fields)


def _values(kind: Kind, message: Any) -> dict[str, object]:
    """The wire value of each field of ``kind`` in ``message``."""
    return {name: getattr(message, name) for name in kind.fields}


def _team_state(state: TeamState) -> _pb2.TeamState:
    return _pb2.TeamState(
        name=names.team_state_name(state.team),
        team=state.team,
        tokens_per_second=state.tokens_per_second,
        weight=state.weight,
        budget_tokens=state.budget_tokens,
        tat_lead=_duration(state.tat_lead_ns),
        next_token_in=_duration(state.next_token_in_ns),
        member_count=state.member_count,
        running_members=state.running_members,
        throttled_members=state.throttled_members,
        tokens_charged=state.tokens_charged,
        throttled_steps=state.throttled_steps,
        fair_share_service=state.fair_share_service,
        prompt_tokens_per_second=state.prompt_tokens_per_second,
    )


def _pacing_mode(mode: PacingMode) -> _pb2.PacingMode:
    return _pb2.PacingMode(
        name=names.PACING_MODE,
        mode=_MODES[mode.mode],
        etag=mode.etag,
        fair_share=mode.fair_share,
    )


def _table(table: LimitsTable) -> _pb2.LimitsTable:
    return _pb2.LimitsTable(
        name=names.LIMITS_TABLE,
        default_tokens_per_second=table.default_tokens_per_second,
        etag=table.etag,
        default=_default(table.default),
        bands=table.bands,
        objectives=[
            _pb2.Objective(name=name, band=band)
            for name, band in table.objectives.items()
        ],
        **{
            kind.collection: [
                _message(holder) for holder in table.holders.get(kind, [])
            ]
            for kind in ALL
        },
    )


def _user_state(view: UserState) -> _pb2.UserState:
    state = view.snapshot
    return _pb2.UserState(
        name=names.user_state_name(state.user),
        user=state.user,
        limit_tokens_per_second=state.limit,
        tat_lead=_duration(state.tat_lead_ns),
        next_token_in=_duration(state.next_token_in_ns),
        tokens_charged=state.tokens_charged,
        refunds=state.refunds,
        throttled_skips=state.throttled_skips,
        throttled_preemptions=state.throttled_preemptions,
        running_requests=state.running_requests,
        throttled_requests=state.throttled_requests,
        recent_tokens_per_second=state.recent_tokens_per_second,
        limit_source=_SOURCES[view.source.kind],
        tier="" if view.tier is None else names.tier_name(view.tier),
        shadow_skips=view.shadow_skips,
        pacing_mode=_MODES[view.mode],
        store=None if view.store is None else _store_view(view.store),
        engine_late=_duration(view.engine_late_ns),
        weight=view.fair_share.weight,
        fair_share_service=view.fair_share.service,
        fair_share_preemptions=view.fair_share.preemptions,
        fair_share=view.fair_share.enabled,
        fair_share_backlogged=view.fair_share.backlogged,
        fair_share_lead=view.fair_share.lead,
        prompt_limit_tokens_per_second=state.prompt_limit,
        prompt_tat_lead=_duration(state.prompt_tat_lead_ns),
        prompt_next_token_in=_duration(state.prompt_next_token_in_ns),
        prompt_tokens_charged=state.prompt_tokens_charged,
        prompt_held_skips=state.prompt_held_skips,
        prompt_shadow_holds=state.prompt_shadow_holds,
        prompt_wait=_duration(state.prompt_wait_ns),
        ceiling_tokens_per_second=view.ceiling.ceiling,
        borrowed_tokens=view.ceiling.borrowed_tokens,
        may_borrow=view.ceiling.may_borrow,
        band=view.band,
    )


def _store_view(view: StoreView) -> _pb2.StoreView:
    return _pb2.StoreView(
        held_tokens=view.held_tokens,
        global_tat_lead=_duration(view.global_tat_lead_ns),
        global_tat_read_age=None
        if view.read_age_ns is None
        else _duration(view.read_age_ns),
        health=_HEALTHS[view.health],
    )


def _duration(ns: int) -> _duration_pb2.Duration:
    duration = _duration_pb2.Duration()
    duration.FromNanoseconds(ns)
    return duration
