"""Claimed balances as the real scheduler's budget source (``use_budget``), filled
by the real claimer from a store: the scheduler never emits a token that was not
claimed, and every claimed token is emitted, held, or given back. Real vLLM
scheduler on a fake clock; the store is fakeredis (its script tests run on a real
``redis-server`` too: ``test_store_script.py``)."""

from __future__ import annotations

from pacing.claims import ClaimedBalances, Request
from tests.store_harness import claim_through_a_store
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
