"""The control API through a real in-process gRPC server: every RPC, and every
bad input with its status code and message."""

from __future__ import annotations

import base64
import threading
import time

import grpc
import pytest
from google.protobuf import duration_pb2

from control.service.operations import LimitsService
from protos.outputrate.v1 import output_rate_pb2 as pb
from tests.control_harness import NS_PER_S, make_rig, serving

CONTROL = "/outputrate.v1.OutputRateControl/"


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5, "bob": 20})


@pytest.fixture
def service(rig):
    return LimitsService(rig.shared)


@pytest.fixture
def served(service):
    with serving(service) as served:
        yield served


def table(served) -> pb.LimitsTable:
    return served.stub.GetLimitsTable(pb.GetLimitsTableRequest())


def error_of(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(request)
        if hasattr(result, "__next__"):  # a stream fails on its first message
            next(result)
    return info.value


def interval(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * NS_PER_S))
    return duration


# -- the default -------------------------------------------------------------


def test_get_default_limit(served):
    got = served.stub.GetDefaultLimit(pb.GetDefaultLimitRequest(name="defaultLimit"))
    assert (got.name, got.tokens_per_second) == ("defaultLimit", 10)


def test_update_default_limit_changes_the_etag_and_wakes_the_engine(served, rig):
    before = table(served).etag
    got = served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=40)
        )
    )
    assert got.tokens_per_second == 40
    assert rig.limiter.rate_of("someone") == 40
    assert rig.limiter.rate_of("alice") == 5  # explicit limits are unaffected
    assert table(served).etag != before
    assert len(rig.wakes) == 1


def test_raising_a_limit_keeps_the_debt_and_pays_it_off_faster(served, rig):
    rig.step("carol", 2)  # default 10/s: TAT 200 ms ahead, next token in 100 ms
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/carol"))
    assert state.next_token_in.ToNanoseconds() == 100_000_000
    served.stub.UpdateLimit(
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/carol", tokens_per_second=50),
            allow_missing=True,
        )
    )
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/carol"))
    # Two tokens owed at 50/s: TAT 40 ms ahead, within the 100 ms burst.
    assert state.tat_lead.ToNanoseconds() == 40_000_000
    assert state.next_token_in.ToNanoseconds() == 0


def test_a_stream_speeds_up_and_slows_down_within_a_second_of_a_change(served, rig):
    """A stream asking every 10 ms gets its limit's pace from the step after
    the RPC: 10/s, raised to 50/s, lowered to 10/s."""

    def tokens_in(seconds: float) -> int:
        granted = 0
        for _ in range(round(seconds * 100)):
            rig.clock.advance_ms(10)
            granted += rig.step("dave")
        return granted

    def set_rate(rate: int) -> None:
        served.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/dave", tokens_per_second=rate),
                allow_missing=True,
            )
        )

    set_rate(10)
    tokens_in(2)
    assert tokens_in(1) == 10
    set_rate(50)
    # At most the GCRA bound (1 s + 100 ms burst) * 50 + 1, at least 50 - 1.
    assert 49 <= tokens_in(1) <= 56
    assert tokens_in(1) == pytest.approx(50, abs=1)
    set_rate(10)
    # Lowering grants no fresh burst: the debt owed at 50/s is paid at 10/s.
    assert tokens_in(1) <= 10
    assert tokens_in(1) == pytest.approx(10, abs=1)


# -- one user's limit --------------------------------------------------------


def test_get_limit(served):
    got = served.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
    assert (got.name, got.tokens_per_second) == ("limits/alice", 5)


def test_create_limit_then_already_exists(served, rig):
    request = pb.CreateLimitRequest(
        limit_id="team/eve", limit=pb.Limit(tokens_per_second=7)
    )
    got = served.stub.CreateLimit(request)
    assert (got.name, got.tokens_per_second) == ("limits/team/eve", 7)
    assert rig.limiter.rate_of("team/eve") == 7
    error = error_of(served.stub.CreateLimit, request)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'limits/team/eve' exists" in error.details()


def test_update_limit_needs_allow_missing_to_create(served, rig):
    request = pb.UpdateLimitRequest(
        limit=pb.Limit(name="limits/fay", tokens_per_second=3)
    )
    assert (
        error_of(served.stub.UpdateLimit, request).code() == grpc.StatusCode.NOT_FOUND
    )
    request.allow_missing = True
    assert served.stub.UpdateLimit(request).tokens_per_second == 3
    request.limit.tokens_per_second = 4
    request.allow_missing = False
    request.update_mask.paths.append("tokens_per_second")
    assert served.stub.UpdateLimit(request).tokens_per_second == 4
    assert rig.limiter.rate_of("fay") == 4


