"""Pure helpers of the benchmarks (``benchmarks.compare_stock`` first): medians
of interleaved repeats, quantiles read off a Prometheus histogram, the printed
table and the ``--only`` parts."""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One line of the table: what was measured, stock's figure, ours, the ratio
    the measure names (ours over stock's unless it says otherwise), and the
    issue's goal (printed, never asserted)."""

    measure: str
    stock: str = ""
    ours: str = ""
    ratio: str = ""
    goal: str = ""


def ratio_of_medians(ours: Sequence[float], stock: Sequence[float]) -> float:
    """``median(ours) / median(stock)``: each side's median over its repeats."""
    return statistics.median(ours) / statistics.median(stock)


def geometric_mean_ratio(
    placements: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> float:
    """The geometric mean over placements of each one's ``ratio_of_medians``
    (ours, stock): a faster CPU set, holding one side in one placement and the
    other in the next, favours neither."""
    return statistics.geometric_mean(
        [ratio_of_medians(ours, stock) for ours, stock in placements]
    )


def ratio_interval(
    placements: Sequence[tuple[Sequence[float], Sequence[float]]],
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A 95 % bootstrap interval of ``geometric_mean_ratio``: each draw resamples,
    with replacement, the runs of each side of each placement. How far apart the
    runs of one server lie shows in its width; a ratio is told apart from 1 only
    when the interval leaves 1 out. Seeded: the same runs give the same interval."""
    return _bootstrap_interval(
        lambda rng: geometric_mean_ratio(
            [
                (rng.choices(ours, k=len(ours)), rng.choices(stock, k=len(stock)))
                for ours, stock in placements
            ]
        ),
        draws,
        seed,
    )


def median_interval(
    values: Sequence[float], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of ``values`` (seeded, as
    ``ratio_interval``)."""
    return _bootstrap_interval(
        lambda rng: statistics.median(rng.choices(values, k=len(values))),
        draws,
        seed,
    )


def _bootstrap_interval(
    estimate: Callable[[random.Random], float], draws: int, seed: int
) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``draws`` estimates, each computed
    from a resample drawn with the given generator."""
    rng = random.Random(seed)
    estimates = sorted(estimate(rng) for _ in range(draws))
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws) - 1]


def histogram_delta(
    before: Mapping[float, float], after: Mapping[float, float]
) -> dict[float, float]:
    """Cumulative bucket counts (upper bound -> count) observed between two
    scrapes of one histogram; a bucket missing before counts from zero."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def bucket_quantile(cumulative: Mapping[float, float], q: float) -> float:
    """The upper bound of the bucket that holds the ``q``-quantile of a histogram
    given as cumulative counts (upper bound -> observations at or below it, the
    ``+Inf`` bucket included): the smallest bound below which at least a share
    ``q`` of the observations lie. ``q = 1`` gives the bound of the highest
    non-empty bucket, i.e. a ceiling on the largest observation. NaN when the
    histogram is empty."""
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q}")
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    for bound in bounds:
        if cumulative[bound] >= q * total:
            return bound
    return bounds[-1]  # float rounding: q * total a hair above the total


def render(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table with a header line."""
    header = Row("measure", "stock", "ours", "ratio", "goal")
    cells = [header, *rows]
    widths = [
        max(len(getattr(row, name)) for row in cells)
        for name in ("measure", "stock", "ours", "ratio", "goal")
    ]
    lines = []
    for row in cells:
        lines.append(
            f"{row.measure:<{widths[0]}}  {row.stock:>{widths[1]}}  "
            f"{row.ours:>{widths[2]}}  {row.ratio:>{widths[3]}}  {row.goal}".rstrip()
        )
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def only_parts(parts: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """The ``--only`` argument type: a comma-separated choice among ``parts``."""

    def parse(value: str) -> tuple[str, ...]:
        chosen = tuple(part.strip() for part in value.split(",") if part.strip())
        unknown = sorted(set(chosen) - set(parts))
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"unknown part(s) {', '.join(unknown) or '(none given)'}; "
                f"choose from {','.join(parts)}"
            )
        return chosen

    return parse
