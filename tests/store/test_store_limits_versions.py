"""Versions of the limits table that are never reused, and documents from
Redis checked like any other input (issue 29, items 4 and 6), on a real
``redis-server``: a store that lost its data (FLUSHALL) or rolled writes back
(a failover) never makes an engine skip a new table or overwrite another
engine's change, and a malformed document is refused with one log line."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from pacing import global_limits
from pacing.table_caps import MAX_EXPLICIT_LIMITS, MAX_TIERS
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.limits_table import encode
from tests.store import test_store_limits_sync as sync_tests
from tests.store.test_store_limits_sync import (
    EVENTUALLY_S,
    KEYS,
    SPREAD_S,
    counter_of,
    engine,
    error_of,
    set_default,
    stored,
    wait_for,
)
from tests.store_harness import stored_table

client = sync_tests.client
#: Passes of a 0.05 s sync period after a refusal, in which no second line may come.
QUIET_S = 0.3


def test_after_a_flushall_a_new_table_at_an_old_counter_is_applied(redis_url, client):
    with engine(redis_url, default_rate=10, start=False) as a:
        a.sync.sync()  # seeds version 1
        global_limits.hub(a.rig.shared).set_backend(a.sync)  # no thread
        set_default(a, 20)
        assert counter_of(a) == 2
        client.flushall()
        with engine(redis_url, default_rate=77) as b:  # seeds, then changes
            set_default(b, 55)
            assert counter_of(b) == 2  # the counter A holds, another write
            assert a.sync.sync() is True
            assert a.limiter.default_rate == 55
            assert a.sync.version == b.sync.version


def test_after_a_flushall_a_write_from_the_old_version_is_refused(redis_url, client):
    with engine(redis_url, default_rate=10, start=False) as a:
        a.sync.sync()
        global_limits.hub(a.rig.shared).set_backend(a.sync)  # no thread
        set_default(a, 20)
        client.flushall()
        with engine(redis_url, default_rate=77) as b:
            set_default(b, 55)
            error = error_of(
                a.stub.UpdateDefaultLimit,
                pb.UpdateDefaultLimitRequest(
                    default_limit=pb.DefaultLimit(tokens_per_second=99)
                ),
            )
            assert error.code() == grpc.StatusCode.ABORTED
            assert stored(client)[1].default_rate == 55  # B's change stands
            assert a.limiter.default_rate == 55  # and A applied it
            wait_for(lambda: b.limiter.default_rate == 55, SPREAD_S)


def test_a_store_that_went_back_gets_the_newest_table_again(redis_url, client, caplog):
    """A failover that lost the last write: the engines hold a newer version
    than the store; one writes its table back, past the counter it held, and
    every engine ends on it (one warning line per write-back)."""
    with engine(redis_url, default_rate=10) as a, engine(redis_url) as b:
        set_default(a, 20)
        wait_for(lambda: b.sync.version == a.sync.version, SPREAD_S)
        older = client.hgetall(KEYS.limits)
        set_default(a, 30)
        wait_for(lambda: b.sync.version == a.sync.version, SPREAD_S)
        assert counter_of(a) == 3
        client.hset(KEYS.limits, mapping=older)  # the rolled-back store
        client.publish(KEYS.limits_channel, older[b"version"])
        wait_for(lambda: stored(client)[0] == 4, EVENTUALLY_S)
        wait_for(
            lambda: a.sync.version == b.sync.version and counter_of(a) == 4,
            EVENTUALLY_S,
        )
        assert stored(client)[1].default_rate == 30
        assert (a.limiter.default_rate, b.limiter.default_rate) == (30, 30)
        assert caplog.text.count("the limits table went back from version 3") == 1


def test_a_store_left_without_a_table_is_seeded_from_the_table_in_force(
    redis_url, client
):
    with engine(redis_url, default_rate=10, period_s=0.05) as a:
        set_default(a, 20)
        held = a.sync.version
        client.flushall()
        wait_for(lambda: stored_or_none(client) is not None, EVENTUALLY_S)
        assert stored(client)[1].default_rate == 20
        # The engine takes the seed's version once its write has returned,
        # after the document is in the store: wait for that, not the document.
        wait_for(lambda: a.sync.version != held, EVENTUALLY_S)
        assert a.sync.version is not None and held is not None
        assert a.sync.version.counter == held.counter  # a seed, not a newer table


def stored_or_none(client):
    return client.hget(KEYS.limits, "document")


# -- documents from Redis are checked like any other input (item 6) --------


def _with(**fields) -> str:
    raw = json.loads(encode(stored_table(12)))
    raw.update(fields)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (
            _with(tier_rates={f"t{i}": 5 for i in range(MAX_TIERS + 1)}),
            f"at most {MAX_TIERS} tiers",
        ),
        (
            _with(
                weights={
                    "users": {f"u{i}": 1 for i in range(MAX_EXPLICIT_LIMITS + 1)},
                    "tiers": {},
                }
            ),
            f"at most {MAX_EXPLICIT_LIMITS} users",
        ),
        (
            _with(memberships={"bob": "a\u200bb"}),
            "memberships.bob: tier id must not contain",
        ),
    ],
    ids=["too-many-tiers", "too-many-users", "bad-tier-id"],
)
def test_a_document_breaking_the_tables_rules_is_refused_once_and_the_table_stays(
    redis_url, client, caplog, document, reason
):
    with engine(redis_url, user_rates={"alice": 5}, period_s=0.05) as one:
        before = one.sync.version
        client.hset(KEYS.limits, mapping={"version": 2, "document": document})
        client.publish(KEYS.limits_channel, 2)
        wait_for(lambda: "ignored limits table version 2" in caplog.text, EVENTUALLY_S)
        time.sleep(QUIET_S)
        refusals = [r for r in caplog.records if "ignored limits table" in r.message]
        assert len(refusals) == 1
        assert reason in refusals[0].message
        assert one.sync.version == before
        assert one.limiter.user_rates == {"alice": 5}
        assert one.limiter.tier_rates == {}
        assert dict(one.rig.shared.fair_share.weights.users) == {}