def test_delete_limit_restores_the_default(served, rig):
    served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/alice"))
    assert rig.limiter.rate_of("alice") == 10
    request = pb.DeleteLimitRequest(name="limits/alice")
    assert (
        error_of(served.stub.DeleteLimit, request).code() == grpc.StatusCode.NOT_FOUND
    )
    served.stub.DeleteLimit(
        pb.DeleteLimitRequest(name="limits/alice", allow_missing=True)
    )


def test_list_limits_pages_in_user_order(served, rig):
    for user in ["d", "c", "a/b", "e"]:
        served.stub.CreateLimit(
            pb.CreateLimitRequest(limit_id=user, limit=pb.Limit(tokens_per_second=1))
        )
    seen, token, pages = [], "", 0
    while True:
        page = served.stub.ListLimits(
            pb.ListLimitsRequest(page_size=2, page_token=token)
        )
        seen += [limit.name for limit in page.limits]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    expected = sorted(["a/b", "alice", "bob", "c", "d", "e"])
    assert seen == [f"limits/{user}" for user in expected]
    assert pages == 3  # no empty trailing page


def test_list_limits_default_page_size_is_100_and_capped_at_1000(served, service):
    served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=10,
                limits=[
                    pb.Limit(name=f"limits/u{i:04}", tokens_per_second=1)
                    for i in range(1500)
                ],
            )
        )
    )
    assert len(served.stub.ListLimits(pb.ListLimitsRequest()).limits) == 100
    assert (
        len(served.stub.ListLimits(pb.ListLimitsRequest(page_size=5000)).limits) == 1000
    )


# -- the whole table ---------------------------------------------------------


def test_get_limits_table(served):
    got = table(served)
    assert got.name == "limitsTable"
    assert got.default_tokens_per_second == 10
    assert [(x.name, x.tokens_per_second) for x in got.limits] == [
        ("limits/alice", 5),
        ("limits/bob", 20),
    ]
    assert got.etag


def test_replace_limits_table_with_the_current_etag(served, rig):
    current = table(served)
    replaced = served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=30,
                limits=[pb.Limit(name="limits/zed", tokens_per_second=2)],
                etag=current.etag,
            )
        )
    )
    assert replaced.etag not in ("", current.etag)
    assert [x.name for x in replaced.limits] == ["limits/zed"]
    assert rig.limiter.user_rates == {"zed": 2}
    assert rig.limiter.default_rate == 30
    assert table(served) == replaced


def test_replace_limits_table_with_a_stale_etag_is_aborted_and_changes_nothing(
    served, rig
):
    stale = table(served).etag
    served.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=11)
        )
    )
    before = table(served)
    error = error_of(
        served.stub.ReplaceLimitsTable,
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(default_tokens_per_second=99, etag=stale)
        ),
    )
    assert error.code() == grpc.StatusCode.ABORTED
    assert "not current" in error.details()
    assert table(served) == before


def test_replace_limits_table_without_etag_is_unconditional(served, rig):
    served.stub.ReplaceLimitsTable(
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(default_tokens_per_second=3)
        )
    )
    assert rig.limiter.user_rates == {}
    assert rig.limiter.default_rate == 3


# -- user state --------------------------------------------------------------


def test_get_user_state_reports_durations_and_counters(served, rig):
    rig.counts.value = {"alice": (3, 2)}
    rig.step("alice", 4)  # 5/s: one granted (TAT +200 ms), three refused
    rig.clock.advance_ms(50)
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/alice"))
    assert state.name == "userStates/alice"
    assert state.user == "alice"
    assert state.limit_tokens_per_second == 5
    assert state.tat_lead.ToNanoseconds() == 150_000_000
    assert state.next_token_in.ToNanoseconds() == 50_000_000
    assert (state.tokens_charged, state.throttled_skips, state.refunds) == (1, 3, 0)
    assert (state.running_requests, state.throttled_requests) == (3, 2)
    assert state.engine_late.ToNanoseconds() == 0
    rig.accounting.record("alice", "engine_late_ns", 120_000_000)
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/alice"))
    assert state.engine_late.ToNanoseconds() == 120_000_000


