"""What runs in an engine-core process with a store: the claimed balances as
the scheduler's budgets (``pacing.store_budget``: output and prompt, users'
and teams'), the claimer threads that fill them, and the sync that keeps the
engine's limits table and mode equal to the global ones
(``store.limits_sync``). Started by ``store.plugin``; stopped at the
scheduler's shutdown."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import replace

from pacing.claims import ClaimedBalances
from pacing.limiter import NS_PER_S, OutputRateLimiter
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


#: The cells' kinds (``KeySpace.cells``), one key space each: output rates
#: of users and of teams, prompt rates of users and of teams.
CELLS = ("user", "team", "prompt", "prompt-team")


class RunningStore:
    """The store's part of one engine: its budgets, its claimers (one per kind
    of cell, ``CELLS``: users' and teams' output cells, users' and teams'
    prompt cells) and the sync of its limits table with the global one."""

    def __init__(
        self,
        shared: SharedLimiter,
        store: RedisStore,
        budget: StoreBudget,
        claimer: Claimer,
        limits: LimitsSync,
        team_claimer: Claimer,
        prompt_budget: StoreBudget,
        prompt_claimers: tuple[Claimer, Claimer],
    ) -> None:
        self.shared = shared
        self.store = store
        self.budget = budget
        self.claimer = claimer
        self.limits = limits
        self.team_claimer = team_claimer
        #: The users' prompt budget (the scheduler reaches it through
        #: ``shared.prompt.budget``).
        self.prompt_budget = prompt_budget
        #: The claimers of the users' and the teams' prompt cells.
        self.prompt_claimers = prompt_claimers

    def stop(self) -> None:
        """Stops claiming and syncing; the engine is taken off the live count."""
        self.limits.stop()
        for claimer in (*self.prompt_claimers, self.team_claimer, self.claimer):
            claimer.stop()


def engine_id() -> str:
    """Unique among the engines of a deployment, readable in Redis: host, pid
    and a random suffix (a restarted engine is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def attach(shared: SharedLimiter, settings: StoreSettings) -> RunningStore:
    """Connects (no round trip yet: an unreachable store is the claimer's
    degraded mode, not a failed start), makes the claimed balances what the
    scheduler spends and starts the claimers.

    Every budget has its cells' rates (``Rates``), claimed balances over
    them, a ``StoreBudget`` (the same failure mode) and a claimer on a key
    space of its own: users' output cells, teams' (a team's rate holds across
    engines), and the prompt budgets' two (``pacing.prompt_budget``: their
    own cells at their own 1 s tolerance, so a prompt never spends output
    budget). The prompt claimers run only while some holder has a prompt
    rate (``PromptBudgets.active``), the teams' only while a team has one
    (``store.claimer``: an idle claimer otherwise takes the lock 100 times a
    second and beats once). One engine id for all: one engine in the live
    count, whichever claimer beats."""
    client = connect(
        settings.url, password=settings.password(), timeout_s=settings.timeout_s
    )
    keys = KeySpace.of_fleet(settings.fleet)
    failure_after_ns = round(settings.failure_after_s * NS_PER_S)
    prompt = shared.prompt

    engine = engine_id()  # one engine in the live count, whichever claimer beats
    stats = StoreStats()

    # Reads of a bool and of a dict's size: no lock needed.
    def prompts_active() -> bool:
        return prompt.active

    def prompt_teams_active() -> bool:
        return prompt.active and bool(prompt.teams.table)

    def claiming(
        cells: str,
        rates: OutputRateLimiter,
        *,
        prompt_tokens: bool = False,
        active: Callable[[], bool] | None = None,
    ) -> tuple[StoreBudget, Claimer]:
        """The budget over ``rates`` and its claimer, on the ``cells`` keys at
        the rates' burst as the cells' tolerance."""
        # A prompt asks for all it lacks at once: claims cover it (pacing.claims).
        balances = ClaimedBalances(
            rates,
            assumed_engines=settings.expected_engines,
            covers_unmet=prompt_tokens,
        )
        budget = StoreBudget(
            balances,
            rates,
            shared.clock,
            failure_mode=settings.failure_mode,
            failure_after_ns=failure_after_ns,
        )
        claimer = Claimer(
            RedisStore(
                client, keys=replace(keys, cells=cells), tolerance_ns=rates.burst_ns
            ),
            balances,
            shared.lock,
            shared.clock,
            engine_id=engine,
            wake=shared.wake,
            stats=stats,
            log_outages=cells == CELLS[0],  # the others' outage is the same
            active=active,
            prompt_tokens=prompt_tokens,
            name="output-rate-claimer"
            if cells == CELLS[0]
            else f"output-rate-{cells}-claimer",
        )
        return budget, claimer

    users, teams, prompt_users, prompt_teams = CELLS
    budget, claimer = claiming(users, shared.limiter)
    team_budget, team_claimer = claiming(teams, shared.teams.cells)
    prompt_budget, prompt_claimer = claiming(
        prompt_users, prompt.limiter, prompt_tokens=True, active=prompts_active
    )
    prompt_team_budget, prompt_team_claimer = claiming(
        prompt_teams,
        prompt.teams.cells,
        prompt_tokens=True,
        active=prompt_teams_active,
    )
    with shared.lock:
        shared.use_budget(budget)
        shared.teams.use_budget(team_budget)
        prompt.use_budget(prompt_budget)
        prompt.teams.use_budget(prompt_team_budget)
        shared.store_stats = stats
    claimers = (claimer, team_claimer, prompt_claimer, prompt_team_claimer)
    for started in claimers:
        started.start()
    # After the control plane attached (entry points load in that order): it
    # has loaded the limits file, which seeds a store that has no table yet.
    store = claimer.store
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
    return RunningStore(
        shared,
        store,
        budget,
        claimer,
        limits,
        team_claimer,
        prompt_budget,
        (prompt_claimer, prompt_team_claimer),
    )
