"""Prompt budgets with a global store (``store.runtime``): each user's and each
team's prompt rate is one rate across engines, claimed by the same machinery
as the output rates (``pacing.claims``, ``store.claimer``) from cells of their
own (``cells="prompt"`` and ``"prompt-team"``, at the prompts' 1 s tolerance),
so prompt claims never spend output budget. The limits sync carries the
prompt rates (under the document's ``attributes``) to every engine's
``shared.prompt``; the prompt claimers run only while some holder has a
prompt rate (the teams' while a team has one); an outage is the failure
mode's for prompts as for output.

Engines are the store's real runtime (``attach``: budgets, claimers, limits
sync) over shared limiters on fake clocks, two at a time, on the session's
real ``redis-server``; the scheduler's takes are made by the test. A cell
reads Redis' clock (``TIME``), the real one: the GCRA bounds are on real
time, over a window from before the first take to after the engines stopped.
For a fresh cell (no debt, nothing held: ``store.cell``'s O(a) = D(a) = 0),
over W seconds the engines together take at most (W + tau)·R + 1 tokens: tau
= 1 s for prompts, 100 ms for output."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from google.protobuf.field_mask_pb2 import FieldMask
from redis.cluster import key_slot

from control.service.operations import LimitsService
from pacing.budget import Health
from pacing.claims import ClaimedBalances, burst_tokens
from pacing.limiter import DEFAULT_BURST_NS, NO_DEFAULT, NS_PER_S, OutputRateLimiter
from pacing.policy.model import Limits, User
from pacing.prompt_budget import PROMPT_BURST_NS
from pacing.settings.store import FailureMode, StoreSettings
from pacing.store_budget import DEGRADED_AFTER_NS
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.claimer import IDLE_PERIOD_S, Claimer
from store.clients import connect
from store.redis_store import KeySpace
from store.runtime import CELLS, RunningStore, attach
from tests.control_harness import Rig, Served, make_rig, serving
from tools.counting_store import CountingStore
from tools.fake_clock import FakeClock
from tools.redis_server import free_port

#: Alice's prompt rate and output rate, tokens/s.
PROMPT_RATE = 400
OUTPUT_RATE = 50
#: Iterations of the run (10 ms of real and fake time each).
STEPS = 200
#: How long a change may take to reach an engine on this shared machine.
EVENTUALLY_S = 20.0


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """The test's own connection to an empty database."""
    real = connect(redis_url, timeout_s=5.0)
    assert isinstance(real, redis.Redis)
    real.flushdb()
    yield real
    real.close()


def with_prompt_rates(rig: Rig, users: dict[str, int]) -> None:
    """Gives ``users`` prompt rates of their own in ``rig``'s policy in force
    (as a limits file at start-up would)."""
    shared = rig.shared
    with shared.lock:
        shared.policy = dataclasses.replace(
            shared.policy,
            users={
                **shared.policy.users,
                **{
                    user: User(Limits(prompt_tokens_per_second=rate))
                    for user, rate in users.items()
                },
            },
        )


@contextlib.contextmanager
def engines(
    url: str,
    count: int = 2,
    *,
    prompt_rates: dict[str, int] | None = None,
    every_engine: bool = False,
    **settings: object,
) -> Iterator[list[tuple[Rig, RunningStore]]]:
    """``count`` engines' store runtimes, started in turn (the first seeds the
    store's table); ``prompt_rates`` are given to the first only, or with
    ``every_engine`` to each (a store never reached gives no table)."""
    started: list[tuple[Rig, RunningStore]] = []
    try:
        for index in range(count):
            rig = make_rig(default_rate=OUTPUT_RATE)
            if prompt_rates and (index == 0 or every_engine):
                with_prompt_rates(rig, prompt_rates)
            attached = attach(rig.shared, StoreSettings(url, **settings))
            started.append((rig, attached))
        yield started
    finally:
        for _, running in started:
            running.stop()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + EVENTUALLY_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {EVENTUALLY_S} s"
        time.sleep(0.01)


def bound(window_s: float, rate: int, tolerance_ns: int) -> float:
    """GCRA's bound for a fresh cell over ``window_s``: (W + tau)·R + 1."""
    return (window_s + tolerance_ns / NS_PER_S) * rate + 1


# -- the key spaces ----------------------------------------------------------


