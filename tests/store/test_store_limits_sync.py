"""Limits are global (``store.limits_sync``): several engines in one process,
each a real shared limiter, control-plane service and gRPC server, synced
through a real ``redis-server`` on loopback. A change through one engine's
control plane reaches the others (debt kept), concurrent writers are told to
retry, the first engine seeds the table, a lost message is made good, and a
store that does not answer refuses changes while reads go on."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis
from google.protobuf.field_mask_pb2 import FieldMask

from control.errors import Unavailable
from control.persistence import ConfigFile
from control.runner import serve
from control.service.operations import LimitsService
from pacing import global_limits
from pacing.limiter import OutputRateLimiter
from pacing.limits import LimitTable
from pacing.modes import Mode
from pacing.policy.model import Policy
from pacing.settings.model import ControlSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.clients import connect
from store.limits_sync import LimitsSync
from store.limits_table import encode
from store.redis_store import KeySpace, RedisStore
from tests.control_harness import Rig, Served, make_rig, serving
from tests.store_harness import stored_table
from tools.redis_server import redis_server

#: The issue's bound for a change to reach every engine.
SPREAD_S = 1.0
#: How long a test waits for what must happen eventually (the periodic read,
#: recovery after an outage); generous, as this machine is shared.
EVENTUALLY_S = 20.0
#: A period long enough that only pub/sub can deliver within a test.
NEVER_S = 3600.0
#: Socket timeouts of engines whose timeouts are not what a test is about.
PATIENT_S = 5.0
KEYS = KeySpace()


@dataclass
class Engine:
    rig: Rig
    service: LimitsService
    sync: LimitsSync
    served: Served

    @property
    def limiter(self) -> OutputRateLimiter:
        return self.rig.limiter

    @property
    def stub(self):
        return self.served.stub


@pytest.fixture
def client(redis_url) -> Iterator[redis.Redis]:
    """The test's own connection to an empty database."""
    real = connect(redis_url, timeout_s=PATIENT_S)
    real.flushdb()
    yield real
    real.close()


@contextlib.contextmanager
def engine(
    url: str,
    *,
    default_rate: int = 10,
    user_rates: dict[str, int] | None = None,
    mode: Mode = Mode.ENFORCE,
    period_s: float = NEVER_S,
    timeout_s: float = PATIENT_S,
    start: bool = True,
) -> Iterator[Engine]:
    """One engine: shared limiter, control plane on a real gRPC server, sync."""
    rig = make_rig(default_rate, user_rates)
    rig.shared.mode = mode
    service = LimitsService(rig.shared, global_store=True)
    store_client = connect(url, timeout_s=timeout_s)
    sync = LimitsSync(RedisStore(store_client), rig.shared, period_s=period_s)
    if start:
        sync.start()
    try:
        with serving(service) as served:
            yield Engine(rig, service, sync, served)
    finally:
        sync.stop()
        store_client.close()


@contextlib.contextmanager
def fleet(url: str, count: int, **kwargs) -> Iterator[list[Engine]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(engine(url, **kwargs)) for _ in range(count)]


