"""Tests for ``pacing.limiter.OutputRateLimiter`` (pure GCRA, injected clock).

Two styles, after golang.org/x/time/rate and redis-cell:

- golden tables: numbered rows walked in order on a fixed time grid ``t0 ... t9``
  (50 ms apart) by ``run_table``, which names the failing step;
- hypothesis properties for the two bounds the module docstring promises, for
  ``ready_at_ns`` being exact, and for ``cleanup_idle_users`` being invisible.

Every time is an integer number of nanoseconds; every bound is checked in exact
integer arithmetic (multiplied through by ``NS_PER_S``), never in floats.
"""

from __future__ import annotations

import bisect
import copy
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacing.limiter import (
    DEFAULT_BURST_NS,
    MAX_RATE,
    NS_PER_S,
    UNLIMITED,
    LimitSource,
    LimitTable,
    OutputRateLimiter,
)

MS = 1_000_000
B = DEFAULT_BURST_NS  # 100 ms

# The time grid, as in x/time/rate's tests.
GRID = tuple(k * 50 * MS for k in range(10))
t0, t1, t2, t3, t4, t5, t6, t7, t8, t9 = GRID
GRID_NAMES = {t: f"t{k}" for k, t in enumerate(GRID)}

FAST = settings(max_examples=200, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def at(now: int) -> str:
    return GRID_NAMES.get(now, f"{now}ns")


# --------------------------------------------------------------------------
# Golden tables
# --------------------------------------------------------------------------


class Row(NamedTuple):
    """One step of a golden table: do ``op``, then read ``user``'s state at ``now``."""

    op: str  # take | refund | set_rate | set_default | cleanup
    user: str
    now: int
    arg: int | None  # the rate for set_rate / set_default, else None
    want: object  # what the op returns
    ready_at: int  # ready_at_ns(user, now) after the op
    lead: int  # lead_ns(user, now) after the op
    rate: int  # rate_of(user) after the op
    tracked: int  # tracked_users() after the op


def apply(lim: OutputRateLimiter, row: Row) -> object:
    if row.op == "take":
        return lim.try_take(row.user, row.now)
    if row.op == "refund":
        return lim.refund(row.user, row.now)
    if row.op == "set_rate":
        return lim.set_rate(row.user, row.arg, row.now)
    if row.op == "set_default":
        assert row.arg is not None
        return lim.set_default_rate(row.arg, row.now)
    if row.op == "cleanup":
        return lim.cleanup_idle_users(row.now)
    raise AssertionError(f"unknown op {row.op!r}")


def run_table(lim: OutputRateLimiter, rows: list[Row]) -> None:
    """Walks ``rows`` in order; a mismatch names the step (1-based) and its time."""
    for i, row in enumerate(rows, start=1):
        result = apply(lim, row)
        got = (
            result,
            lim.ready_at_ns(row.user, row.now),
            lim.lead_ns(row.user, row.now),
            lim.rate_of(row.user),
            lim.tracked_users(),
        )
        want = (row.want, row.ready_at, row.lead, row.rate, row.tracked)
        assert got == want, (
            f"step {i}: {row.op}({row.user!r}, {at(row.now)}, arg={row.arg!r}) "
            "-> (result, ready_at, lead, rate, tracked) = "
            f"{got}, want {want}"
        )


# alice runs on the default (10 tok/s, T = 100 ms); bob has an override of 3 tok/s,
# where T = 333_333_333.33 ns is not a whole number of nanoseconds, so his
# ready_at and lead values show the rounding up.
#
#    op             user     now  arg   -> result ready_at     lead         rate tracked
GOLDEN = [
    Row("take",     "alice", t0, None, True,  t0,          100 * MS,    10, 1),  # 1
    Row("take",     "alice", t0, None, True,  t2,          200 * MS,    10, 1),  # 2
    Row("take",     "alice", t0, None, False, t2,          200 * MS,    10, 1),  # 3
    Row("take",     "alice", t1, None, False, t2,          150 * MS,    10, 1),  # 4
    Row("take",     "bob",   t1, None, True,  283_333_334, 333_333_334, 3,  2),  # 5
    Row("take",     "bob",   t1, None, False, 283_333_334, 333_333_334, 3,  2),  # 6
    Row("take",     "alice", t2, None, True,  t4,          200 * MS,    10, 2),  # 7
    Row("refund",   "alice", t2, None, None,  t2,          100 * MS,    10, 2),  # 8
    Row("take",     "alice", t2, None, True,  t4,          200 * MS,    10, 2),  # 9
    # 1.5 tokens of debt at 10/s (150 ms) are 1.5 tokens at 20/s (75 ms).
    Row("set_rate", "alice", t3, 20,   None,  t3,          75 * MS,     20, 2),  # 10
    Row("take",     "alice", t3, None, True,  175 * MS,    125 * MS,    20, 2),  # 11
    Row("take",     "alice", t3, None, False, 175 * MS,    125 * MS,    20, 2),  # 12
    # Clearing the override: back to 10/s, still 1.5 tokens of debt (150 ms).
    Row("set_rate", "alice", t4, None, None,  t5,          150 * MS,    10, 2),  # 13
    Row("take",     "bob",   t4, None, False, 283_333_334, 183_333_334, 3,  2),  # 14
    Row("take",     "alice", t5, None, True,  t7,          200 * MS,    10, 2),  # 15
    Row("take",     "bob",   t5, None, False, 283_333_334, 133_333_334, 3,  2),  # 16
    # The default moves alice (2 tokens of debt: 200 ms -> 100 ms), not bob.
    Row("set_default", "alice", t5, 20, None, t5,          100 * MS,    20, 2),  # 17
    Row("take",     "bob",   t6, None, True,  616_666_667, 416_666_667, 3,  2),  # 18
    Row("cleanup",  "alice", t6, None, 0,     t6,          50 * MS,     20, 2),  # 19
    # alice's TAT is exactly t7: not ahead of now, so she is dropped.
    Row("cleanup",  "alice", t7, None, 1,     t7,          0,           20, 1),  # 20
    Row("take",     "alice", t7, None, True,  t7,          50 * MS,     20, 2),  # 21
    Row("cleanup",  "bob",   t9, None, 1,     616_666_667, 266_666_667, 3,  1),  # 22
]  # fmt: skip


def test_golden_table_on_the_time_grid() -> None:
    run_table(OutputRateLimiter(10, {"bob": 3}), GOLDEN)


# Time going backwards (rate 10/s): an earlier now sees the TAT further ahead, so
# it is stricter, never looser; nothing raises.
#
#    op           user     now  arg   -> result ready_at lead      rate tracked
BACKWARDS = [
    Row("take",    "carol", t4, None, True,  t4,      100 * MS, 10, 1),  # 1
    Row("take",    "carol", t4, None, True,  t6,      200 * MS, 10, 1),  # 2
    Row("take",    "carol", t2, None, False, t6,      300 * MS, 10, 1),  # 3
    Row("refund",  "carol", t1, None, None,  t4,      250 * MS, 10, 1),  # 4
    Row("take",    "carol", t4, None, True,  t6,      200 * MS, 10, 1),  # 5
    Row("cleanup", "carol", t0, None, 0,     t6,      400 * MS, 10, 1),  # 6
    Row("take",    "carol", t3, None, False, t6,      250 * MS, 10, 1),  # 7
    Row("take",    "carol", t6, None, True,  t8,      200 * MS, 10, 1),  # 8
]  # fmt: skip


def test_time_going_backwards_is_stricter_never_looser() -> None:
    run_table(OutputRateLimiter(10, {}), BACKWARDS)


def test_cleanup_keeps_a_user_whose_tat_is_a_fraction_of_a_nanosecond_ahead() -> None:
    # At 3 tok/s one token moves the TAT to 333_333_333.33 ns.
    lim = OutputRateLimiter(3, {})
    assert lim.try_take("u", 0)
    assert lim.lead_ns("u", 333_333_333) == 1
    assert lim.cleanup_idle_users(333_333_333) == 0
    assert lim.tracked_users() == 1
    assert lim.lead_ns("u", 333_333_334) == 0
    assert lim.cleanup_idle_users(333_333_334) == 1
    assert lim.tracked_users() == 0


# --------------------------------------------------------------------------
# ready_at_ns is exact
# --------------------------------------------------------------------------


@st.composite
def indebted_limiters(draw: st.DrawFn) -> tuple[OutputRateLimiter, int]:
    """A limiter whose user ``u`` took random tokens at random times (often at the
    same instant, with a burst small enough that those takes run into debt), maybe
    followed by a rate change; returns it with the current time."""
    rate = draw(st.integers(1, MAX_RATE))
    interval = ceil_div(NS_PER_S, rate)
    burst = draw(st.integers(0, min(B, 30 * interval)))
    lim = OutputRateLimiter(rate, {}, burst_ns=burst)
    now = draw(st.integers(-(10**15), 10**15))
    gaps = st.one_of(st.just(0), st.integers(0, interval), st.integers(0, 3 * burst))
    for gap in draw(st.lists(gaps, max_size=60)):
        now += gap
        lim.try_take("u", now)
    if draw(st.booleans()):
        lim.set_rate("u", draw(st.integers(1, MAX_RATE)), now)
    now += draw(st.one_of(st.just(0), st.integers(0, interval)))
    return lim, now


@FAST
@given(indebted_limiters())
def test_ready_at_is_the_first_nanosecond_a_take_succeeds(
    scenario: tuple[OutputRateLimiter, int],
) -> None:
    lim, now = scenario
    ready = lim.ready_at_ns("u", now)
    lead = lim.lead_ns("u", now)
    assert ready >= now
    assert ready == max(now, now + lead - lim.burst_ns)
    if ready > now:
        assert not copy.deepcopy(lim).try_take("u", ready - 1)
    assert copy.deepcopy(lim).try_take("u", ready)


# --------------------------------------------------------------------------
# Upper bound: any window [a, a+W] holds at most (W + burst) * rate + 1 grants
# --------------------------------------------------------------------------

WINDOWS = (0, 1, 10 * MS, 50 * MS, B, 250 * MS, NS_PER_S, 3 * NS_PER_S)

small_rates = st.one_of(st.integers(1, 300), st.sampled_from([3, 7, 1000, MAX_RATE]))
gaps_ns = st.one_of(
    st.just(0), st.integers(0, 5 * MS), st.integers(0, 400 * MS), st.just(1)
)
op_kinds = st.sampled_from(
    ["take"] * 8 + ["refund", "refund", "set_rate", "clear_rate", "set_default"]
)
ops = st.lists(st.tuples(op_kinds, gaps_ns, small_rates), min_size=1, max_size=150)


def replay(
    lim: OutputRateLimiter, script: list[tuple[str, int, int]], start: int
) -> list[tuple[int, list[int]]]:
    """Runs ``script`` for user ``u`` from ``start`` (each op after its gap) and
    returns, per constant-rate segment, ``(rate, times of net grants)``.

    A refund gives back the latest grant not yet refunded (at whatever later time
    it comes): on a monotone clock the limiter's state is then exactly that of the
    history without that grant (on one that steps back, at least as strict), so
    the net grants are what the bounds are about.

    On the way it checks the clamp: every call that writes ``u``'s state at ``now``
    (a granted take, a refund, a rate change) leaves the TAT at or after ``now``,
    so the state never offers an earlier ``now`` more than the current one.
    """
    segments: list[tuple[int, list[int]]] = [(lim.rate_of("u"), [])]
    live: list[tuple[int, int]] = []  # (segment index, time), oldest first
    now = start
    for i, (kind, gap, rate) in enumerate(script, start=1):
        now += gap
        wrote = False
        if kind == "take":
            if lim.try_take("u", now):
                live.append((len(segments) - 1, now))
                wrote = True
        elif kind == "refund":
            lim.refund("u", now)
            if live:
                live.pop()
            wrote = lim.tracked_users() == 1
        else:
            if kind == "set_rate":
                lim.set_rate("u", rate, now)
            elif kind == "clear_rate":
                lim.set_rate("u", None, now)
            else:
                lim.set_default_rate(rate, now)
            if lim.rate_of("u") != segments[-1][0]:
                segments.append((lim.rate_of("u"), []))
                wrote = lim.tracked_users() == 1
        if wrote:
            assert lim.lead_ns("u", now - 1) >= 1, f"step {i}: {kind} left TAT < now"
    for seg, when in live:
        segments[seg][1].append(when)
    return segments


def assert_upper_bound(rate: int, times: list[int], burst: int) -> None:
    times = sorted(times)
    for a in times:
        first = bisect.bisect_left(times, a)
        for w in WINDOWS:
            count = bisect.bisect_right(times, a + w) - first
            assert count * NS_PER_S <= (w + burst) * rate + NS_PER_S, (
                f"{count} grants in [{a}, {a} + {w}] at {rate} tok/s"
            )


@FAST
@given(
    default=small_rates,
    override=st.none() | small_rates,
    start=st.integers(-(10**15), 10**15),
    script=ops,
)
def test_no_window_holds_more_than_w_plus_burst_times_rate_plus_one(
    default: int, override: int | None, start: int, script: list
) -> None:
    lim = OutputRateLimiter(default, {} if override is None else {"u": override})
    for rate, times in replay(lim, script, start):
        assert_upper_bound(rate, times, B)


def test_a_burst_at_one_instant_is_burst_times_rate_plus_one() -> None:
    for rate, want in [(10, 2), (3, 1), (20, 3), (1000, 101)]:
        lim = OutputRateLimiter(rate, {})
        got = sum(lim.try_take("u", t0) for _ in range(200))
        assert got == want, f"rate {rate}: {got} tokens at one instant, want {want}"


# --------------------------------------------------------------------------
# Lower bound: a user asking continuously gets about W * rate - 1
# --------------------------------------------------------------------------


def continuous_demand(
    rate: int, step: int, start: int, n_steps: int, burst: int = B
) -> list[int]:
    """Grant times for a fresh user who attempts every ``step`` ns."""
    lim = OutputRateLimiter(rate, {}, burst_ns=burst)
    times = (start + k * step for k in range(n_steps))
    return [t for t in times if lim.try_take("u", t)]


def fewest_grants(grants: list[int], first: int, last: int, w: int) -> int:
    """The fewest grants in any window [a, a+w] inside [first, last]. The fewest
    come right after a grant, so only a = first and a = grant + 1 need checking."""
    counts = [
        bisect.bisect_right(grants, a + w) - bisect.bisect_left(grants, a)
        for a in [first, *(g + 1 for g in grants)]
        if first <= a and a + w <= last
    ]
    assert counts, "no window fits; the scenario is too short"
    return min(counts)


@FAST
@given(
    rate=st.integers(1, 1000),
    data=st.data(),
    start=st.integers(-(10**15), 10**15),
)
def test_continuous_demand_gets_at_least_w_rate_minus_one_less_a_step(
    rate: int, data: st.DataObject, start: int
) -> None:
    """Attempts every ``s`` ns, ``s <= T = 1/rate`` and ``s <= burst``: any window
    ``[a, a+W]`` inside the demanding period holds more than ``(W - s) * rate - 1``
    grants.

    Derivation. Let ``g`` be the TAT's lead over ``now`` just after an attempt. The
    first grant gives ``g = T``; while every attempt is granted ``g`` grows by
    ``T - s >= 0``; after the first refusal it stays in ``(burst, burst + T]`` (a
    refusal needs ``g - s > burst``, and a grant from there lands above ``burst -
    s + T >= burst``). As ``g >= min(T, burst) >= s``, the TAT never falls behind
    the next attempt, so each grant adds exactly ``T`` to it. With ``t_L`` the last
    attempt in the window and ``t_P`` the last one before it, ``n*T = (t_L - t_P) +
    g_L - g_P > (W - s) - T``.

    Hence two departures from the spec's ``W * rate - 1``. It is only the ``s ->
    0`` limit: a grant can come up to ``s`` late (see the coarse-grid test below).
    And ``burst >= s`` is needed: with less, the TAT can fall behind ``now``
    between attempts and the gap is forfeited (burst 0, 779 tok/s, 1 ms steps: a
    grant every 2 ms, 500 tok/s). Bursts down to ``s`` are drawn because they reach
    the steady state sooner than the 100 ms default.
    """
    step = data.draw(st.integers(MS, min(100 * MS, NS_PER_S // rate)), label="step")
    w = data.draw(st.integers(0, 2 * NS_PER_S), label="W")
    n_steps = (w + data.draw(st.integers(0, NS_PER_S), label="extra")) // step + 2
    burst = data.draw(st.sampled_from([step, B]) | st.integers(step, B), label="burst")
    grants = continuous_demand(rate, step, start, n_steps, burst)
    fewest = fewest_grants(grants, start, start + (n_steps - 1) * step, w)
    assert fewest * NS_PER_S > (w - step) * rate - NS_PER_S


ALIGNED_RATES = [r for r in range(1, 1001) if NS_PER_S % r == 0]


@FAST
@given(
    rate=st.sampled_from(ALIGNED_RATES),
    data=st.data(),
    start=st.integers(-(10**15), 10**15),
)
def test_continuous_demand_on_a_grid_dividing_t_gets_at_least_w_rate_minus_one(
    rate: int, data: st.DataObject, start: int
) -> None:
    """When the attempt step divides ``T`` the due times fall on attempts, no grant
    is late, and the spec's ``W * rate - 1`` holds exactly."""
    interval = NS_PER_S // rate
    steps = [
        interval // m
        for m in range(1, interval // MS + 1)
        if interval % m == 0 and interval // m <= 100 * MS
    ]
    step = data.draw(st.sampled_from(steps), label="step")
    w = data.draw(st.integers(0, 2 * NS_PER_S), label="W")
    n_steps = (w + data.draw(st.integers(0, NS_PER_S), label="extra")) // step + 2
    # Any burst, even 0: the TAT stays on the attempt grid, so none is forfeited.
    burst = data.draw(st.sampled_from([0, 1, 10 * MS, B]) | st.integers(0, B))
    grants = continuous_demand(rate, step, start, n_steps, burst)
    fewest = fewest_grants(grants, start, start + (n_steps - 1) * step, w)
    assert fewest * NS_PER_S >= w * rate - NS_PER_S


def test_a_coarse_attempt_grid_can_miss_w_rate_minus_one_by_less_than_a_step() -> None:
    # 10 tok/s attempted every 63 ms: grants land on 63 ms multiples, 126 ms apart
    # where a due time falls between two attempts.
    step, w = 63 * MS, 250 * MS
    grants = continuous_demand(10, step, 0, 40)
    i = grants.index(504 * MS)
    assert grants[i : i + 3] == [504 * MS, 630 * MS, 756 * MS]
    a = 504 * MS + 1
    count = bisect.bisect_right(grants, a + w) - bisect.bisect_left(grants, a)
    assert count == 1
    assert count * NS_PER_S < w * 10 - NS_PER_S  # 1 < 1.5: W*rate - 1 is missed
    assert count * NS_PER_S > (w - step) * 10 - NS_PER_S  # 1 > 0.87: the slack holds


# --------------------------------------------------------------------------
# Rate changes keep the token debt
# --------------------------------------------------------------------------


def test_raising_a_limit_mid_throttle_lets_the_next_token_through_at_the_new_pace() -> (
    None
):
    lim = OutputRateLimiter(10, {})
    assert [lim.try_take("u", t0) for _ in range(3)] == [True, True, False]
    assert (lim.lead_ns("u", t0), lim.ready_at_ns("u", t0)) == (200 * MS, t2)
    lim.set_rate("u", 40, t0)  # 2 tokens of debt at 40/s: 50 ms
    assert (lim.lead_ns("u", t0), lim.ready_at_ns("u", t0)) == (50 * MS, t0)
    assert [lim.try_take("u", t0) for _ in range(4)] == [True, True, True, False]
    # Then one token every 25 ms.
    assert lim.ready_at_ns("u", t0) == 25 * MS
    assert not lim.try_take("u", 25 * MS - 1)
    assert lim.try_take("u", 25 * MS)
    assert lim.ready_at_ns("u", 25 * MS) == t1


@FAST
@given(
    old=st.integers(1, 2000),
    new=st.integers(1, MAX_RATE),
    takes=st.integers(0, 40),
    dt=st.one_of(st.just(0), st.integers(0, 2 * NS_PER_S)),
    later=st.one_of(st.just(0), st.integers(0, NS_PER_S)),
    via_default=st.booleans(),
    start=st.integers(-(10**15), 10**15),
)
def test_a_rate_change_keeps_the_debt_in_tokens(
    old: int, new: int, takes: int, dt: int, later: int, via_default: bool, start: int
) -> None:
    lim = OutputRateLimiter(old, {})
    granted = sum(lim.try_take("u", start) for _ in range(takes))
    now = start + dt
    debt = max(0, granted * NS_PER_S - dt * old)  # tokens owed, times NS_PER_S
    lead = lim.lead_ns("u", now)
    assert lead == ceil_div(debt, old)
    if via_default:
        lim.set_default_rate(new, now)
    else:
        lim.set_rate("u", new, now)
    assert lim.rate_of("u") == new
    # Read first after ``later`` ns: the debt was converted at the change, and is
    # paid off at the new rate since.
    assert lim.lead_ns("u", now + later) == ceil_div(max(0, debt - later * new), new)
    after = lim.lead_ns("u", now)
    assert after == ceil_div(debt, new)
    # lead' = lead * r / r', up to lead's own rounding.
    assert ceil_div(max(0, (lead - 1) * old + 1), new) <= after
    assert after <= ceil_div(lead * old, new)


@FAST
@given(
    high=st.integers(20, 2000),
    data=st.data(),
    via_default=st.booleans(),
    start=st.integers(-(10**15), 10**15),
)
def test_lowering_a_limit_grants_no_fresh_burst(
    high: int, data: st.DataObject, via_default: bool, start: int
) -> None:
    low = data.draw(st.integers(1, high - 1), label="low")
    lim = OutputRateLimiter(high, {})
    granted = 0
    while lim.try_take("u", start):  # full debt at the high rate
        granted += 1
    assert granted == B * high // NS_PER_S + 1
    if via_default:
        lim.set_default_rate(low, start)
    else:
        lim.set_rate("u", low, start)
    ready = lim.ready_at_ns("u", start)
    assert ready == max(start, start + ceil_div(granted * NS_PER_S, low) - B)
    step = 2 * MS
    grants = [
        t
        for t in (start + k * step for k in range(NS_PER_S // step + 1))
        if lim.try_take("u", t)
    ]
    assert all(t >= ready for t in grants)
    assert len(grants) * NS_PER_S <= (NS_PER_S + B) * low + NS_PER_S


# --------------------------------------------------------------------------
# Overrides, the default, and "off"
# --------------------------------------------------------------------------


def test_clearing_an_override_falls_back_to_the_default_and_keeps_the_debt() -> None:
    lim = OutputRateLimiter(10, {"u": 40})
    assert [lim.try_take("u", t0) for _ in range(6)] == [True] * 5 + [False]
    assert lim.lead_ns("u", t0) == 125 * MS  # 5 tokens at 40/s
    lim.set_rate("u", None, t0)
    assert lim.user_rates == {}
    assert lim.rate_of("u") == 10
    assert lim.lead_ns("u", t0) == 500 * MS  # the same 5 tokens at 10/s
    assert lim.ready_at_ns("u", t0) == 400 * MS
    lim.set_rate("nobody", None, t0)  # clearing a missing override is harmless
    assert lim.rate_of("nobody") == 10


def test_set_default_rate_moves_only_users_without_an_override() -> None:
    lim = OutputRateLimiter(10, {"vip": 100})
    for user in ("plain", "vip"):
        assert lim.try_take(user, t0)
        assert lim.try_take(user, t0)
    assert (lim.lead_ns("plain", t0), lim.lead_ns("vip", t0)) == (200 * MS, 20 * MS)
    lim.set_default_rate(20, t0)
    assert lim.default_rate == 20
    assert (lim.rate_of("plain"), lim.rate_of("vip")) == (20, 100)
    # Read at t1: 2 tokens of debt at 20/s from t0 (100 ms), 50 ms of it paid.
    assert (lim.lead_ns("plain", t1), lim.lead_ns("vip", t1)) == (50 * MS, 0)
    assert (lim.lead_ns("plain", t0), lim.lead_ns("vip", t0)) == (100 * MS, 20 * MS)
    assert lim.rate_of("newcomer") == 20


@FAST
@given(
    script=st.lists(
        st.tuples(
            st.sampled_from(["take", "refund", "cleanup"]),
            st.sampled_from(["a", "b"]),
            st.integers(-(10**15), 10**15),
        ),
        max_size=50,
    )
)
def test_a_limiter_without_a_default_rate_always_allows(script: list) -> None:
    lim = OutputRateLimiter(None, {})
    assert not lim.enabled
    for kind, user, now in script:
        if kind == "take":
            assert lim.try_take(user, now)
        elif kind == "refund":
            lim.refund(user, now)
        else:
            assert lim.cleanup_idle_users(now) == 0
        assert lim.ready_at_ns(user, now) == now
        assert lim.lead_ns(user, now) == 0
        assert lim.rate_of(user) == 0
    assert lim.tracked_users() == 0


def test_set_default_rate_turns_a_disabled_limiter_on() -> None:
    lim = OutputRateLimiter(None, {})
    assert all(lim.try_take("u", t0) for _ in range(50))
    lim.set_default_rate(10, t0)
    assert lim.enabled
    assert lim.rate_of("u") == 10
    assert [lim.try_take("u", t0) for _ in range(3)] == [True, True, False]


def test_a_limiter_without_a_default_rate_ignores_overrides() -> None:
    lim = OutputRateLimiter(None, {"u": 5})
    assert not lim.enabled
    assert lim.rate_of("u") == 0
    assert all(lim.try_take("u", t0) for _ in range(10))


# --------------------------------------------------------------------------
# cleanup_idle_users
# --------------------------------------------------------------------------

USERS = ("a", "b", "c")
mixed_ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["take"] * 6 + ["refund", "set_rate", "clear_rate", "set_default"]
        ),
        st.sampled_from(USERS),
        gaps_ns,
        small_rates,
        st.booleans(),  # clean the second limiter before this op?
    ),
    min_size=1,
    max_size=120,
)


@FAST
@given(
    default=small_rates,
    b_rate=small_rates,
    start=st.integers(-(10**15), 10**15),
    script=mixed_ops,
)
def test_cleanup_never_changes_behaviour(
    default: int, b_rate: int, start: int, script: list
) -> None:
    kept = OutputRateLimiter(default, {"b": b_rate})
    cleaned = OutputRateLimiter(default, {"b": b_rate})
    now = start
    for i, (kind, user, gap, rate, clean) in enumerate(script, start=1):
        now += gap
        if clean:
            before = cleaned.tracked_users()
            dropped = cleaned.cleanup_idle_users(now)
            after = cleaned.tracked_users()
            assert dropped == before - after
            # Those left are exactly the users whose TAT is ahead of now.
            assert after == sum(cleaned.lead_ns(u, now) > 0 for u in USERS)
        if kind == "take":
            got = (kept.try_take(user, now), cleaned.try_take(user, now))
            assert got[0] == got[1], f"step {i}: take({user!r}, {now}) -> {got}"
        for lim in (kept, cleaned):
            if kind == "refund":
                lim.refund(user, now)
            elif kind == "set_rate":
                lim.set_rate(user, rate, now)
            elif kind == "clear_rate":
                lim.set_rate(user, None, now)
            elif kind == "set_default":
                lim.set_default_rate(rate, now)
        for u in USERS:
            k = (kept.ready_at_ns(u, now), kept.lead_ns(u, now), kept.rate_of(u))
            c = (cleaned.ready_at_ns(u, now), cleaned.lead_ns(u, now))
            assert k[:2] == c, f"step {i}: {u!r} (ready_at, lead) {k[:2]} vs {c}"
            assert k[2] == cleaned.rate_of(u)


# --------------------------------------------------------------------------
# Time going backwards
# --------------------------------------------------------------------------

jumpy_ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["take"] * 8 + ["refund", "set_rate", "clear_rate", "set_default"]
        ),
        st.integers(-400 * MS, 400 * MS),  # the clock may step back as well
        small_rates,
    ),
    min_size=1,
    max_size=120,
)


@FAST
@given(
    default=small_rates,
    override=st.none() | small_rates,
    start=st.integers(-(10**15), 10**15),
    script=jumpy_ops,
)
def test_a_clock_stepping_backwards_never_beats_the_bound(
    default: int, override: int | None, start: int, script: list
) -> None:
    """Without cleanup (covered separately below), any two net grants i < j of one
    constant-rate segment, in call order, satisfy ``(j - i) * T <= t_j - t_i +
    burst``: the TAT after grant i is at least ``t_i + T``, each later net grant
    adds ``T`` to it, and grant j needs it within ``burst`` of ``t_j``. Whatever the
    times, this implies the windowed upper bound."""
    lim = OutputRateLimiter(default, {} if override is None else {"u": override})
    for rate, times in replay(lim, script, start):
        for i, ti in enumerate(times):
            for j in range(i + 1, len(times)):
                assert (j - i) * NS_PER_S <= (times[j] - ti + B) * rate, (
                    f"grants #{i} at {ti} and #{j} at {times[j]} at {rate} tok/s"
                )
        assert_upper_bound(rate, times, B)
    for probe in (start - 10**9, start, start + 10**9):
        assert lim.lead_ns("u", probe) >= 0
        assert lim.ready_at_ns("u", probe) >= probe


def test_cleanup_at_a_later_now_does_not_refill_a_bucket_for_an_earlier_now() -> None:
    lim = OutputRateLimiter(10, {})
    assert [lim.try_take("u", t0) for _ in range(2)] == [True, True]  # TAT t4
    assert lim.cleanup_idle_users(t9) == 1
    # Kept state would refuse at t0 (TAT 200 ms is 200 ms ahead); 4 tokens at one
    # instant would break the bound of burst * rate + 1 = 2.
    assert not lim.try_take("u", t0)


# --------------------------------------------------------------------------
# refund
# --------------------------------------------------------------------------


@FAST
@given(
    rate=st.integers(1, 2000),
    takes=st.integers(0, 30),
    refunds=st.integers(0, 40),
    dt=st.one_of(st.just(0), st.integers(0, 2 * NS_PER_S)),
    start=st.integers(-(10**15), 10**15),
)
def test_refund_never_moves_tat_below_now(
    rate: int, takes: int, refunds: int, dt: int, start: int
) -> None:
    lim = OutputRateLimiter(rate, {})
    granted = sum(lim.try_take("u", start) for _ in range(takes))
    now = start + dt
    for _ in range(refunds):
        lim.refund("u", now)
        assert lim.lead_ns("u", now) >= 0
    owed = max(0, (granted - refunds) * NS_PER_S - dt * rate)
    assert lim.lead_ns("u", now) == ceil_div(owed, rate)
    if granted and refunds:
        # The TAT is at or after now: an earlier now sees it at least that far on.
        assert lim.lead_ns("u", now - 7 * MS) >= 7 * MS
    # However many refunds, no more than a fresh user's burst at now.
    burst_tokens = B * rate // NS_PER_S + 1
    more = 0
    while more <= burst_tokens and lim.try_take("u", now):
        more += 1
    assert more <= burst_tokens
    if owed == 0:
        assert more == burst_tokens


def test_refund_after_idling_creates_no_extra_burst() -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.try_take("u", t0)  # TAT 100 ms
    lim.refund("u", t9)  # TAT would be 0; it stays at t9
    assert lim.lead_ns("u", t9) == 0
    assert lim.lead_ns("u", t5) == 200 * MS  # seen from before t9: TAT is t9
    assert [lim.try_take("u", t9) for _ in range(3)] == [True, True, False]


def test_refund_for_an_unknown_user_is_a_noop() -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.try_take("alice", t0)
    lim.refund("ghost", t0)
    assert lim.tracked_users() == 1
    assert lim.lead_ns("ghost", t0) == 0
    assert lim.lead_ns("alice", t0) == 100 * MS
    # The ghost then starts like any fresh user.
    assert [lim.try_take("ghost", t0) for _ in range(3)] == [True, True, False]
    off = OutputRateLimiter(None, {})
    off.refund("ghost", t0)
    assert off.tracked_users() == 0


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

BAD_RATES = [0, -1, 1.5, "10", True, False, 10**12, MAX_RATE + 1]


@pytest.mark.parametrize("bad", [*BAD_RATES], ids=repr)
def test_an_invalid_default_rate_is_refused_by_the_constructor(bad: object) -> None:
    with pytest.raises(ValueError, match="default_rate"):
        OutputRateLimiter(bad, {})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [*BAD_RATES, None], ids=repr)
