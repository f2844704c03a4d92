"""Limits are global: with a store, the limits table and the pacing mode live in
Redis (``store.limits_table``), and every engine holds the version it last
applied. ``LimitsSync`` is one engine's side of that.

Versions (``pacing.global_limits.LimitsVersion``) are a counter and a random
stamp: equal only for the same write. The version an engine holds is the one
it applied last or, before its first read, the one its durable copy (the
control plane's limits file: ``pacing.global_limits.DurableCopy``) was saved
at. Each pass compares it with the store's:

- the same: nothing to do;
- no table (a new store, or one that lost its data): this engine seeds it with
  its table (flags and limits file at start-up: start this after the control
  plane; later, the table in force) at the counter it holds (1 if none), with
  a new stamp: a seed claims to be no newer than what it was made from. It is
  written only where there is none, so of engines starting together exactly
  one seeds;
- a lower counter than held (the store went back: a restart without
  persistence that another engine seeded from an older file, a failover that
  lost the last writes): this engine's table is newer, so it writes it back
  over the store's (compare-and-set on the store's version, counting past its
  own) and logs one warning; of several engines doing so, the highest counter
  wins, and the others apply it;
- anything else (a higher counter, or the same counter with another stamp:
  which is newer cannot be told, and the store's wins): the store's table is
  read, checked (``store.limits_table.decode``) and
  applied here. A document that breaks the table's rules is logged once and
  ignored: the table in force stays.

So nothing an engine acknowledged is lost while any engine that applied it
keeps its file, and a table never goes back to one older than an engine held.
Every version made or applied here is saved to the durable copy with its
version. A failed save is logged, and the change stays in force (the store and
the other engines hold it); a change through this engine's control plane then
answers an error saying so (``LimitsNotSaved``), never OK.

- ``start`` registers as the hub's backend (``pacing.global_limits``): from
  then on every change made through this engine's control plane goes to Redis
  first. A thread subscribes to new versions (pub/sub) and reads the version
  every ``period_s`` as well (a lost message, a reconnect).
- a change through the control plane (``publish``) is written only if Redis
  still holds exactly the version applied here (compare-and-set on counter and
  stamp); if not, another engine changed the table (or the store lost it): the
  pass above runs, and the control plane answers ABORTED so that the caller
  reads again and retries. A store that does not answer refuses the change
  (UNAVAILABLE): applying it here alone would let engines diverge. After a
  timeout the write may still have reached Redis; the thread then applies it
  here like any other version.

Applying a table takes ``SharedLimiter.lock`` only for the apply itself, through
the limiter's own calls (``set_default_rate``, ``replace_limits``: every user
keeps its token debt, and ``limit_changes`` counts the change) and the
fair-share ledger's (``apply_policy``: the switch and the weights; an engine
that cannot run fair share keeps it off), then makes the policy the one in
force (``SharedLimiter.policy``, which applies the prompt rates: users',
tiers', teams' and the default's ``prompt_tokens_per_second``, each user's
and team's prompt debt kept, the ceilings: users', tiers' and the
default's ``ceiling_tokens_per_second``, both carried under the document's
``attributes``, and the priority bands: the document's ``bands`` and
``objectives``, each holder's ``band`` under ``attributes``), and ends the
engine's idle wait. A stored table without a default output rate keeps the
engine's (pacing off cannot be applied), never its default prompt rate,
ceiling or band: those are the store's. An equal table (a
seed read back, a mode-only change) is not applied again. Whether the table
changed (its etag moves, the version is counted and logged) is one comparison
of the policy in force with the one read (``pacing.policy.model.Policy``:
every attribute of every holder), the mode and the fair-share switch aside, so
an attribute added to the policy is compared without being named here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from pacing import global_limits
from pacing.fair_share_policy import apply_policy
from pacing.global_limits import LimitsVersion
from pacing.limiter import OutputRateLimiter
from pacing.limits import LimitTable
from pacing.policy.model import Policy
from pacing.shared import SharedLimiter
from store.redis_store import (
    NO_TABLE,
    LimitsSubscription,
    RedisStore,
    StaleLimits,
    StoreError,
)

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: How often the version is read besides pub/sub; also the retry interval while
#: the store does not answer. Within it, a lost message is made good.
DEFAULT_PERIOD_S = 1.0
#: Looks at the store within one pass while other engines' writes race ours.
_WRITE_ATTEMPTS = 4
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
        self._version: LimitsVersion | None = None
        #: A refused document's version and error, logged once.
        self._refused: tuple[LimitsVersion | None, str] | None = None
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Tables from the store applied here (a seed read back not counted).
        self.applied = 0

    @property
    def version(self) -> LimitsVersion | None:
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
        """One pass (see the module docstring). Returns whether a table or mode
        was applied. Raises StoreError, and ValueError for a document that
        breaks the table's rules."""
        with self._hub.lock:
            return self._sync_locked()

    # -- LimitsBackend -----------------------------------------------------------

    def publish(self, policy: Policy) -> None:
        """Writes the control plane's change (its ``mode`` and ``fair_share``
        set) to the store if it still holds the version applied here. Requires
        the hub's lock (the control plane holds it)."""
        if self._version is None:
            raise global_limits.LimitsUnavailable(
                "the limits table has not been read from the store yet"
            )
        try:
            self._version = self._store.write_limits(policy, self._version)
        except StaleLimits as stale:
            try:
                self._sync_locked()
            except StoreError as error:
                self._failed(error)
            except ValueError:
                pass  # a bad document: the thread logs it
            raise global_limits.LimitsConflict(stale.current.counter) from None
        except StoreError as error:
            raise global_limits.LimitsUnavailable(str(error)) from None
        if not self._save(policy, self._version):
            raise global_limits.LimitsNotSaved(
                f"limits version {self._version} is in force on every engine, but "
                "this engine could not save it to its limits file"
            )

    # -- helpers -----------------------------------------------------------------

    def _sync_locked(self) -> bool:
        for _ in range(_WRITE_ATTEMPTS):
            current = self._store.limits_version()
            if current is not None and current == self._version:
                return False
            held = self._held()
            try:
                if current is None:
                    # At the counter held, not past it: a seed claims to be no
                    # newer than the table it was made from.
                    self._write_ours(NO_TABLE, 0 if held is None else held.counter - 1)
                    logger.info(
                        "output-rate store: seeded the limits table as version %s",
                        self._version,
                    )
                    return False
                if held is not None and current.counter < held.counter:
                    self._write_ours(current, held.counter)
                    logger.warning(
                        "output-rate store: the limits table went back from "
                        "version %s to %s (lost or rolled-back writes); wrote "
                        "this engine's table back as version %s",
                        held,
                        current,
                        self._version,
                    )
                    return False
            except StaleLimits:
                continue  # another engine wrote first: look again
            stored = self._store.read_limits()
            if stored is None:  # gone between the two reads: seed it
                continue
            version, policy = stored
            applied = self._apply(version, policy)
            self._save(policy, version)
            return applied
        return False  # writers kept racing: the next pass looks again

    def _held(self) -> LimitsVersion | None:
        """The version applied here, else the durable copy's."""
        if self._version is not None:
            return self._version
        durable = self._hub.durable
        return None if durable is None else durable.saved_version()

    def _write_ours(self, expected: LimitsVersion, count_past: int) -> None:
        """Writes this engine's table over ``expected`` (StaleLimits if that is
        no longer the store's), counting past ``count_past``."""
        policy = self._local()
        self._version = self._store.write_limits(
            policy, expected, count_past=count_past
        )
        self._save(policy, self._version)

    def _save(self, policy: Policy, version: LimitsVersion) -> bool:
        """Saves ``policy`` (one the store took or gave: its mode set) at
        ``version`` to the durable copy, if any; returns False when that failed
        (logged: the table is in force, as the store holds it)."""
        durable = self._hub.durable
        if durable is None:
            return True
        assert policy.mode is not None  # encode refuses, decode sets it
        try:
            durable.save(policy, version)
        except OSError as error:
            logger.error(
                "output-rate store: limits version %s is in force but this "
                "engine could not save it to its limits file: %s",
                version,
                error,
            )
            return False
        return True

    def _local(self) -> Policy:
        """The policy in force here, its mode and fair-share switch set."""
        with self._shared.lock:
            return self._shared.policy_in_force()

    def _apply(self, version: LimitsVersion, policy: Policy) -> bool:
        shared = self._shared
        # The policy in force, read before the apply: nothing else changes the
        # table meanwhile (every change holds the hub's lock, as this does).
        held = self._local()
        if policy.default_rate is None:
            # The limiter cannot drop its default (pacing off), as in the
            # control plane's own whole-table replace; the default's other
            # attributes (its prompt rate, its ceiling, its band) are the
            # store's.
            policy = dataclasses.replace(
                policy,
                default=dataclasses.replace(
                    policy.default, tokens_per_second=held.default_rate
                ),
            )
        changed = _table_part(policy) != _table_part(held)
        table, teams, share = (
            policy.limit_table(),
            policy.team_table(),
            policy.share_policy(),
        )
        default, wanted = policy.default_rate, _entries(table)
        mode = policy.mode
        assert mode is not None  # decode sets it
        in_force = dataclasses.replace(policy, mode=None, fair_share=None)
        with shared.lock:
            limiter = shared.limiter
            now_ns = shared.clock()
            if default is not None and default != limiter.default_rate:
                limiter.set_default_rate(default, now_ns)
            if wanted != _entries(limiter):
                limiter.replace_limits(table, now_ns)
            held_teams = shared.teams.table
            if (teams.rates, teams.memberships) != (
                held_teams.rates,
                held_teams.memberships,
            ):
                shared.teams.replace(teams, now_ns)
            was_enabled = shared.fair_share.enabled
            apply_policy(shared.fair_share, share)
            shared.policy = in_force
            switched = shared.fair_share.enabled != was_enabled
            if changed:
                self._hub.table_changed()
            mode_changed = shared.mode != mode or switched
            shared.mode = mode
            self._version = version
        if not (changed or mode_changed):
            return False
        self.applied += 1
        what = [name for name, c in (("table", changed), ("mode", mode_changed)) if c]
        logger.info(
            "output-rate store: applied limits version %s (%s)",
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
            try:
                version: LimitsVersion | None = self._store.limits_version()
            except ValueError:
                version = None  # a malformed version: the error names it
            if (version, str(error)) != self._refused:
                self._refused = (version, str(error))
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
        """Until a version is announced (a counter alone cannot tell it is the
        one applied: a store that lost data counts again), ``period_s`` passed,
        or ``stop``."""
        deadline = time.monotonic() + self._period_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if subscription.next_version(min(left, _STOP_POLL_S)) is not None:
                return

    def _failed(self, error: StoreError) -> None:
        if not self._failing:
            self._failing = True
            logger.warning(
                "output-rate store: cannot read the limits table (%s); this "
                "engine keeps its table and refuses changes until it can",
                error,
            )


def _table_part(policy: Policy) -> Policy:
    """``policy`` without its mode and fair-share switch: what moves the table
    etag (every holder's attributes: rates, exemptions, weights, groups)."""
    return dataclasses.replace(policy, mode=None, fair_share=None)


def _entries(source: LimitTable | OutputRateLimiter) -> tuple[Any, ...]:
    """Copies of the explicit entries, in ``LimitTable``'s argument order."""
    return (
        source.user_rates,
        source.tier_rates,
        source.memberships,
        source.exempt_users,
        source.exempt_tiers,
    )
