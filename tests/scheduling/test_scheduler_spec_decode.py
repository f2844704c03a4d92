"""Speculative decoding under pacing, on vLLM's real Scheduler and AsyncScheduler
(n-gram drafts, controlled acceptance, a fake clock): a user pays for exactly the
tokens it receives, its grant bounds the drafts scheduled, and the rate stays
within the GCRA bound."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from tools.measure import max_over_gcra_bound_scaled
from tools.scheduler_harness import (
    SYNC_AND_ASYNC,
    driven_scheduler,
    make_request,
)

DRAFTS = 3
LIMIT = 20  # tok/s
BURST_S = 0.1


def _net_charged(scheduler, user: str) -> int:
    """Tokens charged less refunded, as the user's counters say (drafts count
    once received; the budget itself is checked by the rate tests)."""
    counters = scheduler.accounting.of(user)
    return counters.charged - counters.refunds


def _output_tokens(requests) -> int:
    return sum(request.num_output_tokens for request in requests)


def _spec_scheduler(model_dir, async_scheduling, **kwargs):
    kwargs.setdefault("num_speculative_tokens", DRAFTS)
    return driven_scheduler(model_dir, async_scheduling, **kwargs)


@SYNC_AND_ASYNC
def test_an_unthrottled_user_gets_every_draft_scheduled(
    tiny_model_dir, async_scheduling
):
    _, driver = _spec_scheduler(tiny_model_dir, async_scheduling, default_rate=100_000)
    requests = [make_request("fast", max_tokens=200) for _ in range(4)]
    driver.add(requests)
    driver.run(40)
    # Once decoding, every step of every request carries all its drafts.
    late = driver.outputs[10:]
    assert all(
        len(output.scheduled_spec_decode_tokens.get(r.request_id, ())) == DRAFTS
        for output in late
        for r in requests
        if r.request_id in output.num_scheduled_tokens
    )
    assert any(output.scheduled_spec_decode_tokens for output in late)


@SYNC_AND_ASYNC
@pytest.mark.parametrize("accepted", [0, 1, DRAFTS], ids=["none", "one", "all"])
def test_a_user_pays_exactly_the_tokens_it_receives(
    tiny_model_dir, async_scheduling, accepted
):
    """Charged at dispatch for 1 + the drafts, the rejected drafts given back
    once the output is known: net charge = output tokens, whatever the model
    accepts (free steps: a user far from its limit)."""
    scheduler, driver = _spec_scheduler(
        tiny_model_dir, async_scheduling, default_rate=100_000
    )
    driver.accepted = lambda request_id, drafts: min(accepted, drafts)
    requests = [make_request("u", max_tokens=300) for _ in range(4)]
    driver.add(requests)
    driver.run(30)
    driver.settle()
    assert _output_tokens(requests) >= 30 * 4
    assert _net_charged(scheduler, "u") == _output_tokens(requests)
    if not async_scheduling:  # no step is dispatched after a request's last
        assert scheduler.accounting.of("u").refunds == 0


@SYNC_AND_ASYNC
def test_tokens_a_stop_cuts_off_are_given_back(tiny_model_dir, async_scheduling):
    """A step whose accepted drafts run past max_tokens emits only up to it:
    the user pays for what it received (at least 1 token per sampling step)."""
    scheduler, driver = _spec_scheduler(
        tiny_model_dir, async_scheduling, default_rate=100_000
    )
    requests = [make_request("u", max_tokens=n) for n in (5, 6, 7, 9)]
    driver.add(requests)
    driver.run(12)
    driver.settle()
    assert [r.num_output_tokens for r in requests] == [5, 6, 7, 9]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert _net_charged(scheduler, "u") == 27


@SYNC_AND_ASYNC
def test_a_users_grant_bounds_the_drafts_scheduled(tiny_model_dir, async_scheduling):
    """In paced steps, no request of a throttled user is scheduled more drafts
    than its grant covers, and the user is never charged beyond its budget."""
    _, driver = _spec_scheduler(tiny_model_dir, async_scheduling, default_rate=LIMIT)
    requests = [make_request("slow", max_tokens=1000) for _ in range(4)]
    driver.add(requests)
    driver.run(300)
    ids = {r.request_id for r in requests}
    for output in driver.outputs:
        verified = sum(
            1 + len(output.scheduled_spec_decode_tokens.get(rid, ()))
            for rid in output.num_scheduled_tokens
            if rid in ids and not _admitted(output, rid)
        )
        # One step never takes more than a full bucket.
        assert verified <= BURST_S * LIMIT + 1 + 4


def _admitted(output, request_id: str) -> bool:
    return request_id in {n.req_id for n in output.scheduled_new_reqs}


@SYNC_AND_ASYNC
@pytest.mark.parametrize("rate", [LIMIT, 120, 400, 1000])
@pytest.mark.parametrize("acceptance", ["all", "none", "alternate"])
def test_spec_decode_stays_within_the_gcra_bound(
    tiny_model_dir, async_scheduling, rate, acceptance
):
    """4 streams: tokens received in any window of W s stay within
    (W + 0.1)·R + 1 (async scheduling: plus at most the drafts refunded one step
    late, DRAFTS per stream: see ``engine_ext.scheduling.drafts``), the user
    gets at least 97 % of its limit, and pays exactly what it received. Tokens
    are dated by the step that dispatched them."""
    scheduler, driver = _spec_scheduler(
        tiny_model_dir, async_scheduling, default_rate=rate
    )
    steps = iter(range(10**9))
    driver.accepted = {
        "all": lambda request_id, drafts: drafts,
        "none": lambda request_id, drafts: 0,
        "alternate": lambda request_id, drafts: drafts * (next(steps) % 2),
    }[acceptance]
    # Demand stays above every rate: 300 steps of 5 ms end before any request
    # reaches max_model_len (1.5 s at 1,000 tok/s is 375 tokens per stream).
    requests = [make_request("u", max_tokens=5000) for _ in range(4)]
    driver.add(requests)
    driver.tracked = requests
    driver.run(300, step_ms=5.0)
    driver.settle()
    received = [(at, n) for at, n in driver.received if n]
    times = [at for at, n in received for _ in range(n)]
    extra = DRAFTS * len(requests) if async_scheduling else 0
    assert max_over_gcra_bound_scaled(times, rate) <= extra * 10**9
    # Without accepted drafts the 4 streams take at most 4 tokens per 5 ms step
    # (800 tok/s), less than the highest rate.
    reachable = min(rate, 800) if acceptance == "none" else rate
    span_s = (received[-1][0] - received[0][0]) / 1e9
    assert len(times) >= 0.97 * reachable * span_s
    assert _net_charged(scheduler, "u") == _output_tokens(requests)


def test_the_bound_check_finds_a_window_over_the_bound():
    """The check above can fail: at 20 tok/s, 0.1 s·20 + 1 = 3 tokens at once
    are within the bound, 5 are 2 over it; a 4th 50 ms later is within."""
    assert max_over_gcra_bound_scaled([0, 0, 0], LIMIT) == 0
    assert max_over_gcra_bound_scaled([0] * 5, LIMIT) == 2 * 10**9
    assert max_over_gcra_bound_scaled([0, 0, 0, 50_000_000], LIMIT) == 0


@SYNC_AND_ASYNC
def test_a_throttled_spec_user_leaves_an_unthrottled_one_its_drafts(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = _spec_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": LIMIT},
    )
    slow = [make_request("slow", max_tokens=1000) for _ in range(4)]
    fast = [make_request("fast", max_tokens=1000) for _ in range(2)]
    driver.add(slow + fast)
    driver.run(60)
    for output in driver.outputs[20:]:
        for request in fast:
            rows = output.scheduled_spec_decode_tokens.get(request.request_id, ())
            assert len(rows) == DRAFTS
    driver.settle()
    assert _net_charged(scheduler, "fast") == _output_tokens(fast)


@SYNC_AND_ASYNC
def test_shadow_mode_schedules_every_draft(tiny_model_dir, async_scheduling):
    """Shadow mode counts what enforce would refuse and changes nothing: a user
    over its limit still gets all its drafts scheduled."""
    scheduler, driver = _spec_scheduler(
        tiny_model_dir,
        async_scheduling,
        default_rate=LIMIT,
        output_rate={"mode": "shadow"},
    )
    requests = [make_request("u", max_tokens=1000) for _ in range(4)]
    driver.add(requests)
    driver.run(60)
    for output in driver.outputs[10:]:
        for request in requests:
            rows = output.scheduled_spec_decode_tokens.get(request.request_id, ())
            assert len(rows) == DRAFTS
    assert scheduler.accounting.of("u").shadow_skips > 0