def test_an_invalid_user_rate_is_refused_by_the_constructor(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape("rate of user 'bob'")):
        OutputRateLimiter(10, {"ann": 5, "bob": bad})  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", [*BAD_RATES], ids=repr)
def test_an_invalid_set_rate_is_refused_and_changes_nothing(bad: object) -> None:
    lim = OutputRateLimiter(10, {"bob": 3})
    assert lim.try_take("bob", t0)
    with pytest.raises(ValueError, match=re.escape("rate of user 'bob'")):
        lim.set_rate("bob", bad, t0)  # type: ignore[arg-type]
    assert lim.user_rates == {"bob": 3}
    assert lim.lead_ns("bob", t0) == 333_333_334


@pytest.mark.parametrize("bad", [*BAD_RATES, None], ids=repr)
def test_an_invalid_set_default_rate_is_refused_and_changes_nothing(
    bad: object,
) -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.try_take("u", t0)
    with pytest.raises(ValueError, match="default_rate"):
        lim.set_default_rate(bad, t0)  # type: ignore[arg-type]
    assert lim.default_rate == 10
    assert lim.lead_ns("u", t0) == 100 * MS


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"], ids=repr)
def test_an_invalid_burst_is_refused_by_the_constructor(bad: object) -> None:
    with pytest.raises(ValueError, match="burst_ns"):
        OutputRateLimiter(10, {}, burst_ns=bad)  # type: ignore[arg-type]