def test_user_state_of_a_user_known_only_by_requests(served, rig):
    rig.counts.value = {"quiet": (1, 0)}
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/quiet"))
    assert state.limit_tokens_per_second == 10
    assert state.running_requests == 1


def test_recent_tokens_per_second_measures_the_last_seconds(served, rig):
    for _ in range(700):  # 7 s at one attempt per 10 ms: 10/s granted
        rig.clock.advance_ms(10)
        rig.step("gus")
    state = served.stub.GetUserState(pb.GetUserStateRequest(name="userStates/gus"))
    assert state.recent_tokens_per_second == pytest.approx(10, rel=0.05)


def test_list_user_states_by_throttled_skips_desc(served, rig):
    for user, asks in [("u1", 3), ("u2", 6), ("u3", 1), ("u4", 6)]:
        rig.step(user, asks)  # default 10/s: 2 granted, asks - 2 skipped
    seen, token = [], ""
    while True:
        page = served.stub.ListUserStates(
            pb.ListUserStatesRequest(
                page_size=2, page_token=token, order_by="throttled_skips desc"
            )
        )
        seen += [(s.user, s.throttled_skips) for s in page.user_states]
        token = page.next_page_token
        if not token:
            break
    # Ties by user id; alice and bob are known through their explicit limits.
    assert seen == [
        ("u2", 4),
        ("u4", 4),
        ("u1", 1),
        ("alice", 0),
        ("bob", 0),
        ("u3", 0),
    ]


def test_list_user_states_default_order_is_by_user(served, rig):
    rig.step("zoe")
    page = served.stub.ListUserStates(pb.ListUserStatesRequest())
    assert [s.user for s in page.user_states] == ["alice", "bob", "zoe"]
    assert page.next_page_token == ""


def test_list_user_states_by_several_fields(served, rig):
    rig.counts.value = {"alice": (2, 0), "bob": (2, 1), "cy": (1, 1)}
    page = served.stub.ListUserStates(
        pb.ListUserStatesRequest(order_by="running_requests desc, throttled_requests")
    )
    assert [s.user for s in page.user_states] == ["alice", "bob", "cy"]


def test_watch_user_states_sends_updates_at_the_interval(served, rig):
    rig.step("alice", 3)
    # From before the call: the window surely holds the server's interval.
    started = time.monotonic()
    stream = served.stub.WatchUserStates(
        pb.WatchUserStatesRequest(interval=interval(0.1), names=["userStates/alice"])
    )
    first = next(stream)
    rig.step("alice", 2)
    second = next(stream)
    elapsed = time.monotonic() - started
    stream.cancel()
    assert [s.user for s in first.user_states] == ["alice"]
    assert first.user_states[0].throttled_skips == 2
    assert second.user_states[0].throttled_skips == 4
    assert elapsed >= 0.09


def test_watch_without_names_sends_the_top_users(served, rig):
    for user, asks in [("a", 5), ("b", 9), ("c", 2)]:
        rig.step(user, asks)
    stream = served.stub.WatchUserStates(pb.WatchUserStatesRequest(max_users=2))
    update = next(stream)
    stream.cancel()
    assert [s.user for s in update.user_states] == ["b", "a"]


def test_watch_leaves_out_users_not_known_yet(served, rig):
    stream = served.stub.WatchUserStates(
        pb.WatchUserStatesRequest(
            interval=interval(0.1), names=["userStates/later", "userStates/bob"]
        )
    )
    assert [s.user for s in next(stream).user_states] == ["bob"]
    rig.step("later")
    # Updates the server sent (every 0.1 s) before "later" was known leave it
    # out; the first one read after it is known has it.
    for _ in range(50):
        users = [s.user for s in next(stream).user_states]
        if users != ["bob"]:
            break
    assert users == ["later", "bob"]
    stream.cancel()


def test_watches_beyond_the_limit_are_refused(served):
    streams = [
        served.stub.WatchUserStates(pb.WatchUserStatesRequest(interval=interval(10)))
        for _ in range(4)
    ]
    for stream in streams:
        next(stream)
    error = error_of(served.stub.WatchUserStates, pb.WatchUserStatesRequest())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in streams:
        stream.cancel()


