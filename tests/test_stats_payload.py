"""Tests for ``engine_ext.stats_payload`` (pure: no vLLM, no Prometheus).

What must hold: the ``user`` label is bounded (only explicit-limit users, at most
the cap, everyone else under ``__other__``), raw ids from requests never leave the
engine, and the deltas of all payloads add up to the accounting's totals.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.stats_payload import (
    COUNTER_FIELDS,
    MAX_PENDING_IDLE_WAITS,
    OTHER_METHOD,
    OTHER_TIER,
    OTHER_USER,
    PAYLOAD_KEY,
    FailureLog,
    PayloadBuilder,
    PayloadError,
    attach,
    parse,
    take_payload,
)
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.settings import DEFAULT_MAX_LABELLED_USERS
from pacing.shared import ControlPlaneSnapshot
from pacing.store_stats import LATENCY_BUCKETS_NS, StoreStats

#: Prefix of the control plane's full RPC method names.
CONTROL = "/outputrate.v1.OutputRateControl/"


def build(builder: PayloadBuilder, accounting: Accounting, rates: dict, **kw):
    """One payload, after the JSON round trip a msgpack trip resembles."""
    args = {
        "default_rate": 10,
        "throttled_requests": 0,
        "tracked_users": 0,
        **kw,
    }
    raw = builder.build(accounting=accounting, user_rates=rates, **args)
    return json.loads(json.dumps(raw))


def test_users_without_explicit_limit_are_reported_as_other() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 3)
    accounting.record("req-user-1234", "charged", 5)
    accounting.record("req-user-5678", "throttled_skips", 2)
    raw = build(PayloadBuilder(), accounting, {"alice": 50})
    assert raw["users"] == {
        "alice": {"charged": 3},
        OTHER_USER: {"charged": 5, "throttled_skips": 2},
    }
    assert raw["limits"] == {"alice": 50}


def test_raw_user_ids_never_appear_in_the_payload() -> None:
    accounting = Accounting()
    secret = "tenant-7f3a9c-from-request"
    for event in COUNTER_FIELDS:
        accounting.record(secret, event)
    builder = PayloadBuilder()
    for _ in range(3):
        assert secret not in json.dumps(build(builder, accounting, {"alice": 5}))


def test_the_cap_bounds_labelled_users_and_the_rest_aggregate() -> None:
    rates = {f"user-{i:03d}": 10 + i for i in range(150)}
    accounting = Accounting()
    for user in rates:
        accounting.record(user, "charged")
    raw = build(PayloadBuilder(), accounting, rates)
    labelled = sorted(rates)[:DEFAULT_MAX_LABELLED_USERS]
    assert list(raw["limits"]) == labelled
    assert set(raw["users"]) == {*labelled, OTHER_USER}
    assert raw["users"][OTHER_USER] == {"charged": 150 - DEFAULT_MAX_LABELLED_USERS}


def test_a_cap_of_zero_labels_nobody() -> None:
    accounting = Accounting()
    accounting.record("alice", "refunds")
    raw = build(PayloadBuilder(max_labelled_users=0), accounting, {"alice": 5})
    assert raw["limits"] == {}
    assert raw["users"] == {OTHER_USER: {"refunds": 1}}


def test_users_named_like_reserved_labels_are_never_labelled() -> None:
    accounting = Accounting()
    accounting.record("__default__", "charged")
    raw = build(PayloadBuilder(), accounting, {"__other__": 5, "__default__": 6})
    assert raw["limits"] == {}
    assert raw["users"] == {OTHER_USER: {"charged": 1}}


def _strings(value: object) -> list[str]:
    """Every string in a payload tree, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in _strings(item)]
    return []


def test_ids_that_do_not_encode_are_never_labelled() -> None:
    """Defence in depth: validation keeps lone surrogates out, but if one got
    in, the payload must still encode (vLLM's msgpack encoder raises on it)."""
    accounting = Accounting()
    accounting.record("bad\ud800", "charged", 4)
    accounting.record("alice", "charged", 1)
    rates = {"bad\ud800": 3, "alice": 5, "\udfff": 7}
    raw = PayloadBuilder().build(
        accounting=accounting,
        user_rates=rates,
        default_rate=10,
        throttled_requests=0,
        tracked_users=2,
    )
    for text in _strings(raw):
        text.encode("utf-8")  # strict: raises on a surrogate
    assert raw["limits"] == {"alice": 5}
    assert raw["users"] == {"alice": {"charged": 1}, OTHER_USER: {"charged": 4}}
    assert parse(raw).users[OTHER_USER] == {"charged": 4}


