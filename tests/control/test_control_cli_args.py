"""``output-rate-ctl``'s argument checks (``control.cli.args``) against a real
in-process server: every bad argument is a one-line usage error that sends nothing;
the bounds themselves are accepted."""

from __future__ import annotations

import subprocess
import sys

import pytest

RATE_RANGE = "argument rate: must be an integer in 1..1000000 (tokens per second), got"


SURROGATE = "the user id must be well-formed Unicode"
WEIGHT_RANGE = "must be a number in (0, 1e+06], got"


USAGE_ERRORS = {
    # id: (argv, a part of the one line on stderr)
    "no-command": ([], "the following arguments are required: COMMAND"),
    "unknown-command": (["fro\nb"], "invalid choice: 'fro\\nb'"),
    "missing-rate": (["set", "alice"], "the following arguments are required: rate"),
    "missing-user": (["get"], "the following arguments are required: user"),
    "huge-rate": (["set", "huge", "99999999999999999999"], RATE_RANGE),
    "huge-negative-rate": (["set", "a", "-99999999999999999999"], RATE_RANGE),
    "rate-above-max": (["set", "alice", "1000001"], f"{RATE_RANGE} 1000001"),
    "zero-rate": (["set", "alice", "0"], f"{RATE_RANGE} 0"),
    "negative-rate": (["set", "alice", "-3"], f"{RATE_RANGE} -3"),
    "fractional-rate": (["set", "alice", "1.5"], f"{RATE_RANGE} '1.5'"),
    "5000-digit-rate": (["set", "alice", "9" * 5000], f"{RATE_RANGE} '999"),
    "huge-default": (["set-default", "99999999999999999999"], RATE_RANGE),
    "zero-default": (["set-default", "0"], RATE_RANGE),
    "huge-page-size": (
        ["list", "--page-size", "99999999999"],
        "argument --page-size: must be a whole number between 1 and 1000",
    ),
    "negative-page-size": (["list", "--page-size", "-1"], "argument --page-size"),
    "negative-top": (
        ["state", "--top", "-5"],
        "argument --top: must be a whole number, at least 0, got '-5'",
    ),
    "huge-watch-top": (
        ["watch", "--top", "99999999999"],
        "argument --top: must be a whole number between 1 and 1000",
    ),
    "negative-count": (["watch", "--count", "-1"], "argument --count"),
    "short-interval": (
        ["watch", "--interval", "0.001"],
        "argument --interval: must be a number of seconds between 0.1 and 60",
    ),
    "nan-interval": (["watch", "--interval", "nan"], "argument --interval"),
    "infinite-interval": (["watch", "--interval", "1e400"], "argument --interval"),
    "long-interval": (["watch", "--interval", "61"], "argument --interval"),
    "zero-timeout": (
        ["--timeout", "0", "list"],
        "argument --timeout: must be a number of seconds between 0.001 and 86400",
    ),
    "nan-timeout": (["--timeout", "nan", "list"], "argument --timeout"),
    "huge-timeout": (["--timeout", "1e300", "list"], "argument --timeout"),
    "control-character-user": (
        ["set", "a\x01b", "5"],
        "argument user: the user id must not contain control characters",
    ),
    "long-user": (["set", "x" * 300, "5"], "must be at most 256 bytes"),
    "surrogate-user": (["set", "bad\udcff", "5"], SURROGATE),
    "surrogate-get": (["get", "bad\ud800"], SURROGATE),
    "surrogate-delete": (["delete", "bad\ud800"], SURROGATE),
    "surrogate-state": (["state", "bad\ud800"], SURROGATE),
    "surrogate-watch": (["watch", "ok", "bad\ud800"], SURROGATE),
    "surrogate-order": (
        ["state", "--order-by", "x\ud800"],
        "argument --order-by: must be well-formed Unicode",
    ),
    "surrogate-address": (
        ["--address", "x\udcff", "list"],
        "argument --address: must be well-formed Unicode",
    ),
    "token-on-command-line": (
        ["--token", "t", "list"],
        "argument --token: a token on the command line is readable",
    ),
    "unknown-mode": (["set-mode", "loud"], "argument mode: invalid choice: 'loud'"),
    "control-character-tier": (
        ["assign", "alice", "a\x01"],
        "argument tier: the tier id must not contain control characters",
    ),
    "zero-tier-rate": (["create-tier", "free", "0"], f"{RATE_RANGE} 0"),
    "tier-without-rule": (
        ["create-tier", "free"],
        "create-tier needs a RATE, --exempt or both",
    ),
    "update-tier-without-change": (
        ["update-tier", "free"],
        "update-tier needs --rate, --no-rate, --exempt, --no-exempt, --weight, "
        "--no-weight, --prompt-rate, --no-prompt-rate, --ceiling, --no-ceiling, "
        "--band or --no-band",
    ),
    "zero-weight": (["set-weight", "alice", "0"], f"{WEIGHT_RANGE} 0.0"),
    "negative-weight": (["set-weight", "alice", "-2"], f"{WEIGHT_RANGE} -2.0"),
    "nan-weight": (["set-weight", "alice", "nan"], f"{WEIGHT_RANGE} nan"),
    "huge-weight": (["set-weight", "alice", "1e7"], f"{WEIGHT_RANGE} 10000000.0"),
    "text-weight": (["set-weight", "alice", "heavy"], f"{WEIGHT_RANGE} 'heavy'"),
    "zero-tier-weight": (
        ["create-tier", "free", "5", "--weight", "0"],
        f"argument --weight: {WEIGHT_RANGE} 0.0",
    ),
    "weight-and-no-weight": (
        ["update-tier", "free", "--weight", "3", "--no-weight"],
        "argument --no-weight: not allowed with argument --weight",
    ),
    "unknown-switch": (
        ["set-fair-share", "maybe"],
        "argument switch: invalid choice: 'maybe'",
    ),
    "rate-and-no-rate": (
        ["update-tier", "free", "--rate", "3", "--no-rate"],
        "argument --no-rate: not allowed with argument --rate",
    ),
}


