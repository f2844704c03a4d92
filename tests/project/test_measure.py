"""The client-side measurement helpers (no server needed)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from pacing.limiter import NS_PER_S, OutputRateLimiter
from tools.measure import (
    Bracketed,
    StreamResult,
    UserRate,
    assert_at_most_gcra,
    bracketed,
    most_tokens,
    rates_by_user,
)
from tools.server_counters import Read, assert_at_least_the_limit


def test_rate_is_tokens_over_first_to_last_token_span():
    a = StreamResult(user="a", token_times=[10.0, 10.5, 11.0], started_at=9.5)
    b = StreamResult(user="a", token_times=[10.2, 12.0], started_at=9.0)
    rate = rates_by_user([a, b])["a"]
    assert (rate.tokens, rate.span_s) == (5, 2.0)
    assert rate.tokens_per_s == 2.5


def test_window_runs_from_the_users_first_request_sent_to_its_last_token():
    a = StreamResult(user="a", token_times=[10.0, 11.0], started_at=9.5)
    b = StreamResult(user="a", token_times=[10.2, 12.0], started_at=9.0)
    other = StreamResult(user="b", token_times=[13.0], started_at=1.0)
    rates = rates_by_user([a, b, other])
    assert rates["a"].window_s == 3.0
    assert rates["a"].window_tokens_per_s == 4 / 3
    assert rates["b"].window_s == 12.0


def test_most_tokens_with_one_limit_is_the_spec_bound():
    assert most_tokens([(5.0, 100)], 6.83) == pytest.approx((1.83 + 0.1) * 100 + 1)
    assert most_tokens([(5.0, 20)], 5.0) == pytest.approx(0.1 * 20 + 1)


def test_most_tokens_after_lowering_keeps_the_faster_burst_until_time_earns_more():
    limits = [(0.0, 50), (3.0, 10)]
    # Last charge just before lowering: 150 earned + 50 * 0.1 burst + 1.
    assert most_tokens(limits, 3.2) == pytest.approx(156)
    # Later the slow limit's earnings outgrow the fast burst: 170 + 1 + 1.
    assert most_tokens(limits, 5.0) == pytest.approx(172)
    # A raise counts from its own time on, the burst at the new limit.
    assert most_tokens([(0.0, 10), (2.0, 50)], 3.0) == pytest.approx(20 + 50 + 5 + 1)
    # A change after ``until`` is ignored; one exactly at it may hold the last charge.
    assert most_tokens([(0.0, 10), (4.0, 50)], 3.0) == pytest.approx(30 + 1 + 1)
    assert most_tokens([(0.0, 10), (3.0, 50)], 3.0) == pytest.approx(30 + 5 + 1)


@pytest.mark.parametrize(
    "limits",
    [
        [(0.0, 20)],
        [(0.0, 10), (2.0, 50), (5.0, 10)],
        [(0.0, 100), (1.0, 3), (2.5, 7)],
    ],
)
def test_most_tokens_is_the_real_limiters_ceiling_and_it_is_reached(limits):
    """A user taking every token the real limiter grants, on a 1 ms grid with
    the limit changed as ``limits`` says: the count never exceeds the ceiling
    and comes within one token of it."""
    limiter = OutputRateLimiter(limits[0][1], {})
    changes = {round(start * 1000): rate for start, rate in limits[1:]}
    taken, closest = 0, float("inf")
    for ms in range(8000):
        now_ns = ms * NS_PER_S // 1000
        if ms in changes:
            limiter.set_default_rate(changes[ms], now_ns)
        while limiter.try_take("u", now_ns):
            taken += 1
        ceiling = most_tokens(limits, ms / 1000)
        # 1e-9: the ceiling is reached exactly, and seconds are floats.
        assert taken <= ceiling + 1e-9, f"{taken} tokens by {ms} ms, ceiling {ceiling}"
        closest = min(closest, ceiling - taken)
    assert closest < 1


def test_bracketed_ratio_cancels_drift():
    # The machine slows down steadily; the load itself costs nothing.
    result = Bracketed(alone=[100, 90, 80, 70], beside=[95, 85, 75])
    assert result.ratio == pytest.approx(1.0)
    assert Bracketed(alone=[100, 100], beside=[50]).ratio == 0.5
    assert result.ratios == pytest.approx([95 / 95, 85 / 85, 75 / 75])
    assert Bracketed(alone=[100, 100, 50], beside=[50, 60]).ratios == [0.5, 0.8]


def test_bracketed_runs_measurements_around_each_load_and_cancels_it():
    events: list[str] = []
    values = iter(range(100))

    async def measure() -> float:
        events.append("m")
        return float(next(values) + 1)

    async def load() -> None:
        events.append("load")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    result = asyncio.run(bracketed(measure, load, cycles=2, settle_s=0.01))
    cycle = ["load", "m", "cancelled", "m"]
    assert events == ["m", "m", *cycle, *cycle]
    assert result.alone == [2.0, 4.0, 6.0] and result.beside == [3.0, 5.0]


def test_bracketed_refuses_a_load_that_ended_too_early():
    async def measure() -> float:
        await asyncio.sleep(0.02)
        return 1.0

    async def load() -> None:
        return None

    with pytest.raises(RuntimeError, match="ended before"):
        asyncio.run(bracketed(measure, load, cycles=1, settle_s=0.01))


def test_bracketed_raises_the_error_of_a_failed_load():
    async def measure() -> float:
        await asyncio.sleep(0.02)
        return 1.0

    async def load() -> None:
        raise ConnectionError("server gone")

    with pytest.raises(ConnectionError, match="server gone"):
        asyncio.run(bracketed(measure, load, cycles=1, settle_s=0.01))


def test_assert_at_most_gcra_holds_up_to_gcras_bound():
    # 20 tok/s, 10.2 s from sending: ceiling (10.2 + 0.1) * 20 + 1 = 207.
    assert_at_most_gcra(UserRate("u", 207, 10.0, 10.2), 20)
    with pytest.raises(AssertionError, match=r"at most 207\.0 allowed"):
        assert_at_most_gcra(UserRate("u", 208, 10.0, 10.2), 20)


def read(sent: float, count: int) -> Read:
    return Read(sent, sent + 0.01, {"u": count})


def reads_at_20_per_s() -> list[Read]:
    """100 tokens at 20 tok/s from t=1, read every 0.5 s until t=6.5."""
    return [read(k / 2, max(0, min(100, round(20 * (k / 2 - 1))))) for k in range(14)]


def test_the_server_side_floor_spans_first_started_to_last_unfinished_read():
    # 100 tokens at 20 tok/s from t=1: reads every 0.5 s; the first read that saw
    # a charge answered at 1.51, the last unfinished one was sent at 5.5.
    reads = reads_at_20_per_s()
    assert_at_least_the_limit(reads, "u", before=0, total=100, limit=20)
    # The same counts at 21 tok/s's limit: 80 tokens over 3.99 s is below 97 %.
    with pytest.raises(AssertionError, match=r"at least 81\.3 needed"):
        assert_at_least_the_limit(reads, "u", before=0, total=100, limit=21)


def test_the_server_side_floor_needs_a_long_enough_interval():
    reads = [read(0.0, 0), read(1.0, 10), read(2.0, 30), read(3.0, 40)]
    with pytest.raises(AssertionError, match=r"over at least 0\.990 s"):
        assert_at_least_the_limit(reads, "u", before=0, total=40, limit=20)


def test_the_server_side_floor_needs_a_read_while_paced():
    with pytest.raises(AssertionError, match="no read while it was paced"):
        assert_at_least_the_limit([read(0.0, 5)], "u", before=5, total=10, limit=20)


def test_the_server_side_floor_allows_for_the_time_the_engine_came_late():
    # 80 tokens over 3.99 s at 21 tok/s's limit need 81.3 (see above). The
    # engine counted 0.1 s late between the first charged read and the read
    # after the last unfinished one: 2.1 tokens fewer are needed.
    never_late = reads_at_20_per_s()
    reads = [
        replace(r, engine_late_s={"u": 0.3 if k <= 3 else 0.4})
        for k, r in enumerate(never_late)
    ]
    assert_at_least_the_limit(reads, "u", before=0, total=100, limit=21)
    # Counted only on the read after the last unfinished one (k = 12): still
    # allowed for. Counted on none of the reads: not.
    late_at_the_end = [
        replace(r, engine_late_s={"u": 0.1 if k == 12 else 0.0})
        for k, r in enumerate(never_late)
    ]
    assert_at_least_the_limit(late_at_the_end, "u", before=0, total=100, limit=21)
    with pytest.raises(AssertionError, match=r"at least 81\.3 needed"):
        assert_at_least_the_limit(never_late, "u", before=0, total=100, limit=21)


def test_the_server_side_floor_may_fall_short_by_a_stated_allowance():
    # 80 tokens over 3.99 s at 21 tok/s's limit need 81.3 (see above); allowing
    # for 2 lost tokens they need 79.3.
    reads = reads_at_20_per_s()
    assert_at_least_the_limit(reads, "u", before=0, total=100, limit=21, allowance=2)
    with pytest.raises(AssertionError, match=r"at least 80\.3 needed"):
        assert_at_least_the_limit(
            reads, "u", before=0, total=100, limit=21, allowance=1
        )