def test_rpc_method_names_that_do_not_encode_count_as_other() -> None:
    get = f"{CONTROL}GetLimit"
    snapshot = ControlPlaneSnapshot(rpcs={("/x/\ud800", "OK"): 2, (get, "OK"): 1})
    raw = PayloadBuilder().build(
        accounting=Accounting(),
        user_rates={},
        default_rate=10,
        throttled_requests=0,
        tracked_users=0,
        control=snapshot,
    )
    for text in _strings(raw):
        text.encode("utf-8")
    assert parse(raw).control_rpcs == {(OTHER_METHOD, "OK"): 2, (get, "OK"): 1}


def test_failures_are_logged_at_powers_of_two(caplog) -> None:
    log = FailureLog(logging.getLogger("test.failures"), "thing failed")
    with caplog.at_level(logging.ERROR, logger="test.failures"):
        for _ in range(9):
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.record()
    assert log.count == 9
    assert [r.getMessage() for r in caplog.records] == [
        f"thing failed (failure {n}; logged at failures 1, 2, 4, 8, ...)"
        for n in (1, 2, 4, 8)
    ]
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in caplog.records)


def test_counters_are_deltas_since_the_previous_payload() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 4)
    assert build(builder, accounting, {"alice": 5})["users"] == {
        "alice": {"charged": 4}
    }
    assert build(builder, accounting, {"alice": 5})["users"] == {}
    accounting.record("alice", "charged")
    accounting.record("bob", "throttled_preemptions")
    assert build(builder, accounting, {"alice": 5})["users"] == {
        "alice": {"charged": 1},
        OTHER_USER: {"throttled_preemptions": 1},
    }


def test_labelled_set_is_sticky_at_the_cap() -> None:
    builder = PayloadBuilder(max_labelled_users=2)
    accounting = Accounting()
    build(builder, accounting, {"m": 1, "n": 1})
    # "a" sorts first but the cap is reached: existing labels stay.
    raw = build(builder, accounting, {"a": 1, "m": 1, "n": 1})
    assert set(raw["limits"]) == {"m", "n"}
    # "m" loses its explicit limit: its place goes to the next in name order.
    raw = build(builder, accounting, {"a": 1, "n": 1, "z": 1})
    assert set(raw["limits"]) == {"a", "n"}
    assert builder.labelled_users == ["n", "a"]


def test_a_user_labelled_later_starts_from_zero_without_double_counting() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("bob", "charged", 7)
    first = build(builder, accounting, {})
    assert first["users"] == {OTHER_USER: {"charged": 7}}
    # bob gets an explicit limit at runtime; his 7 were already reported.
    second = build(builder, accounting, {"bob": 20})
    assert second["users"] == {}
    assert second["limits"] == {"bob": 20}
    accounting.record("bob", "charged", 2)
    assert build(builder, accounting, {"bob": 20})["users"] == {"bob": {"charged": 2}}


