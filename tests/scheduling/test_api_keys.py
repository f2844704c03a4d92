"""The API key on every way in: with ``--api-key``, every route of the app vLLM
0.32 builds answers 401 without the key, but the probes of
``engine_ext.api_keys.KEY_FREE_ROUTES``; vLLM's own check covers only some path
prefixes. The routes are read from vLLM's real app (every optional router on,
pooling routes too), so a route a new vLLM adds is tested the day it appears.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from fastapi.routing import APIRoute, APIWebSocketRoute
from fastapi.testclient import TestClient
from starlette.routing import Mount, Route
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.pooling.factories import register_pooling_api_routers

from engine_ext.api_keys import KEY_FREE_ROUTES, ApiKeys, api_keys_of, needs_key
from tests import serve_parser_harness

default_control_port_taken_or_not = (
    serve_parser_harness.default_control_port_taken_or_not
)

KEY = "sk-secret"
PACED = [
    "m",
    "--default-user-output-tokens-per-second",
    "100",
    "--output-rate-control-address",
    "off",
    "--enable-scale-out",
    "--tokens-only",
]
TASKS = ("generate", "transcription", "realtime")
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify", "plugin")
#: Stands in for a pooling model's config: the pooling routers read only this.
POOLING_MODEL = SimpleNamespace(get_pooling_task=lambda tasks: "embed")


@pytest.fixture(scope="module")
def keyed_app(serve_parser):
    """vLLM's real app for ``vllm serve ... --api-key KEY`` with our plugin,
    every optional router on, and a pooling model's routes added."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        env.setenv("VLLM_ENABLE_COHERE_API", "1")
        args = serve_parser.parse_args([*PACED, "--api-key", KEY])
        engine_args = AsyncEngineArgs.from_cli_args(args)
        app = build_app(args, supported_tasks=TASKS)
    # Added after the middleware: Starlette builds the stack on the first
    # request, so these routes run inside it like every other.
    register_pooling_api_routers(app, POOLING_TASKS, POOLING_MODEL)  # type: ignore[arg-type]
    app.state.vllm_config = SimpleNamespace(
        additional_config=engine_args.additional_config
    )
    return app


def http_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route of ``app``, path parameters filled."""
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            path = route.path.replace("{response_id}", "resp_1")
            found += [(method, path) for method in sorted(route.methods or ())]
        elif isinstance(route, Mount):
            found.append(("GET", route.path + "/"))
    return found


def test_the_app_has_the_routes_the_hole_was_found_on(keyed_app):
    routes = set(http_routes(keyed_app))
    for path in ("/invocations", "/generative_scoring", "/pooling", "/score"):
        assert ("POST", path) in routes


def test_every_route_but_the_probes_answers_401_without_the_key(keyed_app):
    client = TestClient(keyed_app, raise_server_exceptions=False)
    open_without_key, refused = [], []
    for method, path in http_routes(keyed_app):
        if method == "HEAD":
            continue  # answered as GET
        answer = client.request(method, path, json={})
        if needs_key("http", method, path):
            if answer.status_code != 401:
                open_without_key.append((method, path, answer.status_code))
        elif answer.status_code == 401:
            refused.append((method, path))
    assert not open_without_key, f"served without the API key: {open_without_key}"
    assert not refused, f"probes that asked for the key: {refused}"


def test_with_the_key_no_route_answers_401(keyed_app):
    client = TestClient(keyed_app, raise_server_exceptions=False)
    headers = {"Authorization": f"Bearer {KEY}"}
    # The engine-less app fails most routes (500); what matters is no 401.
    for path in ("/invocations", "/generative_scoring", "/pooling", "/tokenize"):
        answer = client.post(path, json={}, headers=headers)
        assert answer.status_code != 401, path


def test_a_sagemaker_invocation_naming_a_victim_never_reaches_the_engine(keyed_app):
    client = TestClient(keyed_app, raise_server_exceptions=False)
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 4,
        "vllm_xargs": {"output_rate_user": "victim"},
    }
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        answer = client.post("/invocations", json=body, headers=headers)
        assert answer.status_code == 401
        assert answer.json() == {"error": "Unauthorized"}


def test_every_websocket_route_refuses_a_handshake_without_the_key(keyed_app):
    client = TestClient(keyed_app, raise_server_exceptions=False)
    paths = [r.path for r in keyed_app.routes if isinstance(r, APIWebSocketRoute)]
    assert "/v1/realtime" in paths
    for path in paths:
        # vLLM's check answers its paths with a 401 response, the guard others
        # with close code 1008 (which servers answer with 403).
        with (
            pytest.raises((WebSocketDisconnect, WebSocketDenialResponse)) as refused,
            client.websocket_connect(path),
        ):
            pass
        denied = refused.value
        if isinstance(denied, WebSocketDenialResponse):
            assert denied.status_code == 401, path
        else:
            assert denied.code == 1008, path


@pytest.mark.anyio
async def test_the_guard_refuses_a_websocket_without_the_key_on_any_path():
    from engine_ext.http_guard import OutputRateRequestGuard

    async def app(scope, receive, send):
        raise AssertionError("reached the app without the key")

    sent = []
    messages = iter([{"type": "websocket.connect"}])

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    guard = OutputRateRequestGuard(app, api_keys=[KEY])
    scope = {"type": "websocket", "path": "/elsewhere", "headers": []}
    await guard(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_every_key_free_route_is_a_route_of_vllm(keyed_app):
    served = {path.rstrip("/") for _, path in http_routes(keyed_app)}
    assert set(KEY_FREE_ROUTES) <= served


def test_cors_preflights_carry_no_key_and_are_not_refused(keyed_app):
    assert not needs_key("http", "OPTIONS", "/invocations")


def test_the_metrics_mount_is_a_probe_below_its_path():
    assert not needs_key("http", "GET", "/metrics/")
    assert needs_key("http", "POST", "/metrics")


@pytest.mark.parametrize(
    "authorization",
    [
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"Basic " + KEY.encode())],
        [(b"authorization", KEY.encode())],
        # Sent twice: which one a later reader takes is not ours to guess.
        [(b"authorization", b"Bearer " + KEY.encode())] * 2,
    ],
)
def test_a_request_without_exactly_one_valid_bearer_key_is_not_admitted(
    authorization,
):
    assert not ApiKeys([KEY, "other"]).admits(authorization)


def test_any_of_the_keys_is_admitted_in_any_letter_case_of_the_scheme():
    keys = ApiKeys(["first", KEY])
    assert keys.admits([(b"Authorization", b"bearer " + KEY.encode())])
    assert keys.admits([(b"authorization", b"Bearer first")])


def test_keys_are_kept_as_digests_only():
    keys = ApiKeys([KEY])
    assert keys._digests == (hashlib.sha256(KEY.encode()).digest(),)


def test_the_flag_wins_over_the_environment_as_in_vllm():
    flag = SimpleNamespace(api_key=["a", "b"])
    assert api_keys_of(flag, {"VLLM_API_KEY": "env"}) == ("a", "b")
    assert api_keys_of(SimpleNamespace(api_key=None), {"VLLM_API_KEY": "env"}) == (
        "env",
    )
    assert api_keys_of(SimpleNamespace(api_key=None), {}) == ()
    assert api_keys_of(SimpleNamespace(api_key=[""]), {}) == ()
