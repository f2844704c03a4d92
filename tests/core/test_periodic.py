"""The periodic daemon thread behind the idle heartbeat and the file watcher."""

from __future__ import annotations

import threading

from pacing.periodic import Periodic


def test_ticks_until_stopped_and_not_after():
    ticks: list[int] = []
    twice = threading.Event()

    def tick() -> None:
        ticks.append(1)
        if len(ticks) >= 2:
            twice.set()

    periodic = Periodic("test-periodic", 0.01, tick)
    periodic.start()
    assert twice.wait(10)
    periodic.stop()
    stopped_at = len(ticks)
    assert not any(t.name == "test-periodic" for t in threading.enumerate())
    assert len(ticks) == stopped_at


def test_stop_before_start_does_nothing():
    Periodic("never-started", 0.01, lambda: None).stop()