def test_a_forgotten_labelled_user_who_returns_restarts_from_zero() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 5)
    build(builder, accounting, {"alice": 5})
    accounting.forget(set())  # idle cleanup dropped alice's per-user entry
    accounting.record("alice", "charged", 2)
    assert build(builder, accounting, {"alice": 5})["users"] == {
        "alice": {"charged": 2}
    }


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(min_value=0, max_value=3),
    steps=st.lists(
        st.tuples(
            st.lists(  # events: (user index, counter field, count)
                st.tuples(
                    st.integers(0, 5),
                    st.sampled_from(COUNTER_FIELDS),
                    st.integers(1, 3),
                ),
                max_size=6,
            ),
            st.sets(st.integers(0, 5)),  # users with an explicit limit now
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_emitted_deltas_add_up_to_the_totals_and_labels_stay_bounded(
    cap: int, steps: list
) -> None:
    accounting = Accounting()
    builder = PayloadBuilder(max_labelled_users=cap)
    emitted = dict.fromkeys(COUNTER_FIELDS, 0)
    for events, explicit in steps:
        for user, event, count in events:
            accounting.record(f"u{user}", event, count)
        rates = {f"u{user}": 10 for user in explicit}
        raw = build(builder, accounting, rates)
        assert len(raw["limits"]) <= cap
        assert set(raw["limits"]) <= set(rates)
        assert set(raw["users"]) <= {*raw["limits"], OTHER_USER}
        for row in raw["users"].values():
            for event, delta in row.items():
                assert delta > 0
                emitted[event] += delta
    assert emitted == {name: getattr(accounting.total, name) for name in emitted}


def test_gauges_and_limits_are_current_values() -> None:
    raw = build(
        PayloadBuilder(),
        Accounting(),
        {"alice": 5, "bob": 7},
        default_rate=100,
        throttled_requests=3,
        tracked_users=9,
    )
    payload = parse(raw)
    assert payload.limits == {"alice": 5, "bob": 7}
    assert payload.default_limit == 100
    assert (payload.throttled_requests, payload.tracked_users) == (3, 9)


def test_idle_waits_are_drained_by_each_payload_and_bounded() -> None:
    builder = PayloadBuilder()
    builder.observe_idle_wait(0.01)
    builder.observe_idle_wait(0.05)
    assert build(builder, Accounting(), {})["idle_waits_s"] == [0.01, 0.05]
    assert build(builder, Accounting(), {})["idle_waits_s"] == []
    for _ in range(MAX_PENDING_IDLE_WAITS + 10):
        builder.observe_idle_wait(0.001)
    assert len(build(builder, Accounting(), {})["idle_waits_s"]) == (
        MAX_PENDING_IDLE_WAITS
    )


def test_control_plane_counters_travel_as_deltas() -> None:
    builder = PayloadBuilder()
    update, get = f"{CONTROL}UpdateLimit", f"{CONTROL}GetUserState"
    snapshot = ControlPlaneSnapshot(
        limit_changes=2,
        config_reloads={"success": 1, "failure": 1},
        rpcs={(update, "OK"): 2, (get, "NOT_FOUND"): 1},
    )
    payload = parse(build(builder, Accounting(), {}, control=snapshot))
    assert payload.limit_changes == 2
    assert payload.config_reloads == {"success": 1, "failure": 1}
    assert payload.control_rpcs == {(update, "OK"): 2, (get, "NOT_FOUND"): 1}
    snapshot = ControlPlaneSnapshot(
        limit_changes=2,
        config_reloads={"success": 1, "failure": 2},
        rpcs={(update, "OK"): 2, (get, "NOT_FOUND"): 1},
    )
    payload = parse(build(builder, Accounting(), {}, control=snapshot))
    assert payload.limit_changes == 0
    assert payload.config_reloads == {"failure": 1}
    assert payload.control_rpcs == {}
    # A payload built without a snapshot carries no control-plane news, and the
    # next snapshot is not counted again from zero.
    assert parse(build(builder, Accounting(), {})).config_reloads == {}
    snapshot = ControlPlaneSnapshot(
        limit_changes=3,
        config_reloads={"success": 1, "failure": 2},
        rpcs={(update, "OK"): 3, (get, "NOT_FOUND"): 1},
    )
    payload = parse(build(builder, Accounting(), {}, control=snapshot))
    assert (payload.limit_changes, payload.config_reloads) == (1, {})
    assert payload.control_rpcs == {(update, "OK"): 1}


def test_snapshots_from_elsewhere_are_normalised_not_rejected() -> None:
    """A status code or reload result that the payload does not know is
    normalised, not allowed to get every later payload rejected."""
    update = f"{CONTROL}UpdateLimit"
    snapshot = ControlPlaneSnapshot(
        limit_changes=1,
        config_reloads={"success": 2, "partial": 1},
        rpcs={(update, "OK"): 3, (update, "weird"): 1},
    )
    payload = parse(build(PayloadBuilder(), Accounting(), {}, control=snapshot))
    assert payload.config_reloads == {"success": 2}
    assert payload.control_rpcs == {
        (update, "OK"): 3,
        (update, "UNKNOWN"): 1,
    }


def test_attach_and_take_payload_leave_connector_data_alone() -> None:
    stats = SimpleNamespace(kv_connector_stats=None)
    attach(stats, {"v": 1})
    assert stats.kv_connector_stats == {PAYLOAD_KEY: {"v": 1}}
    assert take_payload(stats) == {"v": 1}
    assert stats.kv_connector_stats is None  # as vLLM built it
    stats = SimpleNamespace(kv_connector_stats={"connector": 1})
    attach(stats, {"v": 1})
    assert take_payload(stats) == {"v": 1}
    assert stats.kv_connector_stats == {"connector": 1}
    assert take_payload(stats) is None
    assert take_payload(None) is None


def _valid() -> dict:
    limiter = OutputRateLimiter(10, {}, tier_rates={"free": 20})
    return build(PayloadBuilder(), Accounting(), {"alice": 5}, limiter=limiter)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(v=1), "payload version 1 is not 3"),
        (lambda p: p.update(users={"mallory": {"charged": 1}}), "'mallory'"),
        (lambda p: p.update(users={OTHER_USER: {"bogus": 1}}), "unknown counters"),
        (lambda p: p.update(users={OTHER_USER: {"charged": -1}}), "non-negative"),
        (lambda p: p.update(limits=[]), "limits must be an object"),
        (lambda p: p.update(throttled_requests=True), "throttled_requests"),
        (lambda p: p.update(idle_waits_s=[-0.1]), "idle_waits_s"),
        (lambda p: p.update(config_reloads={"maybe": 1}), "config_reloads"),
        (lambda p: p.update(control_rpcs=[["m", "NOPE", 1]]), "control_rpcs entry"),
        (lambda p: p.pop("tracked_users"), "tracked_users"),
        (lambda p: p.update(mode="fast"), "mode must be one of"),
        (lambda p: p.pop("mode"), "mode must be one of"),
        (lambda p: p.update(tiers={"free": -1}), "tiers\\['free'\\]"),
        (lambda p: p.update(tier_counters={"pro": {"charged": 1}}), "'pro'"),
        (
            lambda p: p.update(tier_counters={"free": {"bogus": 1}}),
            "unknown counters",
        ),
        (lambda p: p.update(tier_counters=[]), "tier_counters must be an object"),
    ],
)
def test_parse_rejects_malformed_payloads_naming_the_field(mutate, message) -> None:
    payload = _valid()
    parse(payload)  # the unmodified payload is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)


