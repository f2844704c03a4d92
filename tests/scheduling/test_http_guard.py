"""The HTTP guard: 400 for a bad ``output_rate_user`` and for beam search on every
guarded endpoint, a clean answer for any body, everything else passed through byte
for byte (a real ASGI app); the user id from a header or the OpenAI ``user``
field written where the engine reads it, a client-sent one refused, 401 when a
user is required; and ``GUARDED_PATHS`` checked against vLLM's own routes."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import engine_ext.http_guard
from engine_ext.http_guard import (
    GUARDED_PATHS,
    MAX_SCORING_ITEMS,
    SCORING_PATH,
    UNATTRIBUTED_PATHS,
    BodyShape,
    IdentityPolicy,
    OutputRateRequestGuard,
    Rejection,
    check_request_body,
)
from pacing.attestation import (
    ATTESTATION_FIELD,
    BINDING_BYTES,
    KEY_BYTES,
    KEY_ENV,
    REQUEST_FIELD,
    attest,
    new_binding,
    verify,
)
from pacing.identity import parse_user_source, validate_user
from tests.settings_harness import settings_of

COMPLETIONS = GUARDED_PATHS["/v1/completions"]
#: The guard's clock in these tests (Unix seconds).
NOW = 1_800_000_000
#: The request binding the guard draws in these tests.
BINDING = "ab" * BINDING_BYTES
#: The guarded paths with JSON bodies (the audio endpoints take forms).
JSON_PATHS = {path: shape for path, shape in GUARDED_PATHS.items() if not shape.form}
SAMPLING_PATHS = sorted(path for path, shape in JSON_PATHS.items() if shape.samples)
RENDER_PATHS = sorted(set(JSON_PATHS) - set(SAMPLING_PATHS))


async def echo(request: Request) -> Response:
    """The request's body, and the content-length the app was handed."""
    return Response(
        await request.body(),
        media_type="application/octet-stream",
        headers={"x-seen-length": request.headers.get("content-length", "")},
    )


def guarded_app(**settings: Any) -> Starlette:
    """An app built as vLLM builds its server: the guard added as middleware,
    and the server's settings in ``app.state.vllm_config``."""
    paced = settings_of(default_rate=100, **settings)
    paths = [*GUARDED_PATHS, *UNATTRIBUTED_PATHS, "/other"]
    app = Starlette(
        routes=[Route(path, echo, methods=["POST"]) for path in paths],
        middleware=[Middleware(OutputRateRequestGuard)],
    )
    additional = {"output_rate": paced.to_additional_config()}
    app.state.vllm_config = SimpleNamespace(additional_config=additional)
    return app


APP = guarded_app()


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The key ``vllm serve`` puts in the environment in the attested mode,
    and the guard's clock stopped at ``NOW`` and its bindings at ``BINDING``
    so that what it writes is known."""
    key = "11" * KEY_BYTES
    monkeypatch.setenv(KEY_ENV, key)
    monkeypatch.setattr(
        engine_ext.http_guard, "time", SimpleNamespace(time=lambda: NOW)
    )
    monkeypatch.setattr(engine_ext.http_guard, "new_binding", lambda: BINDING)
    return key


def written(user: str) -> dict[str, str]:
    """What the guard writes in the attested mode: the id, the binding and
    their attestation under ``attestation_key``'s key."""
    key = bytes.fromhex("11" * KEY_BYTES)
    return {
        "output_rate_user": user,
        REQUEST_FIELD: BINDING,
        ATTESTATION_FIELD: attest(key, user, NOW, binding=BINDING),
    }


async def post(
    path: str,
    content: bytes,
    root_path: str = "",
    app: Starlette = APP,
    headers: Any = None,
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=content, headers=headers)


def with_xargs(shape: BodyShape, xargs: Any, **fields: Any) -> bytes:
    """A body of ``shape`` whose extra-args dict is ``xargs``."""
    body: dict[str, Any] = dict(fields)
    inner = body
    for key in shape.xargs[:-1]:
        inner = inner.setdefault(key, {})
    inner[shape.xargs[-1]] = xargs
    return json.dumps(body).encode()


def error_message(response: httpx.Response) -> str:
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    return response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("xargs", "reason"),
    [
        ({"output_rate_user": 5}, "must be a string, got int"),
        ({"output_rate_user": ["a"]}, "must be a string, got list"),
        ({"output_rate_user": ""}, "must not be empty"),
        ({"output_rate_user": "a" * 257}, "at most 256 bytes"),
        ({"output_rate_user": "a\x00b"}, "control characters"),
    ],
)
@pytest.mark.anyio
async def test_bad_user_gets_400_naming_the_field(xargs, reason):
    response = await post("/v1/completions", with_xargs(COMPLETIONS, xargs))
    error = response.json()["error"]
    assert reason in error_message(response)
    assert "vllm_xargs.output_rate_user" in error["message"]
    assert error["param"] == "vllm_xargs.output_rate_user"
    assert error["code"] == 400


