"""The documented nginx recipe (``tests/nginx_gateway.py``) run by Debian's
nginx in front of a loopback upstream that records the headers it receives: the
user and team headers vLLM sees are the ones the key maps to, whatever the
client sent, in any letter case; a key without a team sends no team header."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.nginx_gateway import Gateway, start_gateway
from tools.local_server import free_port

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
TEAMS = {"sk-alice": "acme"}
HEADER, TEAM_HEADER = "X-User-Id", "X-Team-Id"


class _Recorder(BaseHTTPRequestHandler):
    """Answers every POST with the request's headers as [name, value] pairs."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps([[k, v] for k, v in self.headers.items()]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    workdir: Path = tmp_path_factory.mktemp("nginx-recipe")
    address = f"http://127.0.0.1:{upstream.server_address[1]}"
    gateway = start_gateway(
        workdir, free_port(), address, KEYS, HEADER, TEAMS, TEAM_HEADER
    )
    try:
        yield gateway
    finally:
        gateway.stop()
        upstream.shutdown()
        upstream.server_close()


def seen(gateway: Gateway, headers: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The values of the user and team headers the upstream received (lower
    case name -> every value, in order) for a POST with ``headers``."""
    response = httpx.post(
        f"{gateway.base_url}/v1/completions", content=b"{}", headers=headers, timeout=10
    )
    assert response.status_code == 200, response.text
    received: dict[str, list[str]] = {}
    for name, value in response.json():
        if name.lower() in (HEADER.lower(), TEAM_HEADER.lower(), "authorization"):
            received.setdefault(name.lower(), []).append(value)
    return received


FORGED = [
    [],
    [("X-Team-Id", "beta")],
    [("x-TEAM-id", "beta"), ("X-Team-Id", "gamma")],
    [("X-User-Id", "mallory"), ("x-team-id", "beta")],
]


@pytest.mark.parametrize("forged", FORGED, ids=["none", "one", "two", "user+team"])
def test_a_key_with_a_team_reaches_vllm_with_that_team_alone(gateway, forged):
    received = seen(gateway, [("Authorization", "Bearer sk-alice"), *forged])
    assert received == {"x-user-id": ["alice"], "x-team-id": ["acme"]}


@pytest.mark.parametrize("forged", FORGED, ids=["none", "one", "two", "user+team"])
def test_a_key_without_a_team_reaches_vllm_with_no_team_header(gateway, forged):
    received = seen(gateway, [("Authorization", "Bearer sk-bob"), *forged])
    assert received == {"x-user-id": ["bob"]}


def test_an_unknown_key_never_reaches_vllm(gateway):
    response = httpx.post(
        f"{gateway.base_url}/v1/completions",
        content=b"{}",
        headers={"Authorization": "Bearer sk-nobody", TEAM_HEADER: "acme"},
        timeout=10,
    )
    assert response.status_code == 401