def test_parse_rejects_a_non_object() -> None:
    with pytest.raises(PayloadError, match="must be an object"):
        parse([1, 2])


# -- mode and tiers -------------------------------------------------------------


def test_the_mode_travels_as_its_name() -> None:
    builder = PayloadBuilder()
    assert build(builder, Accounting(), {})["mode"] == "enforce"  # the default
    for mode in Mode:
        raw = build(builder, Accounting(), {}, mode=mode)
        assert raw["mode"] == mode.value
        assert parse(raw).mode is mode


def tiered_limiter() -> OutputRateLimiter:
    """free: 20 (alice, bob), pro: 200 (carol), staff: exempt (dave); erin in
    no tier."""
    return OutputRateLimiter(
        10,
        {"bob": 5},  # a member with a limit of its own still counts in its tier
        tier_rates={"free": 20, "pro": 200},
        memberships={"alice": "free", "bob": "free", "carol": "pro", "dave": "staff"},
        exempt_tiers={"staff"},
    )


def test_tier_counters_sum_their_members_events() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 3)
    accounting.record("bob", "charged", 4)
    accounting.record("bob", "throttled_skips", 2)
    accounting.record("carol", "shadow_skips", 5)
    accounting.record("dave", "charged", 7)
    accounting.record("erin", "charged", 100)
    raw = build(PayloadBuilder(), accounting, {}, limiter=tiered_limiter())
    assert raw["tiers"] == {"free": 20, "pro": 200, "staff": 0}  # 0: exempt
    assert raw["tier_counters"] == {
        "free": {"charged": 7, "throttled_skips": 2},
        "pro": {"shadow_skips": 5},
        "staff": {"charged": 7},
    }
    payload = parse(raw)
    assert payload.tiers == raw["tiers"]
    assert payload.tier_counters == raw["tier_counters"]


