"""The shared limiter: one lock shared with the scheduler, consistent readings,
recent rates on a fixed time grid."""

from __future__ import annotations

import threading

import pytest

from control.service.operations import LimitsService
from pacing.recent_rate import RecentRates
from tests.control_harness import NS_PER_S, make_rig
from tools.fake_clock import T0

S = NS_PER_S


def test_a_change_waits_for_the_step_holding_the_lock():
    rig = make_rig(10)
    service = LimitsService(rig.shared)
    applied = threading.Event()

    def change() -> None:
        service.update_default("", {"tokens_per_second": 20})
        applied.set()

    with rig.shared.lock:  # the scheduler is inside schedule()
        writer = threading.Thread(target=change)
        writer.start()
        assert not applied.wait(0.2)
        assert rig.limiter.default_rate == 10
    assert applied.wait(5)
    writer.join()
    assert rig.limiter.default_rate == 20


def test_wake_can_be_attached_after_construction():
    rig = make_rig(10)
    rig.shared.wake()  # the harness's recorder
    calls = []
    rig.shared.set_wake(lambda: calls.append(1))
    LimitsService(rig.shared).update_default("", {"tokens_per_second": 11})
    assert (len(rig.wakes), calls) == (1, [1])
    rig.shared.set_wake(None)
    rig.shared.wake()  # nothing to wake: no error


def test_a_reading_is_taken_at_one_instant():
    rig = make_rig(10)
    rig.step("a", 3)
    with rig.shared.lock:
        reading = rig.shared.read()
        rig.clock.advance_ms(1000)  # time passing during the read changes nothing
        state = reading.snapshot("a")
    assert state.tat_lead_ns == 200_000_000
    assert state.next_token_in_ns == 100_000_000


def test_a_snapshot_of_an_unknown_user_is_zeros_with_the_default_limit():
    rig = make_rig(10)
    with rig.shared.lock:
        reading = rig.shared.read()
        assert not reading.knows("nobody")
        state = reading.snapshot("nobody")
    assert (state.limit, state.tat_lead_ns, state.tokens_charged) == (10, 0, 0)


def test_pacing_off_reports_limit_zero():
    rig = make_rig(None)
    with rig.shared.lock:
        assert rig.shared.read().snapshot("a").limit == 0


# Recent rates on a fixed grid: a counter sampled once a second, window 5 s.
# Columns: time (s), the counter's total then, the rate read then.
GRID = [
    (0, 0, 0.0),  # the first sample: nothing measured yet
    (1, 10, 10.0),
    (2, 20, 10.0),
    (3, 30, 10.0),
    (4, 40, 10.0),
    (5, 50, 10.0),
    (6, 60, 10.0),  # from here the base is the sample 5 s back
    (7, 60, 8.0),  # idle since t=6
    (8, 60, 6.0),
    (9, 60, 4.0),
    (10, 60, 2.0),
    (11, 60, 0.0),
    (12, 60, 0.0),
]


def test_recent_rates_on_a_time_grid():
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    for second, total, expected in GRID:
        now = T0 + second * S
        rates.observe(now, lambda total=total: {"u": total})
        assert rates.rate("u", now, total) == pytest.approx(expected), f"t={second}"


def test_rates_between_samples_use_the_elapsed_time():
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    rates.observe(T0, lambda: {"u": 0})
    rates.observe(T0 + S, lambda: {"u": 10})
    assert rates.rate("u", T0 + 3 * S // 2, 15) == pytest.approx(10.0)


def test_a_rate_is_measured_over_at_least_one_interval():
    """Two tokens 30 ms after the first sample are not 67 tokens/s."""
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    rates.observe(T0, lambda: {"u": 0})
    assert rates.rate("u", T0 + 30_000_000, 2) == pytest.approx(2.0)


def test_samples_are_taken_at_most_once_per_interval():
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    reads = []
    for offset in [0, S // 2, S - 1, S, S + 1]:
        rates.observe(T0 + offset, lambda offset=offset: reads.append(offset) or {})
    assert reads == [0, S]


def test_a_clock_going_backwards_takes_no_sample_and_reports_zero():
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    rates.observe(T0, lambda: {"u": 0})
    rates.observe(T0 - S, lambda: pytest.fail("sampled in the past"))
    assert rates.rate("u", T0 - S, 5) == 0.0


def test_a_reset_counter_counts_from_zero():
    """The engine forgot an idle user; its counter restarted at 0."""
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    rates.observe(T0, lambda: {"u": 100})
    assert rates.rate("u", T0 + 2 * S, 4) == pytest.approx(2.0)


def test_rates_of_all_users_agree_with_one_user():
    rates = RecentRates(window_ns=5 * S, interval_ns=S)
    rates.observe(T0, lambda: {"a": 0, "b": 50})
    totals = {"a": 30, "b": 40, "c": 6}
    now = T0 + 3 * S
    assert rates.rates(now, totals) == {
        user: rates.rate(user, now, total) for user, total in totals.items()
    }


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="interval_ns <= window_ns"):
        RecentRates(window_ns=S, interval_ns=2 * S)