def test_the_boundary_rates_are_accepted() -> None:
    lim = OutputRateLimiter(1, {"fast": MAX_RATE}, burst_ns=0)
    lim.set_rate("slow", 1, t0)
    lim.set_default_rate(MAX_RATE, t0)
    assert (lim.rate_of("slow"), lim.rate_of("fast"), lim.rate_of("x")) == (
        1,
        MAX_RATE,
        MAX_RATE,
    )


# --------------------------------------------------------------------------
# Many tokens at once: available / take (the scheduler's per-user operations)
# --------------------------------------------------------------------------


def takes_in_a_row(lim: OutputRateLimiter, user: str, now: int, most: int) -> int:
    """How many ``try_take`` calls succeed back to back (on a copy)."""
    probe = copy.deepcopy(lim)
    count = 0
    while count < most and probe.try_take(user, now):
        count += 1
    return count


@FAST
@given(
    default=small_rates,
    b_rate=small_rates,
    start=st.integers(-(10**15), 10**15),
    script=mixed_ops,
)
def test_available_is_the_number_of_takes_that_succeed_in_a_row(
    default: int, b_rate: int, start: int, script: list
) -> None:
    lim = OutputRateLimiter(default, {"b": b_rate})
    now = start
    for i, (kind, user, gap, rate, clean) in enumerate(script, start=1):
        now += gap
        if clean:
            lim.cleanup_idle_users(now)
        tracked = lim.tracked_users()
        most = lim.available(user, now)
        assert lim.tracked_users() == tracked  # reading creates no user
        assert takes_in_a_row(lim, user, now, most + 1) == most, f"step {i}"
        if kind == "take":
            lim.try_take(user, now)
        elif kind == "refund":
            lim.refund(user, now)
        elif kind == "set_rate":
            lim.set_rate(user, rate, now)
        elif kind == "set_default":
            lim.set_default_rate(rate, now)


