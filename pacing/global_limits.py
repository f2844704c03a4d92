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
  one, the control plane first ``publish``-es the whole new table, mode and
  switch as one value (``pacing.policy.model.Policy``; compare-and-set against
  the version this engine applied last), then applies it locally.
- listeners (``on_table_change``): told, with ``SharedLimiter.lock`` held, when
  a table another engine published was applied here; the control plane moves
  its table etag, so an etag read before that change no longer matches.
- ``durable``: ``None``, or where the engine keeps a durable copy of the table
  and the store version it is (the control plane's limits file): the store
  saves every version it makes or applies there, and starts from its version
  (``store.limits_sync`` states the rule), so a store that loses its data
  loses nothing an engine acknowledged.

A version (``LimitsVersion``) is a counter and a stamp drawn at random by each
write: two writes never share one, even after the store lost data and counts
again.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from pacing.policy.model import Policy
from pacing.shared import SharedLimiter

#: A stamp: what ``secrets.token_hex`` draws, or empty (a table written without).
_STAMP: Final = re.compile(r"[0-9a-f]{0,64}")


@dataclass(frozen=True)
class LimitsVersion:
    """A limits table's version in the store: ``counter`` orders the versions
    of one history (each write counts past the one it replaced); ``stamp``,
    drawn at random by each write, tells apart two writes that got the same
    counter (a store that lost data counts again)."""

    counter: int
    stamp: str

    def __post_init__(self) -> None:
        if self.counter < 0 or not _STAMP.fullmatch(self.stamp):
            raise ValueError(f"not a limits version: {self.counter}/{self.stamp!r}")

    def __str__(self) -> str:
        return f"{self.counter}/{self.stamp}"

    @classmethod
    def parse(cls, text: str) -> LimitsVersion:
        """The version ``str`` wrote; ValueError for anything else."""
        counter, slash, stamp = text.partition("/")
        if not slash or not counter.isascii() or not counter.isdigit():
            raise ValueError(f"not a limits version: {text[:80]!r}")
        return cls(int(counter), stamp)


class LimitsConflict(Exception):
    """Another engine changed the table first; this engine has applied the
    newer table (as far as the store could be read) and changed nothing else."""

    def __init__(self, current: int) -> None:
        super().__init__(f"the store's limits table is at version {current}")
        self.current = current


class LimitsUnavailable(Exception):
    """The store could not take the change (unreachable, too slow, or not yet
    read once); nothing was applied on this engine."""


class LimitsNotSaved(Exception):
    """The store took the change (it is every engine's now), but this engine's
    durable copy could not be written: the caller applies it here and says so."""


class LimitsBackend(Protocol):
    """Where the control plane commits a change when a global store is used."""

    def publish(self, policy: Policy) -> None:
        """Makes ``policy`` (the whole table, its ``mode`` and ``fair_share``
        set) every engine's, before the caller applies it here, and saves it to
        the durable copy. Requires the hub's lock held. Raises LimitsConflict
        or LimitsUnavailable (nothing changed), or LimitsNotSaved."""
        ...


class DurableCopy(Protocol):
    """Where an engine keeps its table durably, with the store version it is."""

    def saved_version(self) -> LimitsVersion | None:
        """The store version of the table saved last (``None``: none saved
        with a version, e.g. a new file)."""
        ...

    def save(self, policy: Policy, version: LimitsVersion) -> None:
        """Replaces the saved table by ``policy`` (its mode and switch set),
        store version ``version``. Raises OSError (the copy is then
        unchanged)."""
        ...


class LimitsHub:
    """One engine's limits table between its control plane and a global store;
    see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._backend: LimitsBackend | None = None
        self._listeners: list[Callable[[], None]] = []
        #: Where the table is kept durably (set before the store starts).
        self.durable: DurableCopy | None = None

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
