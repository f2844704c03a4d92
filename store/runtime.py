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
from dataclasses import replace

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
    """The store's part of one engine: its budget, its claimers (users' cells
    and teams' cells) and the sync of its limits table with the global one."""

    def __init__(
        self,
        shared: SharedLimiter,
        store: RedisStore,
        budget: StoreBudget,
        claimer: Claimer,
        limits: LimitsSync,
        team_claimer: Claimer,
    ) -> None:
        self.shared = shared
        self.store = store
        self.budget = budget
        self.claimer = claimer
        self.limits = limits
        self.team_claimer = team_claimer

    def stop(self) -> None:
        """Stops claiming and syncing; the engine is taken off the live count."""
        self.limits.stop()
        self.team_claimer.stop()
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
    failure_after_ns = round(settings.failure_after_s * NS_PER_S)
    balances = ClaimedBalances(
        shared.limiter, assumed_engines=settings.expected_engines
    )
    budget = StoreBudget(
        balances,
        shared.limiter,
        shared.clock,
        failure_mode=settings.failure_mode,
        failure_after_ns=failure_after_ns,
    )
    # Teams' cells, claimed the same way: a team's rate holds across engines.
    team_cells = shared.teams.cells
    team_balances = ClaimedBalances(
        team_cells, assumed_engines=settings.expected_engines
    )
    team_budget = StoreBudget(
        team_balances,
        team_cells,
        shared.clock,
        failure_mode=settings.failure_mode,
        failure_after_ns=failure_after_ns,
    )
    stats = StoreStats()
    with shared.lock:
        shared.use_budget(budget)
        shared.teams.use_budget(team_budget)
        shared.store_stats = stats
    team_store = RedisStore(
        client,
        keys=replace(store.keys, cells="team"),
        tolerance_ns=shared.limiter.burst_ns,
    )
    engine = engine_id()  # one engine in the live count, whichever claimer beats
    claimers = [
        Claimer(
            cells,
            claimed,
            shared.lock,
            shared.clock,
            engine_id=engine,
            wake=shared.wake,
            stats=stats,
            log_outages=logs,
        )
        for cells, claimed, logs in (
            (store, balances, True),
            (team_store, team_balances, False),
        )
    ]
    claimer, team_claimer = claimers
    for started in claimers:
        started.start()
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
    return RunningStore(shared, store, budget, claimer, limits, team_claimer)
