"""A daemon thread that calls ``tick`` every ``period_s`` until stopped.

Both the engine's idle heartbeat (``engine_ext.idle_stats``) and the limits-file
watcher (``control.persistence``) run one. ``tick`` must not raise: each caller
reports its own failures in its own words.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """Calls ``tick`` every ``period_s`` in a daemon thread named ``name``."""

    def __init__(self, name: str, period_s: float, tick: Callable[[], None]) -> None:
        self._name = name
        self._period_s = period_s
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread; the first tick comes one period later."""
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops ticking and waits for the thread to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._tick()
