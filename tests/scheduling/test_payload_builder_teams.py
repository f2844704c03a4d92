"""Tests for ``engine_ext.payload_builder``: the teams' part of the payload
(pure: no vLLM, no Prometheus).

What must hold: the ``team`` label is bounded like the ``user`` label (at most
``max_labelled_users`` teams, the rest under ``__other__``); each event counts
once, in the team its user belongs to at the next build, exempt members
included; the member gauges count a team's members with live requests and the
throttled ones among them, and the member-seconds counters integrate them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.payload_builder import PayloadBuilder, TeamActivity
from engine_ext.payload_parser import PayloadError, parse
from engine_ext.stats_payload import COUNTER_FIELDS, OTHER_TEAM, OTHER_TIER
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.teams import TeamTable
from tests.payload_harness import MS, build


def acme_and_beta() -> TeamTable:
    """acme: 600 (alice, bob), beta: 200 (carol); erin in no team."""
    return TeamTable(
        {"acme": 600, "beta": 200}, {"alice": "acme", "bob": "acme", "carol": "beta"}
    )


def activity(
    table: TeamTable,
    live: tuple[str, ...] = (),
    throttled: tuple[str, ...] = (),
    now_ns: int = 0,
) -> TeamActivity:
    return TeamActivity(table=table, live=live, throttled=throttled, now_ns=now_ns)


def test_team_series_sum_their_members_counters() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 3)
    accounting.record("bob", "charged", 4)
    accounting.record("bob", "throttled_skips", 2)
    accounting.record("bob", "refunds", 1)
    accounting.record("carol", "shadow_skips", 5)
    accounting.record("carol", "fair_share_service", 2.5)
    accounting.record("erin", "charged", 100)  # in no team
    # bob is exempt through his tier: still a member for the series.
    limiter = OutputRateLimiter(
        10, {}, memberships={"bob": "staff"}, exempt_tiers={"staff"}
    )
    raw = build(
        PayloadBuilder(),
        accounting,
        {},
        limiter=limiter,
        teams=activity(acme_and_beta()),
    )
    assert raw["teams"] == {"acme": 600, "beta": 200}
    assert raw["team_counters"] == {
        "acme": {"charged": 7, "throttled_skips": 2, "refunds": 1},
        "beta": {"shadow_skips": 5, "fair_share_service": 2.5},
    }
    assert raw["tier_counters"] == {
        "staff": {"charged": 4, "throttled_skips": 2, "refunds": 1}
    }
    payload = parse(raw)
    assert payload.teams == raw["teams"]
    assert payload.team_counters == raw["team_counters"]


def test_team_counters_are_deltas_and_follow_membership_changes() -> None:
    accounting = Accounting()
    table = acme_and_beta()
    builder = PayloadBuilder()
    accounting.record("alice", "charged", 3)
    build(builder, accounting, {}, teams=activity(table))
    assert build(builder, accounting, {}, teams=activity(table))["team_counters"] == {}
    # alice moves to beta: her earlier tokens stay with acme, new ones go to beta.
    table.set_membership("alice", "beta")
    accounting.record("alice", "charged", 2)
    raw = build(builder, accounting, {}, teams=activity(table))
    assert raw["team_counters"] == {"beta": {"charged": 2}}


def test_team_labels_are_bounded_like_users() -> None:
    teams = {f"t{i:02d}": 10 + i for i in range(5)}
    table = TeamTable(teams, {f"u{i}": team for i, team in enumerate(teams)})
    accounting = Accounting()
    for i in range(5):
        accounting.record(f"u{i}", "charged", i + 1)
    builder = PayloadBuilder(max_labelled_users=2)
    raw = build(builder, accounting, {}, teams=activity(table))
    assert raw["teams"] == {"t00": 10, "t01": 11}
    assert raw["team_counters"] == {
        "t00": {"charged": 1},
        "t01": {"charged": 2},
        OTHER_TEAM: {"charged": 3 + 4 + 5},
    }
    # Sticky like users: a new team sorting first waits for room.
    table.set_rate("a-new", 1)
    assert build(builder, accounting, {}, teams=activity(table))["teams"] == {
        "t00": 10,
        "t01": 11,
    }
    # A team named like the catch-all is never labelled.
    reserved = TeamTable({OTHER_TEAM: 5}, {"alice": OTHER_TEAM})
    accounting.record("alice", "charged", 2)
    raw = build(PayloadBuilder(), accounting, {}, teams=activity(reserved))
    assert raw["teams"] == {}
    assert raw["team_counters"] == {OTHER_TEAM: {"charged": 2}}


def test_team_members_count_those_streaming_and_throttled_now() -> None:
    raw = build(
        PayloadBuilder(),
        Accounting(),
        {},
        teams=activity(
            acme_and_beta(),
            live=("alice", "bob", "erin"),
            # carol's request ended since the last step: not streaming, not counted.
            throttled=("bob", "carol", "erin"),
        ),
    )
    assert raw["team_members"] == {"acme": [2, 1], "beta": [0, 0], OTHER_TEAM: [0, 0]}
    assert parse(raw).team_members == {
        "acme": (2, 1),
        "beta": (0, 0),
        OTHER_TEAM: (0, 0),
    }


def test_team_member_seconds_integrate_the_counts_between_builds() -> None:
    table = acme_and_beta()
    builder = PayloadBuilder()
    accounting = Accounting()
    first = build(
        builder, accounting, {}, teams=activity(table, ("alice", "bob"), ("bob",), 0)
    )
    assert first["team_member_ns"] == {}  # no interval yet
    # For 100 ms acme had 2 members streaming, 1 of them throttled.
    raw = build(
        builder, accounting, {}, teams=activity(table, ("alice", "carol"), (), 100 * MS)
    )
    assert raw["team_member_ns"] == {"acme": [200 * MS, 100 * MS]}
    # Then 50 ms with alice alone in acme and carol in beta, neither throttled.
    raw = build(builder, accounting, {}, teams=activity(table, (), (), 150 * MS))
    assert raw["team_member_ns"] == {"acme": [50 * MS, 0], "beta": [50 * MS, 0]}
    assert parse(raw).team_member_ns == {"acme": (50 * MS, 0), "beta": (50 * MS, 0)}


def test_without_teams_there_are_no_team_series() -> None:
    accounting = Accounting()
    accounting.record("alice", "charged", 2)
    for teams in (None, activity(TeamTable(), live=("alice",))):
        raw = build(PayloadBuilder(), accounting, {}, teams=teams)
        assert (raw["teams"], raw["team_counters"]) == ({}, {})
        assert (raw["team_members"], raw["team_member_ns"]) == ({}, {})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(teams={"acme": -1}), "teams\\['acme'\\]"),
        (lambda p: p.update(team_counters={"zeta": {"charged": 1}}), "'zeta'"),
        (lambda p: p.update(team_members={"acme": [1, 2]}), "2 throttled of 1"),
        (lambda p: p.update(team_members={"zeta": [1, 0]}), "'zeta'"),
        (lambda p: p.update(team_member_ns={"acme": [5]}), "pair"),
        (lambda p: p.pop("team_member_ns"), "team_member_ns must be an object"),
    ],
)
def test_parse_rejects_malformed_team_parts(mutate, message: str) -> None:
    raw = build(
        PayloadBuilder(), Accounting(), {}, teams=activity(acme_and_beta(), ("alice",))
    )
    parse(raw)
    mutate(raw)
    with pytest.raises(PayloadError, match=message):
        parse(raw)


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
            # user index -> group index (3: none), for teams and for tiers
            st.dictionaries(st.integers(0, 4), st.integers(0, 3)),
            st.dictionaries(st.integers(0, 4), st.integers(0, 3)),
            st.booleans(),  # tiers exist at this build
            st.sets(st.integers(0, 4)),  # users the accounting forgets first
            st.sets(st.integers(0, 4)),  # and those it forgets before the build
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_team_and_tier_deltas_each_count_every_event_once(
    cap: int, steps: list
) -> None:
    """Teams exist at every build, tiers at some: each event recorded between
    two builds counts once in the team its user is in at the later build, and
    once in its tier while tiers are counted (the one pass serves both), also
    when the accounting forgot the user in between."""
    accounting = Accounting(keep_forgotten=True)
    builder = PayloadBuilder(max_labelled_users=cap, max_labelled_tiers=cap)
    emitted = {kind: dict.fromkeys(COUNTER_FIELDS, 0) for kind in ("team", "tier")}
    expected = {kind: dict.fromkeys(COUNTER_FIELDS, 0) for kind in ("team", "tier")}
    pending: dict[int, dict[str, int]] = {}  # user -> events since last build
    for events, teams, tiers, tiers_exist, forgotten, forgotten_last in steps:
        forget(accounting, forgotten)
        for user, event, count in events:
            accounting.record(f"u{user}", event, count)
            row = pending.setdefault(user, {})
            row[event] = row.get(event, 0) + count
        forget(accounting, forgotten_last)
        table = TeamTable(
            {"a": 1, "b": 2, "c": 3},
            {f"u{u}": "abc"[t] for u, t in teams.items() if t < 3},
        )
        limiter = OutputRateLimiter(
            10,
            {},
            tier_rates={"t0": 1, "t1": 2, "t2": 3} if tiers_exist else {},
            memberships={f"u{u}": f"t{t}" for u, t in tiers.items() if t < 3}
            if tiers_exist
            else {},
        )
        raw = build(builder, accounting, {}, limiter=limiter, teams=activity(table))
        assert len(raw["teams"]) <= cap
        assert set(raw["team_counters"]) <= {*raw["teams"], OTHER_TEAM}
        assert set(raw["tier_counters"]) <= {*raw["tiers"], OTHER_TIER}
        for user, row in pending.items():
            for kind, groups in (("team", teams), ("tier", tiers)):
                if groups.get(user, 3) < 3 and (kind == "team" or tiers_exist):
                    for event, count in row.items():
                        expected[kind][event] += count
        pending = {}
        for kind in ("team", "tier"):
            for row in raw[f"{kind}_counters"].values():
                for event, delta in row.items():
                    assert delta > 0
                    emitted[kind][event] += delta
    assert emitted == expected
