"""The fake clock of tests and benchmarks: monotonic nanoseconds that move only
when told (the scheduler and the control plane take their clock as an argument)."""

from __future__ import annotations

NS_PER_MS = 1_000_000
#: Where a fake clock starts: far from 0, as a monotonic clock would be (1,000 s).
T0 = 1_000_000_000_000


class FakeClock:
    """Monotonic nanoseconds that only move when a test says so."""

    def __init__(self, start_ns: int = T0) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance_ms(self, ms: float) -> None:
        self.now_ns += round(ms * NS_PER_MS)
