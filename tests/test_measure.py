"""The client-side measurement helpers (no server needed)."""

from __future__ import annotations

import asyncio

import pytest

from engine_ext.measure import Bracketed, StreamResult, bracketed, rates_by_user


def test_rate_is_tokens_over_first_to_last_token_span():
    a = StreamResult(user="a", token_times=[10.0, 10.5, 11.0])
    b = StreamResult(user="a", token_times=[10.2, 12.0])
    rate = rates_by_user([a, b])["a"]
    assert (rate.tokens, rate.span_s) == (5, 2.0)
    assert rate.tokens_per_s == 2.5


def test_bracketed_ratio_cancels_drift():
    # The machine slows down steadily; the load itself costs nothing.
    result = Bracketed(alone=[100, 90, 80, 70], beside=[95, 85, 75])
    assert result.ratio == pytest.approx(1.0)
    assert Bracketed(alone=[100, 100], beside=[50]).ratio == 0.5


def test_bracketed_runs_measurements_around_each_load():
    events: list[str] = []
    values = iter(range(100))

    async def measure() -> float:
        events.append("m")
        return float(next(values) + 1)

    async def load() -> None:
        events.append("load")
        await asyncio.sleep(0.05)

    result = asyncio.run(bracketed(measure, load, cycles=2, settle_s=0.01))
    assert events == ["m", "m", "load", "m", "m", "load", "m", "m"]
    assert result.alone == [2.0, 4.0, 6.0] and result.beside == [3.0, 5.0]


def test_bracketed_refuses_a_load_that_ended_too_early():
    async def measure() -> float:
        await asyncio.sleep(0.02)
        return 1.0

    async def load() -> None:
        return None

    with pytest.raises(RuntimeError, match="ended before"):
        asyncio.run(bracketed(measure, load, cycles=1, settle_s=0.01))
