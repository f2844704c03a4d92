"""The config file: load at start, atomic write-back, live edits, bad files,
restarts."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import grpc
import pytest
import yaml

from control.errors import InvalidArgument
from control.kinds import USERS
from control.persistence import ConfigFile, ConfigWatcher, load_at_start, merge
from control.runner import serve
from control.service.operations import LimitsService
from pacing.modes import Mode
from pacing.policy.document import Document
from pacing.settings.model import ControlSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc
from tests.control_harness import make_rig, pieces, serving, table

FLAGS = table(default_rate=10, user_rates={"flag-only": 1, "both": 2})


@pytest.fixture(params=["json", "yaml"])
def path(request, tmp_path):
    return tmp_path / f"limits.{request.param}"


def write_doc(path, doc: dict) -> None:
    """An operator's edit (JSON is valid YAML, so one writer serves both)."""
    path.write_text(json.dumps(doc))


def files_in(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- load at start -------------------------------------------------------------


def test_the_file_wins_over_the_flags(path):
    write_doc(path, {"default_tokens_per_second": 50, "users": {"both": 20, "file": 3}})
    doc = load_at_start(ConfigFile(path), FLAGS)
    assert pieces(doc).default_rate == 50
    assert pieces(doc).user_rates == {"flag-only": 1, "both": 20, "file": 3}


def test_a_file_without_default_keeps_the_flags_default(path):
    write_doc(path, {"users": {"file": 3}})
    assert load_at_start(ConfigFile(path), FLAGS).policy.default_rate == 10


def test_a_missing_file_is_created_from_the_flags(path):
    assert load_at_start(ConfigFile(path), FLAGS).policy == FLAGS
    assert ConfigFile(path).load().policy == FLAGS


RATE = "must be an integer in 1..1000000 (tokens per second), got"
BAD_FILES = [
    # (content, exact error after "<path>: ")
    ("[1, 2]", "must be an object (a policy document), got list"),
    (
        '{"users": {}, "user": {}}',
        "unknown field(s) 'user'; expected 'mode', 'fair_share', 'default', "
        "'default_tokens_per_second', 'tiers', 'teams', 'users', 'memberships', "
        "'exempt_users', 'team_members', 'weights', 'bands', 'objectives', 'etag', "
        "'store_version'",
    ),
    ('{"default_tokens_per_second": 1.5}', f"default_tokens_per_second: {RATE} 1.5"),
    ('{"default_tokens_per_second": 0}', f"default_tokens_per_second: {RATE} 0"),
    ('{"default_tokens_per_second": true}', f"default_tokens_per_second: {RATE} True"),
    ('{"users": {"a": 2000000}}', f"users.a: {RATE} 2000000"),
    ('{"users": {"a": -1}}', f"users.a: {RATE} -1"),
    ('{"users": {"a": "10"}}', f"users.a: {RATE} '10'"),
    ('{"users": {"": 1}}', "users['']: user id must not be empty"),
    (
        '{"users": {"a\\u0001": 1}}',
        "users['a\\x01']: user id must not contain control characters",
    ),
    (
        '{"users": ["a"]}',
        "users: must be an object mapping user ids to a rate or their limits, got list",
    ),
    ('{"users": {"a": 1, "a": 2}}', "duplicate key 'a'"),
    ('{"mode": 3}', "mode: must be one of enforce, shadow, off, got 3"),
    ('{"tiers": {"free": {}}}', "tiers.free: needs tokens_per_second or exempt: true"),
    (
        '{"tiers": {"free": 20}}',
        "tiers.free: must be an object with any of 'tokens_per_second', 'exempt', "
        "'weight', 'prompt_tokens_per_second', 'ceiling_tokens_per_second', "
        "'band', got int",
    ),
    (
        '{"tiers": {"free": {"tokens_per_second": 0}}}',
        f"tiers.free.tokens_per_second: {RATE} 0",
    ),
    (
        '{"tiers": {"free": {"exempt": "yes"}}}',
        "tiers.free.exempt: must be true or false, got 'yes'",
    ),
    (
        '{"tiers": {"free": {"rate": 1}}}',
        "tiers.free: unknown field(s) 'rate'; expected 'tokens_per_second', "
        "'exempt', 'weight', 'prompt_tokens_per_second', 'ceiling_tokens_per_second', "
        "'band'",
    ),
    ('{"tiers": {"": {"exempt": true}}}', "tiers['']: tier id must not be empty"),
    (
        '{"tiers": ["free"]}',
        "tiers: must be an object mapping tier ids to their limits, got list",
    ),
    ('{"memberships": {"bob": "gold"}}', "memberships.bob: unknown tier 'gold'"),
    (
        '{"memberships": ["bob"]}',
        "memberships: must be an object mapping user ids to tier ids, got list",
    ),
    ('{"exempt_users": "ops"}', "exempt_users: must be a list of user ids, got str"),
    ('{"exempt_users": ["a", "a"]}', "exempt_users[1]: 'a' appears more than once"),
    (
        '{"exempt_users": ["a\\u0000"]}',
        "exempt_users[0]: user id must not contain control characters",
    ),
]


@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_a_bad_file_stops_the_start_with_a_message_naming_the_field(
    path, content, message
):
    path.write_text(content)
    with pytest.raises(InvalidArgument) as info:
        load_at_start(ConfigFile(path), FLAGS)
    assert str(info.value) == f"{path}: {message}"


def test_syntax_errors_name_the_format(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text("{")
    with pytest.raises(InvalidArgument, match=r"limits.json: not valid JSON"):
        ConfigFile(path).load()
    path = tmp_path / "limits.yaml"
    path.write_text("users: [")
    with pytest.raises(InvalidArgument, match=r"limits.yaml: not valid YAML"):
        ConfigFile(path).load()


def test_yaml_duplicate_users_are_refused(tmp_path):
    path = tmp_path / "limits.yml"
    path.write_text("users:\n  a: 1\n  a: 2\n")
    with pytest.raises(InvalidArgument, match="duplicate key 'a'"):
        ConfigFile(path).load()


def test_an_unknown_extension_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=r"name the file \*.json, \*.yaml"):
        ConfigFile(tmp_path / "limits.txt")


# -- write-back ----------------------------------------------------------------


@pytest.fixture
def rig():
    return make_rig(10, {"alice": 5})


def started(path, rig) -> tuple[LimitsService, ConfigFile]:
    file = ConfigFile(path)
    service = LimitsService(rig.shared, persist=file.write)
    doc = load_at_start(file, table(10, {"alice": 5}))
    service.reload(lambda: doc.policy)
    return service, file


def test_every_accepted_change_is_written_atomically(path, rig):
    service, _ = started(path, rig)
    path.chmod(0o640)
    with serving(service) as served:
        for i in range(20):
            served.stub.UpdateLimit(
                pb.UpdateLimitRequest(
                    limit=pb.Limit(name=f"limits/u{i}", tokens_per_second=i + 1),
                    allow_missing=True,
                )
            )
        served.stub.DeleteLimit(pb.DeleteLimitRequest(name="limits/alice"))
        served.stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(tokens_per_second=7)
            )
        )
    assert files_in(path.parent) == [path.name]  # no temp files left behind
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # permissions kept
    assert ConfigFile(path).load().policy == table(
        default_rate=7,
        user_rates={f"u{i}": i + 1 for i in range(20)},
        mode=Mode.ENFORCE,
        fair_share=False,
    )


