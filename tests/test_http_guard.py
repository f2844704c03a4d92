"""The HTTP guard: 400 for a bad ``output_rate_user`` and for beam search on every
guarded endpoint, a clean answer for any body, everything else passed through byte
for byte (a real ASGI app); and ``GUARDED_PATHS`` checked against vLLM's own routes."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import engine_ext.http_guard
from engine_ext.http_guard import (
    GUARDED_PATHS,
    BodyShape,
    OutputRateRequestGuard,
    check_request_body,
)
from pacing.identity import validate_user

COMPLETIONS = GUARDED_PATHS["/v1/completions"]


async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


APP = OutputRateRequestGuard(
    Starlette(
        routes=[
            Route(path, echo, methods=["POST"]) for path in [*GUARDED_PATHS, "/other"]
        ]
    )
)


async def post(path: str, content: bytes, root_path: str = "") -> httpx.Response:
    transport = httpx.ASGITransport(app=APP, root_path=root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=content)


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


@pytest.mark.parametrize("path", sorted(GUARDED_PATHS))
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
    assert check_request_body(at_limit, COMPLETIONS) is None
    assert check_request_body(over, COMPLETIONS) is not None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- GUARDED_PATHS against vLLM's own app ------------------------------------
#
# vLLM's real FastAPI app is built with every optional router on (scale-out,
# tokens-only, dev mode) for the "generate" task, the only task pacing serves: the
# transcription/realtime routes (whose models are multimodal or encoder-decoder)
# and pooling routes (no output tokens) never exist on a paced server.
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


@pytest.fixture(scope="module")
def vllm_post_routes() -> dict[str, Any]:
    """Path -> body annotation (None for a raw body) of every POST route of the
    app vLLM builds, with every optional router on."""
    from fastapi.routing import APIRoute
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--enable-scale-out", "--tokens-only"]
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        env.setenv("VLLM_ENABLE_COHERE_API", "1")
        app = build_app(args, supported_tasks=("generate",))
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