def test_stopping_the_server_ends_watches(service):
    with serving(service) as served:
        stream = served.stub.WatchUserStates(
            pb.WatchUserStatesRequest(interval=interval(60))
        )
        next(stream)
        started = time.monotonic()
        served.server.stop(5)
        assert list(stream) == []  # ended cleanly, not cut off by the grace period
        assert time.monotonic() - started < 2


# -- bad input ---------------------------------------------------------------

LONG = "x" * 257
UNICODE_LONG = "é" * 129  # 258 bytes in UTF-8, 129 characters
Invalid = grpc.StatusCode.INVALID_ARGUMENT
NotFound = grpc.StatusCode.NOT_FOUND


def _token(served) -> str:
    return served.stub.ListLimits(pb.ListLimitsRequest(page_size=1)).next_page_token


def _tampered(token: str) -> str:
    body, mac = token.split(".")
    payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    forged = payload.replace(b"alice", b"aaaaa")
    return base64.urlsafe_b64encode(forged).rstrip(b"=").decode() + "." + mac


BAD_INPUT = [
    # (id, method, request or a function of the server giving it, code, message part)
    (
        "get empty name",
        "GetLimit",
        pb.GetLimitRequest(),
        Invalid,
        "name must look like limits/{user}",
    ),
    (
        "get other collection",
        "GetLimit",
        pb.GetLimitRequest(name="users/alice"),
        Invalid,
        "must look like limits/{user}",
    ),
    (
        "get empty user",
        "GetLimit",
        pb.GetLimitRequest(name="limits/"),
        Invalid,
        "user id in name must not be empty",
    ),
    (
        "get long user",
        "GetLimit",
        pb.GetLimitRequest(name="limits/" + LONG),
        Invalid,
        "at most 256 bytes",
    ),
    (
        "get long unicode user",
        "GetLimit",
        pb.GetLimitRequest(name="limits/" + UNICODE_LONG),
        Invalid,
        "at most 256 bytes",
    ),
    (
        "get control char",
        "GetLimit",
        pb.GetLimitRequest(name="limits/a\nb"),
        Invalid,
        "control characters",
    ),
    (
        "get DEL char",
        "GetLimit",
        pb.GetLimitRequest(name="limits/a\x7fb"),
        Invalid,
        "control characters",
    ),
    (
        "get unknown user",
        "GetLimit",
        pb.GetLimitRequest(name="limits/nobody"),
        NotFound,
        "'limits/nobody' does not exist",
    ),
    (
        "create empty id",
        "CreateLimit",
        pb.CreateLimitRequest(limit=pb.Limit(tokens_per_second=1)),
        Invalid,
        "limit_id must not be empty",
    ),
    (
        "create control char",
        "CreateLimit",
        pb.CreateLimitRequest(limit_id="a\tb", limit=pb.Limit(tokens_per_second=1)),
        Invalid,
        "control characters",
    ),
    (
        "create no rate",
        "CreateLimit",
        pb.CreateLimitRequest(limit_id="new"),
        Invalid,
        "limit.tokens_per_second: must be an integer in 1..1000000 "
        "(tokens per second), got 0",
    ),
    (
        "update zero rate",
        "UpdateLimit",
        pb.UpdateLimitRequest(limit=pb.Limit(name="limits/alice", tokens_per_second=0)),
        Invalid,
        "got 0",
    ),
    (
        "update negative rate",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", tokens_per_second=-5)
        ),
        Invalid,
        "got -5",
    ),
    (
        "update huge rate",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", tokens_per_second=1_000_001)
        ),
        Invalid,
        "got 1000001",
    ),
    (
        "update int64 max rate",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", tokens_per_second=2**63 - 1)
        ),
        Invalid,
        "limit.tokens_per_second: must be an integer in 1..1000000",
    ),
    (
        "update bad mask",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/alice", tokens_per_second=1),
            update_mask={"paths": ["name"]},
        ),
        Invalid,
        "update_mask: cannot update 'name'",
    ),
    (
        "update bad name",
        "UpdateLimit",
        pb.UpdateLimitRequest(limit=pb.Limit(name="alice", tokens_per_second=1)),
        Invalid,
        "limit.name must look like limits/{user}",
    ),
    (
        "update unknown user",
        "UpdateLimit",
        pb.UpdateLimitRequest(
            limit=pb.Limit(name="limits/nobody", tokens_per_second=1)
        ),
        NotFound,
        "does not exist",
    ),
    (
        "delete unknown user",
        "DeleteLimit",
        pb.DeleteLimitRequest(name="limits/nobody"),
        NotFound,
        "does not exist",
    ),
    (
        "delete empty user",
        "DeleteLimit",
        pb.DeleteLimitRequest(name="limits/"),
        Invalid,
        "must not be empty",
    ),
    (
        "default wrong name",
        "GetDefaultLimit",
        pb.GetDefaultLimitRequest(name="limits/alice"),
        Invalid,
        "name must be 'defaultLimit' or empty",
    ),
    (
        "default zero",
        "UpdateDefaultLimit",
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=0)
        ),
        Invalid,
        "default_limit.tokens_per_second: must be an integer in 1..1000000",
    ),
    (
        "default negative",
        "UpdateDefaultLimit",
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=-1)
        ),
        Invalid,
        "got -1",
    ),
    (
        "default huge",
        "UpdateDefaultLimit",
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=10**12)
        ),
        Invalid,
        "got 1000000000000",
    ),
    (
        "default bad mask",
        "UpdateDefaultLimit",
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=5),
            update_mask={"paths": ["name"]},
        ),
        Invalid,
        "update_mask",
    ),
    (
        "list negative page size",
        "ListLimits",
        pb.ListLimitsRequest(page_size=-1),
        Invalid,
        "page_size must not be negative",
    ),
    (
        "list garbage token",
        "ListLimits",
        pb.ListLimitsRequest(page_token="garbage"),
        Invalid,
        "page_token is not valid",
    ),
    (
        "list tampered token",
        "ListLimits",
        lambda s: pb.ListLimitsRequest(page_token=_tampered(_token(s))),
        Invalid,
        "page_token is not valid",
    ),
    (
        "list truncated token",
        "ListLimits",
        lambda s: pb.ListLimitsRequest(page_token=_token(s)[:-2]),
        Invalid,
        "page_token is not valid",
    ),
    (
        "list huge token",
        "ListLimits",
        pb.ListLimitsRequest(page_token="a" * 5000 + ".b"),
        Invalid,
        "page_token is not valid",
    ),
    (
        "list token of another list",
        "ListUserStates",
        lambda s: pb.ListUserStatesRequest(page_token=_token(s)),
        Invalid,
        "other parameters",
    ),
    (
        "states token of another order",
        "ListUserStates",
        lambda s: pb.ListUserStatesRequest(
            order_by="refunds",
            page_token=s.stub.ListUserStates(
                pb.ListUserStatesRequest(page_size=1)
            ).next_page_token,
        ),
        Invalid,
        "other parameters",
    ),
    (
        "states unknown field",
        "ListUserStates",
        pb.ListUserStatesRequest(order_by="tat_lead"),
        Invalid,
        "cannot sort by 'tat_lead'",
    ),
    (
        "states user desc",
        "ListUserStates",
        pb.ListUserStatesRequest(order_by="user desc"),
        Invalid,
        "user can only be sorted ascending",
    ),
    (
        "states bad direction",
        "ListUserStates",
        pb.ListUserStatesRequest(order_by="refunds sideways"),
        Invalid,
        "optionally followed by asc or desc",
    ),
    (
        "states repeated field",
        "ListUserStates",
        pb.ListUserStatesRequest(order_by="refunds, refunds desc"),
        Invalid,
        "appears more than once",
    ),
    (
        "state unknown user",
        "GetUserState",
        pb.GetUserStateRequest(name="userStates/nobody"),
        NotFound,
        "does not know this user",
    ),
    (
        "state wrong collection",
        "GetUserState",
        pb.GetUserStateRequest(name="limits/alice"),
        Invalid,
        "must look like userStates/{user}",
    ),
    (
        "table wrong name",
        "GetLimitsTable",
        pb.GetLimitsTableRequest(name="table"),
        Invalid,
        "'limitsTable' or empty",
    ),
    (
        "replace zero default",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(limits_table=pb.LimitsTable()),
        Invalid,
        "limits_table.default_tokens_per_second: must be an integer in 1..1000000",
    ),
    (
        "replace duplicate",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                limits=[
                    pb.Limit(name="limits/a", tokens_per_second=1),
                    pb.Limit(name="limits/a", tokens_per_second=2),
                ],
            )
        ),
        Invalid,
        "limits_table.limits[1].name: 'limits/a' appears more than once",
    ),
    (
        "replace bad rate",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                limits=[pb.Limit(name="limits/a", tokens_per_second=0)],
            )
        ),
        Invalid,
        "limits_table.limits[0].tokens_per_second",
    ),
    (
        "replace bad user",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(
                default_tokens_per_second=1,
                limits=[pb.Limit(name="limits/" + LONG, tokens_per_second=1)],
            )
        ),
        Invalid,
        "limits_table.limits[0].name",
    ),
    (
        "replace stale etag",
        "ReplaceLimitsTable",
        pb.ReplaceLimitsTableRequest(
            limits_table=pb.LimitsTable(default_tokens_per_second=1, etag="0-0")
        ),
        grpc.StatusCode.ABORTED,
        "etag '0-0' is not current",
    ),
    (
        "watch short interval",
        "WatchUserStates",
        pb.WatchUserStatesRequest(interval=interval(0.01)),
        Invalid,
        "interval must be between 100 ms and 60 s, got 0.01 s",
    ),
    (
        "watch long interval",
        "WatchUserStates",
        pb.WatchUserStatesRequest(interval=interval(61)),
        Invalid,
        "got 61 s",
    ),
    (
        "watch negative interval",
        "WatchUserStates",
        pb.WatchUserStatesRequest(interval=interval(-1)),
        Invalid,
        "got -1 s",
    ),
    (
        "watch too many names",
        "WatchUserStates",
        pb.WatchUserStatesRequest(names=[f"userStates/u{i}" for i in range(101)]),
        Invalid,
        "names holds at most 100 entries",
    ),
    (
        "watch bad name",
        "WatchUserStates",
        pb.WatchUserStatesRequest(names=["userStates/ok", "bob"]),
        Invalid,
        "names[1] must look like userStates/{user}",
    ),
    (
        "watch bad order",
        "WatchUserStates",
        pb.WatchUserStatesRequest(order_by="charm"),
        Invalid,
        "cannot sort by 'charm'",
    ),
    (
        "watch negative max",
        "WatchUserStates",
        pb.WatchUserStatesRequest(max_users=-1),
        Invalid,
        "max_users must not be negative",
    ),
]