def wait_for(condition: Callable[[], bool], deadline_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``deadline_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > deadline_s:
            pytest.fail(f"not within {deadline_s} s")
        time.sleep(0.002)
    return time.monotonic() - start


def stored(client: redis.Redis) -> tuple[int, Policy]:
    """The stored table's version counter and table."""
    got = RedisStore(client).read_limits()
    assert got is not None
    return got[0].counter, got[1]


def counter_of(target: Engine) -> int | None:
    """The counter of the version ``target`` applied (``None``: none yet)."""
    version = target.sync.version
    return None if version is None else version.counter


def write_unannounced(client: redis.Redis, limits: Policy) -> int:
    """Another engine's write whose pub/sub message was lost: the next version
    and its document, published to nobody."""
    version = int(client.hget(KEYS.limits, "version")) + 1
    client.hset(KEYS.limits, mapping={"version": version, "document": encode(limits)})
    return version


def error_of(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value


def set_default(target: Engine, rate: int) -> pb.DefaultLimit:
    return target.stub.UpdateDefaultLimit(
        pb.UpdateDefaultLimitRequest(
            default_limit=pb.DefaultLimit(tokens_per_second=rate)
        )
    )


def table_etag(target: Engine) -> str:
    return target.stub.GetLimitsTable(pb.GetLimitsTableRequest()).etag


# -- seeding -----------------------------------------------------------------


def test_the_first_engine_seeds_the_store_and_the_next_takes_its_table(
    redis_url, client
):
    with engine(redis_url, user_rates={"alice": 5}, mode=Mode.SHADOW) as first:
        version, limits = stored(client)
        assert (version, counter_of(first), first.sync.applied) == (1, 1, 0)
        assert limits.default_rate == 10
        assert limits.limit_table().user_rates == {"alice": 5}
        assert limits.mode is Mode.SHADOW
        with engine(redis_url, default_rate=20, user_rates={"bob": 7}) as second:
            assert counter_of(second) == 1
            assert second.sync.applied == 1
            assert second.limiter.default_rate == 10
            assert second.limiter.user_rates == {"alice": 5}
            assert second.rig.shared.mode is Mode.SHADOW
            assert stored(client)[0] == 1  # nothing written over


@pytest.mark.parametrize("round_", range(5))
def test_engines_starting_together_seed_exactly_once(redis_url, client, round_):
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(
                engine(
                    redis_url,
                    default_rate=10 + i,
                    user_rates={f"u{i}": 1 + i},
                    start=False,
                )
            )
            for i in range(3)
        ]
        barrier = threading.Barrier(len(engines))

        def start(target: Engine) -> None:
            barrier.wait()
            target.sync.start()

        threads = [threading.Thread(target=start, args=(e,)) for e in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        version, limits = stored(client)
        assert version == 1
        seeders = [e for e in engines if e.sync.applied == 0]
        assert len(seeders) == 1
        assert limits.default_rate == seeders[0].limiter.default_rate
        for each in engines:
            assert counter_of(each) == 1
            assert each.limiter.default_rate == limits.default_rate
            assert each.limiter.user_rates == limits.limit_table().user_rates


# -- changes spread ----------------------------------------------------------


def test_a_change_through_one_engine_reaches_the_others_within_a_second(
    redis_url, client
):
    with fleet(redis_url, 3) as engines:
        first, *others = engines
        # Alice runs ahead of her budget on engines 2 and 3; twins of their
        # limiters say what a local change would leave her.
        twins = []
        for each in others:
            each.rig.step("alice", 4)
            twin = OutputRateLimiter(10, {})
            for _ in range(4):
                twin.try_take("alice", each.rig.clock())
            twins.append(twin)
            assert each.limiter.lead_ns("alice", each.rig.clock()) > 0
        etags = [table_etag(each) for each in others]
        changes = [each.limiter.limit_changes for each in others]
        wakes = [len(each.rig.wakes) for each in others]

        sent = time.monotonic()
        first.stub.CreateLimit(
            pb.CreateLimitRequest(limit_id="alice", limit=pb.Limit(tokens_per_second=5))
        )
        wait_for(lambda: all(e.limiter.rate_of("alice") == 5 for e in others), SPREAD_S)
        latency = time.monotonic() - sent
        print(f"a change reached 2 other engines in {latency * 1000:.1f} ms")

        assert stored(client)[0] == 2
        for each, twin, etag, before, woken in zip(
            others, twins, etags, changes, wakes, strict=True
        ):
            now = each.rig.clock()
            twin.set_rate("alice", 5, now)
            assert each.limiter.lead_ns("alice", now) == twin.lead_ns("alice", now)
            assert each.limiter.limit_changes == before + 1
            assert len(each.rig.wakes) == woken + 1
            assert counter_of(each) == 2
            assert table_etag(each) != etag  # the table etag moves with it
            got = each.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
            assert got.tokens_per_second == 5


def test_the_pacing_mode_is_global_and_leaves_the_table_alone(redis_url, client):
    with fleet(redis_url, 3) as engines:
        etags = [table_etag(each) for each in engines]
        changes = [each.limiter.limit_changes for each in engines]
        engines[1].stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(
                pacing_mode=pb.PacingMode(mode=pb.PacingMode.OFF)
            )
        )
        wait_for(lambda: all(e.rig.shared.mode is Mode.OFF for e in engines), SPREAD_S)
        assert stored(client)[1].mode is Mode.OFF
        for each, etag, before in zip(engines, etags, changes, strict=True):
            assert each.limiter.limit_changes == before
            assert table_etag(each) == etag
            state = each.stub.GetPacingMode(pb.GetPacingModeRequest())
            assert state.mode == pb.PacingMode.OFF


def test_weights_and_the_fair_share_switch_reach_every_engine(redis_url, client):
    """The policy is global (one switch, one set of weights); the counters stay
    each engine's. An engine that cannot run fair share keeps it off."""
    with fleet(redis_url, 3) as engines:
        first, second, refusing = engines
        refusing.rig.shared.fair_share.refusal = "not under priority scheduling"
        second.rig.shared.fair_share.counter["alice"] = 77.0
        etag = table_etag(second)
        first.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", weight=3.0), allow_missing=True
            )
        )
        first.stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(pacing_mode=pb.PacingMode(fair_share=True))
        )
        wait_for(
            lambda: all(
                e.rig.shared.fair_share.weights.users == {"alice": 3.0} for e in engines
            ),
            SPREAD_S,
        )
        wait_for(lambda: second.rig.shared.fair_share.enabled, SPREAD_S)
        wait_for(lambda: refusing.sync.version == second.sync.version, SPREAD_S)
        limits = stored(client)[1]
        share = limits.share_policy()
        assert (limits.fair_share, share.enabled, dict(share.users)) == (
            True,
            True,
            {"alice": 3.0},
        )
        assert table_etag(second) != etag  # a weight is a change of the table
        assert second.rig.shared.fair_share.counter == {"alice": 77.0}
        assert refusing.rig.shared.fair_share.enabled is False
        limit = second.stub.GetLimit(pb.GetLimitRequest(name="limits/alice"))
        assert limit.weight == 3.0