@pytest.mark.parametrize("path", sorted(JSON_PATHS))
@pytest.mark.anyio
async def test_every_guarded_path_rejects_a_bad_user_and_passes_a_good_one(path):
    shape = GUARDED_PATHS[path]
    field = ".".join((*shape.xargs, "output_rate_user"))
    for bad in (5, "u" * 300):
        response = await post(path, with_xargs(shape, {"output_rate_user": bad}))
        assert field in error_message(response)
    good = with_xargs(shape, {"output_rate_user": "alice"})
    response = await post(path, good)
    assert response.status_code == 200
    assert response.content == good


@pytest.mark.anyio
async def test_messages_errors_use_anthropics_format():
    body = with_xargs(GUARDED_PATHS["/v1/messages"], {"output_rate_user": 5})
    response = await post("/v1/messages", body)
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "BadRequestError"
    assert "must be a string" in error_message(response)


@pytest.mark.anyio
async def test_guarded_paths_are_matched_below_the_root_path():
    body = with_xargs(COMPLETIONS, {"output_rate_user": 5})
    response = await post("/api/v1/completions", body, root_path="/api")
    assert "must be a string" in error_message(response)


@pytest.mark.parametrize("value", [True, "true", "on", 1])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
@pytest.mark.anyio
async def test_beam_search_gets_400_as_vllm_would_read_the_flag(path, value):
    body = json.dumps({"messages": [], "use_beam_search": value}).encode()
    response = await post(path, body)
    assert "beam search" in error_message(response)
    assert response.json()["error"]["param"] == "use_beam_search"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("/v1/completions", False),
        ("/v1/completions", "false"),
        ("/v1/completions", 0),
        ("/v1/completions", [1]),  # not a bool: vLLM answers 400 itself
        ("/v1/responses", True),  # not a field of ResponsesRequest
    ],
)
@pytest.mark.anyio
async def test_no_beam_search_is_passed_through(path, value):
    body = json.dumps({"prompt": "x", "use_beam_search": value}).encode()
    response = await post(path, body)
    assert response.status_code == 200
    assert response.content == body


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b'{"vllm_xargs": {"output_rate_user": ' + b"[" * 100_000,
        b'{"sampling_params": ' * 100_000,
    ],
    ids=["arrays", "objects", "inside-xargs", "generate-shape"],
)
@pytest.mark.anyio
async def test_json_nested_too_deeply_to_check_gets_400(body):
    response = await post("/v1/completions", body)
    assert "nested too deeply to check" in error_message(response)


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"[1, 2]",
        b'{"prompt": "\xff\xfe"}',  # invalid UTF-8
        b"\xff\xfe{\x00}\x00",  # UTF-16 BOM, as json.loads detects it
        b'{"prompt": ' + b"9" * 5000 + b"}",  # beyond the integer digit limit
        b'{"prompt": 1e999999, "vllm_xargs": {"output_rate_user": "alice"}}',
        b'{"prompt": NaN, "temperature": -Infinity}',
        b'{"vllm_xargs": "not a dict"}',
        b'{"vllm_xargs": {"output_rate_user": "alice"}, "vllm_xargs": 1}',
        b"",
        ("é" * 5000).encode(),
    ],
)
@pytest.mark.anyio
async def test_bodies_vllm_rejects_itself_or_accepts_pass_through_unchanged(body):
    response = await post("/v1/completions", body)
    assert response.status_code == 200
    assert response.content == body


@pytest.mark.parametrize(
    "body",
    [
        b'{"vllm_xargs": {"output_rate_user": NaN}}',
        b'{"vllm_xargs": {"output_rate_user": 1e999999}}',
        b'{"vllm_xargs": {"output_rate_user": ' + b"9" * 4000 + b"}}",
        b'{"vllm_xargs": {"output_rate_user": null}}',
        b'{"vllm_xargs": {"output_rate_user": {"a": [[[]]]}}}',
        # Duplicate keys: json.loads keeps the last, as vLLM's parser does.
        b'{"vllm_xargs": {"output_rate_user": "alice", "output_rate_user": 5}}',
    ],
)
@pytest.mark.anyio
async def test_hostile_user_values_get_400(body):
    response = await post("/v1/completions", body)
    assert "must be a string" in error_message(response)


