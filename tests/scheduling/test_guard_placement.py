"""Where the HTTP guard sits in the app vLLM builds: inside vLLM's own
authentication (``--api-key``), so an unauthenticated client is refused by vLLM
before the guard reads its body or tells it anything about the identity source.

These tests build vLLM's real app (``build_app``) from vLLM's real serve parser;
the guard answers before any route, so no engine is needed.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from starlette.middleware.cors import CORSMiddleware
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from engine_ext import hooks
from engine_ext.http_guard import OutputRateRequestGuard
from tests import serve_parser_harness

default_control_port_taken_or_not = (
    serve_parser_harness.default_control_port_taken_or_not
)

PACED = [
    "m",
    "--default-user-output-tokens-per-second",
    "100",
    "--output-rate-control-address",
    "off",
]
CHAT = "/v1/chat/completions"


def vllm_app(serve_parser, argv: list[str]) -> TestClient:
    """The app ``vllm serve argv`` would serve, with the state the guard reads."""
    args = serve_parser.parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    app = build_app(args, supported_tasks=("generate",))
    app.state.vllm_config = SimpleNamespace(
        additional_config=engine_args.additional_config
    )
    return TestClient(app, raise_server_exceptions=False)


def bad_user_body() -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "vllm_xargs": {"output_rate_user": "tab\tin the id"},
    }


def test_the_guard_runs_inside_vllms_authentication_and_cors(serve_parser):
    client = vllm_app(serve_parser, [*PACED, "--api-key", "secret"])
    classes = [entry.cls for entry in client.app.user_middleware]
    # Starlette runs user_middleware[0] outermost.
    assert classes.count(OutputRateRequestGuard) == 1
    guard = classes.index(OutputRateRequestGuard)
    assert guard > classes.index(AuthenticationMiddleware)
    assert guard > classes.index(CORSMiddleware)


def test_an_unauthenticated_client_gets_vllms_401_not_the_guards_400(serve_parser):
    client = vllm_app(serve_parser, [*PACED, "--api-key", "secret"])
    refused = client.post(CHAT, json=bad_user_body())
    assert refused.status_code == 401
    assert "output_rate_user" not in refused.text
    authenticated = client.post(
        CHAT, json=bad_user_body(), headers={"Authorization": "Bearer secret"}
    )
    assert authenticated.status_code == 400
    assert "output_rate_user" in authenticated.text


def test_without_an_api_key_the_guard_still_answers(serve_parser):
    client = vllm_app(serve_parser, PACED)
    assert client.post(CHAT, json=bad_user_body()).status_code == 400


def test_an_unpaced_server_has_no_guard(serve_parser):
    args = serve_parser.parse_args(["m"])
    AsyncEngineArgs.from_cli_args(args)
    assert not getattr(args, hooks.GUARD_ARG, False)
    app = build_app(args, supported_tasks=("generate",))
    classes = [entry.cls for entry in app.user_middleware]
    assert OutputRateRequestGuard not in classes


def test_a_moved_middleware_function_fails_at_start_up():
    module = ModuleType("vllm.fake")
    with pytest.raises(RuntimeError, match=r"vllm\.fake\.init_entrypoints_middleware"):
        hooks._wrap_function(module, "init_entrypoints_middleware", print)
