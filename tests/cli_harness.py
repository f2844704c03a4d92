"""The fixtures of the ``output-rate-ctl`` tests (tests/control/test_control_cli*.py):
a rig (default 10 tokens/s, alice 5, bob 20), a real in-process server in front
of it that wants a token, and ``ctl``, which runs the CLI against that server.

Invariant: ``ctl`` runs ``control.cli.main`` in-process with ``--address`` and
the token set, and returns the exit status with exactly what the command printed.
A folder's conftest.py (tests/control/conftest.py) or a test module registers
the fixtures by naming them (``rig = cli_harness.rig``).
"""

from __future__ import annotations

import pytest

from control.cli.main import main
from control.service.operations import LimitsService
from tests.control_harness import make_rig, serving

TOKEN = "cli-token"


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5, "bob": 20})


@pytest.fixture
def served(rig):
    with serving(LimitsService(rig.shared), auth_token=TOKEN) as served:
        yield served


@pytest.fixture
def ctl(served, capsys, monkeypatch):
    """Runs the CLI against the server; returns (exit status, stdout, stderr)."""
    monkeypatch.setenv("OUTPUT_RATE_CONTROL_TOKEN", TOKEN)

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(["--address", served.address, *argv])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def entry(
    user: str,
    rate: int | None,
    tier=None,
    exempt=False,
    weight=None,
    team=None,
    prompt_rate=None,
    ceiling=None,
    band=None,
) -> dict:
    """One user's entry as ``--json`` prints it."""
    return {
        "user": user,
        "tokens_per_second": rate,
        "tier": tier,
        "exempt": exempt,
        "weight": weight,
        "prompt_tokens_per_second": prompt_rate,
        "ceiling_tokens_per_second": ceiling,
        "band": band,
        "team": team,
    }
