"""``output-rate-ctl`` against a real in-process server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from control.cli import main
from control.service import LimitsService
from pacing.modes import Mode
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


def entry(user: str, rate: int | None, tier=None, exempt=False) -> dict:
    """One user's entry as ``--json`` prints it."""
    return {"user": user, "tokens_per_second": rate, "tier": tier, "exempt": exempt}


def test_set_get_list_delete_as_json(ctl, rig):
    assert ctl("--json", "set", "carol", "7")[:2] == (
        0,
        json.dumps(entry("carol", 7), indent=2) + "\n",
    )
    status, out, _ = ctl("--json", "get", "carol")
    assert (status, json.loads(out)) == (0, entry("carol", 7))
    status, out, _ = ctl("--json", "list", "--page-size", "2")  # pages through
    assert status == 0
    assert json.loads(out) == [
        entry("alice", 5),
        entry("bob", 20),
        entry("carol", 7),
    ]
    status, out, _ = ctl("--json", "delete", "carol")
    assert (status, json.loads(out)) == (0, {"deleted": "carol"})
    assert rig.limiter.rate_of("carol") == 10


def test_human_readable_tables(ctl):
    status, out, _ = ctl("list")
    assert status == 0
    assert out.splitlines() == [
        "USER   TOKENS/S  TIER  EXEMPT",
        "alice         5     -      no",
        "bob          20     -      no",
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
    assert lines[0] == "pacing mode: enforce"
    assert lines[1].split()[:5] == ["USER", "LIMIT/S", "SOURCE", "TIER", "RECENT/S"]
    assert lines[2].split()[:6] == ["dave", "10", "default", "-", "0.0", "100ms"]
    assert len(lines) == 3


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
    assert out.startswith("imported 2 entries and 0 tiers; etag ")
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
        (
            '{"users": {"a": 99999999999999999999}}',
            "must be between 1 and 1000000, got 99999999999999999999",
        ),
        ('{"default_tokens_per_second": 1e400}', "got inf of type float"),
        ("[" * 100_000, "not valid JSON: nested too deeply"),
        ('{"users": {"a": 1}, "etag": "\\ud800"}', "etag must be well-formed Unicode"),
        (b'{"users": {"\xff": 1}}', "not UTF-8 (invalid start byte)"),
    ],
    ids=[
        "unknown-field",
        "fractional",
        "zero",
        "empty-user",
        "syntax",
        "huge",
        "infinite",
        "deeply-nested",
        "surrogate-etag",
        "not-utf8",
    ],
)
def test_a_bad_import_file_is_invalid_argument_and_changes_nothing(
    ctl, rig, tmp_path, content, message
):
    path = tmp_path / "table.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert message in err
    assert len(err.splitlines()) == 1
    assert rig.limiter.user_rates == {"alice": 5, "bob": 20}


def test_a_multi_line_parser_error_is_printed_on_one_line(ctl, tmp_path):
    path = tmp_path / "table.yaml"
    path.write_text("users: [\n")
    status, _, err = ctl("import", str(path))
    assert status == 1
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert "not valid YAML: while parsing" in err
    assert len(err.splitlines()) == 1


