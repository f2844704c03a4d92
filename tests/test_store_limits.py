"""The limits table in the store (``store.limits_table``): the document's
encoding and its checks, and the versioned, published writes, on ``fakeredis``
and on a real ``redis-server``."""

from __future__ import annotations

import json
import re

import pytest

from pacing.fair_share_policy import SharePolicy
from pacing.limits import LimitTable
from pacing.modes import Mode
from store.limits_table import Limits, decode, encode
from store.redis_store import RedisStore, StaleLimits
from tests import store_harness

client = store_harness.client_or_cluster
local_cluster = store_harness.local_cluster
redis_url = store_harness.redis_url


def full_table() -> Limits:
    return Limits(
        30,
        LimitTable(
            user_rates={"alice": 10, "ünï": 7},
            tier_rates={"pro": 200},
            memberships={"bob": "pro", "carol": "vip"},
            exempt_users={"ops"},
            exempt_tiers={"vip"},
        ),
    )


def same(a: Limits, b: Limits) -> bool:
    return encode(a) == encode(b)


def test_a_document_decodes_to_the_table_it_encodes():
    limits = full_table()
    back = decode(encode(limits))
    assert back.default_rate == 30
    assert back.table.user_rates == {"alice": 10, "ünï": 7}
    assert back.table.memberships == {"bob": "pro", "carol": "vip"}
    assert back.table.exempt_users == {"ops"}
    assert back.table.exempt_tiers == {"vip"}
    assert back.table.overrides == limits.table.overrides


def test_the_mode_is_part_of_the_document():
    limits = Limits(30, LimitTable(), Mode.SHADOW)
    assert json.loads(encode(limits))["mode"] == "shadow"
    assert decode(encode(limits)).mode is Mode.SHADOW
    assert decode(encode(Limits(30, LimitTable()))).mode is Mode.ENFORCE


def test_the_fair_share_policy_travels_only_when_it_holds_something():
    plain = json.loads(encode(full_table()))
    assert "fair_share" not in plain and "weights" not in plain
    assert decode(encode(full_table())).share == SharePolicy()
    limits = Limits(
        30,
        full_table().table,
        share=SharePolicy(True, {"alice": 2.5}, {"pro": 4.0}),
    )
    back = decode(encode(limits))
    assert back.share == SharePolicy(True, {"alice": 2.5}, {"pro": 4.0})


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"fair_share": "yes"}, "fair_share must be true or false"),
        ({"weights": {"groups": {}}}, "weights must be {users, tiers}"),
        ({"weights": {"users": []}}, "users and tiers must be objects"),
        ({"weights": {"users": {"alice": 0}}}, "must be in (0, 1e+06]"),
        ({"weights": {"tiers": {"gold": 2}}}, "weight of unknown tier 'gold'"),
        ({"weights": {"users": {"a\x01": 2}}}, "weighted user id"),
    ],
)
def test_a_bad_fair_share_policy_is_refused(policy, message):
    document = {**json.loads(encode(full_table())), **policy}
    with pytest.raises(ValueError, match=re.escape(message)):
        decode(json.dumps(document))


def test_pacing_off_is_a_null_default():
    assert decode(encode(Limits(None, LimitTable()))).default_rate is None


def document(**changes: object) -> str:
    raw = json.loads(encode(full_table()))
    raw.update(changes)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[", "limits document is not JSON: "),
        ("[]", "limits document must be a JSON object"),
        (
            json.dumps({"default_rate": 1, "extra": 2}),
            "limits document: missing fields ['user_rates', 'tier_rates', "
            "'memberships', 'exempt_users', 'exempt_tiers', 'mode'], unknown "
            "fields ['extra']",
        ),
        (document(default_rate=0), "default_rate must be between 1 and 1000000"),
        (document(user_rates=[]), "limits document: user_rates must be a JSON object"),
        (
            document(exempt_users={}),
            "limits document: exempt_users must be a JSON array",
        ),
        (document(user_rates={"alice": "10"}), "rate of user 'alice' must be"),
        (
            document(memberships={"bob": "gold"}),
            "user 'bob' is a member of tier 'gold', which has neither",
        ),
        (
            document(exempt_users=["a\u200bb"]),
            "limits document: a user id must not contain invisible format",
        ),
        (document(mode="loud"), "limits document: mode must be one of enforce"),
    ],
    ids=[
        "not-json",
        "not-object",
        "fields",
        "default",
        "user-rates-type",
        "exempt-type",
        "rate-type",
        "unknown-tier",
        "bad-user-id",
        "mode",
    ],
)
def test_a_bad_document_is_refused_by_name(text, message):
    with pytest.raises(ValueError) as error:
        decode(text)
    assert str(error.value).startswith(message)


def test_there_is_no_table_until_one_is_written(client):
    assert RedisStore(client).read_limits() is None


def test_each_write_bumps_the_version_and_is_read_back(client):
    store = RedisStore(client)
    assert store.write_limits(full_table(), None) == 1
    assert store.write_limits(Limits(5, LimitTable()), 1) == 2
    stored = store.read_limits()
    assert stored is not None
    version, limits = stored
    assert version == 2
    assert same(limits, Limits(5, LimitTable()))


def test_a_write_from_a_stale_version_is_refused_and_changes_nothing(client):
    store = RedisStore(client)
    store.write_limits(full_table(), None)
    store.write_limits(full_table(), 1)
    with pytest.raises(StaleLimits) as error:
        store.write_limits(Limits(5, LimitTable()), 1)
    assert error.value.current == 2
    stored = store.read_limits()
    assert stored is not None
    assert stored[0] == 2
    assert same(stored[1], full_table())


def test_a_write_publishes_its_version_to_every_subscriber(client):
    writer, reader = RedisStore(client), RedisStore(client)
    first, second = reader.subscribe_limits(), reader.subscribe_limits()
    try:
        version = writer.write_limits(full_table(), None)
        for subscription in (first, second):
            assert subscription.next_version(timeout_s=10) == version
        assert first.next_version(timeout_s=0.05) is None  # nothing more
    finally:
        first.close()
        second.close()


def test_a_refused_write_publishes_nothing(client):
    store = RedisStore(client)
    store.write_limits(full_table(), None)
    subscription = store.subscribe_limits()
    try:
        with pytest.raises(StaleLimits):
            store.write_limits(full_table(), 7)
        assert subscription.next_version(timeout_s=0.05) is None
    finally:
        subscription.close()
