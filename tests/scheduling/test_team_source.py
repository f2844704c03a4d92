"""``--output-rate-team-source header:NAME``: the team from a header the trusted
gateway sets, under the user id's guard rules (refused from a client's body, one
id rule, HTTP 400 for bad values, attested with the user so that it cannot be
forged past the guard), on the real guard and vLLM's real Scheduler."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from vllm.v1.request import RequestStatus

import engine_ext.http_guard
from engine_ext.http_guard import OutputRateRequestGuard
from pacing.attestation import (
    ATTESTATION_FIELD,
    KEY_BYTES,
    KEY_ENV,
    REQUEST_FIELD,
    attest,
    new_binding,
    verify,
)
from pacing.identity import TEAM_FIELD, USER_FIELD, parse_team_source
from pacing.settings.checks import SettingsError
from pacing.settings.model import OutputRateSettings
from tests.settings_harness import settings_of
from tools.scheduler_harness import SYNC_AND_ASYNC, driven_scheduler, make_request

KEY = bytes(range(KEY_BYTES))
NOW = 1_800_000_000
GATEWAY = {
    "user_source": "header:x-user-id",
    "team_source": "header:x-team-id",
    "team_rates": {"acme": 60, "beta": 20},
}


@pytest.fixture(autouse=True)
def attestation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY.hex())


# -- settings -------------------------------------------------------------------


def test_a_team_header_needs_a_gateway_user_source():
    with pytest.raises(SettingsError, match="needs a gateway user source"):
        settings_of(default_rate=100, team_source="header:x-team-id")


def test_the_team_and_user_headers_must_differ():
    with pytest.raises(SettingsError, match="name the same header"):
        settings_of(
            default_rate=100,
            user_source="header:x-id",
            team_source="header:X-Id",
        )


@pytest.mark.parametrize("bad", ["header:authorization", "header:", "teams", 3])
def test_a_bad_team_source_is_refused_naming_the_flag(bad):
    with pytest.raises(SettingsError, match="--output-rate-team-source"):
        settings_of(default_rate=100, user_source="header:x-user-id", team_source=bad)


def test_the_team_source_travels_in_additional_config():
    settings = settings_of(default_rate=100, **GATEWAY)
    entry = settings.to_additional_config()
    assert entry["team_source"] == "header:x-team-id"
    again = OutputRateSettings.from_additional_config({"output_rate": entry})
    assert again.team_source == parse_team_source("header:x-team-id")
    assert "team_source" not in settings_of(default_rate=1).to_additional_config()


# -- the guard ------------------------------------------------------------------


async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


def app(**settings: Any) -> Starlette:
    paced = settings_of(default_rate=100, **settings)
    built = Starlette(
        routes=[Route("/v1/completions", echo, methods=["POST"])],
        middleware=[Middleware(OutputRateRequestGuard)],
    )
    additional = {"output_rate": paced.to_additional_config()}
    built.state.vllm_config = SimpleNamespace(additional_config=additional)
    return built


async def post(body: dict[str, Any], headers: list[tuple[bytes, bytes]], **settings):
    transport = httpx.ASGITransport(app=app(**settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(
            "/v1/completions", content=json.dumps(body).encode(), headers=headers
        )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def stopped_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        engine_ext.http_guard, "time", SimpleNamespace(time=lambda: NOW)
    )


@pytest.mark.anyio
async def test_the_guard_writes_the_gateways_team_attested_with_the_user(
    stopped_clock,
):
    response = await post(
        {"prompt": "hi"}, [(b"x-user-id", b"alice"), (b"x-team-id", b"acme")], **GATEWAY
    )
    assert response.status_code == 200
    xargs = response.json()["vllm_xargs"]
    binding = xargs[REQUEST_FIELD]
    assert xargs == {
        USER_FIELD: "alice",
        TEAM_FIELD: "acme",
        REQUEST_FIELD: binding,
        ATTESTATION_FIELD: attest(KEY, "alice", NOW, binding=binding, team="acme"),
    }
    assert verify(KEY, xargs) == (("alice", "acme", None), binding, NOW)


@pytest.mark.anyio
async def test_without_the_team_header_no_team_is_written(stopped_clock):
    response = await post({"prompt": "hi"}, [(b"x-user-id", b"alice")], **GATEWAY)
    assert response.status_code == 200
    assert TEAM_FIELD not in response.json()["vllm_xargs"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"acme, beta", "must not contain a comma"),
        (b"a\x01b", "must not contain control characters"),
        (b"\xff", "must be UTF-8"),
        (b"x" * 257, "at most 256 bytes"),
    ],
)
async def test_a_bad_team_header_gets_400(value, message):
    response = await post(
        {"prompt": "hi"}, [(b"x-user-id", b"alice"), (b"x-team-id", value)], **GATEWAY
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "settings",
    [GATEWAY, {"user_source": "header:x-user-id"}, {"require_user": True}],
    ids=["team_header", "user_header_only", "require_user"],
)
async def test_a_client_cannot_name_its_team_in_the_body(settings):
    response = await post(
        {"prompt": "hi", "vllm_xargs": {TEAM_FIELD: "acme"}},
        [(b"x-user-id", b"alice")],
        **settings,
    )
    assert response.status_code == 400
    assert f"{TEAM_FIELD} must not be sent" in response.json()["error"]["message"]


# -- the attestation ------------------------------------------------------------


def test_the_attestation_covers_the_team():
    binding = new_binding()
    xargs = {
        USER_FIELD: "alice",
        TEAM_FIELD: "acme",
        REQUEST_FIELD: binding,
        ATTESTATION_FIELD: attest(KEY, "alice", NOW, binding=binding),  # alone
    }
    assert verify(KEY, xargs) is None
    xargs[ATTESTATION_FIELD] = attest(KEY, "alice", NOW, binding=binding, team="beta")
    assert verify(KEY, xargs) is None  # another team
    xargs[ATTESTATION_FIELD] = attest(KEY, "alice", NOW, binding=binding, team="acme")
    assert verify(KEY, xargs) == (("alice", "acme", None), binding, NOW)
    del xargs[TEAM_FIELD]  # the team dropped on the way
    assert verify(KEY, xargs) is None


# -- the scheduler --------------------------------------------------------------


def as_gateway_sends(user: str, team: str | None, attestation_team: str | None):
    request = make_request(user)
    extra = request.sampling_params.extra_args
    if team is not None:
        extra[TEAM_FIELD] = team
    binding = extra[REQUEST_FIELD] = new_binding()
    extra[ATTESTATION_FIELD] = attest(
        KEY, user, int(time.time()), binding=binding, team=attestation_team
    )
    return request


@SYNC_AND_ASYNC
def test_the_gateways_team_decides_the_users_team_cap(tiny_model_dir, async_scheduling):
    """Alice arrives named in team beta (20 tok/s) by her gateway: over 10 s
    the team's cell holds her to 20 tok/s + the burst."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        output_rate=GATEWAY,
    )
    driver.add([as_gateway_sends("alice", "beta", "beta") for _ in range(3)])
    driver.run(1_000, step_ms=10.0)  # 10 s
    teams = scheduler.output_rate_shared.teams
    assert teams.team_of("alice") == "beta"
    assert 20 * 10 <= teams.charged["beta"] <= 20 * 10.1 + 1