@pytest.mark.anyio
async def test_a_utf16_body_is_checked_as_json_loads_reads_it():
    body = json.dumps({"vllm_xargs": {"output_rate_user": 5}}).encode("utf-16")
    response = await post("/v1/completions", body)
    assert "must be a string" in error_message(response)


@pytest.mark.parametrize("user", ["bad\ud800", "\u2028", "\u0085", "ok"])
@pytest.mark.anyio
async def test_odd_unicode_ids_get_identitys_verdict_never_an_error(user):
    body = with_xargs(COMPLETIONS, {"output_rate_user": user})
    response = await post("/v1/completions", body)
    try:
        validate_user(user)
    except ValueError as exc:
        assert error_message(response) == str(exc)
    else:
        assert response.status_code == 200
        assert response.content == body


@pytest.mark.anyio
async def test_a_failing_check_fails_closed_with_400(monkeypatch):
    def broken(value: object, *, field: str) -> str:
        raise TypeError("bug")

    monkeypatch.setattr(engine_ext.http_guard, "validate_user", broken)
    body = with_xargs(COMPLETIONS, {"output_rate_user": "alice"})
    response = await post("/v1/completions", body)
    assert error_message(response) == "request body could not be checked"


@pytest.mark.anyio
async def test_other_paths_are_not_inspected():
    body = b'{"vllm_xargs": {"output_rate_user": 5}}'
    response = await post("/other", body)
    assert response.status_code == 200


def test_check_request_body_accepts_a_user_at_the_byte_limit():
    at_limit = with_xargs(COMPLETIONS, {"output_rate_user": "é" * 128})
    over = with_xargs(COMPLETIONS, {"output_rate_user": "é" * 129})
    assert check_request_body(at_limit, COMPLETIONS) is at_limit
    assert isinstance(check_request_body(over, COMPLETIONS), Rejection)


# -- where the user id comes from (--output-rate-user-source) ------------------

HEADER_APP = guarded_app(user_source="header:X-User-Id")
OPENAI_USER_APP = guarded_app(user_source="openai-user")
ALLOWED_UNATTRIBUTED_APP = guarded_app(
    user_source="header:X-User-Id", allow_unattributed=True
)
REQUIRED = {
    source: guarded_app(user_source=source, require_user=True)
    for source in ("xargs", "header:X-User-Id", "openai-user")
}
#: A minimal valid body of each sampling endpoint, without extra args.
MINIMAL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "hi"}]]},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/invocations": {"prompt": "hi"},
    "/inference/v1/generate": {"token_ids": [1, 2], "sampling_params": {}},
}


def extra_args(shape: BodyShape, body: bytes) -> Any:
    """The dict at ``shape.xargs`` in ``body``."""
    inner: Any = json.loads(body)
    for key in shape.xargs:
        inner = inner[key]
    return inner


def test_every_sampling_path_has_a_minimal_body():
    assert set(MINIMAL_BODIES) == set(SAMPLING_PATHS)


@pytest.mark.parametrize("path", SAMPLING_PATHS)
@pytest.mark.anyio
async def test_the_header_id_is_written_where_the_engine_reads_it(path):
    shape = GUARDED_PATHS[path]
    body = json.dumps(MINIMAL_BODIES[path]).encode()
    response = await post(path, body, app=HEADER_APP, headers={"X-User-Id": "alice"})
    assert response.status_code == 200
    # Nothing else changed, and the app was handed a matching content-length.
    expected = json.loads(body)
    inner = expected
    for key in shape.xargs[:-1]:
        inner = inner[key]
    inner[shape.xargs[-1]] = written("alice")
    assert json.loads(response.content) == expected
    assert response.headers["x-seen-length"] == str(len(response.content))


