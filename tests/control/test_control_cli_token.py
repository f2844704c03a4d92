"""``output-rate-ctl``'s bearer token never on its command line (where ``ps``
shows it) and never in clear text beyond loopback: it comes from
``$OUTPUT_RATE_CONTROL_TOKEN`` or ``--token-file``, ``--token`` is refused, and
a token is sent to a non-loopback address only over TLS."""

from __future__ import annotations

import pytest

from control.cli.main import main
from pacing.settings.flags import TOKEN_ENV
from tests.cli_harness import TOKEN


@pytest.fixture
def run(served, capsys, monkeypatch):
    """Runs the CLI with exactly ``argv`` and no token in the environment
    unless a test sets one; returns (exit status, stdout, stderr)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _alice_rate(rig) -> int | None:
    with rig.shared.lock:
        return rig.limiter.user_rates.get("alice")


@pytest.mark.parametrize(
    "token_args", [["--token", TOKEN], [f"--token={TOKEN}"], ["--token"]]
)
def test_a_token_on_the_command_line_is_refused_naming_the_safe_ways(
    served, rig, run, token_args
):
    status, out, err = run(
        "--address", served.address, *token_args, "set", "alice", "9"
    )
    assert (status, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith("output-rate-ctl: error: argument --token: ")
    assert "process list" in line
    assert f"${TOKEN_ENV}" in line
    assert "--token-file" in line
    assert _alice_rate(rig) == 5  # nothing was sent


def test_the_token_file_carries_the_token(served, rig, run, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    status, _, err = run(
        "--address",
        served.address,
        "--token-file",
        str(token_file),
        "set",
        "alice",
        "9",
    )
    assert status == 0, err
    assert _alice_rate(rig) == 9


def test_the_token_file_comes_before_the_environment(
    served, rig, run, tmp_path, monkeypatch
):
    monkeypatch.setenv(TOKEN_ENV, "not-the-token")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    status, _, err = run(
        "--address",
        served.address,
        "--token-file",
        str(token_file),
        "set",
        "alice",
        "9",
    )
    assert status == 0, err


@pytest.mark.parametrize(
    ("content", "cause"),
    [(None, "No such file or directory"), (" \n", "is empty"), ("a\x01b", "ASCII")],
    ids=["missing", "empty", "control-character"],
)
def test_a_bad_token_file_is_a_usage_error(served, rig, run, tmp_path, content, cause):
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    status, out, err = run(
        "--address",
        served.address,
        "--token-file",
        str(token_file),
        "set",
        "alice",
        "9",
    )
    assert (status, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith(f"output-rate-ctl: error: --token-file {token_file}")
    assert cause in line
    assert _alice_rate(rig) == 5


def test_a_token_is_not_sent_in_clear_text_beyond_loopback(
    served, rig, run, monkeypatch
):
    """0.0.0.0 reaches this host's server, but is no loopback address: the CLI
    cannot know the path stays on the host, so it sends no token without TLS."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    address = f"0.0.0.0:{served.port}"
    status, out, err = run("--address", address, "set", "alice", "9")
    assert (status, out) == (2, "")
    [line] = err.splitlines()
    assert line == (
        f"output-rate-ctl: error: refusing to send the token to {address} in "
        "clear text: it is not a loopback address; give --tls-ca (TLS) or use a "
        "loopback address such as 127.0.0.1"
    )
    assert _alice_rate(rig) == 5


def test_without_a_token_a_non_loopback_address_is_tried(served, rig, run):
    """Nothing secret to protect: the server answers for itself."""
    status, _, err = run("--address", f"0.0.0.0:{served.port}", "get-default")
    assert status == 1
    assert err.startswith("error: UNAUTHENTICATED: ")
