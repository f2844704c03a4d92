"""The scheduler's budget with a store (``pacing.store_budget``): the claimed
balances while the store answers; while it does not, what is held, then each
user's share R / N_live; after the failure time, the failure mode. Every change
of state is announced through ``limit_changes``. Pure, on an injected clock."""

from __future__ import annotations

import pytest

from pacing.budget import StoreView
from pacing.claims import ClaimedBalances
from pacing.limiter import NS_PER_S, UNLIMITED, OutputRateLimiter
from pacing.settings.store import FailureMode
from pacing.store_budget import DEGRADED_AFTER_NS, Health, StoreBudget
from tools.fake_clock import FakeClock

MS = 1_000_000
RATE = 100
LIVE_ENGINES = 4
FAILURE_AFTER_NS = 5 * NS_PER_S


def budget_with(
    held: int, mode: FailureMode = FailureMode.KEEP_LOCAL_SHARE
) -> tuple[StoreBudget, ClaimedBalances, FakeClock]:
    """User "u" (limit RATE) holding ``held`` claimed tokens, 4 live engines."""
    clock = FakeClock()
    limiter = OutputRateLimiter(RATE, {}, tier_rates={}, exempt_users=["vip"])
    claimed = ClaimedBalances(limiter)
    claimed.record_store_ok(LIVE_ENGINES)
    budget = StoreBudget(
        claimed, limiter, clock, failure_mode=mode, failure_after_ns=FAILURE_AFTER_NS
    )
    now = clock()
    budget.take_up_to("u", 1, now)  # the user appears: wanting
    plan = claimed.plan(now)
    assert "u" in plan.claims
    claimed.landed("u", held, 0, now)
    return budget, claimed, clock


def store_down(claimed: ClaimedBalances, clock: FakeClock) -> None:
    """The store stops answering now and stays down past DEGRADED_AFTER_NS."""
    claimed.record_store_failure(clock())
    clock.advance_ms(DEGRADED_AFTER_NS // MS)


def greedy(budget: StoreBudget, clock: FakeClock, seconds: float) -> int:
    """Tokens "u" gets taking all it may every 10 ms for ``seconds``."""
    got = 0
    for _ in range(round(seconds * 100)):
        clock.advance_ms(10)
        got += budget.take_up_to("u", 1000, clock())[0]
    return got


def test_while_the_store_answers_the_budget_is_the_claimed_balance():
    budget, _, clock = budget_with(held=30)
    assert budget.health(clock()) is Health.GLOBAL
    assert budget.available("u", clock()) == 30
    assert greedy(budget, clock, 0.5) == 30  # nothing refills without a claim
    assert budget.available("u", clock()) == 0


def test_an_outage_spends_what_is_held_then_paces_at_the_engines_share():
    budget, claimed, clock = budget_with(held=30)
    changes = budget.limit_changes
    store_down(claimed, clock)
    assert budget.health(clock()) is Health.LOCAL_SHARE
    assert budget.limit_changes == changes + 1
    share = RATE // LIVE_ENGINES  # 25 tok/s
    got = greedy(budget, clock, 2.0)
    # 30 held, then GCRA at 25 tok/s over 2 s from a full bucket (burst 3).
    burst = share * 100 * MS // NS_PER_S + 1
    assert 30 + 2 * share <= got <= 30 + 2 * share + burst


def test_an_unlimited_user_stays_unlimited_in_an_outage():
    budget, claimed, clock = budget_with(held=0)
    store_down(claimed, clock)
    assert budget.take_up_to("vip", 7, clock()) == (7, UNLIMITED - 7)
    assert budget.available("vip", clock()) == UNLIMITED


@pytest.mark.parametrize(
    ("mode", "health", "after"),
    [
        (FailureMode.KEEP_LOCAL_SHARE, Health.LOCAL_SHARE, None),
        (FailureMode.FAIL_OPEN, Health.FAIL_OPEN, UNLIMITED),
        (FailureMode.FAIL_CLOSED, Health.FAIL_CLOSED, 0),
    ],
)
def test_after_the_failure_time_the_failure_mode_decides(mode, health, after):
    budget, claimed, clock = budget_with(held=0, mode=mode)
    store_down(claimed, clock)
    clock.advance_ms((FAILURE_AFTER_NS - DEGRADED_AFTER_NS) // MS - 1)
    assert budget.health(clock()) is Health.LOCAL_SHARE
    changes = budget.limit_changes
    clock.advance_ms(1)
    assert budget.health(clock()) is health
    assert budget.limit_changes == changes + (health is not Health.LOCAL_SHARE)
    if after is not None:
        assert budget.available("u", clock()) == after
        assert budget.take_up_to("u", 5, clock())[0] == (5 if after else 0)


def test_when_the_store_returns_the_local_share_is_gone_and_announced():
    budget, claimed, clock = budget_with(held=0)
    store_down(claimed, clock)
    clock.advance_ms(1000)
    assert budget.available("u", clock()) > 0  # the share
    changes = budget.limit_changes
    claimed.record_store_ok(LIVE_ENGINES)
    assert budget.limit_changes == changes + 1
    assert budget.health(clock()) is Health.GLOBAL
    assert budget.available("u", clock()) == 0  # claimed tokens only


def test_charges_already_dispatched_in_an_outage_spend_held_then_the_share():
    budget, claimed, clock = budget_with(held=2)
    store_down(claimed, clock)
    budget.take_each({"u": 10}, clock())  # 2 held, 8 from the share (in debt)
    assert claimed.available("u", clock()) == 0
    # The share, 25 tok/s (40 ms a token) from a full bucket, was charged 8:
    # its TAT is 320 ms ahead, and the next token is due when it is within
    # the 100 ms tolerance, at 220 ms.
    clock.advance_ms(219)
    assert budget.available("u", clock()) == 0
    clock.advance_ms(1)
    assert budget.available("u", clock()) == 1


def test_a_few_failed_round_trips_are_not_an_outage():
    # A loaded host times out a round trip now and then: the engine spends what
    # it holds and takes nothing from a local share, which the cell never sees.
    budget, claimed, clock = budget_with(held=0)
    claimed.record_store_failure(clock())
    clock.advance_ms(DEGRADED_AFTER_NS // MS - 1)
    assert budget.health(clock()) is Health.GLOBAL
    assert budget.take_up_to("u", 5, clock())[0] == 0


def test_the_store_view_shows_the_balance_the_global_tat_and_the_health():
    budget, claimed, clock = budget_with(held=30, mode=FailureMode.FAIL_CLOSED)
    assert budget.store_view("u", clock()) == StoreView(30, 0, None, Health.GLOBAL)
    claimed.record_cell("u", 250 * MS, clock())
    budget.take_up_to("u", 10, clock())
    clock.advance_ms(100)
    assert budget.store_view("u", clock()) == StoreView(
        20, 150 * MS, 100 * MS, Health.GLOBAL
    )
    store_down(claimed, clock)  # degraded: the reading ages on
    assert budget.store_view("u", clock()) == StoreView(
        20, 0, 100 * MS + DEGRADED_AFTER_NS, Health.LOCAL_SHARE
    )
    clock.advance_ms((FAILURE_AFTER_NS - DEGRADED_AFTER_NS) // MS)
    assert budget.store_view("u", clock()).health is Health.FAIL_CLOSED
