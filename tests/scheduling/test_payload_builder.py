"""Tests for ``engine_ext.payload_builder``: the users' part of the payload, its
gauges and control-plane counters (pure: no vLLM, no Prometheus).

What must hold: the ``user`` label is bounded (only explicit-limit users, at most
the cap, everyone else under ``__other__``), raw ids from requests never leave the
engine, and the deltas of all payloads add up to the accounting's totals.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import MAX_PENDING_IDLE_WAITS, PayloadBuilder
from engine_ext.payload_parser import parse
from engine_ext.stats_payload import COUNTER_FIELDS, OTHER_METHOD, OTHER_USER
from pacing.accounting import Accounting
from pacing.modes import Mode
from pacing.settings.model import DEFAULT_MAX_LABELLED_USERS
from pacing.shared import ControlPlaneSnapshot
from tests.payload_harness import build

#: Prefix of the control plane's full RPC method names.
CONTROL = "/outputrate.v1.OutputRateControl/"


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


def test_the_mode_travels_as_its_name() -> None:
    builder = PayloadBuilder()
    assert build(builder, Accounting(), {})["mode"] == "enforce"  # the default
    for mode in Mode:
        raw = build(builder, Accounting(), {}, mode=mode)
        assert raw["mode"] == mode.value
        assert parse(raw).mode is mode