def test_tier_counters_are_deltas_and_follow_membership_changes() -> None:
    accounting = Accounting()
    limiter = tiered_limiter()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 3)
    build(builder, accounting, {}, limiter=limiter)
    assert build(builder, accounting, {}, limiter=limiter)["tier_counters"] == {}
    # alice moves to pro: her earlier events stay with free, new ones go to pro.
    limiter.set_membership("alice", "pro", now_ns=0)
    accounting.record("alice", "charged", 2)
    raw = build(builder, accounting, {}, limiter=limiter)
    assert raw["tier_counters"] == {"pro": {"charged": 2}}
    # erin joins free: only what she does from then on counts there.
    accounting.record("erin", "charged", 50)
    build(builder, accounting, {}, limiter=limiter)
    limiter.set_membership("erin", "free", now_ns=0)
    accounting.record("erin", "charged", 1)
    raw = build(builder, accounting, {}, limiter=limiter)
    assert raw["tier_counters"] == {"free": {"charged": 1}}


def test_a_forgotten_member_who_returns_counts_from_zero() -> None:
    accounting = Accounting()
    limiter = tiered_limiter()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 5)
    build(builder, accounting, {}, limiter=limiter)
    accounting.forget(set())  # idle cleanup dropped alice's entry
    accounting.record("alice", "charged", 7)  # more than she had before
    raw = build(builder, accounting, {}, limiter=limiter)
    assert raw["tier_counters"] == {"free": {"charged": 7}}


def test_events_from_before_the_first_tier_are_no_tiers_events() -> None:
    accounting = Accounting()
    limiter = OutputRateLimiter(10, {})
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 5)
    raw = build(builder, accounting, {}, limiter=limiter)
    assert (raw["tiers"], raw["tier_counters"]) == ({}, {})
    accounting.record("alice", "charged", 1)
    limiter.set_tier_rate("free", 20, now_ns=0)
    limiter.set_membership("alice", "free", now_ns=0)
    raw = build(builder, accounting, {}, limiter=limiter)
    assert (raw["tiers"], raw["tier_counters"]) == ({"free": 20}, {})
    accounting.record("alice", "charged", 2)
    raw = build(builder, accounting, {}, limiter=limiter)
    assert raw["tier_counters"] == {"free": {"charged": 2}}


def test_the_tier_cap_bounds_tier_labels_and_the_rest_aggregate() -> None:
    tiers = {f"t{i:02d}": 10 + i for i in range(5)}
    limiter = OutputRateLimiter(
        10, {}, tier_rates=tiers, memberships={f"u{i}": t for i, t in enumerate(tiers)}
    )
    accounting = Accounting()
    for i in range(5):
        accounting.record(f"u{i}", "charged", i + 1)
    raw = build(PayloadBuilder(max_labelled_tiers=2), accounting, {}, limiter=limiter)
    assert raw["tiers"] == {"t00": 10, "t01": 11}
    assert raw["tier_counters"] == {
        "t00": {"charged": 1},
        "t01": {"charged": 2},
        OTHER_TIER: {"charged": 3 + 4 + 5},
    }


def test_tiers_named_like_reserved_labels_are_never_labelled() -> None:
    limiter = OutputRateLimiter(
        10, {}, tier_rates={OTHER_TIER: 5}, memberships={"alice": OTHER_TIER}
    )
    accounting = Accounting()
    accounting.record("alice", "charged", 2)
    raw = build(PayloadBuilder(), accounting, {}, limiter=limiter)
    assert raw["tiers"] == {}
    assert raw["tier_counters"] == {OTHER_TIER: {"charged": 2}}
    assert parse(raw).tier_counters == {OTHER_TIER: {"charged": 2}}


