"""The churn proof's bookkeeping: the GCRA bound against the real limiter, the
log's table against the limiter's resolution, and how reads become intervals."""

from __future__ import annotations

import random

import pytest

from pacing.limiter import NS_PER_S, OutputRateLimiter
from tests.churn_log import (
    ENFORCE,
    OFF,
    SHADOW,
    Change,
    Interval,
    Read,
    State,
    Table,
    gcra_bound,
    measure,
)

MS = 1_000_000
T0 = 10**12  # a clock far from 0, as a monotonic clock is

# -- the bound -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "window_ns", "bound"),
    [
        # rate, window, floor(rate * (window + 100 ms) / 1 s) + 1
        (10, 0, 2),
        (10, NS_PER_S, 12),
        (7, 333 * MS, 4),  # 7 * 0.433 = 3.03
        (1, 0, 1),
        (36, 20 * MS, 5),  # 36 * 0.12 = 4.32
        (3, 900 * MS - 1, 3),  # 3 * 0.999999999 = 2.99...
        (3, 900 * MS, 4),
    ],
)
def test_gcra_bound_golden(rate, window_ns, bound):
    assert gcra_bound(rate, window_ns) == bound


@pytest.mark.parametrize("rate", [1, 6, 7, 36, 1000])
@pytest.mark.parametrize("window_ns", [0, 1, 20 * MS, 333 * MS, 5 * NS_PER_S])
def test_the_bound_is_what_a_greedy_user_gets_from_a_full_bucket(rate, window_ns):
    """A user that takes all it may at the start and then at every instant a
    token becomes ready gets exactly the bound: it is tight."""
    limiter = OutputRateLimiter(rate, {})
    tokens, now = 0, T0
    while now <= T0 + window_ns:
        taken, _ = limiter.take_up_to("u", 10**9, now)
        tokens += taken
        now = limiter.ready_at_ns("u", now + 1)
    assert tokens == gcra_bound(rate, window_ns)


def test_no_steps_beat_the_bound_whatever_came_before():
    """Steps as the scheduler makes them (a grant of up to the live requests
    and the unused part given back at the same instant, or an after-the-fact
    batch within the budget), after random debt at other rates: the net
    tokens of the steps in any window at one rate stay within its bound."""
    rng = random.Random(7)
    for _ in range(300):
        limiter = OutputRateLimiter(1000, {}, tier_rates={"t": rng.randint(1, 50)})
        limiter.set_membership("u", "t", T0)
        now = T0
        for _ in range(rng.randint(0, 5)):  # debt or credit under other rates
            now += rng.randint(0, 200 * MS)
            limiter.take_up_to("u", rng.randint(0, 20), now)
            limiter.set_tier_rate("t", rng.randint(1, 50), now)
        rate = limiter.rate_of("u")
        times = sorted(now + rng.randint(0, 2 * NS_PER_S) for _ in range(40))
        net = []
        for t in times:
            if rng.random() < 0.5:
                granted, _ = limiter.take_up_to("u", rng.randint(1, 3), t)
                unused = rng.randint(0, granted)
                limiter.refund("u", t, unused)
                net.append(granted - unused)
            else:
                count = rng.randint(0, limiter.available("u", t))
                limiter.take_each({"u": count}, t)
                net.append(count)
        for i in range(len(times)):
            for j in range(i, len(times)):
                tokens = sum(net[i : j + 1])
                assert tokens <= gcra_bound(rate, times[j] - times[i])


# -- the table -----------------------------------------------------------------

USERS = [f"u{i}" for i in range(6)]
TIERS = ["a", "b", "c"]


def random_change(rng: random.Random) -> Change:
    kind = rng.choice(["tier_rate", "tier_exempt", "membership", "user_exempt"])
    if kind == "tier_rate":
        return Change(kind, rng.choice(TIERS), rng.randint(1, 50))
    if kind == "tier_exempt":
        return Change(kind, rng.choice(TIERS), rng.random() < 0.5)
    if kind == "membership":
        return Change(kind, rng.choice(USERS), rng.choice(TIERS))
    return Change(kind, rng.choice(USERS), rng.random() < 0.5)


