"""Per-user recent output rate, from periodic samples of a cumulative counter.

Like Prometheus' ``rate()``: every ``interval_ns`` the caller hands in each
user's cumulative net charged tokens; ``rate()`` divides the growth since the
newest sample at least ``window_ns`` old by the time since that sample. So the
measured span is ``window_ns`` to ``window_ns + interval_ns`` (shorter only in
the first ``window_ns`` after start, but never under ``interval_ns``). The
clock comes in with every call.

A counter that shrank was reset (the engine forgot an idle user); its current
value is then the growth since the reset.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

NS_PER_S = 1_000_000_000


class RecentRates:
    """Samples of per-user cumulative counters, kept for one window."""

    def __init__(self, window_ns: int, interval_ns: int) -> None:
        if not 0 < interval_ns <= window_ns:
            raise ValueError(
                f"need 0 < interval_ns <= window_ns, got {interval_ns}, {window_ns}"
            )
        self._window_ns = window_ns
        self._interval_ns = interval_ns
        self._samples: deque[tuple[int, Mapping[str, int]]] = deque()

    def observe(
        self, now_ns: int, read_totals: Callable[[], Mapping[str, int]]
    ) -> None:
        """Takes a sample at ``now_ns`` if one is due (``read_totals`` is only
        called then, as it costs one pass over all users)."""
        if self._samples and now_ns - self._samples[-1][0] < self._interval_ns:
            return  # also ignores a clock that went backwards
        self._samples.append((now_ns, dict(read_totals())))
        # Keep the newest sample at least a window old: it is rate()'s base.
        while (
            len(self._samples) >= 2 and self._samples[1][0] <= now_ns - self._window_ns
        ):
            self._samples.popleft()

    def rate(self, user: str, now_ns: int, total: int) -> float:
        """``user``'s counter growth per second, given its current ``total``;
        0.0 before the first sample or at the instant of it."""
        return self.rates(now_ns, {user: total})[user]

    def rates(self, now_ns: int, totals: Mapping[str, int]) -> dict[str, float]:
        """``rate()`` of every user in ``totals`` (their current totals) at once."""
        base = self._base(now_ns)
        if base is None or now_ns <= base[0]:
            return dict.fromkeys(totals, 0.0)
        # At least one interval: right after the first sample a few tokens over
        # a few ms would read as a huge rate.
        then, elapsed_ns = base[1], max(now_ns - base[0], self._interval_ns)
        rates = {}
        for user, total in totals.items():
            before = then.get(user, 0)
            grown = total - before if total >= before else total
            rates[user] = grown * NS_PER_S / elapsed_ns
        return rates

    def _base(self, now_ns: int) -> tuple[int, Mapping[str, int]] | None:
        """The newest sample at least a window before ``now_ns``, else the oldest."""
        base = None
        for sample in self._samples:
            if base is not None and sample[0] > now_ns - self._window_ns:
                break
            base = sample
        return base
