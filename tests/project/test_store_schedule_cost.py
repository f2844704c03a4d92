"""The table of ``benchmarks.store_schedule_cost``: the ratio is the store side's
median over the local side's, and the store side's lines add up its timings."""

from __future__ import annotations

from benchmarks.store_schedule_cost import StoreTraffic, Timing, rows


def test_rows_give_store_over_local_and_add_up_the_store_side() -> None:
    local = [Timing(s, 100, 1.0, 1600, 1.0) for s in (100e-6, 200e-6, 300e-6)]
    store = [
        Timing(250e-6, 100, 1.5, 1600, 1.0, StoreTraffic(12, 0, 1500)),
        Timing(300e-6, 100, 1.0, 1590, 3.0, StoreTraffic(8, 1, 1600)),
        Timing(800e-6, 100, 1.5, 1600, 2.0, StoreTraffic(10, 0, 1700)),
    ]
    ratio, spread, calls, emitted, traffic = rows(
        16, 8, {"local": local, "store": store}
    )
    assert (ratio.stock, ratio.ours, ratio.ratio) == ("200 µs", "300 µs", "1.500x")
    assert spread.ratio == "1.500-2.667x"  # 300/200 to 800/300, repeat by repeat
    assert "R=16" in ratio.measure and "U=8" in ratio.measure
    assert (calls.stock, calls.ours) == ("1.0", "2.0")
    assert emitted.ours == "4,790 / 4,800"  # one timing ran 10 tokens short
    assert traffic.ours == "4,800; 30 (1), 8/s"  # 30 round trips over 4 s
