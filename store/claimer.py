"""The claimer: a background thread that keeps an engine's local balances
(``pacing.claims.ClaimedBalances``) filled from the store, so that the
scheduling step never waits on the network.

Each pass takes the owner's lock just long enough to ask the balances what to
send (``plan``), releases it for the round trip (claims, returns and, every
``heartbeat_ns``, this engine's heartbeat, all in one pipeline), then takes it
again to hand the answers in (``landed``). A pass runs when poked (the scheduler
saw a user start wanting: ``ClaimedBalances.wants_claims``) or every
``period_s``. When a grant lands for a user the engine may be idle-waiting on,
``wake`` ends that wait. Every answer's cell debt goes in too, as the user's
global TAT lead (``ClaimedBalances.record_cell``), for the control plane.

Every heartbeat's answer counts the live engines. What the balances are given
is the largest count of the last heartbeat lifetime (a live set emptied by a
FLUSHALL or a failover refills within a heartbeat period, as every live engine
beats once per period), marked whole once this engine has heard the set for a
whole lifetime (before that, some live engine may not have beaten into it
yet): ``ClaimedBalances.share_divisor``.

A store that does not answer is recorded in the balances
(``record_store_failure``; the claims in flight are marked failed, their
returns dropped: tokens lost to everyone until the cell's debt decays, never
double-spent); the next pass tries again. What the engine does meanwhile
(spend what it holds, then the fallback share) is the scheduler's to decide
from the balances' state.

With ``stats``, each round trip is recorded there for the metrics
(``pacing.store_stats``): answered or failed, how long it took by ``clock``,
the tokens claimed, granted and returned (apart, for a claimer of prompt
tokens: ``prompt_tokens``), and the store's state.

With ``active``, passes run only while it says yes (``store.runtime``'s
prompt claimers: while some holder has a prompt rate). Otherwise the thread
only looks again every ``IDLE_PERIOD_S``: no lock, no round trip, no
heartbeat, so a claimer with nothing to claim costs a few wake-ups a second
(a running idle one: a pass every ``period_s`` under the owner's lock and a
heartbeat a second). It counts the live engines again from its first
heartbeat once active; the other claimers kept this engine in the set.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from typing import Any

from pacing.claims import ClaimedBalances
from pacing.limiter import NS_PER_S
from pacing.store_stats import StoreStats
from store.cell import MICRO
from store.redis_store import RedisStore, StoreError

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

DEFAULT_PERIOD_S = 0.01
#: How often a claimer that is not ``active`` looks again (nothing else).
IDLE_PERIOD_S = 0.1
DEFAULT_HEARTBEAT_NS = NS_PER_S
#: A heartbeat lives for three periods: a lost one does not drop the engine.
HEARTBEAT_LIFETIMES = 3


class Claimer:
    """Claims for ``balances`` from ``store``; see the module docstring.

    ``lock`` is what the scheduler holds while it uses ``balances`` (the
    facade's lock); ``clock`` is the engine's monotonic clock in nanoseconds.
    ``stats``, when given, is updated under ``lock`` after every round trip.
    """

    def __init__(
        self,
        store: RedisStore,
        balances: ClaimedBalances,
        lock: AbstractContextManager[Any],
        clock: Callable[[], int],
        *,
        engine_id: str,
        wake: Callable[[], None] | None = None,
        period_s: float = DEFAULT_PERIOD_S,
        heartbeat_ns: int = DEFAULT_HEARTBEAT_NS,
        stats: StoreStats | None = None,
        log_outages: bool = True,
        active: Callable[[], bool] | None = None,
        prompt_tokens: bool = False,
        name: str = "output-rate-claimer",
    ) -> None:
        self._store = store
        #: While this says no, a pass does nothing (see ``run_once``).
        self._active = active
        #: Whether its tokens are prompt tokens, counted apart in ``stats``.
        self._prompt_tokens = prompt_tokens
        self._name = name
        #: Whether this claimer logs the store going away and coming back
        #: (an engine's second claimer leaves that to the first).
        self._log_outages = log_outages
        self._balances = balances
        self._lock = lock
        self._clock = clock
        self._engine_id = engine_id
        self._wake = wake
        self._period_s = period_s
        self._heartbeat_ns = heartbeat_ns
        self._stats = stats
        self._next_heartbeat_ns: int | None = None
        #: (when, count) of the live-engine counts of the last lifetime.
        self._counts: deque[tuple[int, int]] = deque()
        self._first_count_ns: int | None = None
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def store(self) -> RedisStore:
        """The store (the key space) it claims from."""
        return self._store

    def start(self) -> None:
        """Starts the claimer thread."""
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread, waits for it, and takes this engine off the live
        count (best effort: the heartbeat runs out anyway)."""
        self._stop.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join()
        with suppress(StoreError):
            self._store.leave(self._engine_id)

    def poke(self) -> None:
        """Runs a pass now rather than at the next period (no I/O here: safe
        from the scheduling step)."""
        self._poke.set()

    def run_once(self) -> None:
        """One pass: plan, one round trip, hand the answers in. Nothing while
        not ``active``: no lock, no round trip, no heartbeat (the balances have
        nothing to claim; the other claimers keep this engine counted)."""
        if not self.is_active():
            return
        with self._lock:
            now_ns = self._clock()
            plan = self._balances.plan(now_ns)
            beat = self._next_heartbeat_ns is None or now_ns >= self._next_heartbeat_ns
        if not plan and not beat:
            return
        heartbeat = (
            (self._engine_id, self._heartbeat_ns * HEARTBEAT_LIFETIMES)
            if beat
            else None
        )
        sent_ns = self._clock()
        try:
            answer = self._store.exchange(plan.claims, plan.returns, heartbeat)
        except StoreError as error:
            waited_ns = self._clock() - sent_ns
            with self._lock:
                now_ns = self._clock()
                if self._balances.store_down_since_ns is None and self._log_outages:
                    logger.warning(
                        "output-rate store unavailable: %s%s", error, self._waiting()
                    )
                self._balances.claims_failed(plan.claims)
                self._balances.record_store_failure(now_ns)
                if self._stats is not None:
                    self._stats.record_failed(waited_ns, now_ns)
            return
        # Read before the lock: waiting for the scheduler's step is not the store's.
        waited_ns = self._clock() - sent_ns
        woke = False
        with self._lock:
            now_ns = self._clock()
            if self._balances.store_down_since_ns is not None and self._log_outages:
                logger.warning("output-rate store available again")
            if answer.live_engines is None:
                self._balances.record_store_ok()
            else:
                count, whole = self._live_count(answer.live_engines, now_ns)
                self._balances.record_store_ok(count, whole=whole)
            if beat:
                self._next_heartbeat_ns = now_ns + self._heartbeat_ns
            for user, grant in answer.grants.items():
                self._balances.landed(user, grant.granted, grant.retry_after_ns, now_ns)
                woke = woke or grant.granted > 0
                lead_ns = tat_lead_ns(grant.debt, plan.claims[user].rate)
                self._balances.record_cell(user, lead_ns, now_ns)
            # After the claims: a user's return ran after its claim.
            for user, returned in answer.returned.items():
                lead_ns = tat_lead_ns(returned.debt, plan.returns[user].rate)
                self._balances.record_cell(user, lead_ns, now_ns)
            if self._stats is not None:
                self._stats.record_answered(
                    waited_ns,
                    claimed=sum(request.tokens for request in plan.claims.values()),
                    granted=sum(grant.granted for grant in answer.grants.values()),
                    returned=sum(request.tokens for request in plan.returns.values()),
                    live_engines=self._balances.live_engines,
                    prompt=self._prompt_tokens,
                )
        if woke and self._wake is not None:
            self._wake()

    def is_active(self) -> bool:
        """Whether passes run (``active``'s answer; always, without one)."""
        return self._active is None or self._active()

    def _live_count(self, count: int, now_ns: int) -> tuple[int, bool]:
        """The live engines' count to go by and whether it is whole; see the
        module docstring."""
        lifetime_ns = self._heartbeat_ns * HEARTBEAT_LIFETIMES
        if self._first_count_ns is None:
            self._first_count_ns = now_ns
        self._counts.append((now_ns, count))
        while self._counts[0][0] < now_ns - lifetime_ns:
            self._counts.popleft()
        largest = max(counted for _, counted in self._counts)
        return largest, now_ns - self._first_count_ns >= lifetime_ns

    def _waiting(self) -> str:
        """Why limited users wait, for the outage's log line, when they do."""
        if self._balances.share_divisor is not None:
            return ""
        return (
            "; limited users wait until it answers (no count of live engines "
            "heard yet and no --output-rate-store-expected-engines to assume)"
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self._period_s if self.is_active() else IDLE_PERIOD_S)
            self._poke.clear()
            if self._stop.is_set():
                return
            try:
                self.run_once()
            except Exception:  # a bug here must not end the claims for good
                logger.exception("output-rate claimer pass failed")


def tat_lead_ns(debt: int, rate: int) -> int:
    """A cell's ``debt`` (micro-tokens, ``store.cell``) as how far its TAT runs
    ahead, in nanoseconds at ``rate`` tokens/s, rounded up."""
    return -(-debt * (NS_PER_S // MICRO) // rate)