def test_without_a_limiter_there_are_no_tiers() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 2)
    raw = build(PayloadBuilder(), accounting, {})
    assert (raw["tiers"], raw["tier_counters"]) == ({}, {})


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(min_value=0, max_value=2),
    steps=st.lists(
        st.tuples(
            st.lists(  # events: (user index, counter field, count)
                st.tuples(
                    st.integers(0, 4),
                    st.sampled_from(COUNTER_FIELDS),
                    st.integers(1, 3),
                ),
                max_size=6,
            ),
            # memberships now: user index -> tier index (3: no tier)
            st.dictionaries(st.integers(0, 4), st.integers(0, 3)),
            st.booleans(),  # tiers exist at this build
            st.sets(st.integers(0, 4)),  # users the accounting forgets first
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_tier_deltas_attribute_every_event_to_the_tier_at_the_next_build(
    cap: int, steps: list
) -> None:
    """Against a reference that remembers every event: each event recorded
    between two builds counts once, in the tier its user belongs to at the
    later build, when tiers exist at both (or the later is the first build)."""
    accounting = Accounting()
    builder = PayloadBuilder(max_labelled_tiers=cap)
    emitted = {name: 0 for name in COUNTER_FIELDS}
    expected = dict(emitted)
    pending: dict[int, dict[str, int]] = {}  # user -> events since last build
    tracked = True  # the first build counts everything
    for events, members, tiers_exist, forgotten in steps:
        accounting.forget({f"u{i}" for i in range(5)} - {f"u{i}" for i in forgotten})
        for user in forgotten:
            pending.pop(user, None)  # gone before any build saw them
        for user, event, count in events:
            accounting.record(f"u{user}", event, count)
            row = pending.setdefault(user, {})
            row[event] = row.get(event, 0) + count
        if tiers_exist:
            limiter = OutputRateLimiter(
                10,
                {},
                tier_rates={"t0": 1, "t1": 2, "t2": 3},
                memberships={f"u{u}": f"t{t}" for u, t in members.items() if t < 3},
            )
        else:
            limiter = OutputRateLimiter(10, {})
        raw = build(builder, accounting, {}, limiter=limiter)
        assert len(raw["tiers"]) <= cap
        assert set(raw["tier_counters"]) <= {*raw["tiers"], OTHER_TIER}
        if tiers_exist and tracked:
            for user, row in pending.items():
                if members.get(user, 3) < 3:
                    for event, count in row.items():
                        expected[event] += count
        tracked = tiers_exist
        pending = {}
        for row in raw["tier_counters"].values():
            for event, delta in row.items():
                assert delta > 0
                emitted[event] += delta
    assert emitted == expected


# -- the store ------------------------------------------------------------------

MS = 1_000_000


def test_without_a_store_the_payload_has_no_store_part() -> None:
    raw = build(PayloadBuilder(), Accounting(), {})
    assert raw["store"] is None
    assert parse(raw).store is None


def test_the_store_part_carries_deltas_and_current_gauges() -> None:
    stats = StoreStats()
    builder = PayloadBuilder()
    stats.record_answered(
        300_000, claimed=12, granted=10, returned=0, live_engines=3
    )  # 0.3 ms: in (0.25, 0.5] ms
    stats.record_answered(2 * MS, claimed=5, granted=5, returned=4, live_engines=3)
    first = parse(build(builder, Accounting(), {}, store=stats)).store
    assert first is not None
    assert first.round_trips == {"ok": 2, "error": 0}
    assert first.tokens == {"claimed": 17, "granted": 15, "returned": 4}
    assert (first.degraded, first.live_engines) == (False, 3)
    nonzero = {
        LATENCY_BUCKETS_NS[i]: bucket
        for i, bucket in enumerate(first.latency_ns)
        if bucket != (0, 0)
    }
    assert nonzero == {500_000: (1, 300_000), 2_500_000: (1, 2 * MS)}

    stats.record_failed(50 * MS, now_ns=7)  # a timeout: degraded from now on
    second = parse(build(builder, Accounting(), {}, store=stats)).store
    assert second is not None
    assert second.round_trips == {"ok": 0, "error": 1}
    assert second.tokens == {"claimed": 0, "granted": 0, "returned": 0}
    assert second.degraded
    assert second.latency_ns[LATENCY_BUCKETS_NS.index(50 * MS)] == (1, 50 * MS)
    assert sum(count for count, _ in second.latency_ns) == 1

    stats.record_answered(MS, claimed=1, granted=1, returned=0, live_engines=2)
    third = parse(build(builder, Accounting(), {}, store=stats)).store
    assert third is not None
    assert (third.degraded, third.live_engines) == (False, 2)


def test_a_new_store_stats_object_is_reported_from_zero() -> None:
    builder = PayloadBuilder()
    old = StoreStats()
    old.record_answered(MS, claimed=9, granted=9, returned=0, live_engines=1)
    build(builder, Accounting(), {}, store=old)
    new = StoreStats()
    new.record_answered(MS, claimed=2, granted=1, returned=0, live_engines=1)
    part = parse(build(builder, Accounting(), {}, store=new)).store
    assert part is not None
    assert part.tokens == {"claimed": 2, "granted": 1, "returned": 0}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("answered"),
                st.integers(0, 3 * 10**9),
                st.integers(0, 50),
                st.integers(0, 50),
                st.integers(0, 50),
            ),
            st.tuples(st.just("failed"), st.integers(0, 3 * 10**9)),
            st.just(("build",)),
        ),
        max_size=40,
    )
)
def test_store_deltas_add_up_and_every_bucket_mean_lies_in_its_bucket(ops) -> None:
    """Whatever the latencies (bounds exactly included), every payload parses
    (which checks each bucket's mean against its bounds) and the deltas add
    up to the totals."""
    stats = StoreStats()
    builder = PayloadBuilder()
    counts = [0] * (len(LATENCY_BUCKETS_NS) + 1)
    sums = [0] * (len(LATENCY_BUCKETS_NS) + 1)
    trips = {"ok": 0, "error": 0}
    tokens = {"claimed": 0, "granted": 0, "returned": 0}

    def collect() -> None:
        part = parse(build(builder, Accounting(), {}, store=stats)).store
        assert part is not None
        for i, (count, total) in enumerate(part.latency_ns):
            counts[i] += count
            sums[i] += total
        for key in trips:
            trips[key] += part.round_trips[key]
        for key in tokens:
            tokens[key] += part.tokens[key]

    for op in ops:
        if op[0] == "answered":
            _, latency, claimed, granted, returned = op
            stats.record_answered(
                latency,
                claimed=claimed,
                granted=granted,
                returned=returned,
                live_engines=1,
            )
        elif op[0] == "failed":
            stats.record_failed(op[1], now_ns=1)
        else:
            collect()
    collect()
    assert counts == stats.latency_counts
    assert sums == stats.latency_sums_ns
    assert trips == {
        "ok": stats.round_trips_answered,
        "error": stats.round_trips_failed,
    }
    assert tokens == {
        "claimed": stats.tokens_claimed,
        "granted": stats.tokens_granted,
        "returned": stats.tokens_returned,
    }


