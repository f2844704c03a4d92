"""``output-rate-ctl`` as a whole against a real in-process server: how a command
ends (exit status, one line on stderr), the channel's checks, the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from control.cli.main import main
from pacing.settings.flags import TOKEN_ENV
from tests.cli_harness import TOKEN


def test_create_refuses_an_existing_limit(ctl):
    status, out, err = ctl("set", "--create", "alice", "9")
    assert status == 1
    assert out == ""
    assert err.startswith("error: ALREADY_EXISTS: ")


@pytest.mark.parametrize(
    ("argv", "status", "code"),
    [
        (["get", "nobody"], 1, "NOT_FOUND"),
        (["state", "--order-by", "shoe size"], 1, "INVALID_ARGUMENT"),
        (["watch", *(f"u{i}" for i in range(101))], 1, "INVALID_ARGUMENT"),
    ],
    ids=["unknown-user", "bad-order", "too-many-watched"],
)
def test_refused_requests_exit_1_with_the_status_code(ctl, argv, status, code):
    got, out, err = ctl(*argv)
    assert (got, out) == (status, "")
    assert err.startswith(f"error: {code}: ")


@pytest.mark.parametrize("given", ["--tls-cert", "--tls-key"])
def test_a_client_certificate_without_its_key_is_a_usage_error(
    served, capsys, tmp_path, given
):
    """gRPC would abort the whole process (a C-level check) on a certificate
    without its key."""
    pem = tmp_path / "x.pem"
    pem.write_text("-")
    status = main(["--address", served.address, given, str(pem), "list"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.splitlines() == [
        "output-rate-ctl: error: --tls-cert and --tls-key go together"
    ]


def test_a_wrong_token_exits_1_unauthenticated(served, capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "nope")
    status = main(["--address", served.address, "list"])
    assert status == 1
    assert capsys.readouterr().err.startswith("error: UNAUTHENTICATED: ")


def test_an_unreachable_server_exits_1_unavailable(capsys):
    status = main(["--address", "127.0.0.1:1", "--timeout", "2", "list"])
    assert status == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")


def test_the_console_script_runs(served):
    """The installed entry point, as an operator runs it."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from control.cli.main import run; run()",
            "--address",
            served.address,
            "--json",
            "get-default",
        ],
        env={**os.environ, TOKEN_ENV: TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "default_tokens_per_second": 10,
        "default_prompt_tokens_per_second": None,
        "default_ceiling_tokens_per_second": None,
        "default_band": None,
    }