def test_available_does_not_create_a_user() -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.available("a", t0) == B * 10 // NS_PER_S + 1  # a full bucket: 2
    assert lim.tracked_users() == 0


def test_available_is_unlimited_without_a_default_rate() -> None:
    lim = OutputRateLimiter(None, {"a": 1})
    assert lim.available("a", t0) == UNLIMITED


@FAST
@given(
    default=small_rates,
    start=st.integers(-(10**15), 10**15),
    script=mixed_ops,
    counts=st.lists(st.integers(0, 40), min_size=120, max_size=120),
)
def test_take_up_to_n_is_that_many_successful_try_takes(
    default: int, start: int, script: list, counts: list[int]
) -> None:
    """``take_up_to(n)`` takes ``min(n, available)`` and leaves exactly the state
    of that many single takes (every later answer agrees); refunding ``k`` at
    once is ``k`` single refunds."""
    batched = OutputRateLimiter(default, {})
    single = OutputRateLimiter(default, {})
    now = start
    for i, ((kind, user, gap, rate, _), count) in enumerate(
        zip(script, counts, strict=False), start=1
    ):
        now += gap
        if kind == "take":
            available = batched.available(user, now)
            taken, left = batched.take_up_to(user, count, now)
            assert (taken, left) == (min(count, available), available - taken)
            for _ in range(taken):
                assert single.try_take(user, now), f"step {i}"
        elif kind == "refund":
            batched.refund(user, now, count)
            for _ in range(count):
                single.refund(user, now)
        elif kind == "set_default":
            batched.set_default_rate(rate, now)
            single.set_default_rate(rate, now)
        for u in USERS:
            got = (batched.ready_at_ns(u, now), batched.lead_ns(u, now))
            want = (single.ready_at_ns(u, now), single.lead_ns(u, now))
            assert got == want, f"step {i}: {u!r} {got} vs {want}"


