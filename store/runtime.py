"""What runs in an engine-core process with a store: the claimed balances as
the scheduler's budget (``pacing.store_budget``), the claimer thread that fills
them, and the sync that keeps the engine's limits table and mode equal to the
global ones (``store.limits_sync``). Started by ``store.plugin``; stopped at the
scheduler's shutdown."""

from __future__ import annotations

import logging
import os
import socket
import uuid

from pacing.claims import ClaimedBalances
from pacing.limiter import NS_PER_S
from pacing.settings.store import StoreSettings
from pacing.shared import SharedLimiter
from pacing.store_budget import StoreBudget
from pacing.store_stats import StoreStats
from store.claimer import Claimer
from store.clients import connect
from store.limits_sync import LimitsSync
from store.redis_store import KeySpace, RedisStore

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")


class RunningStore:
    """The store's part of one engine: its budget, its claimer and the sync of
    its limits table with the global one."""

    def __init__(
        self,
        shared: SharedLimiter,
        store: RedisStore,
        budget: StoreBudget,
        claimer: Claimer,
        limits: LimitsSync,
    ) -> None:
        self.shared = shared
        self.store = store
        self.budget = budget
        self.claimer = claimer
        self.limits = limits

    def stop(self) -> None:
        """Stops claiming and syncing; the engine is taken off the live count."""
        self.limits.stop()
        self.claimer.stop()


def engine_id() -> str:
    """Unique among the engines of a deployment, readable in Redis: host, pid
    and a random suffix (a restarted engine is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def attach(shared: SharedLimiter, settings: StoreSettings) -> RunningStore:
    """Connects (no round trip yet: an unreachable store is the claimer's
    degraded mode, not a failed start), makes the claimed balances what the
    scheduler spends and starts the claimer."""
    client = connect(
        settings.url, password=settings.password(), timeout_s=settings.timeout_s
    )
    store = RedisStore(
        client,
        keys=KeySpace.of_fleet(settings.fleet),
        tolerance_ns=shared.limiter.burst_ns,
    )
    balances = ClaimedBalances(
        shared.limiter, assumed_engines=settings.expected_engines
    )
    budget = StoreBudget(
        balances,
        shared.limiter,
        shared.clock,
        failure_mode=settings.failure_mode,
        failure_after_ns=round(settings.failure_after_s * NS_PER_S),
    )
    stats = StoreStats()
    with shared.lock:
        shared.use_budget(budget)
        shared.store_stats = stats
    claimer = Claimer(
        store,
        balances,
        shared.lock,
        shared.clock,
        engine_id=engine_id(),
        wake=shared.wake,
        stats=stats,
    )
    claimer.start()
    # After the control plane attached (entry points load in that order): it
    # has loaded the limits file, which seeds a store that has no table yet.
    limits = LimitsSync(store, shared)
    limits.start()
    logger.info(
        "output-rate store: claiming from %s, keys under %s (failure mode %s "
        "after %.1f s)",
        settings.url,
        store.keys.prefix,
        settings.failure_mode.value,
        settings.failure_after_s,
    )
    return RunningStore(shared, store, budget, claimer, limits)
