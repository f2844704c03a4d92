"""Claimed balances as the real scheduler's budget source (``use_budget``), filled
by the real claimer from a store: the scheduler never emits a token that was not
claimed, and every claimed token is emitted, held, or given back. Real vLLM
scheduler on a fake clock; the store is fakeredis (its script tests run on a real
``redis-server`` too: ``test_store_script.py``)."""

from __future__ import annotations

import fakeredis

from pacing.claims import ClaimedBalances, Request
from store.claimer import Claimer
from tests.store_harness import claim_through_a_store
from tools.counting_store import CountingStore
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import driven_scheduler as setup
from tools.scheduler_harness import make_request


@MODES
def test_the_scheduler_emits_only_claimed_tokens(tiny_model_dir, async_scheduling):
    """Two users, three streams each, at 100 tok/s; a claimer pass after every
    10 ms step, for 1.5 s of the engine's clock (leases of 1 s expire)."""
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=100)
    shared = scheduler.output_rate_shared
    balances, store, claimer = claim_through_a_store(scheduler, driver.clock)
    requests = [make_request(user, max_tokens=1000) for user in "ab" for _ in range(3)]
    driver.add(requests)
    sampled = 0
    for _ in range(150):
        sampled += len(driver.step_sampled())
        claimer.run_once()
    with shared.lock:
        now_ns = driver.clock()
        pending = balances.plan(now_ns).returns  # expired leases included
        held = sum(balances.available(user, now_ns) for user in "ab")
    total = scheduler.accounting.total
    charged = total.charged - total.refunds
    assert 0 < sampled <= store.granted
    assert charged == sampled
    assert store.granted == charged + held + store.returned + sum(
        request.tokens for request in pending.values()
    )
    assert not any(request.is_finished() for request in requests)


@MODES
def test_a_lease_that_ends_stops_the_streams_at_once(tiny_model_dir, async_scheduling):
    """100 tokens land; the streams spend some in free steps (the scheduler
    caches what is left); the lease ends with tokens left, which go back to
    the store: no token is emitted after that (the expiry is announced through
    ``limit_changes``, so the cache is dropped)."""
    scheduler, driver = setup(tiny_model_dir, async_scheduling, default_rate=1000)
    shared = scheduler.output_rate_shared
    balances = ClaimedBalances(scheduler.limiter)
    requests = [make_request("u", max_tokens=1000) for _ in range(2)]
    with shared.lock:
        shared.use_budget(balances)
        now_ns = driver.clock()
        balances.take_up_to("u", 0, now_ns)  # wanting
        balances.plan(now_ns)
        balances.landed("u", 100, 0, now_ns)  # as if the store granted 100
    driver.add(requests)
    before = sum(len(driver.step_sampled()) for _ in range(10))
    assert 0 < before < 100
    driver.clock.advance_ms(1000)  # the lease has ended
    with shared.lock:
        returned = balances.plan(driver.clock()).returns  # the claimer's pass
    assert returned == {"u": Request(100 - before, 1000)}
    assert sum(len(driver.step_sampled()) for _ in range(10)) == 0


@MODES
def test_a_team_spends_only_what_its_claimer_claimed(tiny_model_dir, async_scheduling):
    """Team acme at 60 tok/s, its members' own caps far above; the team's
    tokens come from claims on its store cell (a second claimer, as
    ``store.runtime`` runs). A team with no balance is due a claim as soon as
    a member asks, so its members go on streaming after the first balance is
    spent; every token charged to the team was claimed. (Claims are sized on
    the engine's fake clock and granted on the store's real one, so the rate
    itself is measured end to end: ``tests/e2e/test_e2e_scaleout.py``.)"""
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=10_000,
        output_rate={"team_rates": {"acme": 60}, "team_members": {"a": "acme"}},
    )
    shared = scheduler.output_rate_shared
    balances = ClaimedBalances(shared.teams.cells)
    with shared.lock:
        shared.teams.use_budget(balances)
    store = CountingStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    claimer = Claimer(store, balances, shared.lock, driver.clock, engine_id="e")
    driver.add([make_request("a", max_tokens=1000) for _ in range(3)])
    sampled = []
    for _ in range(300):
        sampled.append(len(driver.step_sampled()))
        claimer.run_once()
    charged = shared.teams.charged["acme"]
    assert 0 < charged == sum(sampled) <= store.granted
    assert sum(sampled[200:]) > 0  # still claiming, not stuck after a balance