def test_each_kind_of_cell_has_keys_of_its_own_in_the_users_slot() -> None:
    fleets = (None, "a", "prompt", "prompt-team", "user", "team")
    made = {
        (fleet, cells): replace_cells(KeySpace.of_fleet(fleet), cells).cell("alice")
        for fleet, cells in itertools.product(fleets, CELLS)
    }
    assert len(set(made.values())) == len(made)
    assert made[(None, "prompt")] == "output_rate:prompt:{alice}"
    assert made[(None, "prompt-team")] == "output_rate:prompt-team:{alice}"
    assert made[(None, "user")] == "output_rate:user:{alice}"  # as before
    assert {key_slot(key.encode()) for key in made.values()} == {key_slot(b"alice")}


def replace_cells(keys: KeySpace, cells: str) -> KeySpace:
    return dataclasses.replace(keys, cells=cells)


# -- one prompt rate across engines ---------------------------------------------


def test_two_engines_take_one_prompt_rate_between_them_and_leave_output_alone(
    redis_url: str, client: redis.Redis
) -> None:
    """Alice, with a prompt rate (given to the first engine, carried to the
    second by the limits sync) and the default output rate, asks both engines
    for far more of each every 10 ms. The prompt tokens both take stay within
    the one prompt cell's bound, the output tokens within the output cell's:
    two cells, each at its own rate and tolerance, neither spending the
    other's budget."""
    with engines(redis_url, prompt_rates={"alice": PROMPT_RATE}) as fleet:
        for rig, running in fleet:  # the second engine has it from the store
            assert rig.shared.prompt.rate_of("alice") == PROMPT_RATE
            users, teams = running.prompt_claimers
            assert (users.is_active(), teams.is_active()) == (True, False)  # no team
        prompt_taken = [0] * len(fleet)
        output_taken = [0] * len(fleet)
        cells: dict[str, dict[bytes, bytes]] = {}
        keys = KeySpace()
        start_s = time.time()
        for step in range(STEPS):
            time.sleep(0.01)
            for i, (rig, _) in enumerate(fleet):
                rig.clock.advance_ms(10)
                shared = rig.shared
                with shared.lock:
                    now = rig.clock()
                    prompt_taken[i] += shared.prompt.budget.take_up_to(
                        "alice", 10_000, now
                    )[0]
                    output_taken[i] += shared.budget.take_up_to("alice", 8, now)[0]
            if step >= STEPS // 2:  # both cells held while the user is paced
                for name, key in (
                    ("prompt", replace_cells(keys, "prompt").cell("alice")),
                    ("user", keys.cell("alice")),
                ):
                    if name not in cells and (held := client.hgetall(key)):
                        cells[name] = held
        for _, running in fleet:
            running.stop()
        window_s = time.time() - start_s
        stats = [rig.shared.store_stats for rig, _ in fleet]
        assert all(s is not None for s in stats)
        prompt_bound = bound(window_s, PROMPT_RATE, PROMPT_BURST_NS)
        output_bound = bound(window_s, OUTPUT_RATE, DEFAULT_BURST_NS)
        print(
            f"\nover {window_s:.2f} s: prompt {prompt_taken} = {sum(prompt_taken)} "
            f"tokens (at most {prompt_bound:.0f}), output {output_taken} = "
            f"{sum(output_taken)} (at most {output_bound:.0f})"
        )
        assert sum(prompt_taken) <= prompt_bound
        assert sum(output_taken) <= output_bound
        # Paced, not stopped: every engine took of both (how much depends on
        # how often this loaded machine runs the claimers: no floor on it).
        assert all(prompt_taken) and all(output_taken)
        # Two cells, each at its own rate.
        assert int(cells["prompt"][b"rate"]) == PROMPT_RATE
        assert int(cells["user"][b"rate"]) == OUTPUT_RATE
        # The store's traffic in one set of stats, the tokens apart.
        prompt_granted = sum(s.prompt_tokens_granted for s in stats if s)
        prompt_returned = sum(s.prompt_tokens_returned for s in stats if s)
        output_granted = sum(s.tokens_granted for s in stats if s)
        output_returned = sum(s.tokens_returned for s in stats if s)
        assert sum(prompt_taken) <= prompt_granted
        assert prompt_granted - prompt_returned <= prompt_bound
        assert sum(output_taken) <= output_granted
        assert output_granted - output_returned <= output_bound
    cell_keys = {k for k in client.scan_iter("output_rate:*") if b"{alice}" in k}
    assert cell_keys <= {b"output_rate:prompt:{alice}", b"output_rate:user:{alice}"}