def test_a_failed_write_applies_nothing(path, rig, monkeypatch):
    service, _ = started(path, rig)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with serving(service) as served:
        before = served.stub.GetLimitsTable(pb.GetLimitsTableRequest())
        monkeypatch.setattr(os, "replace", full_disk)
        with pytest.raises(grpc.RpcError) as info:
            served.stub.UpdateLimit(
                pb.UpdateLimitRequest(
                    limit=pb.Limit(name="limits/alice", tokens_per_second=99)
                )
            )
        monkeypatch.undo()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "No space left on device" in info.value.details()
        assert served.stub.GetLimitsTable(pb.GetLimitsTableRequest()) == before
    assert rig.limiter.rate_of("alice") == 5
    assert files_in(path.parent) == [path.name]


@pytest.fixture
def umask():
    """Sets the process umask for one test (it is process-wide: restored after)."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


def mode_of(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o664], ids=oct)
def test_a_rewrite_keeps_the_files_mode(path, umask, mode):
    umask(0o077)  # the mode comes from the old file, not from the umask
    ConfigFile(path).write(FLAGS)
    path.chmod(mode)
    ConfigFile(path).write(table(5, {"x": 1}))
    assert mode_of(path) == mode
    assert ConfigFile(path).load().policy == table(5, {"x": 1})


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o000], ids=oct)
def test_a_new_file_is_private_whatever_the_umask(path, umask, mask):
    umask(mask)
    load_at_start(ConfigFile(path), FLAGS)  # created from the flags
    assert mode_of(path) == 0o600


def test_a_file_deleted_and_recreated_by_a_change_is_private(path, rig, umask):
    service, _ = started(path, rig)
    path.unlink()
    service.update(USERS, "limits/alice", {"tokens_per_second": 6})
    assert mode_of(path) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give files away")
def test_a_rewrite_keeps_the_files_owner_and_group(path):
    ConfigFile(path).write(FLAGS)
    os.chown(path, 4242, 4343)
    path.chmod(0o640)
    ConfigFile(path).write(table(5, {"x": 1}))
    info = path.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (4242, 4343, 0o640)


def _directory_removed(path) -> None:
    """The directory opened at start-up is removed: no file can be created in
    it (ENOENT), whatever now stands at its path."""
    path.unlink()
    path.parent.rmdir()


def _target_made_a_directory(path) -> None:
    """The file is replaced by a non-empty directory: the rename fails (EISDIR)."""
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("x")


@pytest.mark.parametrize(
    ("breakage", "error"),
    [(_directory_removed, "No such file"), (_target_made_a_directory, "Is a")],
    ids=["directory-removed", "target-is-a-directory"],
)
def test_a_failed_write_is_logged_with_the_path_and_the_os_error(
    tmp_path, rig, caplog, breakage, error
):
    """Real failures that hold for root too (chmod would not stop root)."""
    path = tmp_path / "conf" / "limits.json"
    path.parent.mkdir()
    service, _ = started(path, rig)
    breakage(path)
    with (
        serving(service) as served,
        caplog.at_level(logging.ERROR, logger="vllm.control.persistence"),
        pytest.raises(grpc.RpcError) as info,
    ):
        served.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", tokens_per_second=99)
            )
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert rig.limiter.rate_of("alice") == 5
    [record] = [r for r in caplog.records if r.name == "vllm.control.persistence"]
    assert record.levelno == logging.ERROR
    assert str(path) in record.getMessage()
    assert error in record.getMessage()
    if path.is_dir():  # the temp file beside it is gone again
        assert files_in(path.parent) == [path.name]


def test_a_deeply_nested_file_is_invalid_not_a_crash(path):
    path.write_text("[" * 100_000)
    with pytest.raises(InvalidArgument, match="nested too deeply"):
        ConfigFile(path).load()


def test_changes_while_pacing_is_off_write_a_valid_file(tmp_path):
    rig = make_rig(None)
    file = ConfigFile(tmp_path / "limits.json")
    service = LimitsService(rig.shared, persist=file.write)
    service.create(USERS, "a", {"tokens_per_second": 5})
    assert file.load().policy == table(
        None, {"a": 5}, mode=Mode.ENFORCE, fair_share=False
    )
    assert service.get_limits_table("").default_tokens_per_second == 0
    assert rig.limiter.rate_of("a") == 0  # explicit limits wait for a default
    service.update_default("", {"tokens_per_second": 9})
    assert rig.limiter.rate_of("a") == 5
    assert file.load().policy == table(9, {"a": 5}, mode=Mode.ENFORCE, fair_share=False)


def test_a_write_through_a_symlink_replaces_the_target(tmp_path, rig):
    real = tmp_path / "real" / "limits.json"
    real.parent.mkdir()
    link = tmp_path / "limits.json"
    link.symlink_to(real)
    ConfigFile(link).write(table(3, {"x": 1}))
    assert link.is_symlink()
    assert ConfigFile(real).load().policy == table(3, {"x": 1})


# -- live edits ------------------------------------------------------------------


def watcher_for(path, rig, **kwargs) -> tuple[ConfigWatcher, LimitsService]:
    service, file = started(path, rig)
    flags = table(10, {"alice": 5})
    return ConfigWatcher(file, service, flags, **kwargs), service


def test_our_own_writes_are_not_reapplied(path, rig):
    watcher, service = watcher_for(path, rig)
    service.update(USERS, "limits/bob", {"tokens_per_second": 4}, allow_missing=True)
    etag = service.get_limits_table("").etag
    assert watcher.poll() is False
    assert service.get_limits_table("").etag == etag


def test_an_external_edit_is_applied(path, rig):
    watcher, service = watcher_for(path, rig)
    etag = service.get_limits_table("").etag
    wakes = len(rig.wakes)
    write_doc(path, {"default_tokens_per_second": 30, "users": {"carol": 9}})
    assert watcher.poll() is True
    assert rig.limiter.default_rate == 30
    # Flags overlaid by the file: alice comes from the flags.
    assert rig.limiter.user_rates == {"alice": 5, "carol": 9}
    assert service.get_limits_table("").etag != etag
    assert len(rig.wakes) == wakes + 1
    assert watcher.poll() is False  # nothing new


def test_an_edit_with_the_same_table_changes_nothing(path, rig):
    watcher, service = watcher_for(path, rig)
    etag = service.get_limits_table("").etag
    path.write_text('{"users": {"alice": 5}, "default_tokens_per_second": 10}\n\n')
    assert watcher.poll() is False
    assert service.get_limits_table("").etag == etag


def test_a_corrupt_edit_keeps_the_last_good_table_and_is_counted_once(path, rig):
    watcher, service = watcher_for(path, rig)
    write_doc(path, {"users": {"alice": 6}})
    assert watcher.poll() is True
    good = service.get_limits_table("")
    path.write_text('{"users": {"alice": ')
    assert watcher.poll() is False
    assert watcher.failures == 1
    assert "not valid" in watcher.last_error
    assert watcher.poll() is False
    assert watcher.failures == 1  # the same bad content is reported once
    write_doc(path, {"users": {"alice": 0}})
    assert watcher.poll() is False
    assert watcher.failures == 2
    assert f"users.alice: {RATE} 0" in watcher.last_error
    assert service.get_limits_table("") == good
    write_doc(path, {"users": {"alice": 8}})
    assert watcher.poll() is True
    assert rig.limiter.rate_of("alice") == 8


def test_a_deleted_file_keeps_the_table_and_is_recreated_by_the_next_change(path, rig):
    watcher, service = watcher_for(path, rig)
    path.unlink()
    assert watcher.poll() is False
    assert watcher.failures == 1
    assert rig.limiter.rate_of("alice") == 5
    service.update(USERS, "limits/alice", {"tokens_per_second": 6})
    assert pieces(ConfigFile(path).load()).user_rates == {"alice": 6}


def test_the_watcher_thread_picks_up_edits(path, rig):
    watcher, _ = watcher_for(path, rig, interval_s=0.02)
    watcher.start()
    try:
        write_doc(path, {"users": {"alice": 42}})
        deadline = time.monotonic() + 5
        while rig.limiter.rate_of("alice") != 42 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watcher.stop()
    assert rig.limiter.rate_of("alice") == 42


def test_merge_lets_the_file_win():
    merged = merge(FLAGS, Document(table(None, {"both": 5})))
    assert merged.policy == table(10, {"flag-only": 1, "both": 5})


def test_merge_adds_the_files_tiers_memberships_and_exemptions_to_the_flags():
    flags = table(
        10,
        {"a": 1},
        tier_rates={"free": 2},
        memberships={"b": "free"},
        exempt_users=frozenset({"c"}),
        mode=Mode.ENFORCE,
    )
    file = table(
        None,
        tier_rates={"free": 3, "pro": 30},
        exempt_tiers=frozenset({"staff"}),
        memberships={"b": "pro", "d": "staff"},
        exempt_users=frozenset({"e"}),
        mode=Mode.SHADOW,
    )
    assert merge(flags, Document(file)).policy == table(
        10,
        {"a": 1},
        tier_rates={"free": 3, "pro": 30},
        exempt_tiers=frozenset({"staff"}),
        memberships={"b": "pro", "d": "staff"},
        exempt_users=frozenset({"c", "e"}),
        mode=Mode.SHADOW,
    )


# -- tiers, memberships, exemptions ----------------------------------------------

TIERED = {
    "tiers": {"free": {"tokens_per_second": 2}, "staff": {"exempt": True}},
    "users": {"alice": 5},
    "memberships": {"bob": "free", "carol": "staff"},
    "exempt_users": ["ops"],
}


def test_tiers_memberships_and_exemptions_round_trip_through_the_file(path, rig):
    service, _ = started(path, rig)
    with serving(service) as served:
        served.stub.CreateTier(
            pb.CreateTierRequest(tier_id="free", tier=pb.Tier(tokens_per_second=2))
        )
        served.stub.CreateTier(
            pb.CreateTierRequest(tier_id="staff", tier=pb.Tier(exempt=True))
        )
        for user, fields in [
            ("bob", {"tier": "tiers/free"}),
            ("carol", {"tier": "tiers/staff"}),
            ("ops", {"exempt": True}),
        ]:
            served.stub.CreateLimit(
                pb.CreateLimitRequest(limit_id=user, limit=pb.Limit(**fields))
            )
    expected = table(
        10,
        {"alice": 5},
        tier_rates={"free": 2},
        exempt_tiers=frozenset({"staff"}),
        memberships={"bob": "free", "carol": "staff"},
        exempt_users=frozenset({"ops"}),
        mode=Mode.ENFORCE,
        fair_share=False,
    )
    assert ConfigFile(path).load().policy == expected
    # A new engine process, started from the same flags: the file restores all.
    second = make_rig(10, {"alice": 5})
    started(path, second)
    limiter = second.limiter
    assert (limiter.tier_rates, limiter.exempt_tiers) == ({"free": 2}, {"staff"})
    assert limiter.memberships == {"bob": "free", "carol": "staff"}
    assert limiter.exempt_users == {"ops"}
    assert [limiter.rate_of(u) for u in ("alice", "bob", "carol", "ops")] == [
        5,
        2,
        0,
        0,
    ]


def test_an_edit_adding_tiers_members_and_exemptions_is_applied(path, rig):
    watcher, service = watcher_for(path, rig)
    etag = service.get_limits_table("").etag
    write_doc(path, TIERED)
    assert watcher.poll() is True
    assert rig.limiter.rate_of("bob") == 2
    assert rig.limiter.rate_of("carol") == 0
    assert rig.limiter.rate_of("ops") == 0
    assert service.get_limits_table("").etag != etag
    assert service.get_user_state("userStates/bob").source.tier == "free"


def test_an_edit_removing_a_tier_with_its_members_is_applied(path, rig):
    watcher, _ = watcher_for(path, rig)
    write_doc(path, TIERED)
    watcher.poll()
    write_doc(path, {**TIERED, "tiers": {"staff": {"exempt": True}}, "memberships": {}})
    assert watcher.poll() is True
    assert rig.limiter.tier_rates == {}
    assert rig.limiter.memberships == {}
    assert rig.limiter.rate_of("bob") == 10


def test_an_edit_keeping_a_member_of_a_removed_tier_is_refused(path, rig):
    watcher, _ = watcher_for(path, rig)
    write_doc(path, TIERED)
    watcher.poll()
    write_doc(path, {**TIERED, "tiers": {"staff": {"exempt": True}}})
    assert watcher.poll() is False
    assert "memberships.bob: unknown tier 'free'" in watcher.last_error
    assert rig.limiter.rate_of("bob") == 2  # the last good table stays


def test_a_written_file_lists_every_section_for_operators_to_fill(path, rig):
    service, _ = started(path, rig)
    service.update_default("", {"tokens_per_second": 11})
    text = path.read_text()
    assert yaml.safe_load(text) == {  # JSON is YAML, too
        "mode": "enforce",
        "fair_share": False,
        "default_tokens_per_second": 11,
        "tiers": {},
        "users": {"alice": 5},
        "memberships": {},
        "exempt_users": [],
        "weights": {"users": {}, "tiers": {}},
    }
    if path.suffix == ".yaml":
        assert text.startswith("# Per-user output-token limits")


# -- restart ---------------------------------------------------------------------


def test_limits_survive_a_restart(path):
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    first = make_rig(10, {"alice": 5})
    plane = serve(first.shared, settings)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{plane.port}")
        stub = output_rate_pb2_grpc.OutputRateControlStub(channel)
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/bob", tokens_per_second=77),
                allow_missing=True,
            )
        )
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(tokens_per_second=25)
            )
        )
        channel.close()
    finally:
        plane.stop(0)
    # A new engine process: the limiter is built from the same flags again.
    second = make_rig(10, {"alice": 5})
    plane = serve(second.shared, settings)
    try:
        assert second.limiter.rate_of("bob") == 77
        assert second.limiter.default_rate == 25
        assert second.limiter.rate_of("alice") == 5
        # TATs start afresh: bob may burst again.
        assert second.limiter.lead_ns("bob", second.clock()) == 0
    finally:
        plane.stop(0)
