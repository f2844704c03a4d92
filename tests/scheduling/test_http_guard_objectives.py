"""The gateway's objective in the HTTP guard (a real ASGI app): with a gateway
user source, the objective a gateway names in ``x-llm-d-inference-objective``
or its deprecated name ``x-gateway-inference-objective`` is written beside the
user as ``output_rate_objective`` and attested with it; the two names must
agree, a bad value is 400 naming the header, a client-sent
``output_rate_objective`` is refused in the attested mode, and without a
gateway source the headers are not read."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import engine_ext.http_guard
from engine_ext.http_guard import OutputRateRequestGuard
from pacing.attestation import (
    ATTESTATION_FIELD,
    BINDING_BYTES,
    KEY_BYTES,
    KEY_ENV,
    REQUEST_FIELD,
    attest,
    verify,
)
from pacing.identity import (
    OBJECTIVE_FIELD,
    OBJECTIVE_HEADERS,
    TEAM_FIELD,
    USER_FIELD,
)
from tests.settings_harness import settings_of

KEY = bytes(range(KEY_BYTES))
NOW = 1_800_000_000
BINDING = "ab" * BINDING_BYTES
CURRENT, DEPRECATED = OBJECTIVE_HEADERS
USER_HEADER = (b"x-user-id", b"alice")
HEADER_SOURCE = {"user_source": "header:x-user-id"}
OPENAI_USER = {"user_source": "openai-user"}
TRANSCRIPTIONS = "/v1/audio/transcriptions"


def test_the_header_names_are_llm_ds_current_and_deprecated_ones():
    assert OBJECTIVE_HEADERS == (
        "x-llm-d-inference-objective",
        "x-gateway-inference-objective",
    )
    assert OBJECTIVE_FIELD == "output_rate_objective"


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attested mode's key, the guard's clock stopped at ``NOW`` and its
    bindings at ``BINDING``, so that what it writes is known."""
    monkeypatch.setenv(KEY_ENV, KEY.hex())
    monkeypatch.setattr(
        engine_ext.http_guard, "time", SimpleNamespace(time=lambda: NOW)
    )
    monkeypatch.setattr(engine_ext.http_guard, "new_binding", lambda: BINDING)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


async def form_xargs(request: Request) -> JSONResponse:
    """The form's ``vllm_xargs`` field, parsed."""
    form = await request.form()
    return JSONResponse(json.loads(str(form["vllm_xargs"])))


def app(**settings: Any) -> Starlette:
    paced = settings_of(default_rate=100, **settings)
    built = Starlette(
        routes=[
            Route("/v1/completions", echo, methods=["POST"]),
            Route("/v1/completions/render", echo, methods=["POST"]),
            Route(TRANSCRIPTIONS, form_xargs, methods=["POST"]),
        ],
        middleware=[Middleware(OutputRateRequestGuard)],
    )
    additional = {"output_rate": paced.to_additional_config()}
    built.state.vllm_config = SimpleNamespace(additional_config=additional)
    return built


async def post(
    headers: list[tuple[bytes, bytes]],
    body: dict[str, Any] | None = None,
    path: str = "/v1/completions",
    **settings: Any,
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app(**(settings or HEADER_SOURCE)))
    content = json.dumps({"prompt": "hi"} if body is None else body).encode()
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, content=content, headers=headers)


def written(
    objective: str | None, user: str = "alice", team: str | None = None
) -> dict[str, str]:
    """What the guard writes: the user, the team and objective when named,
    the binding and their attestation."""
    xargs = {USER_FIELD: user}
    if team is not None:
        xargs[TEAM_FIELD] = team
    if objective is not None:
        xargs[OBJECTIVE_FIELD] = objective
    xargs[REQUEST_FIELD] = BINDING
    xargs[ATTESTATION_FIELD] = attest(
        KEY, user, NOW, binding=BINDING, team=team, objective=objective
    )
    return xargs


def objective_header(name: str, value: bytes) -> tuple[bytes, bytes]:
    return (name.encode(), value)


def error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("name", [CURRENT, DEPRECATED, CURRENT.upper()])
async def test_either_name_puts_the_objective_beside_the_user_attested(name):
    response = await post([USER_HEADER, (name.encode(), b"premium")])
    assert response.status_code == 200
    xargs = response.json()["vllm_xargs"]
    assert xargs == written("premium")
    attestation = verify(KEY, xargs)
    assert attestation is not None
    assert attestation.identity == ("alice", None, "premium")


@pytest.mark.anyio
async def test_both_names_with_one_value_name_that_objective():
    response = await post(
        [
            USER_HEADER,
            (CURRENT.encode(), b"premium"),
            (DEPRECATED.encode(), b" premium\t"),  # stripped as HTTP does
        ]
    )
    assert response.status_code == 200
    assert response.json()["vllm_xargs"] == written("premium")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("current", "deprecated"),
    [(b"premium", b"batch"), (b"premium", b""), (b"", b"premium")],
)
async def test_two_names_naming_different_objectives_get_400(current, deprecated):
    response = await post(
        [USER_HEADER, (CURRENT.encode(), current), (DEPRECATED.encode(), deprecated)]
    )
    message = error(response)
    assert CURRENT in message
    assert DEPRECATED in message
    assert "different objectives" in message
    # The values are never echoed.
    assert "premium" not in message


