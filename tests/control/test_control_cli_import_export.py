"""``output-rate-ctl export`` and ``import`` (``control.cli.import_export``)
against a real in-process server."""

from __future__ import annotations

import json

import pytest
import yaml

from pacing.modes import Mode


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
    assert out.startswith("imported 2 entries, 0 tiers and 0 teams; etag ")
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


RATE = "must be an integer in 1..1000000 (tokens per second)"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"users": {"a": 1}, "colour": "red"}', "unknown field(s) 'colour'"),
        ('{"users": {"a": 1.5}}', f"users.a: {RATE}, got 1.5"),
        ('{"users": {"a": 0}}', f"users.a: {RATE}, got 0"),
        ('{"users": {"": 1}}', "must not be empty"),
        ('{"users": {"a": 1}', "not valid JSON"),
        (
            '{"users": {"a": 99999999999999999999}}',
            f"users.a: {RATE}, got 99999999999999999999",
        ),
        (
            '{"default_tokens_per_second": 1e400}',
            f"default_tokens_per_second: {RATE}, got inf",
        ),
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


def test_import_without_default_keeps_the_current_one(ctl, rig, tmp_path):
    path = tmp_path / "table.json"
    path.write_text('{"users": {"zed": 4}}')
    assert ctl("import", str(path))[0] == 0
    assert rig.limiter.default_rate == 10
    assert rig.limiter.user_rates == {"zed": 4}


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
    assert out.startswith("imported 5 entries, 2 tiers and 0 teams; etag ")
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