def test_the_table_resolves_limits_as_the_limiter_does():
    rng = random.Random(3)
    rates = {"a": 5, "b": 10, "c": 20}
    members = {u: TIERS[i % 3] for i, u in enumerate(USERS)}
    table = Table(dict(rates), dict(members))
    limiter = OutputRateLimiter(1000, {}, tier_rates=rates, memberships=members)
    setters = {
        "tier_rate": limiter.set_tier_rate,
        "tier_exempt": limiter.set_tier_exempt,
        "membership": limiter.set_membership,
        "user_exempt": limiter.set_user_exempt,
    }
    for _ in range(500):
        change = random_change(rng)
        table.apply(change)
        setters[change.kind](change.target, change.value, T0)
        assert {u: table.limit(u) for u in USERS} == {
            u: limiter.rate_of(u) for u in USERS
        }


def test_the_table_follows_the_mode():
    table = Table({"a": 5}, {"u": "a"})
    assert table.states(["u"]) == {"u": (ENFORCE, 5)}
    table.apply(Change("mode", "", SHADOW))
    table.apply(Change("user_exempt", "u", True))
    assert table.states(["u"]) == {"u": (SHADOW, 0)}


@pytest.mark.parametrize(
    "change",
    [
        Change("membership", "u", "nope"),
        Change("tier_rate", "nope", 5),
        Change("tier_exempt", "nope", True),
        Change("tier_rate", "a", 0),
        Change("tier_rate", "a", True),
        Change("mode", "", "loud"),
        Change("default", "", 5),
    ],
)
def test_the_table_refuses_what_the_server_would(change):
    table = Table({"a": 5}, {"u": "a"})
    with pytest.raises(ValueError):
        table.apply(change)
    assert table == Table({"a": 5}, {"u": "a"})


# -- intervals -----------------------------------------------------------------


def reads(*nets: int) -> list[Read]:
    """Reads 20 ms apart, each taking 5 ms, with user u's net counts."""
    return [
        Read(sent_ns=j * 20 * MS, received_ns=j * 20 * MS + 5 * MS, net={"u": n})
        for j, n in enumerate(nets)
    ]


def states(*states: State) -> list[dict[str, State]]:
    return [{"u": s} for s in states]


def test_intervals_run_between_changes_of_the_state_and_skip_unmeasured_ones():
    on10, on20 = (ENFORCE, 10), (ENFORCE, 20)
    result = measure(
        reads(100, 101, 103, 110, 111, 150, 160, 170, 171, 172, 180),
        states(
            *[on10] * 3,
            *[on20] * 2,
            *[(SHADOW, 20)] * 2,
            (OFF, 20),
            *[(ENFORCE, 0)] * 2,  # exempt
            on20,  # one read: no interval
        ),
        ["u"],
    )
    assert result.intervals == [
        Interval("u", 10, 0, 2, window_ns=45 * MS, tokens=3),
        Interval("u", 20, 3, 4, window_ns=25 * MS, tokens=1),
    ]
    assert (result.resets, result.unproven) == (0, 0)
    assert (result.pairs, result.covered) == (3, 3)
    assert result.intervals[0].bound == 2  # 10 * 0.145 + 1


def test_a_shrinking_count_cuts_the_interval_and_counts_a_reset():
    on = (ENFORCE, 10)
    result = measure(reads(100, 104, 3, 5, 7), states(*[on] * 5), ["u"])
    assert [(i.first, i.last, i.tokens) for i in result.intervals] == [
        (0, 1, 4),
        (2, 4, 4),
    ]
    # 3, 5 were within the pair's bound (10 * 0.145 + 1 = 2.45): 3 > 2 proves no
    # reset between reads 2 and 3, so only the shrink is cut.
    assert (result.resets, result.unproven) == (1, 0)
    assert (result.pairs, result.covered) == (4, 3)


def test_a_count_a_reset_could_hide_in_cuts_the_interval():
    on = (ENFORCE, 10)
    result = measure(reads(0, 2, 3, 9), states(*[on] * 4), ["u"])
    # Pair bound 2: 0 and 2 cannot prove no reset happened; 3 can.
    assert [(i.first, i.last) for i in result.intervals] == [(2, 3)]
    assert (result.resets, result.unproven) == (0, 2)
    assert (result.pairs, result.covered) == (3, 1)


def test_reads_and_states_must_pair_up():
    with pytest.raises(ValueError):
        measure(reads(1, 2), states((ENFORCE, 10)), ["u"])