def test_take_up_to_reports_what_is_still_available() -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.take_up_to("a", 1, t0) == (1, 1)  # a full bucket holds 2
    assert lim.take_up_to("a", 5, t0) == (1, 0)
    assert lim.take_up_to("a", 5, t0) == (0, 0)
    assert lim.ready_at_ns("a", t0) == t0 + 100 * MS


# --------------------------------------------------------------------------
# Tiers and exemptions: which limit applies (pacing.limits)
# --------------------------------------------------------------------------

TABLE = {
    "user_rates": {"pinned": 5, "staff-pinned": 7, "exempt-pinned": 3},
    "tier_rates": {"free": 20, "pro": 200, "staff": 50},
    "memberships": {
        "f": "free",
        "p": "pro",
        "pinned": "free",
        "s": "staff",
        "i": "internal",
        "staff-pinned": "staff",
        "e": "free",
    },
    "exempt_users": {"e", "exempt-pinned"},
    "exempt_tiers": {"staff", "internal"},
}

# Default 10 tok/s. The rule numbers are those of pacing.limits' docstring.
#
#    user             rate  limit_source                         rule
RESOLUTION = [
    ("nobody",        10,  LimitSource("default")),            # 5
    ("f",             20,  LimitSource("tier", "free")),       # 4
    ("p",             200, LimitSource("tier", "pro")),        # 4
    ("pinned",        5,   LimitSource("user")),               # 2 before 4
    ("s",             0,   LimitSource("exempt", "staff")),    # 3 before 4 (50 kept)
    ("i",             0,   LimitSource("exempt", "internal")), # 3, a tier with no rate
    ("staff-pinned",  7,   LimitSource("user")),               # 2 before 3
    ("e",             0,   LimitSource("exempt")),             # 1 before 4
    ("exempt-pinned", 0,   LimitSource("exempt")),             # 1 before 2
]  # fmt: skip


