"""Completed control-plane RPCs per method and status code, for the metrics."""

from __future__ import annotations

import threading
from collections import Counter

#: Distinct method names counted under their own name; later ones count as
#: ``OTHER_METHOD``, so the ``method`` label stays bounded whatever names reach
#: the counts.
MAX_METHODS = 32
OTHER_METHOD = "__other__"


class RpcCounts:
    """Completed RPCs per (full method name, status code name); thread-safe.

    The server counts only the methods it implements; the cap of
    ``max_methods`` names is the second line that keeps the keys bounded.
    """

    def __init__(self, max_methods: int = MAX_METHODS) -> None:
        self._lock = threading.Lock()
        self._max_methods = max_methods
        self._methods: set[str] = set()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, method: str, code: str) -> None:
        """Counts one RPC of ``method`` that ended with status ``code``."""
        with self._lock:
            if method not in self._methods:
                if len(self._methods) >= self._max_methods:
                    method = OTHER_METHOD
                else:
                    self._methods.add(method)
            self._counts[(method, code)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of all counts."""
        with self._lock:
            return dict(self._counts)