def _with_store() -> dict:
    stats = StoreStats()
    stats.record_answered(MS, claimed=2, granted=1, returned=0, live_engines=2)
    return build(PayloadBuilder(), Accounting(), {}, store=stats)


def _set_bucket(payload: dict, index: int, value: list) -> None:
    payload["store"]["latency_ns"][index] = value


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop("store"), "store must be an object or null"),
        (lambda p: p.update(store=[]), "store must be an object or null"),
        (lambda p: p["store"]["round_trips"].pop("error"), "store.round_trips keys"),
        (lambda p: p["store"]["tokens"].update(spent=1), "store.tokens keys"),
        (lambda p: p["store"]["tokens"].update(granted=-1), "non-negative"),
        (lambda p: p["store"]["latency_ns"].pop(), "store.latency_ns must be"),
        (lambda p: _set_bucket(p, 0, [1]), "store.latency_ns\\[0\\] must be a"),
        # 0.1 ms is the first bucket's bound: in it, but not in the second.
        (lambda p: _set_bucket(p, 1, [1, 100_000]), "not in its bucket"),
        (lambda p: _set_bucket(p, 0, [2, 200_001]), "not in its bucket"),
        (lambda p: _set_bucket(p, 2, [0, 5]), "not in its bucket"),
        (lambda p: p["store"].update(degraded=True), "store.degraded must be 0"),
        (lambda p: p["store"].update(degraded=2), "store.degraded must be 0"),
        (lambda p: p["store"].pop("live_engines"), "store.live_engines"),
    ],
)
def test_parse_rejects_a_malformed_store_part_naming_the_field(mutate, message) -> None:
    payload = _with_store()
    parse(payload)  # the unmodified payload is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)


def test_a_bucket_holding_its_bounds_parses() -> None:
    payload = _with_store()
    _set_bucket(payload, 0, [2, 200_000])  # twice 0.1 ms: the bound, included
    _set_bucket(payload, 1, [1, 250_000])
    _set_bucket(payload, len(LATENCY_BUCKETS_NS), [1, 10**10])  # past 1 s
    store = parse(payload).store
    assert store is not None
    assert store.latency_ns[0] == (2, 200_000)
