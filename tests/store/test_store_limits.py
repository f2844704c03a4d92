"""The limits table in the store (``store.limits_table``): the document's
encoding (byte for byte what earlier versions wrote and read) and its checks,
and the versioned, published writes, on ``fakeredis`` and on a real
``redis-server``."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pacing.fair_share_policy import SharePolicy
from pacing.global_limits import LimitsVersion
from pacing.limits import LimitTable
from pacing.modes import Mode
from pacing.policy.model import Limits, Policy, User
from pacing.table_caps import MAX_EXPLICIT_LIMITS, MAX_TIERS
from pacing.teams import TeamTable
from store.limits_table import decode, encode
from store.redis_store import NO_TABLE, RedisStore, StaleLimits
from tests import store_harness
from tests.store_harness import stored_table

client = store_harness.client_or_cluster

#: The rate rule's words (pacing.limits.validate_rate).
RATE = "must be an integer in 1..1000000 (tokens per second)"


def full_table() -> Policy:
    return stored_table(
        30,
        LimitTable(
            user_rates={"alice": 10, "ünï": 7},
            tier_rates={"pro": 200},
            memberships={"bob": "pro", "carol": "vip"},
            exempt_users={"ops"},
            exempt_tiers={"vip"},
        ),
    )


def same(a: Policy, b: Policy) -> bool:
    return encode(a) == encode(b)


def test_a_document_decodes_to_the_table_it_encodes():
    limits = full_table()
    back = decode(encode(limits))
    assert back == limits
    table = back.limit_table()
    assert back.default_rate == 30
    assert table.user_rates == {"alice": 10, "ünï": 7}
    assert table.memberships == {"bob": "pro", "carol": "vip"}
    assert table.exempt_users == {"ops"}
    assert table.exempt_tiers == {"vip"}
    assert table.overrides == limits.limit_table().overrides


def test_the_mode_is_part_of_the_document():
    limits = stored_table(30, mode=Mode.SHADOW)
    assert json.loads(encode(limits))["mode"] == "shadow"
    assert decode(encode(limits)).mode is Mode.SHADOW
    assert decode(encode(stored_table(30))).mode is Mode.ENFORCE


def test_a_table_without_its_mode_or_switch_is_not_stored():
    for unsaid in ({"mode": None}, {"fair_share": None}):
        with pytest.raises(ValueError, match="says its mode and fair-share switch"):
            encode(dataclasses.replace(full_table(), **unsaid))


def test_the_fair_share_policy_travels_only_when_it_holds_something():
    plain = json.loads(encode(full_table()))
    assert "fair_share" not in plain and "weights" not in plain
    back = decode(encode(full_table()))
    assert back.fair_share is False
    assert back.share_policy() == SharePolicy()
    limits = stored_table(
        30,
        full_table().limit_table(),
        share=SharePolicy(True, {"alice": 2.5}, {"pro": 4.0}),
    )
    back = decode(encode(limits))
    assert back.fair_share is True
    assert back.share_policy() == SharePolicy(True, {"alice": 2.5}, {"pro": 4.0})


# -- the document, byte for byte ------------------------------------------------
# Engines of the previous version read the documents this one writes, and this
# one reads theirs: each document below is the string the previous version's
# code wrote for the table (computed with it, pasted here).

FULL = (
    '{"default_rate": 30, "exempt_tiers": ["vip"], "exempt_users": ["ops", "zed"], '
    '"fair_share": true, "memberships": {"alice": "free", "bob": "pro", '
    '"carol": "vip"}, "mode": "shadow", "team_members": {"alice": "acme", '
    '"erin": "beta"}, "team_rates": {"acme": 60, "beta": 9}, "tier_rates": '
    '{"free": 5, "pro": 200}, "user_rates": {"alice": 10, "ops": 4, "ünï": 7}, '
    '"weights": {"teams": {"acme": 0.5}, "tiers": {"pro": 4.0}, "users": '
    '{"alice": 2.5, "dan": 1.0}}}'
)
#: The plain document of ``DECODED``'s entries, with the mode each holds.
PLAIN = (
    '{"default_rate": 8, "exempt_tiers": [], "exempt_users": [], "memberships": '
    '{}, "mode": "%s", "tier_rates": {}, "user_rates": {}}'
)

GOLDEN: dict[str, tuple[Policy, str]] = {
    "bare": (
        stored_table(12),
        '{"default_rate": 12, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "enforce", "tier_rates": {}, "user_rates": {}}',
    ),
    "pacing-off": (
        stored_table(None, mode=Mode.OFF),
        '{"default_rate": null, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "off", "tier_rates": {}, "user_rates": {}}',
    ),
    "everything": (
        stored_table(
            30,
            LimitTable(
                user_rates={"alice": 10, "ünï": 7, "ops": 4},
                tier_rates={"pro": 200, "free": 5},
                memberships={"bob": "pro", "carol": "vip", "alice": "free"},
                exempt_users={"ops", "zed"},
                exempt_tiers={"vip"},
            ),
            Mode.SHADOW,
            SharePolicy(True, {"alice": 2.5, "dan": 1.0}, {"pro": 4.0}, {"acme": 0.5}),
            TeamTable({"acme": 60, "beta": 9}, {"alice": "acme", "erin": "beta"}),
        ),
        FULL,
    ),
    "weights-without-the-switch": (
        stored_table(
            7,
            LimitTable(tier_rates={"pro": 20}, memberships={"bob": "pro"}),
            share=SharePolicy(False, {"bob": 3.0}, {"pro": 2.0}),
        ),
        '{"default_rate": 7, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {"bob": "pro"}, "mode": "enforce", "tier_rates": '
        '{"pro": 20}, "user_rates": {}, "weights": {"tiers": {"pro": 2.0}, '
        '"users": {"bob": 3.0}}}',
    ),
    "the-switch-without-weights": (
        stored_table(5, LimitTable(user_rates={"a": 1}), share=SharePolicy(True)),
        '{"default_rate": 5, "exempt_tiers": [], "exempt_users": [], '
        '"fair_share": true, "memberships": {}, "mode": "enforce", "tier_rates": '
        '{}, "user_rates": {"a": 1}}',
    ),
    "teams-without-weights": (
        stored_table(5, mode=Mode.OFF, teams=TeamTable({"t": 3}, {"u": "t"})),
        '{"default_rate": 5, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "off", "team_members": {"u": "t"}, '
        '"team_rates": {"t": 3}, "tier_rates": {}, "user_rates": {}}',
    ),
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_a_table_is_stored_as_the_document_the_previous_version_wrote(name):
    table, document = GOLDEN[name]
    assert encode(table) == document
    assert decode(document) == table
    assert decode(document.encode()) == table  # as Redis answers: bytes


@pytest.mark.parametrize("name", list(GOLDEN))
def test_an_attribute_the_pieces_do_not_carry_travels_beside_them(name):
    """Stored as if the pieces carried no weights, every weight goes under
    ``attributes`` in the document's object form, and the same policy comes
    back: how an attribute without a piece of its own is carried."""
    table, _ = GOLDEN[name]
    document = encode(table, carried=("tokens_per_second", "exempt"))
    raw = json.loads(document)
    assert "weights" not in raw
    weights = table.share_policy()
    assert bool(weights.users or weights.tiers or weights.teams) == (
        "attributes" in raw
    )
    for user, weight in weights.users.items():
        assert raw["attributes"]["users"][user] == {"weight": weight}
    assert decode(document) == table


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ([], "limits document: attributes: must be"),
        ({"groups": {}}, "limits document: attributes.groups: unknown holders"),
        (
            {"users": {"a": {"weight": 0}}},
            "limits document: users.a.weight: must be a number in (0, 1e+06]",
        ),
        (
            {"users": {"a": {"tier": "nope"}}},
            "limits document: users.a.tier: unknown tier 'nope'",
        ),
    ],
    ids=["not-an-object", "unknown-holders", "bad-weight", "unknown-tier"],
)
def test_bad_attributes_beside_the_pieces_are_refused(attributes, message):
    document = json.loads(GOLDEN["bare"][1])
    document["attributes"] = attributes
    with pytest.raises(ValueError) as error:
        decode(json.dumps(document))
    assert str(error.value).startswith(message)


def test_an_attribute_given_as_a_piece_and_beside_it_is_refused():
    document = json.loads(GOLDEN["weights-without-the-switch"][1])
    document["attributes"] = {"users": {"bob": {"weight": 5.0}}}
    with pytest.raises(ValueError, match="bob"):
        decode(json.dumps(document))


def test_the_policy_value_is_stored_as_its_tables_are():
    """The policy written holder by holder is the one of the runtime tables
    (``stored_table``): the same value, the same document."""
    policy = Policy(
        mode=Mode.SHADOW,
        fair_share=True,
        default=Limits(30),
        groups={
            "tier": {
                "pro": Limits(200, weight=4.0),
                "free": Limits(5),
                "vip": Limits(exempt=True),
            },
            "team": {"acme": Limits(60, weight=0.5), "beta": Limits(9)},
        },
        users={
            "alice": User(Limits(10, weight=2.5), {"tier": "free", "team": "acme"}),
            "ünï": User(Limits(7)),
            "ops": User(Limits(4, exempt=True)),
            "zed": User(Limits(exempt=True)),
            "bob": User(groups={"tier": "pro"}),
            "carol": User(groups={"tier": "vip"}),
            "dan": User(Limits(weight=1.0)),
            "erin": User(groups={"team": "beta"}),
        },
    )
    assert policy == GOLDEN["everything"][0]
    assert encode(policy) == FULL


#: Documents the previous version decoded that it never wrote in this form,
#: each with the document of the table it decoded to (what it wrote back).
DECODED = {
    "null-mode": (
        json.dumps({**json.loads(PLAIN % "shadow"), "mode": None}),
        PLAIN % "enforce",
    ),
    "switch-off": (
        json.dumps({**json.loads(PLAIN % "shadow"), "fair_share": False}),
        PLAIN % "shadow",
    ),
    "empty-weights": (
        json.dumps({**json.loads(PLAIN % "shadow"), "weights": {}}),
        PLAIN % "shadow",
    ),
    "null-weights": (
        json.dumps({**json.loads(PLAIN % "shadow"), "weights": None}),
        PLAIN % "shadow",
    ),
    "empty-teams": (
        json.dumps(
            {**json.loads(PLAIN % "shadow"), "team_rates": {}, "team_members": {}}
        ),
        PLAIN % "shadow",
    ),
    "integer-weight": (
        '{"default_rate": 8, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "shadow", "tier_rates": {}, "user_rates": '
        '{"a": 3}, "weights": {"users": {"a": 2}, "tiers": {}}}',
        '{"default_rate": 8, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "shadow", "tier_rates": {}, "user_rates": '
        '{"a": 3}, "weights": {"tiers": {}, "users": {"a": 2.0}}}',
    ),
    "null-pieces": (
        '{"default_rate": null, "exempt_tiers": [], "exempt_users": null, '
        '"memberships": {}, "mode": "shadow", "tier_rates": {}, "user_rates": null}',
        '{"default_rate": null, "exempt_tiers": [], "exempt_users": [], '
        '"memberships": {}, "mode": "shadow", "tier_rates": {}, "user_rates": {}}',
    ),
    "unsorted-lists": (
        '{"default_rate": 8, "exempt_tiers": ["x", "t"], "exempt_users": ["z", '
        '"a"], "memberships": {"u": "x"}, "mode": "shadow", "tier_rates": {"t": 2}, '
        '"user_rates": {}}',
        '{"default_rate": 8, "exempt_tiers": ["t", "x"], "exempt_users": ["a", '
        '"z"], "memberships": {"u": "x"}, "mode": "shadow", "tier_rates": {"t": 2}, '
        '"user_rates": {}}',
    ),
    "object-entries": (
        json.dumps(
            {
                **json.loads(PLAIN % "shadow"),
                "user_rates": {"a": {"exempt": True, "weight": 2}},
            }
        ),
        '{"default_rate": 8, "exempt_tiers": [], "exempt_users": ["a"], '
        '"memberships": {}, "mode": "shadow", "tier_rates": {}, "user_rates": {}, '
        '"weights": {"tiers": {}, "users": {"a": 2.0}}}',
    ),
}


@pytest.mark.parametrize("name", list(DECODED))
def test_a_document_the_previous_version_read_decodes_to_the_same_table(name):
    document, written_back = DECODED[name]
    policy = decode(document)
    assert policy.mode is not None and policy.fair_share is not None
    assert encode(policy) == written_back
    assert decode(written_back) == policy


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            {"fair_share": "yes"},
            "limits document: fair_share: must be true or false, got 'yes'",
        ),
        (
            {"weights": {"groups": {}}},
            "limits document: weights: unknown field(s) 'groups'",
        ),
        (
            {"weights": {"users": []}},
            "limits document: user_weights: must be an object, got list",
        ),
        (
            {"weights": {"teams": {"nosuch": 2}}},
            "limits document: weights.teams.nosuch: unknown team 'nosuch'",
        ),
        (
            {"weights": {"users": {"alice": 0}}},
            "limits document: weights.users.alice: must be a number in (0, 1e+06], "
            "got 0",
        ),
        (
            {"weights": {"tiers": {"gold": 2}}},
            "limits document: weights.tiers.gold: unknown tier 'gold'",
        ),
        (
            {"weights": {"users": {"a\x01": 2}}},
            "limits document: weights.users['a\\x01']: user id must not",
        ),
    ],
)
def test_a_bad_fair_share_policy_is_refused(policy, message):
    document = {**json.loads(encode(full_table())), **policy}
    with pytest.raises(ValueError, match=re.escape(message)):
        decode(json.dumps(document))


def test_teams_round_trip_and_are_left_out_when_there_are_none():
    teams = TeamTable({"acme": 60}, {"alice": "acme"})
    share = SharePolicy(teams={"acme": 2.0})
    limits = stored_table(10, teams=teams, share=share)
    again = decode(encode(limits))
    assert (again.team_table().rates, again.team_table().memberships) == (
        {"acme": 60},
        {"alice": "acme"},
    )
    assert dict(again.share_policy().teams) == {"acme": 2.0}
    plain = json.loads(encode(stored_table(10)))
    assert "team_rates" not in plain and "team_members" not in plain


@pytest.mark.parametrize(
    ("teams", "message"),
    [
        (
            {"team_rates": []},
            "limits document: team_rates: must be an object, got list",
        ),
        (
            {"team_rates": {"acme": 0}},
            f"limits document: teams.acme.tokens_per_second: {RATE}, got 0",
        ),
        (
            {"team_rates": {}, "team_members": {"alice": "acme"}},
            "limits document: team_members.alice: unknown team 'acme'",
        ),
        (
            {"team_rates": {"acme": 1}, "team_members": {"a\x01": "acme"}},
            "limits document: team_members['a\\x01']: user id must not",
        ),
    ],
)
def test_a_bad_team_part_is_refused(teams, message):
    document = {**json.loads(encode(full_table())), **teams}
    with pytest.raises(ValueError, match=re.escape(message)):
        decode(json.dumps(document))


def test_pacing_off_is_a_null_default():
    assert decode(encode(stored_table(None))).default_rate is None


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
        (
            document(default_rate=0),
            f"limits document: default_tokens_per_second: {RATE}, got 0",
        ),
        (
            document(user_rates=[]),
            "limits document: user_rates: must be an object, got list",
        ),
        (
            document(exempt_users={}),
            "limits document: exempt_users: must be a list of ids, got dict",
        ),
        (
            document(user_rates={"alice": "10"}),
            f"limits document: users.alice: {RATE}, got '10'",
        ),
        (
            document(memberships={"bob": "gold"}),
            "limits document: memberships.bob: unknown tier 'gold'",
        ),
        (
            document(exempt_users=["a\u200bb"]),
            "limits document: exempt_users[0]: user id must not contain invisible",
        ),
        (document(mode="loud"), "limits document: mode: must be one of enforce"),
        (
            document(
                user_rates={f"u{i}": 1 for i in range(MAX_EXPLICIT_LIMITS)},
                exempt_users=["one-too-many"],
            ),
            f"limits document: a policy holds at most {MAX_EXPLICIT_LIMITS} users",
        ),
        (
            document(
                user_rates={},
                memberships={},
                exempt_users=[],
                weights={"users": {f"u{i}": 1 for i in range(MAX_EXPLICIT_LIMITS + 1)}},
            ),
            f"limits document: a policy holds at most {MAX_EXPLICIT_LIMITS} users",
        ),
        (
            document(
                tier_rates={f"t{i}": 1 for i in range(MAX_TIERS)},
                exempt_tiers=["one-too-many"],
            ),
            f"limits document: tiers: a policy holds at most {MAX_TIERS} tiers",
        ),
        (
            document(exempt_tiers=["a\u200bb"]),
            "limits document: exempt_tiers[0]: tier id must not contain invisible",
        ),
        (
            document(exempt_tiers=[["a"]]),
            "limits document: exempt_tiers[0]: tier id must be a string",
        ),
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
        "too-many-users",
        "too-many-weighted-users",
        "too-many-tiers",
        "bad-tier-id",
        "unhashable-tier",
    ],
)
def test_a_bad_document_is_refused_by_name(text, message):
    with pytest.raises(ValueError) as error:
        decode(text)
    assert str(error.value).startswith(message)


def test_there_is_no_table_until_one_is_written(client):
    assert RedisStore(client).read_limits() is None


def test_each_write_counts_on_with_a_fresh_stamp_and_is_read_back(client):
    store = RedisStore(client)
    first = store.write_limits(full_table(), None)
    second = store.write_limits(stored_table(5), first)
    assert (first.counter, second.counter) == (1, 2)
    assert first.stamp != second.stamp and len(second.stamp) == 16
    stored = store.read_limits()
    assert stored is not None
    version, limits = stored
    assert version == second == store.limits_version()
    assert same(limits, stored_table(5))


def test_a_write_from_a_stale_version_is_refused_and_changes_nothing(client):
    store = RedisStore(client)
    first = store.write_limits(full_table(), None)
    second = store.write_limits(full_table(), first)
    with pytest.raises(StaleLimits) as error:
        store.write_limits(stored_table(5), first)
    assert error.value.current == second
    stored = store.read_limits()
    assert stored is not None
    assert stored[0] == second
    assert same(stored[1], full_table())


def test_the_same_counter_with_another_stamp_is_stale(client):
    """A store that lost its data counts again: an old version's counter comes
    back, its stamp does not."""
    store = RedisStore(client)
    mine = store.write_limits(full_table(), None)
    client.flushall()
    theirs = store.write_limits(stored_table(5), None)
    assert theirs.counter == mine.counter
    with pytest.raises(StaleLimits):
        store.write_limits(full_table(), mine)
    stored = store.read_limits()
    assert stored is not None and same(stored[1], stored_table(5))


def test_no_table_expected_writes_only_where_there_is_none(client):
    store = RedisStore(client)
    seeded = store.write_limits(full_table(), NO_TABLE)
    with pytest.raises(StaleLimits) as error:
        store.write_limits(stored_table(5), NO_TABLE)
    assert error.value.current == seeded


def test_a_write_counts_past_the_counter_it_is_given(client):
    store = RedisStore(client)
    assert store.write_limits(full_table(), NO_TABLE, count_past=7).counter == 8


def test_a_write_publishes_its_counter_to_every_subscriber(client):
    writer, reader = RedisStore(client), RedisStore(client)
    first, second = reader.subscribe_limits(), reader.subscribe_limits()
    try:
        version = writer.write_limits(full_table(), None)
        for subscription in (first, second):
            assert subscription.next_version(timeout_s=10) == version.counter
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
            store.write_limits(full_table(), LimitsVersion(7, ""))
        assert subscription.next_version(timeout_s=0.05) is None
    finally:
        subscription.close()
