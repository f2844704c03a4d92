"""Counters the control plane keeps for metrics, readable from other threads."""

from __future__ import annotations

import threading
from collections import Counter


class RpcCounts:
    """Completed RPCs per (full method name, status code name); thread-safe.

    Only methods the server implements are counted, so the keys stay bounded
    whatever method names clients send.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, method: str, code: str) -> None:
        """Counts one RPC of ``method`` that ended with status ``code``."""
        with self._lock:
            self._counts[(method, code)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of all counts."""
        with self._lock:
            return dict(self._counts)