@pytest.mark.parametrize("path", SAMPLING_PATHS)
def test_vllm_reads_the_written_id_from_every_sampling_body(path):
    """The rewritten body, parsed by vLLM's own request model, carries the id
    in the extra args it hands the engine."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import (
        BatchChatCompletionRequest,
        ChatCompletionRequest,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateRequest,
    )

    policy = IdentityPolicy(parse_user_source("header:x-user-id"))
    body = json.dumps(MINIMAL_BODIES[path]).encode()
    rewritten = check_request_body(
        body, GUARDED_PATHS[path], policy, [(b"x-user-id", b"alice")]
    )
    assert isinstance(rewritten, bytes)
    payload = json.loads(rewritten)
    if path == "/inference/v1/generate":
        xargs = GenerateRequest.model_validate(payload).sampling_params.extra_args
    elif path == "/v1/chat/completions/batch":
        batch = BatchChatCompletionRequest.model_validate(payload)
        conversation = batch.messages[0]
        xargs = batch.to_chat_completion_request(conversation).vllm_xargs
    else:
        model = {
            "/v1/completions": CompletionRequest,
            "/invocations": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/v1/messages": AnthropicMessagesRequest,
        }[path]
        xargs = model.model_validate(payload).vllm_xargs
    assert xargs == {"output_rate_user": "alice"}


@pytest.mark.anyio
async def test_the_written_id_keeps_the_other_extra_args():
    body = with_xargs(COMPLETIONS, {"other": [1, "x"]}, prompt="hi")
    response = await post(
        "/v1/completions", body, app=HEADER_APP, headers={"x-user-id": "alice"}
    )
    assert extra_args(COMPLETIONS, response.content) == {
        "other": [1, "x"],
        **written("alice"),
    }


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": NaN, "temperature": -Infinity, "top_p": 1e999999}',
        b'{"prompt": "\\ud800 \\u00e9 \xc3\xa9", "n": 12345678901234567890}',
        b'{"prompt": "a", "prompt": "b", "vllm_xargs": null}',
        b'{"prompt": [1, 2.5, true, null, {"x": []}], "seed": -0.0}',
    ],
)
def test_a_rewritten_body_reads_back_as_the_original_plus_the_id(body):
    policy = IdentityPolicy(parse_user_source("header:x-user-id"))
    rewritten = check_request_body(
        body, COMPLETIONS, policy, [(b"x-user-id", b"alice")]
    )
    assert isinstance(rewritten, bytes)
    expected = json.loads(body)
    expected["vllm_xargs"] = {"output_rate_user": "alice"}
    # Compared as JSON text: NaN is not equal to itself.
    assert json.dumps(json.loads(rewritten)) == json.dumps(expected)


@pytest.mark.parametrize("path", RENDER_PATHS)
@pytest.mark.anyio
async def test_render_paths_are_never_rewritten(path):
    """A render's output goes back to /inference/v1/generate, where the id is
    written; one written here would be refused there as client-sent."""
    body = json.dumps({"prompt": "hi", "user": "alice"}).encode()
    for app in (HEADER_APP, OPENAI_USER_APP):
        response = await post(path, body, app=app, headers={"x-user-id": "alice"})
        assert response.content == body


@pytest.mark.parametrize("app", [HEADER_APP, OPENAI_USER_APP], ids=["header", "user"])
@pytest.mark.parametrize("path", sorted(JSON_PATHS))
@pytest.mark.anyio
async def test_a_client_sent_id_is_refused_in_the_gateway_modes(path, app):
    shape = GUARDED_PATHS[path]
    field = ".".join((*shape.xargs, "output_rate_user"))
    # Even when it names the same user as the header and the user field.
    body = with_xargs(shape, {"output_rate_user": "alice"}, user="alice")
    response = await post(path, body, app=app, headers={"x-user-id": "alice"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(f"{field} must not be sent: this server ")
    assert ("request header x-user-id" if app is HEADER_APP else "`user` field") in (
        error["message"]
    )
    assert "--output-rate-user-source" in error["message"]
    if not shape.anthropic_errors:
        assert error["param"] == field


@pytest.mark.parametrize(
    "app", [HEADER_APP, REQUIRED["xargs"]], ids=["header", "required_xargs"]
)
@pytest.mark.parametrize("field", [REQUEST_FIELD, ATTESTATION_FIELD])
@pytest.mark.anyio
async def test_a_client_sent_binding_or_attestation_is_refused_in_the_attested_mode(
    app, field
):
    sent = {"output_rate_user": "alice"} if app is REQUIRED["xargs"] else {}
    body = with_xargs(COMPLETIONS, {**sent, field: BINDING}, prompt="hi")
    response = await post("/v1/completions", body, app=app, headers={"x-user-id": "a"})
    message = error_message(response)
    assert message == f"vllm_xargs.{field} must not be sent: only this server writes it"


@pytest.mark.anyio
async def test_each_http_request_gets_a_binding_of_its_own(monkeypatch):
    monkeypatch.setattr(engine_ext.http_guard, "new_binding", new_binding)
    key = bytes.fromhex("11" * KEY_BYTES)
    body = json.dumps({"prompt": "hi"}).encode()
    seen = []
    for _ in range(2):
        response = await post(
            "/v1/completions", body, app=HEADER_APP, headers={"x-user-id": "alice"}
        )
        xargs = extra_args(COMPLETIONS, response.content)
        attestation = verify(key, xargs)
        assert attestation is not None
        assert attestation.identity == ("alice", None, None)
        seen.append(attestation.binding)
    assert seen[0] != seen[1]


@pytest.mark.parametrize("value", [None, "null", 5])
@pytest.mark.anyio
async def test_any_client_sent_value_counts_as_sent(value):
    body = with_xargs(COMPLETIONS, {"output_rate_user": value})
    response = await post("/v1/completions", body, app=HEADER_APP)
    assert "must not be sent" in error_message(response)


@pytest.mark.parametrize(
    "headers", [{}, {"x-user-id": ""}, {"x-user-id": " \t "}], ids=["none", "", "ws"]
)
@pytest.mark.anyio
async def test_without_the_header_a_request_is_anonymous(headers):
    body = json.dumps({"prompt": "hi"}).encode()
    response = await post("/v1/completions", body, app=HEADER_APP, headers=headers)
    assert response.status_code == 200
    assert response.content == body  # nothing written: charged to __anonymous__


@pytest.mark.anyio
async def test_the_header_value_is_stripped_as_http_field_values_are():
    body = json.dumps({"prompt": "hi"}).encode()
    headers = {"x-user-id": "\t alice smith "}
    response = await post("/v1/completions", body, app=HEADER_APP, headers=headers)
    assert extra_args(COMPLETIONS, response.content)["output_rate_user"] == (
        "alice smith"
    )


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([("x-user-id", "a" * 257)], "request header x-user-id must be at most 256"),
        ([("x-user-id", b"al\x7fice")], "x-user-id must not contain control"),
        ([("x-user-id", b"\xc3\x28")], "request header x-user-id must be UTF-8"),
        ([("x-user-id", b"\xed\xa0\x80")], "x-user-id must be UTF-8"),  # surrogate
        (
            [("x-user-id", "alice"), ("X-User-Id", "bob")],
            "request header x-user-id must be sent once, got 2",
        ),
    ],
)
@pytest.mark.anyio
async def test_a_bad_header_id_gets_400_naming_the_header(headers, message):
    body = json.dumps({"prompt": "hi"}).encode()
    response = await post("/v1/completions", body, app=HEADER_APP, headers=headers)
    assert message in error_message(response)
    assert response.json()["error"]["param"] is None


@pytest.mark.parametrize(
    "path", sorted(p for p in SAMPLING_PATHS if GUARDED_PATHS[p].openai_user)
)
@pytest.mark.anyio
async def test_the_openai_user_field_is_written_where_the_engine_reads_it(path):
    body = json.dumps({**MINIMAL_BODIES[path], "user": "alice"}).encode()
    response = await post(path, body, app=OPENAI_USER_APP)
    assert extra_args(GUARDED_PATHS[path], response.content) == {**written("alice")}
    assert json.loads(response.content)["user"] == "alice"  # left for vLLM


@pytest.mark.parametrize(
    ("user", "message"),
    [(5, "user must be a string, got int"), ("a\nb", "user must not contain")],
)
@pytest.mark.anyio
async def test_a_bad_openai_user_gets_400_naming_the_field(user, message):
    body = json.dumps({"prompt": "hi", "user": user}).encode()
    response = await post("/v1/completions", body, app=OPENAI_USER_APP)
    assert message in error_message(response)
    assert response.json()["error"]["param"] == "user"


@pytest.mark.parametrize("user", [None, ""])
@pytest.mark.anyio
async def test_a_null_or_empty_openai_user_is_anonymous(user):
    body = json.dumps({"prompt": "hi", "user": user}).encode()
    response = await post("/v1/completions", body, app=OPENAI_USER_APP)
    assert response.content == body


@pytest.mark.parametrize("path", ["/v1/messages", "/inference/v1/generate"])
@pytest.mark.anyio
async def test_bodies_without_an_openai_user_field_are_anonymous_in_that_mode(path):
    body = json.dumps({**MINIMAL_BODIES[path], "user": "alice"}).encode()
    response = await post(path, body, app=OPENAI_USER_APP)
    assert response.content == body
    response = await post(path, body, app=REQUIRED["openai-user"])
    assert response.status_code == 401
    assert "has no OpenAI `user` field" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("source", "headers", "missing", "param"),
    [
        (
            "xargs",
            {},
            "vllm_xargs.output_rate_user is missing",
            "vllm_xargs.output_rate_user",
        ),
        ("header:X-User-Id", {}, "request header x-user-id is missing or empty", None),
        (
            "header:X-User-Id",
            {"x-user-id": ""},
            "request header x-user-id is missing or empty",
            None,
        ),
        ("openai-user", {}, "the OpenAI `user` field is missing or empty", "user"),
    ],
)
@pytest.mark.anyio
async def test_a_required_user_that_is_missing_gets_401(
    source, headers, missing, param
):
    body = json.dumps({"prompt": "hi", "user": ""}).encode()
    response = await post(
        "/v1/completions", body, app=REQUIRED[source], headers=headers
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["message"] == (
        f"no user id: {missing}; this server charges every request to a user "
        "(--output-rate-require-user)"
    )
    assert (error["type"], error["code"], error["param"]) == (
        "AuthenticationError",
        401,
        param,
    )


@pytest.mark.anyio
async def test_a_required_user_that_is_present_passes():
    body = json.dumps({"prompt": "hi"}).encode()
    app = REQUIRED["header:X-User-Id"]
    response = await post("/v1/completions", body, app=app, headers={"x-user-id": "a"})
    assert extra_args(COMPLETIONS, response.content) == written("a")
    body = with_xargs(COMPLETIONS, {"output_rate_user": "a"})
    response = await post("/v1/completions", body, app=REQUIRED["xargs"])
    assert extra_args(COMPLETIONS, response.content) == written("a")


@pytest.mark.anyio
async def test_a_missing_user_gets_401_in_anthropics_format_on_messages():
    body = json.dumps(MINIMAL_BODIES["/v1/messages"]).encode()
    response = await post("/v1/messages", body, app=REQUIRED["header:X-User-Id"])
    assert response.status_code == 401
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.parametrize("path", RENDER_PATHS)
@pytest.mark.anyio
async def test_render_paths_need_no_user_they_charge_nobody(path):
    body = json.dumps({"prompt": "hi"}).encode()
    response = await post(path, body, app=REQUIRED["header:X-User-Id"])
    assert response.status_code == 200


@pytest.mark.parametrize("path", sorted(UNATTRIBUTED_PATHS))
@pytest.mark.anyio
async def test_paths_no_id_can_reach_are_anonymous_only_without_a_gateway(path):
    body = b'{"any": "body"}'
    for app in (APP, ALLOWED_UNATTRIBUTED_APP):
        response = await post(path, body, app=app, headers={"x-user-id": "alice"})
        assert response.content == body
    response = await post(
        path, body, app=REQUIRED["header:X-User-Id"], headers={"x-user-id": "alice"}
    )
    assert response.status_code == 401
    assert (
        "this endpoint cannot carry one to the scheduler"
        in (response.json()["error"]["message"])
    )


@pytest.mark.parametrize("path", sorted(UNATTRIBUTED_PATHS))
@pytest.mark.parametrize("app", [HEADER_APP, OPENAI_USER_APP], ids=["header", "user"])
@pytest.mark.anyio
async def test_a_gateway_tenant_cannot_choose_the_anonymous_budget_by_route(path, app):
    response = await post(path, b"{}", app=app, headers={"x-user-id": "alice"})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "PermissionDeniedError"
    assert "--output-rate-allow-unattributed-routes" in error["message"]


@pytest.mark.anyio
async def test_generative_scoring_fans_out_to_at_most_the_bound():
    items = ["x"] * MAX_SCORING_ITEMS
    for app in (APP, ALLOWED_UNATTRIBUTED_APP):
        within = json.dumps({"query": "q", "items": items}).encode()
        assert (await post(SCORING_PATH, within, app=app)).content == within
        beyond = json.dumps({"query": "q", "items": [*items, "x"]}).encode()
        response = await post(SCORING_PATH, beyond, app=app)
        assert f"at most {MAX_SCORING_ITEMS} entries" in error_message(response)
        assert response.json()["error"]["param"] == "items"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", b'{"vllm_xargs": "x"}', "vllm_xargs must be an object"),
        ("/v1/completions", b'{"vllm_xargs": []}', "vllm_xargs must be an object"),
        ("/inference/v1/generate", b'{"token_ids": [1]}', "sampling_params must be"),
        (
            "/inference/v1/generate",
            b'{"sampling_params": {"extra_args": 7}}',
            "sampling_params.extra_args must be an object",
        ),
    ],
)
@pytest.mark.anyio
async def test_an_id_that_cannot_be_written_gets_400(path, body, message):
    response = await post(path, body, app=HEADER_APP, headers={"x-user-id": "alice"})
    assert message in error_message(response)


@pytest.mark.anyio
async def test_a_server_whose_state_holds_no_vllm_config_fails_closed():
    app = Starlette(
        routes=[Route("/v1/completions", echo, methods=["POST"])],
        middleware=[Middleware(OutputRateRequestGuard)],
    )
    with pytest.raises(RuntimeError, match="vLLM internals moved"):
        await post("/v1/completions", b"{}", app=app)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- GUARDED_PATHS against vLLM's own app ------------------------------------
#
# vLLM's real FastAPI app is built with every optional router on (scale-out,
# tokens-only, dev mode, Cohere) for the generation tasks, and a pooling model's
# routes added: whichever model a paced server serves, its routes are here.
# Two checks: (1) every POST route whose body model declares ``vllm_xargs`` or a
# ``SamplingParams`` is guarded, with the body shape the model implies; (2) every
# other POST route is in the reviewed list below, so a route a new vLLM adds,
# whatever its body, fails this test until someone decides whether to guard it.

_ADMIN = "administration: submits no generation request"
_NO_XARGS = "submits requests built from named fields only: no vllm_xargs, anonymous"
_NO_ENGINE = "never reaches the engine"

REVIEWED_UNGUARDED = {
    "/tokenize": _NO_ENGINE,
    "/detokenize": _NO_ENGINE,
    "/v1/messages/count_tokens": _NO_ENGINE,
    # Turn a finished generation into a response; the original request they
    # carry (with its vllm_xargs) is only read for parsing.
    "/v1/chat/completions/derender": _NO_ENGINE,
    "/v1/completions/derender": _NO_ENGINE,
    "/v1/systemone": _NO_XARGS,
    "/generative_scoring": _NO_XARGS,
    "/cohere/v2/chat": _NO_XARGS,
    # Pooling models' routes: pooling params, no sampling.
    "/pooling": _NO_XARGS,
    "/classify": _NO_XARGS,
    "/v1/embeddings": _NO_XARGS,
    "/v2/embed": _NO_XARGS,
    "/score": _NO_XARGS,
    "/v1/score": _NO_XARGS,
    "/rerank": _NO_XARGS,
    "/v1/rerank": _NO_XARGS,
    "/v2/rerank": _NO_XARGS,
    "/cohere/v2/chat/render": _NO_ENGINE,
    "/ping": _ADMIN,
    "/v1/responses/{response_id}/cancel": _ADMIN,
    "/inference/v1/abort_requests": _ADMIN,
    "/abort_requests": _ADMIN,
    "/scale_elastic_ep": _ADMIN,
    "/is_scaling_elastic_ep": _ADMIN,
    "/reset_prefix_cache": _ADMIN,
    "/reset_mm_cache": _ADMIN,
    "/reset_encoder_cache": _ADMIN,
    "/collective_rpc": _ADMIN,
    "/sleep": _ADMIN,
    "/release_kv_cache_memory": _ADMIN,
    "/wake_up": _ADMIN,
    "/pause": _ADMIN,
    "/resume": _ADMIN,
    "/init_weight_transfer_engine": _ADMIN,
    "/shutdown_weight_transfer_engine": _ADMIN,
    "/start_weight_update": _ADMIN,
    "/start_draft_weight_update": _ADMIN,
    "/update_weights": _ADMIN,
    "/finish_weight_update": _ADMIN,
    "/update_weight_version": _ADMIN,
    "/weight_checker": _ADMIN,
}


#: Every task whose routes can submit a generation request.
SUPPORTED_TASKS = ("generate", "transcription", "realtime")
#: The pooling tasks, whose routes submit pooling requests.
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify", "plugin")


@pytest.fixture(scope="module")
def vllm_post_routes() -> dict[str, Any]:
    """Path -> body annotation (None for a raw body) of every POST route of the
    app vLLM builds, with every optional router on."""
    from fastapi.routing import APIRoute
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.pooling.factories import register_pooling_api_routers
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--enable-scale-out", "--tokens-only"]
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        env.setenv("VLLM_ENABLE_COHERE_API", "1")
        app = build_app(args, supported_tasks=SUPPORTED_TASKS)
    # A pooling model's routes (the routers read only its pooling task).
    pooling_model = SimpleNamespace(get_pooling_task=lambda tasks: "embed")
    register_pooling_api_routers(app, POOLING_TASKS, pooling_model)  # type: ignore[arg-type]
    return {
        route.path: route.body_field.field_info.annotation if route.body_field else None
        for route in app.routes
        if isinstance(route, APIRoute) and "POST" in route.methods
    }


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation admits, through unions, lists, etc."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def _admits(annotation: Any, cls: type) -> bool:
    return annotation is cls or any(
        _admits(a, cls) for a in typing.get_args(annotation)
    )


def _extra_args_locations(
    annotation: Any, prefix: tuple[str, ...] = (), seen: frozenset = frozenset()
) -> set[tuple[str, ...]]:
    """Key paths in a body of type ``annotation`` to a dict vLLM hands the engine
    as ``SamplingParams.extra_args``: a ``vllm_xargs`` field, or a
    ``SamplingParams``'s ``extra_args``, at any depth."""
    from vllm.sampling_params import SamplingParams

    found: set[tuple[str, ...]] = set()
    for model in _models(annotation):
        if model in seen:
            continue
        for name, field in model.model_fields.items():
            key = (*prefix, field.alias or name)
            if name == "vllm_xargs":
                found.add(key)
            elif _admits(field.annotation, SamplingParams):
                found.add((*key, "extra_args"))
            else:
                found |= _extra_args_locations(field.annotation, key, seen | {model})
    return found