def test_a_prompt_needing_more_than_a_block_gets_it_from_the_cell_at_once(
    client: redis.Redis,
) -> None:
    """A prompt's take asks for all it lacks and, below its floor (a KV
    block), gives back what it got: the consumption that sizes claims stays
    0. Claims that cover the unmet demand (the prompt balances') get the
    floor from a fresh cell in one pass; claims sized by consumption alone
    (the output's) get 1 token a pass, each for a lease, and a floor of 512
    is never reached."""
    floor, need = 512, 3000
    rates = OutputRateLimiter(
        NO_DEFAULT, {"alice": 5000}, PROMPT_BURST_NS, table_only=True
    )
    got = {}
    for covers in (True, False):
        client.flushdb()
        balances = ClaimedBalances(rates, covers_unmet=covers)
        clock = FakeClock()
        store = CountingStore(client, tolerance_ns=PROMPT_BURST_NS)
        claimer = Claimer(store, balances, threading.Lock(), clock, engine_id="e")
        taken = passes = 0
        while taken < floor and passes < 300:  # 3 s: three leases
            clock.advance_ms(10)
            now = clock()
            got_now = balances.take_up_to("alice", need, now)[0]
            if got_now < floor:
                balances.refund("alice", now, got_now)
            else:
                taken = got_now
            claimer.run_once()
            passes += 1
        got[covers] = (taken, passes, store.claims)
    print(f"\ncovering the unmet demand: {got[True]}; by consumption: {got[False]}")
    assert got[True][0] >= floor and got[True][1] <= 2
    assert got[False][0] == 0


# -- the limits table carries the prompt rates -------------------------------------


@contextlib.contextmanager
def served_engine(
    url: str, default_rate: int | None
) -> Iterator[tuple[Rig, RunningStore, Served]]:
    """One engine's store runtime with its control plane on real gRPC."""
    rig = make_rig(default_rate=default_rate)
    running = attach(rig.shared, StoreSettings(url))
    try:
        with serving(LimitsService(rig.shared, global_store=True)) as served:
            yield rig, running, served
    finally:
        running.stop()


@pytest.mark.parametrize(
    "default_rate", [OUTPUT_RATE, None], ids=["paced", "no-default"]
)
def test_prompt_rates_set_through_one_engine_reach_the_others_prompt_budgets(
    redis_url: str, client: redis.Redis, default_rate: int | None
) -> None:
    """A default, a user's and a team's prompt rate set through one engine's
    control plane are stored (under ``attributes``) and become every engine's
    prompt tables, their prompt claimers running from then on; an engine
    without a default output rate (pacing only the users its table names)
    takes the default prompt rate as well."""
    with contextlib.ExitStack() as stack:
        first, second = (
            stack.enter_context(served_engine(redis_url, default_rate))
            for _ in range(2)
        )
        for _, running, _ in (first, second):
            assert not any(c.is_active() for c in running.prompt_claimers)
        stub = first[2].stub
        stub.UpdateDefaultLimit(
            pb.UpdateDefaultLimitRequest(
                default_limit=pb.DefaultLimit(prompt_tokens_per_second=200),
                update_mask=FieldMask(paths=["prompt_tokens_per_second"]),
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/alice", prompt_tokens_per_second=300),
                update_mask=FieldMask(paths=["prompt_tokens_per_second"]),
                allow_missing=True,
            )
        )
        stub.CreateTeam(
            pb.CreateTeamRequest(
                team_id="acme",
                team=pb.Team(tokens_per_second=60, prompt_tokens_per_second=900),
            )
        )
        stub.UpdateLimit(
            pb.UpdateLimitRequest(
                limit=pb.Limit(name="limits/bob", team="teams/acme"),
                update_mask=FieldMask(paths=["team"]),
                allow_missing=True,
            )
        )
        prompt = second[0].shared.prompt
        wait_for(lambda: prompt.teams.table.memberships == {"bob": "acme"})
        assert (prompt.rate_of("alice"), prompt.rate_of("carol")) == (300, 200)
        assert prompt.teams.table.rates == {"acme": 900}
        assert prompt.limits("bob")
        assert second[0].shared.policy.default_rate == default_rate  # kept
        for _, running, _ in (first, second):
            assert all(c.is_active() for c in running.prompt_claimers)
        document = json.loads(client.hget(KeySpace().limits, "document"))
        assert document["default_rate"] == default_rate
        assert document["attributes"] == {
            "default": {"prompt_tokens_per_second": 200},
            "users": {"alice": {"prompt_tokens_per_second": 300}},
            "teams": {"acme": {"prompt_tokens_per_second": 900}},
        }
        # The second engine's prompt budget is the store's: alice's first take
        # finds nothing held, and her prompt cell fills from the claims.
        rig = second[0]
        with rig.shared.lock:
            assert prompt.budget.take_up_to("alice", 100, rig.clock())[0] == 0
        wait_for(
            lambda: (
                client.exists(replace_cells(KeySpace(), "prompt").cell("alice")) == 1
            )
        )


