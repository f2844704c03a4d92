"""The pure helpers behind ``benchmarks.compare_stock``'s table: quantiles read
off a Prometheus histogram, the delta between two scrapes, medians, the
throughput ratio and its interval, rendering."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.table import (
    Row,
    bucket_quantile,
    geometric_mean_ratio,
    histogram_delta,
    median_interval,
    ratio_interval,
    ratio_of_medians,
    render,
)

INF = math.inf
#: Cumulative counts: 10 observations, 1 at or below 0.01, 5 at or below 0.05,
#: 9 at or below 0.1, the last above 0.5.
HISTOGRAM = {0.01: 1.0, 0.05: 5.0, 0.1: 9.0, 0.5: 9.0, INF: 10.0}


@pytest.mark.parametrize(
    ("q", "bound"),
    [
        (0.1, 0.01),  # exactly the first bucket's share
        (0.11, 0.05),
        (0.5, 0.05),  # the median: 5 of 10 at or below 0.05
        (0.51, 0.1),
        (0.9, 0.1),
        (0.91, INF),  # the 10th observation is above every finite bound
        (1.0, INF),
    ],
)
def test_bucket_quantile_is_the_bound_of_the_bucket_holding_it(
    q: float, bound: float
) -> None:
    assert bucket_quantile(HISTOGRAM, q) == bound


def test_bucket_quantile_of_the_maximum_skips_empty_top_buckets() -> None:
    assert bucket_quantile({0.01: 3.0, 0.05: 4.0, 0.1: 4.0, INF: 4.0}, 1.0) == 0.05


def test_bucket_quantile_of_an_empty_histogram_is_nan() -> None:
    assert math.isnan(bucket_quantile({0.01: 0.0, INF: 0.0}, 0.5))
    assert math.isnan(bucket_quantile({}, 0.5))


@pytest.mark.parametrize("q", [0.0, -0.1, 1.01])
def test_bucket_quantile_refuses_a_share_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match="q must be"):
        bucket_quantile(HISTOGRAM, q)


def test_histogram_delta_counts_only_what_was_observed_between_scrapes() -> None:
    before = {0.01: 1.0, 0.05: 2.0, INF: 2.0}
    after = {0.01: 1.0, 0.05: 6.0, 0.1: 3.0, INF: 9.0}
    assert histogram_delta(before, after) == {0.01: 0.0, 0.05: 4.0, 0.1: 3.0, INF: 7.0}


def test_ratio_of_medians_takes_each_sides_median() -> None:
    assert ratio_of_medians([3.0, 1.0, 2.0, 100.0, 2.0], [1.0, 4.0, 1.0]) == 2.0


def test_render_aligns_columns_under_a_header() -> None:
    text = render([Row("a", "1", "2", "2.0x", "≤ 1x"), Row("longer measure", ours="3")])
    lines = text.splitlines()
    assert lines[0].split() == ["measure", "stock", "ours", "ratio", "goal"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["a", "1", "2", "2.0x", "≤", "1x"]
    assert lines[3].split() == ["longer", "measure", "3"]
    # Right-aligned number columns: every value ends where its header ends.
    assert lines[2].index("2.0x") + 4 == lines[0].index("ratio") + 5


def test_each_compared_server_gets_cpus_of_its_own(monkeypatch) -> None:
    from benchmarks import compare_stock

    monkeypatch.setattr(compare_stock.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert compare_stock.server_cpus(2) == [{0, 1}, {2, 3}]
    assert [compare_stock._bind_env(cpus) for cpus in ({0, 1}, {2, 3})] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    monkeypatch.setattr(compare_stock.os, "sched_getaffinity", lambda pid: {5})
    assert compare_stock.server_cpus(2) == [set(), set()]  # one CPU: no sets
    assert compare_stock._bind_env(set()) == {}  # vLLM's own choice


def test_the_ratio_is_the_geometric_mean_of_each_placements_ratio_of_medians() -> None:
    placements = [([2.0, 4.0, 3.0], [3.0, 3.0, 3.0]), ([10.0, 12.0], [8.0, 8.0])]
    # Placement ratios 3/3 = 1 and 11/8: their geometric mean.
    assert geometric_mean_ratio(placements) == pytest.approx(math.sqrt(11 / 8))


def test_identical_runs_give_an_interval_of_one_point() -> None:
    assert ratio_interval([([5.0] * 7, [4.0] * 7)]) == (1.25, 1.25)


def test_the_interval_holds_the_estimate_and_widens_with_the_spread() -> None:
    steady = ([99.0, 100.0, 101.0] * 5, [100.0, 101.0, 99.0] * 5)
    noisy = ([60.0, 100.0, 140.0] * 5, [140.0, 60.0, 100.0] * 5)
    low, high = ratio_interval([steady])
    assert low <= geometric_mean_ratio([steady]) <= high
    noisy_low, noisy_high = ratio_interval([noisy])
    assert noisy_low < low and high < noisy_high
    assert ratio_interval([noisy]) == (noisy_low, noisy_high)  # seeded


def test_the_median_interval_holds_the_median_and_is_seeded() -> None:
    values = [0.9, 0.95, 1.0, 1.02, 0.97, 0.99, 1.05, 0.93, 1.01]
    low, high = median_interval(values)
    assert low <= statistics.median(values) <= high
    assert min(values) <= low < high <= max(values)
    assert median_interval(values) == (low, high)
    assert median_interval([0.98] * 5) == (0.98, 0.98)


def test_cpu_shares_split_the_cpus_in_order_and_leave_the_leftover(
    monkeypatch,
) -> None:
    from tools import local_server

    monkeypatch.setattr(
        local_server.os, "sched_getaffinity", lambda pid: {7, 1, 3, 5, 9}
    )
    assert local_server.cpu_shares(2) == [{1, 3}, {5, 7}]  # 9 left over
    assert local_server.cpu_shares(5) == [{1}, {3}, {5}, {7}, {9}]
    with pytest.raises(ValueError, match="6 shares of 5 CPUs"):
        local_server.cpu_shares(6)