@pytest.mark.parametrize(("user", "rate", "source"), RESOLUTION, ids=repr)
def test_the_first_matching_rule_decides_a_users_limit(
    user: str, rate: int, source: LimitSource
) -> None:
    lim = OutputRateLimiter(10, TABLE["user_rates"], **without_user_rates(TABLE))
    assert (lim.rate_of(user), lim.limit_source(user)) == (rate, source)
    full_bucket = B * rate // NS_PER_S + 1
    assert lim.available(user, t0) == (UNLIMITED if rate == 0 else full_bucket)


@pytest.mark.parametrize(("user", "rate", "source"), RESOLUTION, ids=repr)
def test_without_a_default_rate_nobody_is_limited_whatever_the_table(
    user: str, rate: int, source: LimitSource
) -> None:
    lim = OutputRateLimiter(None, TABLE["user_rates"], **without_user_rates(TABLE))
    assert (lim.rate_of(user), lim.limit_source(user)) == (0, LimitSource("off"))
    assert lim.available(user, t0) == UNLIMITED
    assert all(lim.try_take(user, t0) for _ in range(10))
    assert lim.tracked_users() == 0
    # The table is kept and applies once a default is set.
    lim.set_default_rate(10, t0)
    assert (lim.rate_of(user), lim.limit_source(user)) == (rate, source)


def without_user_rates(table: dict) -> dict:
    return {k: v for k, v in table.items() if k != "user_rates"}


@pytest.mark.parametrize("user", ["s", "i", "e", "exempt-pinned"])
def test_an_exempt_user_is_always_granted_and_holds_no_state(user: str) -> None:
    lim = OutputRateLimiter(10, TABLE["user_rates"], **without_user_rates(TABLE))
    assert all(lim.try_take(user, t0) for _ in range(1000))
    lim.refund(user, t0)
    assert lim.available(user, t0) == UNLIMITED
    assert (lim.ready_at_ns(user, t0), lim.lead_ns(user, t0)) == (t0, 0)
    assert lim.tracked_users() == 0


class TierStep(NamedTuple):
    """One step of a tier golden table: do ``op`` on ``target`` (a user or a
    tier) at ``now``, then read user ``ann``'s state at ``now``."""

    op: str  # take | user_rate | user_exempt | member | tier_rate | tier_exempt
    #          | default | cleanup
    target: str
    now: int
    arg: object  # the rate, flag or tier; None for take and cleanup
    want: object  # what the op returns, or the exception type it raises
    rate: int  # rate_of("ann") after the op
    source: str  # limit_source("ann") after the op: kind, or kind:tier
    lead: int  # lead_ns("ann", now) after the op
    avail: int  # available("ann", now) after the op
    tracked: int  # tracked_users() after the op


def apply_tier_step(lim: OutputRateLimiter, s: TierStep) -> object:
    arg: Any = s.arg
    ops: dict[str, Callable[[], object]] = {
        "take": lambda: lim.try_take(s.target, s.now),
        "user_rate": lambda: lim.set_rate(s.target, arg, s.now),
        "user_exempt": lambda: lim.set_user_exempt(s.target, arg, s.now),
        "member": lambda: lim.set_membership(s.target, arg, s.now),
        "tier_rate": lambda: lim.set_tier_rate(s.target, arg, s.now),
        "tier_exempt": lambda: lim.set_tier_exempt(s.target, arg, s.now),
        "default": lambda: lim.set_default_rate(arg, s.now),
        "cleanup": lambda: lim.cleanup_idle_users(s.now),
    }
    if isinstance(s.want, type) and issubclass(s.want, Exception):
        with pytest.raises(s.want):
            ops[s.op]()
        return s.want
    return ops[s.op]()


def run_tier_table(lim: OutputRateLimiter, steps: list[TierStep]) -> None:
    """Walks ``steps`` in order; a mismatch names the step (1-based) and its time."""
    for i, s in enumerate(steps, start=1):
        result = apply_tier_step(lim, s)
        source = lim.limit_source("ann")
        got = (
            result,
            lim.rate_of("ann"),
            source.kind if source.tier is None else f"{source.kind}:{source.tier}",
            lim.lead_ns("ann", s.now),
            lim.available("ann", s.now),
            lim.tracked_users(),
        )
        want = (s.want, s.rate, s.source, s.lead, s.avail, s.tracked)
        assert got == want, (
            f"step {i}: {s.op}({s.target!r}, {at(s.now)}, arg={s.arg!r}) "
            f"-> (result, rate, source, lead, available, tracked) = {got}, "
            f"want {want}"
        )