@pytest.mark.anyio
@pytest.mark.parametrize("name", [CURRENT, DEPRECATED])
@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"gold, premium", "must not contain a comma"),
        (b"a\x01b", "must not contain control characters"),
        ("a\u200bb".encode(), "must not contain invisible format characters"),
        (b"\xff", "must be UTF-8"),
        (b"x" * 257, "at most 256 bytes"),
    ],
)
async def test_a_malformed_objective_gets_400_naming_the_header(name, value, reason):
    response = await post([USER_HEADER, (name.encode(), value)])
    message = error(response)
    assert f"request header {name}" in message
    assert reason in message
    assert response.json()["error"]["param"] is None


@pytest.mark.anyio
@pytest.mark.parametrize("name", [CURRENT, DEPRECATED])
async def test_an_objective_header_sent_twice_gets_400(name):
    header = name.encode()
    response = await post([USER_HEADER, (header, b"a"), (header.upper(), b"a")])
    assert f"request header {name} must be sent once" in error(response)


@pytest.mark.anyio
async def test_an_empty_objective_header_names_none():
    response = await post([USER_HEADER, (CURRENT.encode(), b"")])
    assert response.status_code == 200
    assert response.json()["vllm_xargs"] == written(None)


@pytest.mark.anyio
async def test_the_openai_user_source_reads_the_objective_too():
    response = await post(
        [(DEPRECATED.encode(), b"bulk")], {"prompt": "hi", "user": "bob"}, **OPENAI_USER
    )
    assert response.status_code == 200
    assert response.json()["vllm_xargs"] == written("bulk", user="bob")


@pytest.mark.anyio
async def test_the_team_and_the_objective_are_attested_together():
    response = await post(
        [USER_HEADER, (b"x-team-id", b"acme"), (CURRENT.encode(), b"premium")],
        **HEADER_SOURCE,
        team_source="header:x-team-id",
        team_rates={"acme": 60},
    )
    assert response.status_code == 200
    xargs = response.json()["vllm_xargs"]
    assert xargs == written("premium", team="acme")
    attestation = verify(KEY, xargs)
    assert attestation is not None
    assert attestation.identity == ("alice", "acme", "premium")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "settings",
    [HEADER_SOURCE, OPENAI_USER, {"require_user": True}],
    ids=["user_header", "openai_user", "require_user"],
)
async def test_a_client_cannot_name_its_objective_in_the_body(settings):
    body = {
        "prompt": "hi",
        "user": "alice",
        "vllm_xargs": {USER_FIELD: "alice"} if "require_user" in settings else {},
    }
    body["vllm_xargs"][OBJECTIVE_FIELD] = "premium"
    response = await post([USER_HEADER], body, **settings)
    assert error(response) == (
        f"vllm_xargs.{OBJECTIVE_FIELD} must not be sent: only this server writes it"
    )


@pytest.mark.anyio
@pytest.mark.parametrize("settings", [{}, {"require_user": True}], ids=["xargs", "req"])
async def test_without_a_gateway_source_the_headers_are_not_read(settings):
    """The client names its user itself: nothing it sends in a header moves
    its request (a malformed one neither), and the attestation, when there
    is one, covers no objective."""
    body = {"prompt": "hi", "vllm_xargs": {USER_FIELD: "alice"}}
    headers = [(CURRENT.encode(), b"premium"), (DEPRECATED.encode(), b"a,b")]
    response = await post(headers, body, **settings, user_source="xargs")
    assert response.status_code == 200
    xargs = json.loads(response.content)["vllm_xargs"]
    assert OBJECTIVE_FIELD not in xargs
    if settings:
        assert xargs == written(None)
        assert verify(KEY, xargs) == (("alice", None, None), BINDING, NOW)


@pytest.mark.anyio
async def test_in_the_unattested_mode_a_client_sent_objective_passes_unread():
    """The guard cannot write the field there: it passes on, and the engine,
    which reads an objective only from an attestation, ignores it."""
    body = {"prompt": "hi", "vllm_xargs": {USER_FIELD: "a", OBJECTIVE_FIELD: "x"}}
    response = await post([], body, user_source="xargs")
    assert response.status_code == 200
    assert json.loads(response.content) == body


@pytest.mark.anyio
async def test_a_request_naming_no_user_is_anonymous_but_a_bad_objective_is_refused():
    anonymous = await post([(CURRENT.encode(), b"premium")])
    assert anonymous.status_code == 200
    assert json.loads(anonymous.content) == {"prompt": "hi"}
    assert "must not contain" in error(await post([(CURRENT.encode(), b"a\x00")]))


@pytest.mark.anyio
async def test_render_endpoints_are_not_rewritten():
    response = await post(
        [USER_HEADER, (CURRENT.encode(), b"premium")], path="/v1/completions/render"
    )
    assert response.status_code == 200
    assert json.loads(response.content) == {"prompt": "hi"}


@pytest.mark.anyio
async def test_a_form_body_gets_the_objective_too():
    transport = httpx.ASGITransport(app=app(**HEADER_SOURCE))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post(
            TRANSCRIPTIONS,
            data={"model": "m", "vllm_xargs": json.dumps({"keep": 1})},
            files={"file": ("a.wav", b"RIFF", "audio/wav")},
            headers=[USER_HEADER, (DEPRECATED.encode(), b"bulk")],
        )
    assert response.status_code == 200
    assert response.json() == {"keep": 1, **written("bulk")}