def test_teams_their_members_and_weights_reach_every_engine(redis_url, client):
    """Teams travel with the limits table: a team created, weighed and joined
    through one engine is every engine's, and stored in the document."""
    with fleet(redis_url, 3) as engines:
        first, *others = engines
        first.stub.CreateTeam(
            pb.CreateTeamRequest(
                team_id="acme", team=pb.Team(tokens_per_second=60, weight=2.0)
            )
        )
        first.stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", team="teams/acme"),
                update_mask=FieldMask(paths=["team"]),
                allow_missing=True,
            )
        )
        wait_for(
            lambda: all(
                e.rig.shared.teams.table.memberships == {"alice": "acme"}
                for e in engines
            ),
            SPREAD_S,
        )
        for target in others:
            assert target.rig.shared.teams.table.rates == {"acme": 60}
            assert target.rig.shared.fair_share.weights.teams == {"acme": 2.0}
        limits = stored(client)[1]
        assert limits.team_table().rates == {"acme": 60}
        assert limits.team_table().memberships == {"alice": "acme"}
        assert dict(limits.share_policy().teams) == {"acme": 2.0}


def test_a_change_of_team_weights_alone_moves_the_table_and_is_counted(
    redis_url, client
):
    """A team's weight is part of the table: an engine that applies another's
    change of it alone moves its table etag and counts (and logs) the version,
    as for user and tier weights."""
    with fleet(redis_url, 2) as (first, second):
        first.stub.CreateTeam(
            pb.CreateTeamRequest(
                team_id="acme", team=pb.Team(tokens_per_second=60, weight=2.0)
            )
        )
        wait_for(lambda: second.rig.shared.fair_share.weights.teams, SPREAD_S)
        etag, applied = table_etag(second), second.sync.applied
        first.stub.UpdateTeam(
            pb.UpdateTeamRequest(
                team=pb.Team(name="teams/acme", weight=5.0),
                update_mask=FieldMask(paths=["weight"]),
            )
        )
        wait_for(
            lambda: second.rig.shared.fair_share.weights.teams == {"acme": 5.0},
            SPREAD_S,
        )
        assert table_etag(second) != etag
        assert second.sync.applied == applied + 1


def test_a_table_without_a_default_keeps_the_engines_and_is_no_change(
    redis_url, client
):
    """The limiter cannot drop its default (pacing off): a stored table without
    one, otherwise the table in force, is applied without moving the table etag
    or being counted."""
    with engine(redis_url, user_rates={"alice": 5}, period_s=0.05) as one:
        etag, applied = table_etag(one), one.sync.applied
        table = stored_table(None, LimitTable({"alice": 5}))
        version = write_unannounced(client, table)
        wait_for(lambda: counter_of(one) == version, EVENTUALLY_S)
        assert one.limiter.default_rate == 10
        assert table_etag(one) == etag
        assert one.sync.applied == applied


