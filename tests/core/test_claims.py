"""Tests for ``pacing.claims``: an engine's local balances of globally claimed
tokens (pure, clock passed in).

Golden tables walk a fixed time grid ``t0 ... t9`` (50 ms apart) and name the
failing row; Hypothesis checks, against a plain list-of-batches model, that no
token is spent after its lease, none is created or lost, and every token ends up
spent or returned.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacing.claims import (
    CellReading,
    ClaimedBalances,
    Plan,
    Request,
    burst_tokens,
    fallback_rate,
)
from pacing.limiter import DEFAULT_BURST_NS, NS_PER_S, UNLIMITED, OutputRateLimiter

MS = 1_000_000
T = 1_000 * NS_PER_S  # far from 0, as a monotonic clock is
GRID = tuple(T + k * 50 * MS for k in range(10))
t0, t1, t2, t3, t4, t5, t6, t7, t8, t9 = GRID
LEASE = NS_PER_S


def at(now: int) -> str:
    """``now`` as ``tK``, or as ms after t0 off the grid."""
    if now in GRID:
        return f"t{GRID.index(now)}"
    return f"t0+{(now - t0) // MS}ms"


def balances_at(rate: int = 100, **kwargs: int) -> ClaimedBalances:
    """Balances of users limited to ``rate`` tokens/s (burst 100 ms)."""
    return ClaimedBalances(OutputRateLimiter(rate, {}), **kwargs)


# --------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "tolerance_ns", "want"),
    [
        # 1. rate, 2. tolerance, 3. tokens the cell grants at once from full
        (1, 100 * MS, 1),
        (9, 100 * MS, 1),
        (10, 100 * MS, 2),
        (30, 100 * MS, 4),
        (1000, 100 * MS, 101),
        (1000, 0, 1),
        (1_000_000, 100 * MS, 100_001),
    ],
)
def test_burst_tokens_is_what_gcra_grants_at_once(rate, tolerance_ns, want):
    assert burst_tokens(rate, tolerance_ns) == want
    if tolerance_ns == DEFAULT_BURST_NS:  # what the single-engine limiter grants
        assert OutputRateLimiter(rate, {}).available("u", 0) == want


@pytest.mark.parametrize(
    ("rate", "live", "want"),
    [
        (30, 1, 30),
        (30, 3, 10),
        (30, 4, 7),  # rounded down: the engines together stay within R
        (2, 3, 1),  # at least 1: nobody is stopped outright
        (30, 0, 30),  # no heartbeat seen: as if alone
        (0, 3, 0),  # not limited stays not limited
    ],
)
def test_fallback_rate_is_the_share_of_each_live_engine(rate, live, want):
    assert fallback_rate(rate, live) == want


# --------------------------------------------------------------------------
# Claim sizing
# --------------------------------------------------------------------------


class SizeRow(NamedTuple):
    """Spend ``spends`` ((time, tokens), all that landed at t0), claim at
    ``claimed``, then ask the claim size at ``now`` for a user limited to
    ``rate``."""

    spends: tuple[tuple[int, int], ...]
    claimed: int
    now: int
    rate: int
    want: int


SIZES = [
    # 1. nothing spent yet: the minimum
    SizeRow((), t0, t0, 100, 1),
    # 2. 10 tokens in the first 50 ms: 10 per horizon
    SizeRow(((t0, 10),), t1, t1, 100, 10),
    # 3. the same 10 over 100 ms: 5 per 50 ms
    SizeRow(((t0, 10),), t2, t2, 100, 5),
    # 4. ... rounded up
    SizeRow(((t0, 10),), t3, t3, 100, 4),
    # 5. capped at the burst (100 tok/s: 11 tokens)
    SizeRow(((t0, 200),), t1, t1, 100, 11),
    # 6. the burst of a slow user (10 tok/s: 2 tokens)
    SizeRow(((t0, 10),), t2, t2, 10, 2),
    # 7. within the first horizon the span is one horizon, not less
    SizeRow(((t0, 3),), t0 + 10 * MS, t0 + 10 * MS, 100, 3),
    # 8. a full window later: the previous window counts whole
    SizeRow(((t0, 100),), t0 + 500 * MS, t0 + 500 * MS, 100, 10),
    # 9. half a window later: half of it
    SizeRow(((t0, 100),), t0 + 750 * MS, t0 + 750 * MS, 100, 5),
    # 10. two windows later: forgotten
    SizeRow(((t0, 100),), t0 + 1000 * MS, t0 + 1000 * MS, 100, 1),
    # 11. previous and current windows add up
    SizeRow(((t0, 100), (t0 + 600 * MS, 40)), t0 + 750 * MS, t0 + 750 * MS, 100, 9),
    # 12. the last claim was 150 ms ago: the claim covers 150 ms (not 3 tokens)
    SizeRow(((t0, 10),), t1, t4, 100, 8),
    # 13. ... but never more than a window: 600 ms since, 500 ms covered
    #     (10 tokens at 70 % weight over the window: 7; over 600 ms it would be 9)
    SizeRow(((t0, 10),), t1, t0 + 650 * MS, 100, 7),
]


@pytest.mark.parametrize("row", SIZES, ids=[f"row{k + 1}" for k in range(len(SIZES))])
def test_claim_size_is_a_horizon_of_recent_consumption(row: SizeRow):
    balances = balances_at(row.rate, lease_ns=10 * NS_PER_S)
    balances.take_up_to("a", 0, t0)  # the user appears at t0
    balances.plan(t0)
    balances.landed("a", sum(tokens for _, tokens in row.spends), 0, t0)
    for at, tokens in row.spends:
        assert balances.take_up_to("a", tokens, at)[0] == tokens
    if row.spends:  # all spent: wanting, so a claim goes out
        assert "a" in balances.plan(row.claimed).claims
    assert balances.claim_size("a", row.now) == row.want


def test_an_unknown_user_claims_the_minimum():
    assert balances_at().claim_size("nobody", t0) == 1


def test_a_user_not_limited_claims_nothing():
    balances = ClaimedBalances(OutputRateLimiter(100, {}, exempt_users=["ops"]))
    assert balances.claim_size("ops", t0) == 0


# --------------------------------------------------------------------------
# A user's walk through claims, spends, leases and returns
# --------------------------------------------------------------------------


class Row(NamedTuple):
    """Do ``op`` at ``now``; ``want`` is what it returns, ``held`` the user's
    balance after it."""

    op: str  # take | plan | land | end | refund
    now: int
    arg: Any  # take: most; land: (granted, retry_after_ns); refund: count
    want: Any
    held: int  # available("a", now) after the op


def claims(**sizes: int) -> dict[str, Request]:
    return {user: Request(size, 100) for user, size in sizes.items()}


def returns(**counts: int) -> dict[str, Request]:
    return {user: Request(count, 100) for user, count in counts.items()}


def run_table(balances: ClaimedBalances, rows: list[Row]) -> None:
    for number, row in enumerate(rows, 1):
        if row.op == "take":
            got: Any = balances.take_up_to("a", row.arg, row.now)
        elif row.op == "plan":
            plan = balances.plan(row.now)
            got = (plan.claims, plan.returns)
        elif row.op == "land":
            got = balances.landed("a", *row.arg, row.now)
        elif row.op == "end":
            got = balances.end_user("a", row.now)
        elif row.op == "refund":
            got = balances.refund("a", row.now, row.arg)
        else:
            raise AssertionError(f"row {number}: unknown op {row.op!r}")
        step = f"row {number}: {row.op} at {at(row.now)}"
        assert got == row.want, step
        assert balances.available("a", row.now) == row.held, step


WALK = [
    # 1. first sight: nothing held, so the step is refused
    Row("take", t0, 3, (0, 0), 0),
    # 2. wanting, no consumption yet: a claim of 1
    Row("plan", t0, None, (claims(a=1), {}), 0),
    # 3. in flight: not claimed twice
    Row("plan", t0, None, ({}, {}), 0),
    # 4. the store granted it
    Row("land", t0, (1, 0), None, 1),
    # 5. spent at once
    Row("take", t0, 3, (1, 0), 0),
    # 6. 1 token in the first horizon: claim 1 again
    Row("plan", t1, None, (claims(a=1), {}), 0),
    # 7. the store had none (it owes a token for 20 ms) ...
    Row("land", t1, (0, 20 * MS), None, 0),
    # 8. ... so the claim waits
    Row("plan", t1 + 10 * MS, None, ({}, {}), 0),
    # 9. the wait is over: claimed again, without any spend in between
    Row("plan", t2, None, (claims(a=1), {}), 0),
    # 10. a big grant lands at t2 (lease to t2 + 1 s)
    Row("land", t2, (8, 0), None, 8),
    # 11. partly spent
    Row("take", t3, 2, (2, 6), 6),
    # 12. 3 tokens over 150 ms: a claim would be 1; 6 held is plenty
    Row("plan", t3, None, ({}, {}), 6),
    # 13. a refund goes back to the balance
    Row("refund", t3, 1, None, 7),
    # 14. the lease ends: nothing to spend ...
    Row("take", t2 + LEASE, 1, (0, 0), 0),
    # 15. ... the unspent tokens go back, and a new claim goes out
    Row("plan", t2 + LEASE, None, (claims(a=1), returns(a=7)), 0),
    # 16. the user's last request ends with the claim in flight ...
    Row("end", t2 + LEASE, None, None, 0),
    # 17. ... which lands for nobody ...
    Row("land", t2 + LEASE, (1, 0), None, 0),
    # 18. ... and goes back
    Row("plan", t2 + LEASE, None, ({}, returns(a=1)), 0),
]


def test_a_users_walk_through_claims_leases_and_returns():
    run_table(balances_at(), WALK)


def test_the_whole_balance_goes_back_when_the_users_last_request_ends():
    balances = balances_at()
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 5, 0, t0)
    assert balances.take_up_to("a", 2, t1) == (2, 3)
    balances.end_user("a", t1)
    assert balances.active_users() == 0
    assert balances.plan(t1) == Plan({}, returns(a=3))
    # Back on this engine later: starts from nothing, wanting again.
    assert balances.take_up_to("a", 1, t2) == (0, 0)
    assert balances.plan(t2).claims == claims(a=1)


def test_a_user_not_limited_is_unlimited_and_needs_no_claims():
    limiter = OutputRateLimiter(100, {})
    balances = ClaimedBalances(limiter)
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 2, 0, t0)
    limiter.set_user_exempt("a", True, t0)
    assert balances.take_up_to("a", 5, t1) == (5, UNLIMITED - 5)
    assert balances.take_each({"a": 3}, t1) == {"a": UNLIMITED}
    assert balances.available("a", t1) == UNLIMITED
    assert balances.ready_at_ns("a", t1) == t1
    balances.end_user("a", t1)
    assert balances.plan(t1) == Plan()  # its 2 tokens are not given back


def test_a_refund_after_the_lease_goes_back_to_the_store():
    balances = balances_at()
    balances.take_up_to("a", 0, t0)
    balances.plan(t0)
    balances.landed("a", 2, 0, t0)
    assert balances.take_up_to("a", 2, t1) == (2, 0)
    balances.refund("a", t1 + LEASE, 2)  # the batch it came from has expired
    assert balances.available("a", t1 + LEASE) == 0
    assert balances.plan(t1 + LEASE).returns == returns(a=2)


def test_a_refund_keeps_the_expiry_of_the_batch_it_came_from():
    balances = balances_at()
    balances.take_up_to("a", 0, t0)
    balances.plan(t0)
    balances.landed("a", 1, 0, t0)  # expires at t0 + lease
    assert balances.take_up_to("a", 1, t1) == (1, 0)
    balances.plan(t5)
    balances.landed("a", 1, 0, t5)  # expires at t5 + lease
    assert balances.take_up_to("a", 1, t6) == (1, 0)
    balances.refund("a", t6)
    assert balances.available("a", t0 + LEASE) == 1  # not the t0 batch's expiry ...
    assert balances.available("a", t5 + LEASE) == 0  # ... nor a fresh lease from t6


def test_take_each_charges_what_the_scheduler_dispatched():
    balances = balances_at()
    balances.take_up_to("a", 0, t0)
    balances.plan(t0)
    balances.landed("a", 5, 0, t0)
    assert balances.take_each({"a": 3}, t1) == {"a": 2}
    # Dispatched against a batch whose lease ended meanwhile: charged to it all
    # the same (its expiry was announced; the next take enforces it).
    assert balances.take_each({"a": 2}, t0 + LEASE) == {"a": 0}
    assert balances.plan(t0 + LEASE).returns == {}


def test_an_expiry_with_tokens_left_is_announced_as_a_shrink():
    limiter = OutputRateLimiter(100, {})
    balances = ClaimedBalances(limiter)
    balances.take_up_to("a", 0, t0)
    balances.plan(t0)
    balances.landed("a", 2, 0, t0)
    seen = balances.limit_changes
    assert balances.take_up_to("a", 1, t1) == (1, 1)  # a take is no shrink
    assert balances.limit_changes == seen
    balances.plan(t0 + LEASE)  # expires the last token
    assert balances.limit_changes == seen + 1
    limiter.set_rate("a", 50, t0 + LEASE)  # the limiter's changes count too
    assert balances.limit_changes == seen + 2


def test_without_tokens_the_engine_may_wait_for_the_claim_or_the_stores_word():
    balances = balances_at()
    assert balances.ready_at_ns("a", t0) == t0 + 50 * MS  # one horizon
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 0, 300 * MS, t0)  # the store: nothing for 300 ms
    assert balances.ready_at_ns("a", t1) == t0 + 300 * MS
    balances.plan(t0 + 300 * MS)
    balances.landed("a", 1, 0, t0 + 300 * MS)
    assert balances.ready_at_ns("a", t0 + 300 * MS) == t0 + 300 * MS


def test_a_failed_claim_may_be_planned_again():
    balances = balances_at()
    balances.take_up_to("a", 1, t0)
    plan = balances.plan(t0)
    assert balances.plan(t0) == Plan()
    balances.claims_failed(plan.claims)
    assert balances.plan(t0) == plan


def test_wants_claims_is_set_when_a_user_starts_wanting_and_cleared_by_plan():
    balances = balances_at()
    assert not balances.wants_claims
    balances.take_up_to("a", 1, t0)
    assert balances.wants_claims
    balances.plan(t0)
    assert not balances.wants_claims
    balances.take_up_to("a", 1, t0)  # still wanting (in flight): no new signal
    assert not balances.wants_claims


def test_an_account_nobody_spends_from_is_forgotten_after_a_lease():
    balances = balances_at()
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 3, 0, t0)
    assert balances.plan(t0 + LEASE).returns == returns(a=3)  # expired
    assert balances.active_users() == 0


def test_an_account_in_use_is_kept():
    balances = balances_at()
    for k in range(40):  # a take every 50 ms for 2 s, never any token
        now = t0 + k * 50 * MS
        balances.take_up_to("a", 1, now)
        balances.plan(now)
        assert balances.active_users() == 1, f"step {k}"


def test_store_health_is_recorded_with_the_last_live_engines_count():
    balances = balances_at()
    assert (balances.store_down_since_ns, balances.live_engines) == (None, 1)
    balances.record_store_ok(live_engines=3)
    balances.record_store_failure(t1)
    balances.record_store_failure(t2)  # the outage started at the first
    assert (balances.store_down_since_ns, balances.live_engines) == (t1, 3)
    balances.record_store_ok()  # the count is kept when the store did not say
    assert (balances.store_down_since_ns, balances.live_engines) == (None, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease_ns": 0}, "lease_ns must be positive, got 0"),
        ({"horizon_ns": -1}, "horizon_ns must be positive, got -1"),
        ({"window_ns": 0}, "window_ns must be positive, got 0"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        balances_at(**kwargs)


# --------------------------------------------------------------------------
# Cell readings: the user's global TAT as this engine last saw it
# --------------------------------------------------------------------------


class ReadingRow(NamedTuple):
    """At ``now``, record a reading of ``lead`` ms (``None``: record nothing);
    then ``want`` is ``cell_reading("a", now)`` as (lead ms, age ms)."""

    now: int
    lead: int | None
    want: tuple[int, int] | None


READINGS = [
    # 1. nothing read yet
    ReadingRow(t0, None, None),
    # 2. the store's answer: 120 ms ahead, just now
    ReadingRow(t0, 120, (120, 0)),
    # 3. the TAT stays put, so its lead shrinks with the engine's clock ...
    ReadingRow(t1, None, (70, 50)),
    ReadingRow(t2, None, (20, 100)),
    # 4. ... down to zero (a full bucket), while the reading ages on
    ReadingRow(t3, None, (0, 150)),
    ReadingRow(t5, None, (0, 250)),
    # 5. a newer answer replaces it
    ReadingRow(t6, 30, (30, 0)),
    ReadingRow(t7, None, (0, 50)),
    # 6. a negative lead (never sent by the store) counts as zero
    ReadingRow(t8, -5, (0, 0)),
]


def test_a_cell_reading_decays_on_the_engines_clock_down_to_zero():
    balances = balances_at()
    balances.take_up_to("a", 0, t0)  # an account: readings are kept
    for number, row in enumerate(READINGS, 1):
        if row.lead is not None:
            balances.record_cell("a", row.lead * MS, row.now)
        want = None if row.want is None else CellReading(*(x * MS for x in row.want))
        assert balances.cell_reading("a", row.now) == want, f"row {number}"


def test_a_cell_reading_is_kept_while_the_user_has_an_account():
    balances = balances_at()
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 5, 0, t0)
    balances.record_cell("a", 100 * MS, t0)
    for k in range(1, 5):  # takes keep the account for 2 s, 20 x the lead
        now = t0 + k * LEASE // 2
        balances.take_up_to("a", 1, now)
        balances.plan(now)
    assert balances.cell_reading("a", t0 + 2 * LEASE) == CellReading(0, 2 * LEASE)


def test_a_gone_users_reading_is_forgotten_once_run_out_and_a_lease_old():
    """Readings stay bounded: a user without an account (its last request
    ended, or it went idle) keeps its reading only so long."""
    balances = balances_at(rate=1)
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 1, 0, t0)
    balances.record_cell("a", 100 * MS, t0)
    balances.end_user("a", t0)  # a lease old at t0 + LEASE
    assert balances.plan(t0 + LEASE - 1).returns == {"a": Request(1, 1)}
    assert balances.cell_reading("a", t0 + LEASE - 1) is not None
    balances.plan(t0 + LEASE)
    assert balances.cell_reading("a", t0 + LEASE) is None
    # The answer to the return, for a user without an account: 1.5 s ahead at
    # 1 tok/s (longer than a lease), so kept until that has run out.
    balances.record_cell("a", 1500 * MS, t1)
    balances.plan(t1 + 1500 * MS - 1)
    assert balances.cell_reading("a", t1 + 1500 * MS - 1) == CellReading(
        1, 1500 * MS - 1
    )
    balances.plan(t1 + 1500 * MS)
    assert balances.cell_reading("a", t1 + 1500 * MS) is None


def test_an_idle_users_reading_goes_with_its_account():
    balances = balances_at()
    balances.take_up_to("a", 0, t0)
    balances.record_cell("a", 40 * MS, t0)
    balances.plan(t0 + LEASE)  # no take for a lease: the account is dropped
    assert balances.active_users() == 0
    assert balances.cell_reading("a", t0 + LEASE) is None


def test_held_is_the_unexpired_balance_whether_limited_or_not():
    limiter = OutputRateLimiter(100, {})
    balances = ClaimedBalances(limiter)
    assert balances.held("a", t0) == 0
    balances.take_up_to("a", 1, t0)
    balances.plan(t0)
    balances.landed("a", 4, 0, t0)
    balances.take_up_to("a", 1, t1)
    assert balances.held("a", t1) == 3
    limiter.set_user_exempt("a", True, t1)
    assert (balances.available("a", t1), balances.held("a", t1)) == (UNLIMITED, 3)
    assert balances.held("a", t0 + LEASE) == 0  # the lease ended


# --------------------------------------------------------------------------
# Properties against a list-of-batches model
# --------------------------------------------------------------------------

USERS = ("a", "b")

ops = st.lists(
    st.one_of(
        # Steps of every scale against the leases below (Hypothesis would
        # otherwise keep to small numbers, which never reach a lease).
        st.tuples(st.just("advance"), st.sampled_from([1, 20, 100, 300, 700])),
        st.tuples(st.just("take"), st.sampled_from(USERS), st.integers(0, 5)),
        st.tuples(st.just("plan")),
        st.tuples(st.just("land"), st.integers(0, 100), st.integers(0, 30 * MS)),
        st.tuples(st.just("fail")),
        st.tuples(st.just("end"), st.sampled_from(USERS)),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, lease_ms=st.sampled_from([10, 250, 1000]))
def test_tokens_are_spent_within_their_lease_and_none_is_created_or_lost(ops, lease_ms):
    """Plays random interleavings against a model: FIFO batches, each usable
    until ``landing + lease``, and a claim's tokens added only to an account
    still waiting for it. Every take spends exactly what the model says, no
    account has two claims in flight, and at the end, after every user ended,
    all that landed was spent or returned."""
    lease = lease_ms * MS
    balances = balances_at(lease_ns=lease)
    model: dict[str, list[list[int]]] = {}  # user -> [expires, left] batches
    waiting: set[str] = set()  # users whose account has a claim in flight
    outstanding: list[str] = []  # every claim not answered yet, oldest first
    now = T
    landed = spent = returned = 0

    def plan() -> None:
        nonlocal returned
        got = balances.plan(now)
        assert not got.claims.keys() & waiting, "claimed twice"
        for request in got.claims.values():
            assert 1 <= request.tokens <= burst_tokens(100, DEFAULT_BURST_NS)
        waiting.update(got.claims)
        outstanding.extend(got.claims)
        returned += sum(request.tokens for request in got.returns.values())

    for op in ops:
        if op[0] == "advance":
            now += op[1] * MS
        elif op[0] == "take":
            user, most = op[1], op[2]
            batches = [b for b in model.get(user, []) if b[0] > now]
            want = min(most, sum(b[1] for b in batches))
            left = want
            for batch in batches:
                use = min(left, batch[1])
                batch[1] -= use
                left -= use
            model[user] = [b for b in batches if b[1]]
            assert balances.take_up_to(user, most, now)[0] == want
            spent += want
        elif op[0] == "plan":
            plan()
        elif op[0] == "land" and outstanding:
            user = outstanding.pop(0)
            granted = op[1]
            balances.landed(user, granted, op[2], now)
            landed += granted
            if user in waiting:
                waiting.discard(user)
                model.setdefault(user, []).append([now + lease, granted])
        elif op[0] == "fail" and outstanding:
            balances.claims_failed(outstanding)
            outstanding.clear()
            waiting.clear()
        elif op[0] == "end":
            balances.end_user(op[1], now)
            model.pop(op[1], None)
            waiting.discard(op[1])
        for user, batches in model.items():
            held = sum(b[1] for b in batches if b[0] > now)
            assert balances.available(user, now) == held, user
    for user in outstanding:
        balances.landed(user, 0, 0, now)
    for user in USERS:
        balances.end_user(user, now)
    plan()
    assert landed == spent + returned


def test_a_user_asking_for_a_steps_worth_wants_a_claim_before_running_dry():
    # Two streams here ask for 2 tokens a step; claims are 1 token (a slow
    # user): the next claim goes out while 1 is still held, so no step has to
    # wait for a claim's round trip.
    balances = balances_at(rate=10)  # burst 2
    balances.take_up_to("a", 2, t0)
    assert balances.plan(t0).claims["a"].tokens == 1
    balances.landed("a", 1, 0, t0)
    assert "a" in balances.plan(t0).claims  # holds 1 <= 2 - 1: wanting again
    balances.landed("a", 1, 0, t0)
    assert balances.take_up_to("a", 2, t1) == (2, 0)
