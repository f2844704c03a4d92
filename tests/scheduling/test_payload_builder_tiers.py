"""Tests for ``engine_ext.payload_builder``: the tiers' part of the payload
(pure: no vLLM, no Prometheus).

What must hold: the ``tier`` label is bounded (every tier, at most the cap, the
rest under ``__other__``), and each event counts once, in the tier its user
belongs to at the next build.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import PayloadBuilder
from engine_ext.payload_parser import parse
from engine_ext.stats_payload import COUNTER_FIELDS, OTHER_TIER
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from tests.payload_harness import build


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


def forget(accounting: Accounting, users: set[int]) -> None:
    """The idle clean-up forgets ``users`` (by index) and keeps the rest."""
    accounting.forget({f"u{i}" for i in range(5)} - {f"u{i}" for i in users})


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
            st.sets(st.integers(0, 4)),  # and those it forgets before the build
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
    later build, when tiers exist at both (or the later is the first build),
    also when the accounting forgot the user in between."""
    accounting = Accounting(keep_forgotten=True)
    builder = PayloadBuilder(max_labelled_tiers=cap)
    emitted = {name: 0 for name in COUNTER_FIELDS}
    expected = dict(emitted)
    pending: dict[int, dict[str, int]] = {}  # user -> events since last build
    tracked = True  # the first build counts everything
    for events, members, tiers_exist, forgotten, forgotten_last in steps:
        forget(accounting, forgotten)
        for user, event, count in events:
            accounting.record(f"u{user}", event, count)
            row = pending.setdefault(user, {})
            row[event] = row.get(event, 0) + count
        forget(accounting, forgotten_last)
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
