"""The HTTP guard on vLLM's audio endpoints (multipart forms whose ``vllm_xargs``
field is a JSON string) and on websockets (vLLM's ``/v1/realtime``), through a
real ASGI app that parses the form with Starlette's parser, as vLLM's does: the
same rules as JSON bodies, the id written by encoding the whole form anew (files
and every other field kept, in order), and whatever a client sends answered
with 200 or 400, never an unchecked id."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine_ext import http_guard
from engine_ext.http_guard import GUARDED_PATHS, OutputRateRequestGuard
from pacing.attestation import (
    ATTESTATION_FIELD,
    BINDING_BYTES,
    KEY_BYTES,
    KEY_ENV,
    REQUEST_FIELD,
    attest,
)
from tests.settings_harness import settings_of

FORM_PATHS = sorted(path for path, shape in GUARDED_PATHS.items() if shape.form)
TRANSCRIPTIONS = "/v1/audio/transcriptions"
REALTIME = "/v1/realtime"
HEADER = "x-user-id"
KEY = bytes.fromhex("22" * KEY_BYTES)
#: The guard's clock in these tests (Unix seconds).
NOW = 1_800_000_000
#: The request binding the guard draws in these tests.
BINDING = "ef" * BINDING_BYTES
BOUNDARY = "test-boundary-4f1c"
AUDIO = ("a.wav", b'RIFF\x00\x01\x02"\r\n--not-a-boundary\r\n\xff', "audio/wav")


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key ``vllm serve`` puts in the environment in the attested mode,
    and the guard's clock stopped at ``NOW`` and its bindings at ``BINDING``
    so that what it writes is known."""
    monkeypatch.setenv(KEY_ENV, KEY.hex())
    monkeypatch.setattr(http_guard, "time", SimpleNamespace(time=lambda: NOW))
    monkeypatch.setattr(http_guard, "new_binding", lambda: BINDING)


async def form_echo(request: Request) -> JSONResponse:
    """The form as the app parsed it: (name, value) in order, a file as
    [file name, content type, bytes as latin-1]."""
    form = await request.form()
    fields: list[list[Any]] = []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            data = (await value.read()).decode("latin-1")
            fields.append([name, [value.filename, value.content_type, data]])
        else:
            fields.append([name, value])
    return JSONResponse(fields)


async def realtime(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("session.created")
    await websocket.close()


def form_app(**settings: Any) -> Starlette:
    """The guard in front of form routes and a websocket, with the server's
    settings in ``app.state.vllm_config``."""
    paced = settings_of(default_rate=100, **settings)
    app = Starlette(
        routes=[
            *(Route(path, form_echo, methods=["POST"]) for path in FORM_PATHS),
            WebSocketRoute(REALTIME, realtime),
        ],
        middleware=[Middleware(OutputRateRequestGuard)],
    )
    additional = {"output_rate": paced.to_additional_config()}
    app.state.vllm_config = SimpleNamespace(additional_config=additional)
    return app


XARGS_APP = form_app()
HEADER_APP = form_app(user_source=f"header:{HEADER}")
REQUIRED_APP = form_app(user_source=f"header:{HEADER}", require_user=True)


async def post_form(
    app: Starlette,
    data: dict[str, Any] | list[tuple[str, str]],
    *,
    path: str = TRANSCRIPTIONS,
    headers: dict[str, str] | None = None,
    files: Any = None,
) -> httpx.Response:
    items = list(data.items()) if isinstance(data, dict) else data
    body = multipart(items, files or {"file": AUDIO})
    sent = {
        "content-type": f"multipart/form-data; boundary={BOUNDARY}",
        **(headers or {}),
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=body, headers=sent)


def multipart(
    fields: list[tuple[str, str]], files: dict[str, tuple[str, bytes, str]]
) -> bytes:
    """A ``multipart/form-data`` body: the fields in order, then the files."""
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"'.encode()
        + b"\r\n\r\n"
        + value.encode()
        + b"\r\n"
        for name, value in fields
    ]
    parts += [
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="{filename}"\r\nContent-Type: {content_type}\r\n\r\n'
        ).encode()
        + data
        + b"\r\n"
        for name, (filename, data, content_type) in files.items()
    ]
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def sent_fields(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return {name: value for name, value in response.json()}


def error_message(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


@pytest.mark.parametrize("path", FORM_PATHS)
@pytest.mark.anyio
async def test_a_forms_bad_user_gets_400_and_a_good_one_passes_unchanged(path):
    bad = {"model": "m", "vllm_xargs": json.dumps({"output_rate_user": ""})}
    message = error_message(await post_form(XARGS_APP, bad, path=path))
    assert "vllm_xargs.output_rate_user must not be empty" in message
    good = {"model": "m", "vllm_xargs": json.dumps({"output_rate_user": "alice"})}
    fields = sent_fields(await post_form(XARGS_APP, good, path=path))
    assert fields == {
        "model": "m",
        "vllm_xargs": good["vllm_xargs"],
        "file": [AUDIO[0], AUDIO[2], AUDIO[1].decode("latin-1")],
    }


@pytest.mark.anyio
async def test_a_gateway_id_is_written_into_the_form_with_its_attestation():
    data = [("model", "m"), ("language", "en"), ("vllm_xargs", '{"keep": 1}')]
    response = await post_form(HEADER_APP, data, headers={HEADER: "alice"})
    assert response.json() == [
        ["model", "m"],
        ["language", "en"],
        [
            "vllm_xargs",
            json.dumps(
                {
                    "keep": 1,
                    "output_rate_user": "alice",
                    REQUEST_FIELD: BINDING,
                    ATTESTATION_FIELD: attest(KEY, "alice", NOW, binding=BINDING),
                }
            ),
        ],
        ["file", [AUDIO[0], AUDIO[2], AUDIO[1].decode("latin-1")]],
    ]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (
            {"vllm_xargs": json.dumps({"output_rate_user": "bob"})},
            "vllm_xargs.output_rate_user must not be sent",
        ),
        (
            {"vllm_xargs": json.dumps({ATTESTATION_FIELD: "0" * 64})},
            f"vllm_xargs.{ATTESTATION_FIELD} must not be sent",
        ),
        (
            {"vllm_xargs": json.dumps({REQUEST_FIELD: BINDING})},
            f"vllm_xargs.{REQUEST_FIELD} must not be sent",
        ),
        (
            [("vllm_xargs", "{}"), ("vllm_xargs", "{}")],
            "vllm_xargs must be sent once, got 2",
        ),
        ({"use_beam_search": "true"}, "beam search"),
        ({"vllm_xargs": "[1]"}, "vllm_xargs must be an object"),
    ],
)
@pytest.mark.anyio
async def test_what_the_json_bodies_refuse_the_form_refuses(data, reason):
    response = await post_form(HEADER_APP, data, headers={HEADER: "alice"})
    assert reason in error_message(response)


