"""An engine without a model for the store's tests and benchmarks: the real
claimer (``store.claimer``) filling real balances (``pacing.claims``) from a
real store, and a stepping thread in place of the scheduler that, every
``step_s``, asks each of its users for ``streams`` tokens under the shared lock
(``take_up_to``, as the paced step does) and pokes the claimer when a user
starts wanting. Every user wants far more than its limit: each is paced by the
store, the worst case for round trips."""

from __future__ import annotations

import threading
import time

from pacing.claims import DEFAULT_HORIZON_NS, ClaimedBalances
from pacing.limiter import OutputRateLimiter
from pacing.store_stats import StoreStats
from store.claimer import Claimer
from tools.counting_store import CountingStore


class TimedLock:
    """A lock that records how long each hold by the claimer thread lasted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.claimer_holds: list[float] = []
        self._since = 0.0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread().name == "output-rate-claimer":
            self.claimer_holds.append(time.perf_counter() - self._since)
        self._lock.release()


class SimulatedEngine:
    """Balances, the claimer thread and a stepping loop; ``taken`` counts the
    tokens its steps spent per user, ``stats`` the claimer's round trips."""

    def __init__(
        self,
        store: CountingStore,
        name: str,
        users: list[str],
        *,
        rate: int,
        streams: int = 2,
        step_s: float = 0.005,
        horizon_ns: int = DEFAULT_HORIZON_NS,
    ) -> None:
        self.users = users
        self.streams = streams
        self.step_s = step_s
        self.lock = TimedLock()
        self.balances = ClaimedBalances(
            OutputRateLimiter(rate, {}), horizon_ns=horizon_ns
        )
        self.store = store
        self.stats = StoreStats()
        self.claimer = Claimer(
            store,
            self.balances,
            self.lock,
            time.monotonic_ns,
            engine_id=name,
            stats=self.stats,
        )
        self.taken = dict.fromkeys(users, 0)
        self.step_seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-steps")

    def start(self) -> None:
        self.claimer.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.claimer.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.step_s):
            started = time.perf_counter()
            with self.lock:
                now_ns = time.monotonic_ns()
                for user in self.users:
                    self.taken[user] += self.balances.take_up_to(
                        user, self.streams, now_ns
                    )[0]
                poke = self.balances.wants_claims
            if poke:
                self.claimer.poke()
            self.step_seconds.append(time.perf_counter() - started)