U = UNLIMITED
S = TierStep
E = ValueError
# Default 10 tok/s; tiers free 10, pro 40; ann starts in free. A full bucket is
# B * rate + 1 tokens: 2 at 10/s, 3 at 20/s, 5 at 40/s.
#
#   op             target now arg     -> result rate source       lead  avail tracked
TIER_STEPS = [
    S("take",        "ann",  t0, None,   True, 10, "tier:free",  100 * MS, 1, 1),  # 1
    S("take",        "ann",  t0, None,   True, 10, "tier:free",  200 * MS, 0, 1),  # 2
    # The tier's rate doubles: ann's 2 tokens of debt (200 ms) are 100 ms at 20/s.
    S("tier_rate",   "free", t0, 20,     None, 20, "tier:free",  100 * MS, 1, 1),  # 3
    S("take",        "ann",  t0, None,   True, 20, "tier:free",  150 * MS, 0, 1),  # 4
    # A move keeps the debt too: 2 tokens (100 ms at 20/s) are 50 ms at 40/s.
    S("member",      "ann",  t1, "pro",  None, 40, "tier:pro",   50 * MS,  3, 1),  # 5
    # Her own limit wins over the tier: 2 tokens at 5/s are 400 ms ...
    S("user_rate",   "ann",  t1, 5,      None, 5,  "user",       400 * MS, 0, 1),  # 6
    # ... and over the tier's exemption.
    S("tier_exempt", "pro",  t1, True,   None, 5,  "user",       400 * MS, 0, 1),  # 7
    # Without it the exempt tier frees her, and her state is dropped.
    S("user_rate",   "ann",  t1, None,   None, 0,  "exempt:pro", 0,        U, 0),  # 8
    S("take",        "ann",  t1, None,   True, 0,  "exempt:pro", 0,        U, 0),  # 9
    # Lifting the exemption starts her afresh: a full bucket, no more.
    S("tier_exempt", "pro",  t2, False,  None, 40, "tier:pro",   0,        5, 0),  # 10
    S("take",        "ann",  t2, None,   True, 40, "tier:pro",   25 * MS,  4, 1),  # 11
    # Her own exemption wins over everything.
    S("user_exempt", "ann",  t2, True,   None, 0,  "exempt",     0,        U, 0),  # 12
    S("user_exempt", "ann",  t3, False,  None, 40, "tier:pro",   0,        5, 0),  # 13
    S("member",      "ann",  t3, None,   None, 10, "default",    0,        2, 0),  # 14
    S("take",        "ann",  t3, None,   True, 10, "default",    100 * MS, 1, 1),  # 15
    # The default moves her (1 token: 100 ms -> 50 ms), not the tier members.
    S("default",     "",     t3, 20,     None, 20, "default",    50 * MS,  2, 1),  # 16
    S("member",      "bob",  t3, "free", None, 20, "default",    50 * MS,  2, 1),  # 17
    # A tier with members cannot be removed, nor a missing tier joined.
    S("tier_rate",   "free", t3, None,   E,    20, "default",    50 * MS,  2, 1),  # 18
    S("member",      "ann",  t3, "gold", E,    20, "default",    50 * MS,  2, 1),  # 19
    S("cleanup",     "",     t4, None,   1,    20, "default",    0,        3, 0),  # 20
]  # fmt: skip


def test_tier_golden_table_on_the_time_grid() -> None:
    lim = OutputRateLimiter(10, {}, tier_rates={"free": 10, "pro": 40})
    lim.set_membership("ann", "free", t0)
    run_tier_table(lim, TIER_STEPS)
    assert lim.tier_rates == {"free": 20, "pro": 40}
    assert lim.memberships == {"bob": "free"}
    assert (lim.exempt_users, lim.exempt_tiers) == (frozenset(), frozenset())


def test_a_tier_rate_change_moves_every_member_without_its_own_limit_at_once() -> None:
    lim = OutputRateLimiter(
        100,
        {"pinned": 10},
        tier_rates={"free": 10},
        memberships={"a": "free", "b": "free", "pinned": "free"},
    )
    for user in ("a", "b", "pinned", "outsider"):
        assert lim.try_take(user, t0) and lim.try_take(user, t0)  # 200 ms at 10/s
    lim.set_tier_rate("free", 30, t1)
    # At t1 a and b owed 1.5 tokens, 50 ms at 30/s; the others kept their pace.
    leads = {u: lim.lead_ns(u, t1) for u in ("a", "b", "pinned", "outsider")}
    assert leads == {"a": 50 * MS, "b": 50 * MS, "pinned": 150 * MS, "outsider": 0}
    assert lim.tracked_users() == 4


def test_a_tier_rate_change_rescales_at_the_change_not_at_the_next_read() -> None:
    lim = OutputRateLimiter(10, {}, tier_rates={"free": 10}, memberships={"a": "free"})
    assert [lim.try_take("a", t0) for _ in range(3)] == [True, True, False]
    lim.set_tier_rate("free", 20, t1)  # 1.5 tokens owed at t1: 75 ms at 20/s
    # First read at t2: 25 ms are left. Rescaled only now, the 1 token owed at
    # t2 would be 50 ms at 20/s.
    assert lim.lead_ns("a", t2) == 25 * MS


def test_a_tier_change_recompiles_only_the_members_the_tier_decides() -> None:
    table = LimitTable(
        {"pinned": 7},
        {"free": 10},
        {"a": "free", "b": "free", "pinned": "free", "freed": "free"},
        exempt_users={"freed"},
    )
    assert set(table.set_tier_rate("free", 30)) == {"a", "b"}
    assert dict(table.overrides) == {"a": 30, "b": 30, "pinned": 7, "freed": 0}
    assert set(table.set_tier_exempt("free", True)) == {"a", "b"}
    assert dict(table.overrides) == {"a": 0, "b": 0, "pinned": 7, "freed": 0}
    assert set(table.set_tier_rate("gold", 5)) == set()  # no members


def test_a_tier_change_rescales_the_members_holding_state_and_no_one_else() -> None:
    members = {f"m{i}": "free" for i in range(1000)}
    lim = OutputRateLimiter(
        100, {"m0": 10}, tier_rates={"free": 10}, memberships=members
    )
    for user in ("m0", "m1", "m2"):
        assert lim.try_take(user, t0) and lim.try_take(user, t0)  # 200 ms at 10/s
    lim.set_tier_rate("free", 20, t1)
    # At t1 m1 and m2 owed 1.5 tokens, 75 ms at 20/s; m0 keeps its own pace,
    # and the other members still hold no state.
    assert [lim.lead_ns(u, t1) for u in ("m0", "m1", "m2", "m3")] == [
        150 * MS,
        75 * MS,
        75 * MS,
        0,
    ]
    assert lim.tracked_users() == 3
    lim.set_tier_exempt("free", True, t1)  # m1 and m2 are unlimited: state dropped
    assert lim.tracked_users() == 1
    assert (lim.rate_of("m0"), lim.rate_of("m1"), lim.rate_of("m999")) == (10, 0, 0)