def test_import_without_default_keeps_the_current_one(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text('{"users": {"zed": 4}}')
    assert ctl("import", str(path))[0] == 0
    assert rig.limiter.default_rate == 10
    assert rig.limiter.user_rates == {"zed": 4}


# -- mode, tiers, memberships, exemptions --------------------------------------


def test_get_and_set_the_pacing_mode(ctl, rig):
    assert ctl("get-mode")[:2] == (0, "pacing mode: enforce\n")
    status, out, _ = ctl("--json", "set-mode", "shadow")
    assert (status, json.loads(out)) == (0, {"pacing_mode": "shadow"})
    assert rig.shared.mode is Mode.SHADOW
    assert ctl("set-mode", "off")[:2] == (0, "pacing mode: off\n")
    assert rig.shared.mode is Mode.OFF


def test_create_list_update_and_delete_tiers(ctl, rig):
    assert ctl("create-tier", "free", "20")[0] == 0
    assert ctl("create-tier", "staff", "--exempt")[0] == 0
    assert ctl("assign", "bob", "free")[0] == 0
    status, out, _ = ctl("list-tiers")
    assert (status, out.splitlines()) == (
        0,
        [
            "TIER   TOKENS/S  EXEMPT  MEMBERS",
            "free         20      no        1",
            "staff         -     yes        0",
        ],
    )
    status, out, _ = ctl("--json", "update-tier", "free", "--rate", "30", "--exempt")
    assert json.loads(out) == {
        "tier": "free",
        "tokens_per_second": 30,
        "exempt": True,
        "member_count": 1,
    }
    assert (rig.limiter.tier_rates, rig.limiter.exempt_tiers) == (
        {"free": 30},
        {"free", "staff"},
    )
    status, out, _ = ctl("--json", "get-tier", "free")
    assert json.loads(out)["tokens_per_second"] == 30
    # The exemption was staff's last rule: lifting it removes the tier.
    assert ctl("update-tier", "staff", "--no-exempt")[:2] == (
        0,
        "tier staff has neither rate nor exemption left: deleted\n",
    )
    assert ctl("delete-tier", "free")[0] == 1  # bob is a member
    assert ctl("unassign", "bob")[0] == 0
    assert ctl("delete-tier", "free")[:2] == (0, "deleted tier free\n")
    assert rig.limiter.tier_rates == {}


def test_deleting_a_tier_with_members_exits_1_failed_precondition(ctl, rig):
    ctl("create-tier", "free", "20")
    ctl("assign", "carol", "free")
    status, out, err = ctl("delete-tier", "free")
    assert (status, out) == (1, "")
    assert err.startswith("error: FAILED_PRECONDITION: 'tiers/free' has 1 member(s)")
    assert rig.limiter.tier_rates == {"free": 20}


def test_assigning_a_tier_that_does_not_exist_exits_1(ctl, rig):
    status, _, err = ctl("assign", "carol", "gold")
    assert status == 1
    assert err.startswith("error: FAILED_PRECONDITION: limit.tier: 'tiers/gold'")
    assert rig.limiter.memberships == {}


def test_membership_exemption_and_own_limit_are_separate_fields(ctl, rig):
    ctl("create-tier", "free", "2")
    assigned = json.loads(ctl("--json", "assign", "alice", "free")[1])
    assert assigned == entry("alice", 5, "free")  # her own limit stays
    exempted = json.loads(ctl("--json", "exempt", "alice")[1])
    assert exempted == entry("alice", 5, "free", exempt=True)
    assert rig.limiter.rate_of("alice") == 0
    ctl("unexempt", "alice")
    ctl("unset", "alice")
    assert rig.limiter.rate_of("alice") == 2  # now the tier's
    assert ctl("unassign", "alice")[:2] == (
        0,
        "alice has no entry left (the default applies)\n",
    )
    assert rig.limiter.rate_of("alice") == 10
    out = ctl("--json", "exempt", "dora")[1]  # no entry before
    assert json.loads(out) == entry("dora", None, exempt=True)
    assert ctl("list")[1].splitlines() == [
        "USER  TOKENS/S  TIER  EXEMPT",
        "bob         20     -      no",
        "dora         -     -     yes",
    ]


def test_delete_removes_the_whole_entry(ctl, rig):
    ctl("create-tier", "free", "2")
    ctl("assign", "alice", "free")
    assert ctl("delete", "alice")[:2] == (
        0,
        "deleted the entry of alice: limit, tier and exemption (the default applies)\n",
    )
    assert rig.limiter.rate_of("alice") == 10
    assert rig.limiter.memberships == {}


def test_state_shows_the_limit_source_the_tier_and_the_mode(ctl, rig):
    ctl("create-tier", "free", "2")
    ctl("assign", "carol", "free")
    ctl("set-mode", "shadow")
    rig.step("carol", 3)
    state = json.loads(ctl("--json", "state", "carol")[1])
    assert (state["limit_source"], state["tier"], state["pacing_mode"]) == (
        "tier",
        "free",
        "shadow",
    )
    assert state["shadow_skips"] == 0  # the rig acts as enforce
    lines = ctl("state", "carol")[1].splitlines()
    assert lines[0] == "pacing mode: shadow"
    assert lines[2].split()[:4] == ["carol", "2", "tier", "free"]


def test_state_without_users_still_shows_the_mode(capsys):
    rig = make_rig(10)
    with serving(LimitsService(rig.shared)) as served:
        status = main(["--address", served.address, "state"])
    out = capsys.readouterr().out
    assert (status, out.splitlines()[0]) == (0, "pacing mode: enforce")
    assert out.splitlines()[1].startswith("USER")


def test_export_then_import_carries_tiers_memberships_and_exemptions(
    ctl, rig, tmp_path
):
    ctl("create-tier", "free", "2")
    ctl("create-tier", "staff", "--exempt")
    ctl("assign", "carol", "free")
    ctl("exempt", "ops")
    exported = tmp_path / "table.yaml"
    assert ctl("export", str(exported))[0] == 0
    doc = yaml.safe_load(exported.read_text())
    assert doc["tiers"] == {"free": {"tokens_per_second": 2}, "staff": {"exempt": True}}
    assert doc["memberships"] == {"carol": "free"}
    assert doc["exempt_users"] == ["ops"]
    assert "mode" not in doc  # not part of the table
    doc["memberships"]["dave"] = "staff"
    doc["tiers"]["free"]["tokens_per_second"] = 3
    exported.write_text(yaml.safe_dump(doc))
    status, out, err = ctl("import", str(exported))
    assert (status, err) == (0, "")
    assert out.startswith("imported 5 entries and 2 tiers; etag ")
    assert rig.limiter.memberships == {"carol": "free", "dave": "staff"}
    assert rig.limiter.rate_of("carol") == 3
    assert rig.limiter.rate_of("dave") == 0


def test_import_leaves_the_mode_and_says_so(ctl, rig, tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("mode: off\nusers: {alice: 5}\n")
    status, _, err = ctl("import", "--force", str(path))
    assert status == 0
    assert err == (
        f"note: {path} names mode off, which import leaves as it is; use "
        "set-mode to change it\n"
    )
    assert rig.shared.mode is Mode.ENFORCE


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


RATE_RANGE = "argument rate: must be a whole number between 1 and 1000000, got"
SURROGATE = "the user id must be well-formed Unicode"
USAGE_ERRORS = {
    # id: (argv, a part of the one line on stderr)
    "no-command": ([], "the following arguments are required: COMMAND"),
    "unknown-command": (["fro\nb"], "invalid choice: 'fro\\nb'"),
    "missing-rate": (["set", "alice"], "the following arguments are required: rate"),
    "missing-user": (["get"], "the following arguments are required: user"),
    "huge-rate": (["set", "huge", "99999999999999999999"], RATE_RANGE),
    "huge-negative-rate": (["set", "a", "-99999999999999999999"], RATE_RANGE),
    "rate-above-max": (["set", "alice", "1000001"], f"{RATE_RANGE} '1000001'"),
    "zero-rate": (["set", "alice", "0"], f"{RATE_RANGE} '0'"),
    "negative-rate": (["set", "alice", "-3"], f"{RATE_RANGE} '-3'"),
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
    "newline-token": (["--token", "a\nb", "list"], "must be printable ASCII"),
    "unknown-mode": (["set-mode", "loud"], "argument mode: invalid choice: 'loud'"),
    "control-character-tier": (
        ["assign", "alice", "a\x01"],
        "argument tier: the tier id must not contain control characters",
    ),
    "zero-tier-rate": (["create-tier", "free", "0"], f"{RATE_RANGE} '0'"),
    "tier-without-rule": (
        ["create-tier", "free"],
        "create-tier needs a RATE, --exempt or both",
    ),
    "update-tier-without-change": (
        ["update-tier", "free"],
        "update-tier needs --rate, --no-rate, --exempt or --no-exempt",
    ),
    "rate-and-no-rate": (
        ["update-tier", "free", "--rate", "3", "--no-rate"],
        "argument --no-rate: not allowed with argument --rate",
    ),
    "surrogate-token": (["--token", "a\udcff", "list"], "must be printable ASCII"),
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
    assert len(err) < 400  # the input is not echoed unbounded
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


def test_a_missing_import_file_is_a_usage_error(ctl, tmp_path):
    status, _, err = ctl("import", str(tmp_path / "nope.json"))
    assert status == 2
    assert "cannot read" in err


def test_an_unwritable_export_file_is_a_usage_error(ctl, tmp_path):
    path = tmp_path / "missing-dir" / "table.json"
    status, _, err = ctl("export", str(path))
    assert status == 2
    assert err.splitlines() == [
        f"output-rate-ctl: error: cannot write {path}: No such file or directory"
    ]


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


def test_the_console_script_refuses_a_huge_rate_with_one_line():
    """The reproduction of the report, as an operator runs it: before, protobuf's
    ``ValueError: Value out of range`` as a traceback and exit status 1."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from control.cli import run; run()",
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
        "output-rate-ctl set: error: argument rate: must be a whole number between "
        "1 and 1000000, got '99999999999999999999' (see output-rate-ctl set --help)"
    ]
