"""Tests for the ceilings' part of the metrics payload (``engine_ext.
payload_builder`` and ``payload_parser``; pure: no vLLM, no Prometheus).

What must hold: borrowed tokens travel as deltas per labelled user (the rest
under ``__other__``), tier and team, never negative although refunds take
borrowing back (the exported count is the highest the net count reached); the
labelled users' ceilings (as resolved: their own, their tier's or the default)
and the default ceiling travel as gauges, and whether borrowing was blocked at
the engine's last step as 0/1 while any holder has a ceiling (``None``
otherwise); the parser accepts that and nothing malformed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import PayloadBuilder, TeamActivity
from engine_ext.payload_parser import PayloadError, parse
from engine_ext.stats_payload import (
    NET_COUNTER_FIELDS,
    OTHER_TEAM,
    OTHER_TIER,
    OTHER_USER,
)
from pacing.accounting import Accounting
from pacing.ceilings import Ceilings
from pacing.limiter import OutputRateLimiter
from pacing.modes import Mode
from pacing.policy.model import Limits, Policy, User
from pacing.teams import TeamTable
from tests.payload_harness import build

BORROWED = "borrowed_tokens"


def test_borrowed_tokens_are_the_net_counter() -> None:
    assert {BORROWED} == NET_COUNTER_FIELDS


def test_borrowed_tokens_travel_as_deltas_per_user_and_the_rest_as_other() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", BORROWED, 40)
    accounting.record("req-user-1234", BORROWED, 7)
    raw = build(builder, accounting, {"alice": 50})
    assert raw["users"] == {"alice": {BORROWED: 40}, OTHER_USER: {BORROWED: 7}}
    assert parse(raw).users == raw["users"]
    accounting.record("alice", BORROWED, 5)
    assert build(builder, accounting, {"alice": 50})["users"] == {
        "alice": {BORROWED: 5}
    }


def test_a_refund_is_never_a_negative_delta_and_is_taken_from_later_borrowing():
    """A refund of borrowed tokens after the payload that carried them: the
    counter holds still (neither negative nor counted again from zero) until
    the net count passes the highest it reached."""
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 10)
    accounting.record("alice", BORROWED, 10)
    accounting.record("bob", "charged", 4)
    accounting.record("bob", BORROWED, 4)
    assert build(builder, accounting, {"alice": 5})["users"] == {
        "alice": {"charged": 10, BORROWED: 10},
        OTHER_USER: {"charged": 4, BORROWED: 4},
    }
    accounting.record("alice", "refunds", 3)
    accounting.record("alice", BORROWED, -3)
    accounting.record("bob", BORROWED, -4)
    raw = build(builder, accounting, {"alice": 5})
    assert raw["users"] == {"alice": {"refunds": 3}}
    parse(raw)
    # alice borrows 2 (net 9 < 10: nothing new), then 4 more (net 13: 3 new).
    accounting.record("alice", BORROWED, 2)
    accounting.record("bob", BORROWED, 1)
    assert build(builder, accounting, {"alice": 5})["users"] == {}
    accounting.record("alice", BORROWED, 4)
    accounting.record("bob", BORROWED, 5)
    assert build(builder, accounting, {"alice": 5})["users"] == {
        "alice": {BORROWED: 3},
        OTHER_USER: {BORROWED: 2},
    }


def test_a_forgotten_user_who_returns_borrows_from_zero() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 20)
    accounting.record("alice", BORROWED, 8)
    build(builder, accounting, {"alice": 5})
    accounting.forget(set())  # idle cleanup dropped alice's per-user entry
    accounting.record("alice", "charged", 3)
    accounting.record("alice", BORROWED, 2)
    assert build(builder, accounting, {"alice": 5})["users"]["alice"] == {
        "charged": 3,
        BORROWED: 2,
    }


def test_tier_and_team_borrowing_is_summed_and_never_negative() -> None:
    accounting = Accounting()
    builder = PayloadBuilder()
    limiter = OutputRateLimiter(
        10, {}, tier_rates={"free": 20}, memberships={"alice": "free", "bob": "free"}
    )
    table = TeamTable({"acme": 60}, {"alice": "acme", "carol": "acme"})

    def step() -> dict:
        return build(
            builder,
            accounting,
            {},
            limiter=limiter,
            teams=TeamActivity(table, (), (), 0),
        )

    accounting.record("alice", BORROWED, 6)
    accounting.record("bob", BORROWED, 2)
    accounting.record("carol", BORROWED, 1)
    raw = step()
    assert raw["tier_counters"] == {"free": {BORROWED: 8}}
    assert raw["team_counters"] == {"acme": {BORROWED: 7}}
    accounting.record("alice", BORROWED, -5)
    accounting.record("carol", BORROWED, 1)
    raw = step()
    assert (raw["tier_counters"], raw["team_counters"]) == ({}, {})
    parse(raw)
    accounting.record("alice", BORROWED, 9)  # free: net 12, was 8 at most
    raw = step()
    assert raw["tier_counters"] == {"free": {BORROWED: 4}}
    assert raw["team_counters"] == {"acme": {BORROWED: 5}}  # net 12, was 7
    assert OTHER_TIER not in raw["tier_counters"]
    assert OTHER_TEAM not in raw["team_counters"]


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.lists(  # events: (user index, borrowed (+) or refunded (-))
            st.tuples(st.integers(0, 3), st.integers(-4, 6)), max_size=6
        ),
        min_size=1,
        max_size=12,
    )
)
def test_exported_borrowing_is_the_highest_net_count_each_series_reached(
    steps: list,
) -> None:
    """u0 and u1 labelled, u2 and u3 under ``__other__``, u0 and u2 in tier
    free: each series' exported deltas are non-negative and add up to the
    highest its net count was at a build."""
    accounting = Accounting()
    builder = PayloadBuilder()
    limiter = OutputRateLimiter(
        10, {}, tier_rates={"free": 20}, memberships={"u0": "free", "u2": "free"}
    )
    net = dict.fromkeys(("u0", "u1", "u2", "u3"), 0)
    series = {
        "u0": ("u0",),
        "u1": ("u1",),
        OTHER_USER: ("u2", "u3"),
        "free": ("u0", "u2"),
    }
    highest = dict.fromkeys(series, 0)
    exported = dict.fromkeys(series, 0)
    for events in steps:
        for user, count in events:
            # A refund never takes back more than was borrowed.
            count = max(count, -net[f"u{user}"])
            if count:
                accounting.record(f"u{user}", BORROWED, count)
                net[f"u{user}"] += count
        raw = build(builder, accounting, {"u0": 5, "u1": 5}, limiter=limiter)
        parse(raw)
        rows = {**raw["users"], **raw["tier_counters"]}
        for label, members in series.items():
            delta = rows.get(label, {}).get(BORROWED, 0)
            assert delta >= 0
            exported[label] += delta
            highest[label] = max(highest[label], sum(net[m] for m in members))
    assert exported == highest


def ceilings(policy: Policy, needy: tuple[str, ...] | None = None) -> Ceilings:
    """The ceilings of ``policy``; with ``needy``, a borrowing budget that was
    told those holders waited."""
    table = Ceilings(policy)
    if needy is not None:
        base = OutputRateLimiter(100, {})
        borrowing = table.over(base, base.rate_of, Accounting(), base.burst_ns)
        borrowing.lend_to(needy)
    return table


POLICY = Policy(
    default=Limits(100, ceiling_tokens_per_second=150),
    groups={"tier": {"pro": Limits(200, ceiling_tokens_per_second=400)}},
    users={
        "alice": User(Limits(50, ceiling_tokens_per_second=90)),
        "bob": User(Limits(60), groups={"tier": "pro"}),
        "carol": User(Limits(70)),
        "dave": User(Limits(80, exempt=True)),
        "erin": User(Limits(None, ceiling_tokens_per_second=500)),
    },
)


def test_the_ceilings_of_labelled_users_travel_as_resolved_with_the_default():
    table = ceilings(POLICY, needy=())
    raw = build(
        PayloadBuilder(),
        Accounting(),
        {"alice": 50, "bob": 60, "carol": 70, "dave": 80},
        ceilings=table,
    )
    assert raw["ceiling_limits"] == {
        "alice": 90,  # her own
        "bob": 400,  # his tier's
        "carol": 150,  # the default
        # dave: exempt, no ceiling; erin: a ceiling, but no label
    }
    assert raw["default_ceiling_limit"] == 150
    assert raw["borrowing_blocked"] == 0
    payload = parse(raw)
    assert payload.ceiling_limits == raw["ceiling_limits"]
    assert (payload.default_ceiling_limit, payload.borrowing_blocked) == (150, False)


def test_without_a_default_ceiling_only_holders_with_one_have_a_ceiling() -> None:
    policy = Policy(
        default=Limits(100),
        users={"alice": User(Limits(50, ceiling_tokens_per_second=90))},
    )
    raw = build(
        PayloadBuilder(),
        Accounting(),
        {"alice": 50, "bob": 5},
        ceilings=(ceilings(policy)),
    )
    assert raw["ceiling_limits"] == {"alice": 90}
    assert raw["default_ceiling_limit"] is None


@pytest.mark.parametrize(
    ("needy", "blocked"),
    [((), 0), (("alice",), 1), (("alice", "bob"), 1)],
)
def test_borrowing_is_blocked_while_a_holder_within_its_rate_waits(
    needy: tuple[str, ...], blocked: int
) -> None:
    raw = build(PayloadBuilder(), Accounting(), {}, ceilings=ceilings(POLICY, needy))
    assert raw["borrowing_blocked"] == blocked
    assert parse(raw).borrowing_blocked is bool(blocked)


def test_no_blocked_sample_without_ceilings_or_with_pacing_off() -> None:
    no_ceilings = Ceilings(Policy(default=Limits(100)))
    raw = build(PayloadBuilder(), Accounting(), {"a": 5}, ceilings=no_ceilings)
    assert (raw["ceiling_limits"], raw["default_ceiling_limit"]) == ({}, None)
    assert raw["borrowing_blocked"] is None
    # Ceilings set, but no paced step has built the borrowing budget yet.
    assert (
        build(PayloadBuilder(), Accounting(), {}, ceilings=ceilings(POLICY))[
            "borrowing_blocked"
        ]
        == 0
    )
    off = build(
        PayloadBuilder(),
        Accounting(),
        {},
        ceilings=ceilings(POLICY, ("alice",)),
        mode=Mode.OFF,
    )
    assert off["borrowing_blocked"] is None
    assert off["default_ceiling_limit"] == 150  # the table still says so
    bare = build(PayloadBuilder(), Accounting(), {})
    assert (bare["ceiling_limits"], bare["default_ceiling_limit"]) == ({}, None)
    assert bare["borrowing_blocked"] is None
    assert parse(bare).borrowing_blocked is None


def _valid() -> dict:
    accounting = Accounting()
    accounting.record("alice", BORROWED, 3)
    return build(
        PayloadBuilder(),
        accounting,
        {"alice": 50},
        ceilings=ceilings(POLICY, ("bob",)),
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(ceiling_limits={"mallory": 5}), "not labelled"),
        (lambda p: p.update(ceiling_limits={"alice": -1}), "ceiling_limits"),
        (lambda p: p.pop("ceiling_limits"), "ceiling_limits must be an object"),
        (lambda p: p.update(default_ceiling_limit=-1), "default_ceiling_limit"),
        (lambda p: p.update(default_ceiling_limit="x"), "default_ceiling_limit"),
        (lambda p: p.pop("borrowing_blocked"), "borrowing_blocked must be"),
        (lambda p: p.update(borrowing_blocked=2), "borrowing_blocked must be"),
        (lambda p: p.update(borrowing_blocked=True), "borrowing_blocked must be"),
        (
            lambda p: p["users"]["alice"].update(borrowed_tokens=-1),
            "'borrowed_tokens'.* non-negative integer",
        ),
        (
            lambda p: p["users"]["alice"].update(borrowed_tokens=0.5),
            "'borrowed_tokens'.* non-negative integer",
        ),
    ],
)
def test_parse_rejects_a_malformed_ceilings_part_naming_the_field(mutate, message):
    payload = _valid()
    assert parse(payload).borrowing_blocked is True  # the unmodified one is fine
    mutate(payload)
    with pytest.raises(PayloadError, match=message):
        parse(payload)