# -- the prompt claimers idle while no holder has a prompt rate ------------------------


def test_a_claimer_not_active_takes_no_lock_and_makes_no_round_trip(
    client: redis.Redis,
) -> None:
    """Not active, a pass does nothing and the thread looks again every
    ``IDLE_PERIOD_S``; once active, its first pass beats (and claims)."""
    acquired = []

    class CountingLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            self._lock.acquire()
            acquired.append(time.monotonic())

        def __exit__(self, *exc: object) -> None:
            self._lock.release()

    active = False
    store = CountingStore(client)
    balances = ClaimedBalances(OutputRateLimiter(NO_DEFAULT, {}, table_only=True))
    claimer = Claimer(
        store,
        balances,
        CountingLock(),
        FakeClock(),
        engine_id="e",
        active=lambda: active,
    )
    claimer.start()
    try:
        time.sleep(5 * IDLE_PERIOD_S)
        assert (acquired, store.claims, client.zcard(KeySpace().engines)) == ([], 0, 0)
        active = True
        wait_for(lambda: client.zcard(KeySpace().engines) == 1)
        assert acquired
    finally:
        claimer.stop()


# -- an outage: the failure mode's, for prompts as for output ---------------------


def outage_seen(fleet: list[tuple[Rig, RunningStore]]) -> None:
    """Every prompt budget has seen the store fail, and the outage lasts past
    the point where the local share stands in."""
    deadline = time.monotonic() + EVENTUALLY_S
    while not all(
        r.prompt_budget.claimed.store_down_since_ns is not None
        and r.budget.claimed.store_down_since_ns is not None
        for _, r in fleet
    ):
        assert time.monotonic() < deadline, f"not within {EVENTUALLY_S} s"
        time.sleep(0.01)
        for rig, _ in fleet:
            rig.clock.advance_ms(100)
    for rig, _ in fleet:
        rig.clock.advance_ms(2 * DEGRADED_AFTER_NS / 1e6)


def taken_over(
    fleet: list[tuple[Rig, RunningStore]], seconds: int
) -> tuple[list[int], list[int]]:
    """The prompt and output tokens of alice each engine hands out over
    ``seconds`` fake seconds, asked for every 10 ms (far more than either
    rate)."""
    prompt = [0] * len(fleet)
    output = [0] * len(fleet)
    for _ in range(seconds * 100):
        for i, (rig, _) in enumerate(fleet):
            rig.clock.advance_ms(10)
            shared = rig.shared
            with shared.lock:
                now = rig.clock()
                prompt[i] += shared.prompt.budget.take_up_to("alice", 10_000, now)[0]
                output[i] += shared.budget.take_up_to("alice", 8, now)[0]
    return prompt, output


def test_with_the_store_down_prompts_get_the_local_share_then_the_failure_mode() -> (
    None
):
    """Nothing listens on the store's port. Past 500 ms each of two engines
    (stated fleet size 2) paces alice's prompts at half her prompt rate, as
    her output at half her output rate; past the failure mode's start
    (``fail-closed``, 10 s) both hold her, prompts and output alike."""
    engines_n, window_s = 2, 5
    url = f"redis://127.0.0.1:{free_port()}/0"
    with engines(
        url,
        engines_n,
        prompt_rates={"alice": PROMPT_RATE},
        every_engine=True,
        expected_engines=engines_n,
        failure_mode=FailureMode.FAIL_CLOSED,
        failure_after_s=window_s + 5.0,
    ) as fleet:
        outage_seen(fleet)
        for rig, running in fleet:
            assert running.prompt_budget.health(rig.clock()) is Health.LOCAL_SHARE
        prompt, output = taken_over(fleet, window_s)
        prompt_share = PROMPT_RATE // engines_n
        output_share = OUTPUT_RATE // engines_n
        print(
            f"\nlocal shares over {window_s} s: prompt {prompt} "
            f"(share {prompt_share}/s), output {output} (share {output_share}/s)"
        )
        for taken, share, tolerance_ns in (
            (prompt, prompt_share, PROMPT_BURST_NS),
            (output, output_share, DEFAULT_BURST_NS),
        ):
            most = share * window_s + burst_tokens(share, tolerance_ns)
            assert all(share * window_s <= n <= most for n in taken), (taken, most)
        for rig, _ in fleet:  # past the failure mode's start
            rig.clock.advance_ms(6_000)
        for rig, running in fleet:
            assert running.prompt_budget.health(rig.clock()) is Health.FAIL_CLOSED
        assert taken_over(fleet, 1) == ([0] * engines_n, [0] * engines_n)