@pytest.mark.parametrize(
    ("argv", "part"), USAGE_ERRORS.values(), ids=USAGE_ERRORS.keys()
)
def test_bad_arguments_are_one_line_usage_errors_and_send_nothing(ctl, rig, argv, part):
    status, out, err = ctl(*argv)
    assert (status, out) == (2, "")
    assert err.startswith("output-rate-ctl")
    assert ": error: " in err
    assert part in err
    assert len(err.splitlines()) == 1
    assert len(err) < 500  # the input is not echoed unbounded
    assert "Traceback" not in err
    assert rig.limiter.default_rate == 10
    assert rig.limiter.user_rates == {"alice": 5, "bob": 20}


def test_the_bounds_are_accepted(ctl, rig):
    assert ctl("set", "alice", "1000000")[0] == 0
    assert ctl("set", "bob", "1")[0] == 0
    assert ctl("set-default", "1000000")[0] == 0
    assert ctl("list", "--page-size", "1000")[0] == 0
    assert ctl("--timeout", "86400", "list")[0] == 0
    assert ctl("watch", "--interval", "0.1", "--top", "1000", "--count", "1")[0] == 0
    assert (rig.limiter.rate_of("alice"), rig.limiter.rate_of("bob")) == (1000000, 1)
    assert rig.limiter.default_rate == 1000000


def test_the_console_script_refuses_a_huge_rate_with_one_line():
    """As an operator runs it: a rate beyond what protobuf can carry is refused
    by the CLI with one line, not protobuf's ``ValueError: Value out of range``
    as a traceback."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from control.cli.main import run; run()",
            "--address",
            "127.0.0.1:1",  # nothing is sent
            "set",
            "huge",
            "99999999999999999999",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "output-rate-ctl set: error: argument rate: must be an integer in "
        "1..1000000 (tokens per second), got 99999999999999999999 "
        "(see output-rate-ctl set --help)"
    ]