@pytest.mark.parametrize(
    ("method", "request_", "code", "message"),
    [row[1:] for row in BAD_INPUT],
    ids=[row[0] for row in BAD_INPUT],
)
def test_bad_input_gets_its_status_and_changes_nothing(
    served, rig, method, request_, code, message
):
    if callable(request_):
        request_ = request_(served)
    before = table(served)
    error = error_of(getattr(served.stub, method), request_)
    assert error.code() == code
    assert message in error.details()
    assert table(served) == before
    assert rig.wakes == []
    assert served.server.rpc_counts.snapshot()[(CONTROL + method, code.name)] >= 1


def test_error_messages_do_not_echo_unbounded_input(served):
    error = error_of(served.stub.GetLimit, pb.GetLimitRequest(name="x" * 100_000))
    assert len(error.details()) < 300


def test_unexpected_errors_are_internal_and_not_leaked(served, rig, caplog):
    def broken():
        raise RuntimeError("secret detail")

    rig.shared._request_counts = broken
    error = error_of(
        served.stub.GetUserState, pb.GetUserStateRequest(name="userStates/alice")
    )
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in error.details()
    assert "secret detail" in caplog.text


def test_concurrent_changes_and_steps_stay_consistent(served, rig):
    """Writers race each other and a scheduler thread; every change lands and
    the etag moves once per change."""
    first = table(served).etag
    stop = threading.Event()

    def scheduler() -> None:
        while not stop.is_set():
            rig.step("alice")

    def writer(prefix: str) -> None:
        for i in range(25):
            served.stub.UpdateLimit(
                pb.UpdateLimitRequest(
                    limit=pb.Limit(name=f"limits/{prefix}{i}", tokens_per_second=i + 1),
                    allow_missing=True,
                )
            )

    threads = [threading.Thread(target=scheduler)]
    threads += [threading.Thread(target=writer, args=(p,)) for p in "wxyz"]
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join()
    stop.set()
    threads[0].join()
    final = table(served)
    assert len(final.limits) == 2 + 100
    epoch, generation = first.rsplit("-", 1)
    assert final.etag == f"{epoch}-{int(generation) + 100}"
    assert len(rig.wakes) == 100