def test_a_lost_message_is_made_good_by_the_periodic_read(redis_url, client):
    with fleet(redis_url, 2, period_s=0.2) as engines:
        version = write_unannounced(client, stored_table(33, LimitTable({"bob": 3})))
        took = wait_for(
            lambda: all(counter_of(e) == version for e in engines), EVENTUALLY_S
        )
        print(f"an unannounced version was applied after {took * 1000:.0f} ms")
        for each in engines:
            assert each.limiter.default_rate == 33
            assert each.limiter.user_rates == {"bob": 3}


def test_a_bad_document_is_ignored_and_the_table_in_force_stays(
    redis_url, client, caplog
):
    with engine(redis_url, user_rates={"alice": 5}, period_s=0.05) as one:
        client.hset(KEYS.limits, mapping={"version": 2, "document": '{"mode": 1}'})
        client.publish(KEYS.limits_channel, 2)
        wait_for(lambda: "ignored limits table version 2" in caplog.text, EVENTUALLY_S)
        assert counter_of(one) == 1
        assert one.limiter.user_rates == {"alice": 5}
        assert caplog.text.count("ignored limits table version 2") == 1
        # A good version later still lands: the thread survived the bad one.
        good = write_unannounced(client, stored_table(12))
        wait_for(lambda: counter_of(one) == good, EVENTUALLY_S)
        assert one.limiter.default_rate == 12
        assert one.limiter.user_rates == {}


# -- concurrent writers ------------------------------------------------------


def test_a_change_from_a_stale_version_is_aborted_and_the_newer_table_applied(
    redis_url, client
):
    with fleet(redis_url, 2) as (first, second):
        version = write_unannounced(client, stored_table(42))
        error = error_of(
            first.stub.UpdateDefaultLimit,
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(tokens_per_second=20)
            ),
        )
        assert error.code() == grpc.StatusCode.ABORTED
        assert "changed through another engine" in error.details()
        assert "retry" in error.details()
        # The newer table is applied here, and nothing was written.
        assert first.limiter.default_rate == 42
        assert counter_of(first) == version
        assert stored(client)[0] == version
        # The retry wins and spreads.
        assert set_default(first, 20).tokens_per_second == 20
        wait_for(lambda: second.limiter.default_rate == 20, SPREAD_S)
        assert stored(client)[0] == version + 1


def test_an_etag_read_before_another_engines_change_no_longer_matches(
    redis_url, client
):
    with fleet(redis_url, 2) as (first, second):
        stale = table_etag(second)
        set_default(first, 25)
        wait_for(lambda: second.limiter.default_rate == 25, SPREAD_S)
        error = error_of(
            second.stub.ReplaceLimitsTable,
            pb.ReplaceLimitsTableRequest(
                limits_table=pb.LimitsTable(default_tokens_per_second=99, etag=stale)
            ),
        )
        assert error.code() == grpc.StatusCode.ABORTED
        assert second.limiter.default_rate == 25
        assert stored(client)[1].default_rate == 25


def test_concurrent_writers_one_version_per_success_and_engines_agree(
    redis_url, client
):
    rounds = 20
    outcomes: list[tuple[int, grpc.StatusCode]] = []
    with fleet(redis_url, 2) as engines:
        for round_ in range(rounds):
            barrier = threading.Barrier(len(engines))
            lock = threading.Lock()

            def write(
                target: Engine,
                rate: int,
                barrier: threading.Barrier = barrier,
                lock: threading.Lock = lock,
            ) -> None:
                barrier.wait()
                try:
                    set_default(target, rate)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                with lock:
                    outcomes.append((rate, code))

            threads = [
                threading.Thread(target=write, args=(e, 100 + 2 * round_ + i))
                for i, e in enumerate(engines)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        codes = [code for _, code in outcomes]
        won = codes.count(grpc.StatusCode.OK)
        print(f"{won} writes won, {codes.count(grpc.StatusCode.ABORTED)} aborted")
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}
        assert won >= rounds  # at least one writer per round
        version, limits = stored(client)
        assert version == 1 + won  # the seed, then one version per success
        assert limits.default_rate in {
            rate for rate, code in outcomes if code == grpc.StatusCode.OK
        }
        wait_for(
            lambda: all(e.limiter.default_rate == limits.default_rate for e in engines),
            SPREAD_S,
        )