@SYNC_AND_ASYNC
def test_a_header_team_holds_for_its_requests_only_and_is_never_stored(
    tiny_model_dir, async_scheduling
):
    """The team a gateway names is the team of that request, while it lives:
    the operator's membership table never changes (so neither the limits
    file nor the store's table can learn it), and once alice's beta requests
    end, a request naming no team is charged to no team."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=10_000, output_rate=GATEWAY
    )
    teams = scheduler.output_rate_shared.teams
    named = [as_gateway_sends("alice", "beta", "beta") for _ in range(2)]
    driver.add(named)
    driver.run(100)
    assert teams.team_of("alice") == "beta"
    assert teams.table.memberships == {}
    scheduler.finish_requests(
        [r.request_id for r in named], RequestStatus.FINISHED_ABORTED
    )
    driver.settle()
    assert teams.team_of("alice") is None
    assert teams.gateway_teams == {}
    team_charged = teams.charged["beta"]
    alice_charged = scheduler.accounting.of("alice").charged
    driver.add([as_gateway_sends("alice", None, None)])
    driver.run(100)
    assert teams.charged["beta"] == team_charged
    assert scheduler.accounting.of("alice").charged > alice_charged


@SYNC_AND_ASYNC
def test_a_request_naming_another_team_while_others_live_is_refused(
    tiny_model_dir, async_scheduling
):
    """One user's live requests are charged to one team: a request naming
    another is refused before any step; once they end, the other team is
    hers for the requests that name it."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=10_000, output_rate=GATEWAY
    )
    teams = scheduler.output_rate_shared.teams
    beta = as_gateway_sends("alice", "beta", "beta")
    driver.add([beta])
    other = as_gateway_sends("alice", "acme", "acme")
    driver.add([other])
    assert other.status == RequestStatus.FINISHED_ERROR
    assert teams.gateway_teams == {"alice": ("beta", 1)}
    scheduler.finish_requests([beta.request_id], RequestStatus.FINISHED_ABORTED)
    acme = as_gateway_sends("alice", "acme", "acme")
    driver.add([acme])
    assert acme.status != RequestStatus.FINISHED_ERROR
    assert teams.team_of("alice") == "acme"
    assert teams.table.memberships == {}


@SYNC_AND_ASYNC
def test_a_team_that_does_not_exist_refuses_the_request(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=10_000, output_rate=GATEWAY
    )
    request = as_gateway_sends("alice", "nosuch", "nosuch")
    driver.add([request])
    assert request.status == RequestStatus.FINISHED_ERROR
    assert scheduler.output_rate_shared.teams.team_of("alice") is None


@SYNC_AND_ASYNC
def test_a_team_added_past_the_guard_does_not_count(tiny_model_dir, async_scheduling):
    """A request whose team was added after the guard attested the user alone
    fails the attestation: charged to the anonymous budget, in no team."""
    scheduler, driver = driven_scheduler(
        tiny_model_dir, async_scheduling, default_rate=10_000, output_rate=GATEWAY
    )
    request = as_gateway_sends("alice", "acme", None)
    driver.add([request])
    assert scheduler.user_of(request) == "__anonymous__"
    assert scheduler.output_rate_shared.teams.team_of("alice") is None