def _declares_beam_search(annotation: Any) -> bool:
    return any("use_beam_search" in m.model_fields for m in _models(annotation))


def test_every_vllm_route_that_takes_extra_args_is_guarded_with_its_shape(
    vllm_post_routes,
):
    taking = {
        path: locations
        for path, body in vllm_post_routes.items()
        if (locations := _extra_args_locations(body))
    }
    # The introspection sees what it must.
    assert {"/v1/completions", "/v1/messages", "/inference/v1/generate"} <= set(taking)
    unguarded = {
        path: locations
        for path, locations in taking.items()
        if path not in GUARDED_PATHS and REVIEWED_UNGUARDED.get(path) != _NO_ENGINE
    }
    assert not unguarded, f"vLLM routes that take extra args, unguarded: {unguarded}"
    for path in taking.keys() & GUARDED_PATHS.keys():
        shape = GUARDED_PATHS[path]
        assert taking[path] == {shape.xargs}, path
        assert shape.beam_search == _declares_beam_search(vllm_post_routes[path]), path


def test_openai_user_is_read_exactly_where_vllms_body_declares_user(
    vllm_post_routes,
):
    from vllm.entrypoints.generate.factories import get_generate_invocation_types

    for path, shape in GUARDED_PATHS.items():
        body = vllm_post_routes[path]
        if body is None:  # /invocations: a chat or completion body
            models = [t for t, _ in get_generate_invocation_types(("generate",))]
        else:
            models = list(_models(body))
        declares = [("user" in model.model_fields) for model in models]
        assert declares and all(d == shape.openai_user for d in declares), path