# -- the store does not answer ------------------------------------------------


@contextlib.contextmanager
def stopped(client: redis.Redis) -> Iterator[None]:
    """``redis-server`` stopped with SIGSTOP: connections stay open, nothing
    answers (every call times out)."""
    pid = int(client.info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_with_the_store_down_changes_are_refused_and_reads_served():
    with redis_server() as url:
        watcher = connect(url, timeout_s=PATIENT_S)
        with fleet(url, 2, timeout_s=0.05, period_s=0.2) as (first, second):
            first.rig.step("alice")
            with stopped(watcher):
                error = error_of(
                    first.stub.UpdateDefaultLimit,
                    pb.UpdateDefaultLimitRequest(
                        default_limit=pb.DefaultLimit(tokens_per_second=50)
                    ),
                )
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert "limits store did not take it" in error.details()
                assert first.limiter.default_rate == 10  # nothing applied here
                assert set_default_fails(second)
                got = first.stub.GetLimitsTable(pb.GetLimitsTableRequest())
                assert got.default_tokens_per_second == 10
                state = first.stub.GetUserState(
                    pb.GetUserStateRequest(name="userStates/alice")
                )
                assert state.limit_tokens_per_second == 10
            # Back: a change goes through again and reaches the other engine.
            wait_for(lambda: set_default_succeeds(first, 50), EVENTUALLY_S)
            wait_for(lambda: second.limiter.default_rate == 50, EVENTUALLY_S)
        watcher.close()


def set_default_fails(target: Engine) -> bool:
    try:
        set_default(target, 60)
    except grpc.RpcError as error:
        return error.code() == grpc.StatusCode.UNAVAILABLE
    return False


def set_default_succeeds(target: Engine, rate: int) -> bool:
    try:
        return set_default(target, rate).tokens_per_second == rate
    except grpc.RpcError as error:
        # ABORTED too: a write that timed out while Redis was stopped may still
        # land once it runs again (docs/operating/scale-out.md), moving the version
        # past this engine's; the engine applies that table and the caller retries.
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        return False


def test_an_engine_started_while_the_store_is_down_refuses_changes_until_it_reads():
    with redis_server() as url:
        watcher = connect(url, timeout_s=PATIENT_S)
        with engine(url, timeout_s=0.05, period_s=0.2, start=False) as one:
            with stopped(watcher):
                one.sync.start()
                assert counter_of(one) is None
                assert set_default_fails(one)
                assert one.limiter.default_rate == 10
            wait_for(lambda: counter_of(one) == 1, EVENTUALLY_S)
            assert set_default_succeeds(one, 30)
            assert stored(watcher)[1].default_rate == 30
        watcher.close()


# -- the runner --------------------------------------------------------------


def test_with_a_store_the_config_file_seeds_is_not_watched_and_keeps_each_version(
    redis_url, client, tmp_path
):
    path = tmp_path / "limits.yaml"
    path.write_text("default_tokens_per_second: 7\nusers: {alice: 3}\n")
    rig = make_rig(10)
    settings = ControlSettings(address="127.0.0.1:0", config_path=str(path))
    plane = serve(rig.shared, settings, global_store=True)
    try:
        assert plane.watcher is None
        # No store connected yet: refused, not applied here alone.
        with pytest.raises(Unavailable, match="not connected yet"):
            plane.service.update_default("defaultLimit", {"tokens_per_second": 9})
        assert rig.limiter.default_rate == 7
        sync = LimitsSync(RedisStore(client), rig.shared, period_s=NEVER_S)
        sync.start()
        try:
            assert stored(client)[1].limit_table().user_rates == {"alice": 3}
            plane.service.update_default("defaultLimit", {"tokens_per_second": 9})
            assert stored(client)[1].default_rate == 9
            assert rig.limiter.default_rate == 9
        finally:
            sync.stop()
        assert global_limits.hub(rig.shared).backend is None
        saved = ConfigFile(path).load()
        assert saved is not None
        policy = saved.policy
        assert (policy.default_rate, policy.limit_table().user_rates) == (
            9,
            {"alice": 3},
        )
        assert saved.store_version == sync.version
    finally:
        plane.stop(0)