@pytest.mark.anyio
async def test_vllm_xargs_sent_as_a_file_gets_400():
    files = {"file": AUDIO, "vllm_xargs": ("x.json", b"{}", "application/json")}
    response = await post_form(HEADER_APP, {}, headers={HEADER: "a"}, files=files)
    assert "vllm_xargs must be a form field, not a file" in error_message(response)


@pytest.mark.anyio
async def test_a_field_name_the_encoder_cannot_write_back_gets_400():
    body = b'--b\r\nContent-Disposition: form-data; name="a\\"b"\r\n\r\nv\r\n--b--\r\n'
    transport = httpx.ASGITransport(app=HEADER_APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(
            TRANSCRIPTIONS,
            content=body,
            headers={"content-type": "multipart/form-data; boundary=b", HEADER: "a"},
        )
    assert "must not contain quotes" in error_message(response)


@pytest.mark.anyio
async def test_a_form_without_the_gateway_header_is_refused_when_a_user_is_required():
    response = await post_form(REQUIRED_APP, {"model": "m"})
    assert response.status_code == 401


FIELD_NAMES = st.sampled_from(
    ["model", "language", "vllm_xargs", "use_beam_search", "prompt", "x"]
)
FIELD_VALUES = st.one_of(
    st.text(max_size=20),
    st.just(json.dumps({"output_rate_user": "mallory"})),
    st.just(
        json.dumps(
            {
                REQUEST_FIELD: BINDING,
                ATTESTATION_FIELD: attest(KEY, "mallory", NOW, binding=BINDING),
            }
        )
    ),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3).map(json.dumps),
    st.sampled_from(["true", "false", "{", "[]", "null", '"s"']),
)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    fields=st.lists(st.tuples(FIELD_NAMES, FIELD_VALUES), max_size=6),
    # A header is ASCII on the wire here; the id rule's other cases are the
    # JSON bodies' tests'.
    user=st.text(
        st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8
    ),
)
def test_fuzzed_forms_get_200_with_exactly_the_gateways_id_or_400(fields, user):
    import anyio

    async def send() -> httpx.Response:
        return await post_form(HEADER_APP, fields, headers={HEADER: user})

    response = anyio.run(send)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        return
    echoed = response.json()
    xargs_fields = [value for name, value in echoed if name == "vllm_xargs"]
    assert len(xargs_fields) == 1
    try:
        xargs = json.loads(xargs_fields[0])
    except ValueError:
        # Not JSON: passed on as sent, for vLLM's own 400 (and never attested,
        # so whatever vLLM made of it would be anonymous).
        assert [[n, v] for n, v in echoed if n != "file"] == [list(f) for f in fields]
        return
    assert xargs["output_rate_user"] == user
    assert xargs[REQUEST_FIELD] == BINDING
    assert xargs[ATTESTATION_FIELD] == attest(KEY, user, NOW, binding=BINDING)
    # Every other field reaches the app as it was sent, in order.
    others = [[n, v] for n, v in echoed if n not in ("vllm_xargs", "file")]
    assert others == [[n, v] for n, v in fields if n != "vllm_xargs"]


def test_a_websocket_is_anonymous_only_without_a_gateway_or_where_allowed():
    for app in (
        form_app(),
        form_app(user_source=f"header:{HEADER}", allow_unattributed=True),
    ):
        with TestClient(app).websocket_connect(REALTIME) as socket:
            assert socket.receive_text() == "session.created"
    for app, flag in (
        (REQUIRED_APP, "--output-rate-require-user"),
        (HEADER_APP, "--output-rate-allow-unattributed-routes"),
    ):
        with (
            pytest.raises(WebSocketDisconnect) as closed,
            TestClient(app).websocket_connect(
                REALTIME, headers={HEADER: "alice"}
            ) as socket,
        ):
            socket.receive_text()
        assert closed.value.code == 1008
        assert "websocket cannot carry" in closed.value.reason
        assert flag in closed.value.reason