def test_the_unattributed_paths_are_the_reviewed_ones_that_reach_the_engine():
    reaching = {path for path, why in REVIEWED_UNGUARDED.items() if why == _NO_XARGS}
    assert reaching == UNATTRIBUTED_PATHS


def test_every_other_vllm_post_route_was_reviewed(vllm_post_routes):
    unreviewed = sorted(
        set(vllm_post_routes) - set(GUARDED_PATHS) - set(REVIEWED_UNGUARDED)
    )
    assert not unreviewed, (
        f"POST routes of this vLLM that nobody decided to guard or not: {unreviewed}"
    )


def test_every_guarded_path_is_a_vllm_route(vllm_post_routes):
    assert set(GUARDED_PATHS) <= set(vllm_post_routes)


def test_batch_chat_carries_vllm_xargs_although_it_does_not_declare_it():
    from vllm.entrypoints.openai.chat_completion.protocol import (
        BatchChatCompletionRequest,
    )

    conversation = [{"role": "user", "content": "x"}]
    batch = BatchChatCompletionRequest.model_validate(
        {"messages": [conversation], "vllm_xargs": {"output_rate_user": "u"}}
    )
    assert "vllm_xargs" not in BatchChatCompletionRequest.model_fields
    request = batch.to_chat_completion_request(conversation)
    assert request.vllm_xargs == {"output_rate_user": "u"}


def test_sagemaker_invocations_dispatch_chat_and_completion_bodies(
    vllm_post_routes,
):
    from vllm.entrypoints.generate.factories import get_generate_invocation_types

    assert vllm_post_routes["/invocations"] is None  # a raw body
    types = {t.__name__ for t, _ in get_generate_invocation_types(("generate",))}
    assert types == {"ChatCompletionRequest", "CompletionRequest"}


@pytest.mark.parametrize("value", [b"alice, bob", b"alice,bob", b","])
@pytest.mark.anyio
async def test_a_header_id_with_a_comma_gets_400(value):
    # A proxy merges a header sent twice into "a, b": a fresh budget per
    # combination.
    body = json.dumps({"prompt": "hi"}).encode()
    response = await post(
        "/v1/completions", body, app=HEADER_APP, headers=[(b"x-user-id", value)]
    )
    assert "must not contain a comma" in error_message(response)