def test_without_a_rate_an_exempt_tier_stays_and_without_exemption_it_goes() -> None:
    lim = OutputRateLimiter(10, {}, tier_rates={"vip": 50}, exempt_tiers={"vip"})
    lim.set_membership("v", "vip", t0)
    lim.set_tier_rate("vip", None, t0)  # still exempt: still a tier
    assert lim.limit_source("v") == LimitSource("exempt", "vip")
    with pytest.raises(ValueError, match="tier 'vip' has 1 member"):
        lim.set_tier_exempt("vip", False, t0)
    assert lim.limit_source("v") == LimitSource("exempt", "vip")
    lim.set_membership("v", None, t0)
    lim.set_tier_exempt("vip", False, t0)
    assert lim.limits().tiers == frozenset()
    # Removing what is not there is a no-op, as set_rate(user, None) is.
    lim.set_tier_rate("ghost", None, t0)
    lim.set_tier_exempt("ghost", False, t0)
    assert lim.limits().tiers == frozenset()


BAD_TIER_NAMES = ["", "a\x00b", "x" * 257, "zero\u200bwidth", 7]


@pytest.mark.parametrize("bad", BAD_TIER_NAMES, ids=repr)
def test_an_invalid_tier_name_is_refused_everywhere_and_changes_nothing(
    bad: object,
) -> None:
    lim = OutputRateLimiter(10, {}, tier_rates={"free": 20})
    attempts: list[Callable[[], object]] = [
        lambda: lim.set_tier_rate(bad, 5, t0),  # type: ignore[arg-type]
        lambda: lim.set_tier_exempt(bad, True, t0),  # type: ignore[arg-type]
        lambda: lim.set_membership("u", bad, t0),  # type: ignore[arg-type]
        lambda: OutputRateLimiter(10, {}, tier_rates={bad: 5}),  # type: ignore[dict-item]
        lambda: OutputRateLimiter(10, {}, exempt_tiers={bad}),  # type: ignore[arg-type]
    ]
    for attempt in attempts:
        with pytest.raises(ValueError, match="tier name"):
            attempt()
    assert (lim.tier_rates, lim.exempt_tiers, lim.memberships) == (
        {"free": 20},
        frozenset(),
        {},
    )


@pytest.mark.parametrize("bad", [*BAD_RATES, None], ids=repr)
def test_an_invalid_tier_rate_is_refused_by_the_constructor(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape("rate of tier 'pro'")):
        OutputRateLimiter(10, {}, tier_rates={"free": 5, "pro": bad})  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", BAD_RATES, ids=repr)
def test_an_invalid_set_tier_rate_is_refused_and_changes_nothing(bad: object) -> None:
    lim = OutputRateLimiter(10, {}, tier_rates={"pro": 3}, memberships={"m": "pro"})
    assert lim.try_take("m", t0)
    with pytest.raises(ValueError, match=re.escape("rate of tier 'pro'")):
        lim.set_tier_rate("pro", bad, t0)  # type: ignore[arg-type]
    assert lim.tier_rates == {"pro": 3}
    assert lim.lead_ns("m", t0) == 333_333_334


def test_a_membership_in_a_tier_that_does_not_exist_is_refused_by_the_constructor() -> (
    None
):
    with pytest.raises(ValueError, match=r"memberships.*: unknown tier 'gold'"):
        OutputRateLimiter(10, {}, tier_rates={"free": 5}, memberships={"u": "gold"})


def test_replace_limits_is_every_change_at_once() -> None:
    """Editing a copy of the table and handing it back leaves the limiter exactly
    as the same changes made one by one at the same time."""
    table = dict(tier_rates={"free": 10, "pro": 40}, memberships={"a": "free"})
    at_once = OutputRateLimiter(20, {"b": 5}, **table)  # type: ignore[arg-type]
    one_by_one = OutputRateLimiter(20, {"b": 5}, **table)  # type: ignore[arg-type]
    for lim in (at_once, one_by_one):
        for user in ("a", "b", "c"):
            for _ in range(3):
                lim.try_take(user, t0)
    edited = at_once.limits()
    edited.set_tier_rate("free", 30)
    edited.set_membership("b", "pro")
    edited.set_user_rate("b", None)
    edited.set_user_exempt("c", True)
    assert at_once.tier_rates == {"free": 10, "pro": 40}  # a copy: nothing yet
    at_once.replace_limits(edited, t1)
    one_by_one.set_tier_rate("free", 30, t1)
    one_by_one.set_membership("b", "pro", t1)
    one_by_one.set_rate("b", None, t1)
    one_by_one.set_user_exempt("c", True, t1)
    for user in ("a", "b", "c", "d"):
        for now in (t1, t2, t5):
            got = [
                f(user, now)
                for f in (at_once.lead_ns, at_once.available, at_once.ready_at_ns)
            ]
            want = [
                f(user, now)
                for f in (one_by_one.lead_ns, one_by_one.available,
                          one_by_one.ready_at_ns)
            ]  # fmt: skip
            assert got == want, f"{user} at {at(now)}"
        assert at_once.limit_source(user) == one_by_one.limit_source(user)
    assert at_once.tracked_users() == one_by_one.tracked_users() == 2


def test_limit_table_reads_are_copies() -> None:
    table = LimitTable({"a": 5}, {"free": 10}, {"b": "free"}, {"c"}, {"staff"})
    table.user_rates["a"] = 1
    table.tier_rates["free"] = 1
    table.memberships["b"] = "staff"
    assert (table.user_rates, table.tier_rates, table.memberships) == (
        {"a": 5},
        {"free": 10},
        {"b": "free"},
    )
    assert table.tiers == {"free", "staff"}
    assert table.members("free") == {"b"}
    assert table.tier_of("b") == "free"
    assert dict(table.overrides) == {"a": 5, "b": 10, "c": 0}


@FAST
@given(
    default=small_rates,
    b_rate=small_rates,
    start=st.integers(-(10**15), 10**15),
    script=mixed_ops,
    counts=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_take_each_is_each_users_count_of_try_takes_and_reports_what_is_left(
    default: int, b_rate: int, start: int, script: list, counts: list[int]
) -> None:
    """After any history, ``take_each`` charges every user exactly as that many
    ``try_take`` calls would when all succeed, and returns ``available``."""
    batched = OutputRateLimiter(default, {"b": b_rate})
    now = start
    for kind, user, gap, rate, _ in script:
        now += gap
        if kind == "take":
            batched.try_take(user, now)
        elif kind == "set_rate":
            batched.set_rate(user, rate, now)
    single = copy.deepcopy(batched)
    wanted = {
        user: min(count, batched.available(user, now))
        for user, count in zip(USERS, counts, strict=True)
    }
    left = batched.take_each(wanted, now)
    for user, count in wanted.items():
        for _ in range(count):
            assert single.try_take(user, now)
        assert left[user] == single.available(user, now)
        assert batched.ready_at_ns(user, now) == single.ready_at_ns(user, now)
        assert batched.lead_ns(user, now) == single.lead_ns(user, now)


def test_take_each_beyond_what_is_available_charges_every_token_anyway() -> None:
    lim = OutputRateLimiter(10, {})
    assert lim.take_each({"a": 5}, t0) == {"a": 0}  # 2 available, 3 more owed
    assert lim.lead_ns("a", t0) == 500 * MS


def test_take_each_without_a_default_rate_is_unlimited() -> None:
    lim = OutputRateLimiter(None, {})
    assert lim.take_each({"a": 3}, t0) == {"a": UNLIMITED}
    assert lim.tracked_users() == 0
