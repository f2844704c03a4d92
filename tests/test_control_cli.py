"""``output-rate-ctl`` against a real in-process server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from control.cli import main
from control.service import LimitsService
from tests.control_harness import make_rig, serving

TOKEN = "cli-token"


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5, "bob": 20})


@pytest.fixture
def served(rig):
    with serving(LimitsService(rig.host), auth_token=TOKEN) as served:
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


def test_set_get_list_delete_as_json(ctl, rig):
    assert ctl("--json", "set", "carol", "7")[:2] == (
        0,
        json.dumps({"user": "carol", "tokens_per_second": 7}, indent=2) + "\n",
    )
    status, out, _ = ctl("--json", "get", "carol")
    assert (status, json.loads(out)) == (0, {"user": "carol", "tokens_per_second": 7})
    status, out, _ = ctl("--json", "list", "--page-size", "2")  # pages through
    assert status == 0
    assert json.loads(out) == [
        {"user": "alice", "tokens_per_second": 5},
        {"user": "bob", "tokens_per_second": 20},
        {"user": "carol", "tokens_per_second": 7},
    ]
    status, out, _ = ctl("--json", "delete", "carol")
    assert (status, json.loads(out)) == (0, {"deleted": "carol"})
    assert rig.limiter.rate_of("carol") == 10


def test_human_readable_tables(ctl):
    status, out, _ = ctl("list")
    assert status == 0
    assert out.splitlines() == [
        "USER   TOKENS/S",
        "alice         5",
        "bob          20",
    ]


def test_default_get_and_set(ctl, rig):
    assert ctl("get-default")[:2] == (0, "default: 10 tokens/s\n")
    status, out, _ = ctl("--json", "set-default", "30")
    assert (status, json.loads(out)) == (0, {"default_tokens_per_second": 30})
    assert rig.limiter.default_rate == 30


def test_create_refuses_an_existing_limit(ctl):
    status, out, err = ctl("set", "--create", "alice", "9")
    assert status == 1
    assert out == ""
    assert err.startswith("error: ALREADY_EXISTS: ")


def test_state_of_one_user_and_of_all_sorted_by_throttled_skips(ctl, rig):
    rig.step("alice", 3)  # 5/s: 1 granted, 2 skipped
    rig.step("dave", 7)  # 10/s: 2 granted, 5 skipped
    rig.counts.value = {"dave": (4, 3)}
    status, out, _ = ctl("--json", "state", "dave")
    assert status == 0
    state = json.loads(out)
    assert state["throttled_skips"] == 5
    assert (state["running_requests"], state["throttled_requests"]) == (4, 3)
    assert state["tat_lead_s"] == pytest.approx(0.2)
    assert state["next_token_in_s"] == pytest.approx(0.1)
    status, out, _ = ctl("--json", "state")
    assert [(s["user"], s["throttled_skips"]) for s in json.loads(out)] == [
        ("dave", 5),
        ("alice", 2),
        ("bob", 0),
    ]
    status, out, _ = ctl("state", "--top", "1")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["USER", "LIMIT/S", "RECENT/S"]
    assert lines[1].split()[:4] == ["dave", "10", "0.0", "100ms"]
    assert len(lines) == 2


def test_watch_streams_updates_as_json_lines(ctl, rig):
    rig.step("alice", 3)
    status, out, _ = ctl(
        "--json", "watch", "alice", "--interval", "0.1", "--count", "2"
    )
    assert status == 0
    updates = [json.loads(line) for line in out.splitlines()]
    assert len(updates) == 2
    assert [s["user"] for s in updates[0]["user_states"]] == ["alice"]


def test_export_then_import_round_trips_with_the_etag(ctl, rig, tmp_path):
    exported = tmp_path / "table.json"
    assert ctl("export", str(exported))[0] == 0
    doc = json.loads(exported.read_text())
    assert doc["users"] == {"alice": 5, "bob": 20}
    assert doc["default_tokens_per_second"] == 10
    assert doc["etag"]
    doc["users"]["erin"] = 3
    del doc["users"]["bob"]
    exported.write_text(json.dumps(doc))
    status, out, err = ctl("import", str(exported))
    assert (status, err) == (0, "")
    assert out.startswith("imported 2 limits; etag ")
    assert rig.limiter.user_rates == {"alice": 5, "erin": 3}


def test_import_after_a_concurrent_change_is_aborted(ctl, rig, tmp_path):
    exported = tmp_path / "table.json"
    ctl("export", str(exported))
    ctl("set", "alice", "6")  # someone else changes the table
    status, _, err = ctl("import", str(exported))
    assert status == 1
    assert err.startswith("error: ABORTED: ")
    assert rig.limiter.rate_of("alice") == 6
    assert ctl("import", "--force", str(exported))[0] == 0
    assert rig.limiter.rate_of("alice") == 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"users": {"a": 1}, "colour": "red"}', "unknown field(s) 'colour'"),
        ('{"users": {"a": 1.5}}', "got 1.5 of type float"),
        ('{"users": {"a": 0}}', "must be between 1 and 1000000, got 0"),
        ('{"users": {"": 1}}', "must not be empty"),
        ('{"users": {"a": 1}', "not valid JSON"),
    ],
    ids=["unknown-field", "fractional", "zero", "empty-user", "syntax"],
)
def test_a_bad_import_file_is_invalid_argument_and_changes_nothing(
    ctl, rig, tmp_path, content, message
):
    path = tmp_path / "table.json"
    path.write_text(content)
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert message in err
    assert rig.limiter.user_rates == {"alice": 5, "bob": 20}


def test_import_without_default_keeps_the_current_one(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text('{"users": {"zed": 4}}')
    assert ctl("import", str(path))[0] == 0
    assert rig.limiter.default_rate == 10
    assert rig.limiter.user_rates == {"zed": 4}


@pytest.mark.parametrize(
    ("argv", "status", "code"),
    [
        (["get", "nobody"], 1, "NOT_FOUND"),
        (["set", "alice", "0"], 1, "INVALID_ARGUMENT"),
        (["set", "alice", "-3"], 1, "INVALID_ARGUMENT"),
        (["set", "alice", "99999999999"], 1, "INVALID_ARGUMENT"),
        (["set", "a\x01b", "5"], 1, "INVALID_ARGUMENT"),
        (["set", "x" * 300, "5"], 1, "INVALID_ARGUMENT"),
        (["state", "--order-by", "shoe size"], 1, "INVALID_ARGUMENT"),
        (["watch", "--interval", "0.001"], 1, "INVALID_ARGUMENT"),
    ],
)
def test_refused_requests_exit_1_with_the_status_code(ctl, argv, status, code):
    got, out, err = ctl(*argv)
    assert (got, out) == (status, "")
    assert err.startswith(f"error: {code}: ")


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate"], ["set", "alice"], ["set", "alice", "1.5"], ["get"]],
    ids=["no-command", "unknown", "missing-rate", "fractional-rate", "missing-user"],
)
def test_usage_errors_exit_2(ctl, argv):
    assert ctl(*argv)[0] == 2


def test_a_missing_import_file_is_a_usage_error(ctl, tmp_path):
    status, _, err = ctl("import", str(tmp_path / "nope.json"))
    assert status == 2
    assert "cannot read" in err


def test_a_wrong_token_exits_1_unauthenticated(served, capsys):
    status = main(["--address", served.address, "--token", "nope", "list"])
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
            "from control.cli import run; run()",
            "--address",
            served.address,
            "--token",
            TOKEN,
            "--json",
            "get-default",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"default_tokens_per_second": 10}
