"""Limits are global: with a store, the limits table and the pacing mode live in
Redis (``store.limits_table``), and every engine holds the version it last
applied. ``LimitsSync`` is one engine's side of that.

- ``start``: when Redis has no table, seeds it with this engine's start-up
  table and mode (flags and limits file: what the limiter holds once the control
  plane has loaded its file, so start this after the control plane), written
  only where there is none, so that of engines starting together exactly one
  seeds; then applies Redis' table here. It also registers as the hub's backend
  (``pacing.global_limits``): from then on every change made through this
  engine's control plane goes to Redis first.
- a thread subscribes to new versions (pub/sub) and reads the version every
  ``period_s`` as well (a lost message, a reconnect): any version other than
  the one applied here is read and applied. "Other", not "newer": a store that
  lost its data (a restart without persistence, a failover's rolled-back
  writes) starts counting again, and what it holds is the truth from then on;
  a store left with no table at all is seeded again from this engine's table.
- a change through the control plane (``publish``) is written only if Redis
  still holds the version applied here (compare-and-set); if not, another
  engine changed the table: it is read and applied here, and the control plane
  answers ABORTED so that the caller reads again and retries. A store that does
  not answer refuses the change (UNAVAILABLE): applying it here alone would let
  engines diverge. After a timeout the write may still have reached Redis; the
  thread then applies it here like any other version.

Applying a table takes ``SharedLimiter.lock`` only for the apply itself, through
the limiter's own calls (``set_default_rate``, ``replace_limits``: every user
keeps its token debt, and ``limit_changes`` counts the change) and the
fair-share ledger's (``apply_policy``: the switch and the weights; an engine
that cannot run fair share keeps it off), and ends the engine's idle wait. An
equal table (a seed read back, a mode-only change) is not applied again. A
document that breaks the table's rules is logged and ignored: the table in
force stays.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pacing import global_limits
from pacing.fair_share_policy import SharePolicy, apply_policy, policy_of
from pacing.limiter import OutputRateLimiter
from pacing.limits import LimitTable
from pacing.modes import Mode
from pacing.shared import SharedLimiter
from store.limits_table import Limits
from store.redis_store import LimitsSubscription, RedisStore, StaleLimits, StoreError

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: How often the version is read besides pub/sub; also the retry interval while
#: the store does not answer. Within it, a lost message is made good.
DEFAULT_PERIOD_S = 1.0
#: Longest wait for a message between looks at ``stop``.
_STOP_POLL_S = 0.1


class LimitsSync:
    """Keeps ``shared``'s limits table and mode equal to ``store``'s; see the
    module docstring. A ``pacing.global_limits.LimitsBackend``."""

    def __init__(
        self,
        store: RedisStore,
        shared: SharedLimiter,
        *,
        period_s: float = DEFAULT_PERIOD_S,
    ) -> None:
        self._store = store
        self._shared = shared
        self._hub = global_limits.hub(shared)
        self._period_s = period_s
        #: The store's version this engine's table is at; None until read once.
        self._version: int | None = None
        self._refused: int | None = None  # a bad document's version, logged once
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Tables from the store applied here (a seed read back not counted).
        self.applied = 0

    @property
    def version(self) -> int | None:
        """The store's version this engine's table is at (``None``: not read
        yet)."""
        return self._version

    def start(self) -> None:
        """Seeds and applies once (a store that does not answer is logged: the
        thread keeps trying, and changes are refused until it answers), routes
        the control plane's changes through the store, starts the thread."""
        self._hub.set_backend(self)
        try:
            self.sync()
        except StoreError as error:
            self._failed(error)
        self._thread = threading.Thread(
            target=self._run, name="output-rate-limits-sync", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread; changes apply locally again."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._hub.backend is self:
            self._hub.set_backend(None)

    def sync(self) -> bool:
        """One pass: seeds an empty store, then applies the store's table here
        when its version is not the one applied. Returns whether a table or
        mode was applied. Raises StoreError."""
        with self._hub.lock:
            return self._sync_locked()

    # -- LimitsBackend -----------------------------------------------------------

    def publish(
        self,
        default_rate: int | None,
        table: LimitTable,
        mode: Mode,
        share: SharePolicy,
    ) -> None:
        """Writes the control plane's change to the store if it still holds the
        version applied here. Requires the hub's lock (the control plane holds
        it)."""
        if self._version is None:
            raise global_limits.LimitsUnavailable(
                "the limits table has not been read from the store yet"
            )
        try:
            self._version = self._store.write_limits(
                Limits(default_rate, table, mode, share), self._version
            )
        except StaleLimits as stale:
            try:
                self._sync_locked()
            except StoreError as error:
                self._failed(error)
            except ValueError:
                pass  # a bad document: the thread logs it
            raise global_limits.LimitsConflict(stale.current) from None
        except StoreError as error:
            raise global_limits.LimitsUnavailable(str(error)) from None

    # -- helpers -----------------------------------------------------------------

    def _sync_locked(self) -> bool:
        version = self._store.limits_version()
        if version is None:
            try:
                self._version = self._store.write_limits(self._local(), 0)
                logger.info("output-rate store: seeded the limits table")
                return False
            except StaleLimits:
                pass  # another engine seeded it first: apply that one
        elif version == self._version:
            return False
        stored = self._store.read_limits()
        if stored is None:  # gone between the two reads: the next pass seeds
            return False
        version, document = stored
        return self._apply(version, document)

    def _local(self) -> Limits:
        shared = self._shared
        with shared.lock:  # copies only; the table is built off the lock
            limiter = shared.limiter
            default, mode = limiter.default_rate, shared.mode
            entries = _entries(limiter)
            share = policy_of(shared.fair_share)
        return Limits(default, LimitTable(*entries), mode, share)

    def _apply(self, version: int, limits: Limits) -> bool:
        shared = self._shared
        table, default = limits.table, limits.default_rate
        wanted = _entries(table)
        with shared.lock:
            limiter = shared.limiter
            now_ns = shared.clock()
            # The limiter cannot drop its default (pacing off), as in the
            # control plane's own whole-table replace.
            new_default = False
            if default is not None and default != limiter.default_rate:
                limiter.set_default_rate(default, now_ns)
                new_default = True
            new_entries = wanted != _entries(limiter)
            if new_entries:
                limiter.replace_limits(table, now_ns)
            before = policy_of(shared.fair_share)
            apply_policy(shared.fair_share, limits.share)
            new_weights = _weights(limits.share) != _weights(before)
            switched = shared.fair_share.enabled != before.enabled
            changed = new_default or new_entries or new_weights
            if changed:
                self._hub.table_changed()
            mode_changed = shared.mode != limits.mode or switched
            shared.mode = limits.mode
            self._version = version
        if not (changed or mode_changed):
            return False
        self.applied += 1
        what = [name for name, c in (("table", changed), ("mode", mode_changed)) if c]
        logger.info(
            "output-rate store: applied limits version %d (%s)",
            version,
            " and ".join(what),
        )
        shared.wake()
        return True

    def _run(self) -> None:
        subscription: LimitsSubscription | None = None
        while not self._stop.is_set():
            try:
                if subscription is None:
                    # Subscribe before reading: a version published after the
                    # read is announced, one before it is read.
                    subscription = self._store.subscribe_limits()
                self._read()
                self._wait(subscription)
            except StoreError as error:
                self._failed(error)
                if subscription is not None:
                    subscription.close()
                    subscription = None
                self._stop.wait(self._period_s)
            except Exception:  # keep syncing whatever one pass hit
                logger.exception("output-rate store: syncing the limits failed")
                self._stop.wait(self._period_s)
        if subscription is not None:
            subscription.close()

    def _read(self) -> None:
        """``sync``, logging a document that breaks the table's rules once per
        version instead of raising."""
        try:
            self.sync()
        except ValueError as error:
            version = self._store.limits_version()
            if version != self._refused:
                self._refused = version
                logger.error(
                    "output-rate store: ignored limits table version %s, keeping "
                    "the table in force: %s",
                    version,
                    error,
                )
        if self._failing:
            self._failing = False
            logger.info("output-rate store: the limits table is read again")

    def _wait(self, subscription: LimitsSubscription) -> None:
        """Until a version other than the one applied is announced, ``period_s``
        passed, or ``stop``."""
        deadline = time.monotonic() + self._period_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            announced = subscription.next_version(min(left, _STOP_POLL_S))
            if announced is not None and announced != self._version:
                return

    def _failed(self, error: StoreError) -> None:
        if not self._failing:
            self._failing = True
            logger.warning(
                "output-rate store: cannot read the limits table (%s); this "
                "engine keeps its table and refuses changes until it can",
                error,
            )


def _weights(share: SharePolicy) -> tuple[Any, ...]:
    """The weights of ``share`` (part of the table: they move the table etag;
    the switch does not, like the mode)."""
    return (dict(share.users), dict(share.tiers))


def _entries(source: LimitTable | OutputRateLimiter) -> tuple[Any, ...]:
    """Copies of the explicit entries, in ``LimitTable``'s argument order."""
    return (
        source.user_rates,
        source.tier_rates,
        source.memberships,
        source.exempt_users,
        source.exempt_tiers,
    )
