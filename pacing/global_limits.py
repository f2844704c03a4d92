"""The seam through which a global store keeps one engine's limits table and
pacing mode equal to every other engine's, without the control plane knowing
the store or the store knowing the control plane (both import only this).

Each ``SharedLimiter`` has one ``LimitsHub`` (``hub(shared)``):

- ``lock`` serialises every change of the engine's table and mode: the control
  plane holds it from validating a change to applying it, a store's sync holds
  it from reading the store to applying what it read. The table travels with
  the mode and the fair-share policy (``pacing.fair_share_policy``: the switch
  and the weights; the counters stay each engine's). So a change is always
  validated against, and published from, the version the engine holds. Order:
  ``lock``, then the store's round trips, then ``SharedLimiter.lock`` for the
  apply alone (the scheduler never waits on the store).
- ``backend``: ``None`` on a single engine (the control plane applies its
  changes locally, as it always did), or the store's ``LimitsBackend``. With
  one, the control plane first ``publish``-es the whole new table and mode
  (compare-and-set against the version this engine applied last), then applies
  it locally.
- listeners (``on_table_change``): told, with ``SharedLimiter.lock`` held, when
  a table another engine published was applied here; the control plane moves
  its table etag, so an etag read before that change no longer matches.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from pacing.fair_share_policy import SharePolicy
from pacing.limits import LimitTable
from pacing.modes import Mode
from pacing.shared import SharedLimiter


class LimitsConflict(Exception):
    """Another engine changed the table first; this engine has applied the
    newer table (as far as the store could be read) and changed nothing else."""

    def __init__(self, current: int) -> None:
        super().__init__(f"the store's limits table is at version {current}")
        self.current = current


class LimitsUnavailable(Exception):
    """The store could not take the change (unreachable, too slow, or not yet
    read once); nothing was applied on this engine."""


class LimitsBackend(Protocol):
    """Where the control plane commits a change when a global store is used."""

    def publish(
        self,
        default_rate: int | None,
        table: LimitTable,
        mode: Mode,
        share: SharePolicy,
    ) -> None:
        """Makes the whole table, mode and fair-share policy every engine's,
        before the caller applies them here. Requires the hub's lock held.
        Raises LimitsConflict or LimitsUnavailable."""
        ...


class LimitsHub:
    """One engine's limits table between its control plane and a global store;
    see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._backend: LimitsBackend | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def backend(self) -> LimitsBackend | None:
        return self._backend

    def set_backend(self, backend: LimitsBackend | None) -> None:
        """Makes ``backend`` where changes are committed (``None``: locally)."""
        with self.lock:
            self._backend = backend

    def on_table_change(self, listener: Callable[[], None]) -> None:
        """Calls ``listener`` after each table from another engine is applied."""
        self._listeners.append(listener)

    def table_changed(self) -> None:
        """A table another engine published was applied here: tells the
        listeners. Requires ``SharedLimiter.lock`` held."""
        for listener in self._listeners:
            listener()


_hubs: weakref.WeakKeyDictionary[SharedLimiter, LimitsHub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def hub(shared: SharedLimiter) -> LimitsHub:
    """``shared``'s hub, created on first use (by the control plane or the
    store, whichever attaches first)."""
    with _hubs_lock:
        found = _hubs.get(shared)
        if found is None:
            found = _hubs[shared] = LimitsHub()
        return found
