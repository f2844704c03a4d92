"""Slots go to users with budget (``engine_ext.scheduling.slots``): parked
requests yield their model-runner slot or KV blocks to waiting requests of users
with budget, on vLLM's real Scheduler / AsyncScheduler and KV manager with a
fake clock."""

from __future__ import annotations

import random

import pytest
from vllm.v1.request import RequestStatus

from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import Driver, make_request
from tools.scheduler_harness import driven_scheduler as setup


def fill_slots_with_parked(driver: Driver, scheduler, user: str, count: int):
    """Adds ``count`` long requests of ``user`` and steps until all of them run
    and every one is parked (its user has no budget)."""
    requests = [make_request(user, prompt_len=4, max_tokens=1000) for _ in range(count)]
    driver.add(requests)
    for _ in range(20):
        driver.step()
        if all(r.status == RequestStatus.RUNNING for r in requests) and not any(
            r.request_id in driver.outputs[-1].num_scheduled_tokens for r in requests
        ):
            return requests
    raise AssertionError("the requests never all ran parked")


def preempted(requests) -> list:
    return [r for r in requests if r.status == RequestStatus.PREEMPTED]


@MODES
def test_parked_request_yields_its_slot_to_a_user_with_budget(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=4,
        max_num_active_seqs=2,
    )
    slow = fill_slots_with_parked(driver, scheduler, "slow", 4)
    assert len(scheduler.running) == 4  # every slot held by a parked request
    fast = make_request("fast", prompt_len=4, max_tokens=5)
    driver.add([fast])
    output = driver.step()
    assert fast.request_id in output.num_scheduled_tokens
    assert len(preempted(slow)) == 1
    assert preempted(slow)[0].request_id in output.preempted_req_ids
    assert scheduler.accounting.of("slow").throttled_preemptions == 1


@MODES
def test_the_victim_is_the_users_most_recently_served_stream(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=4,
    )
    slow = fill_slots_with_parked(driver, scheduler, "slow", 4)
    last_served = scheduler._users.last_served["slow"]
    driver.add([make_request("fast", prompt_len=4, max_tokens=5)])
    driver.step()
    assert [r.request_id for r in preempted(slow)] == [last_served]


@MODES
def test_the_victim_is_the_user_furthest_from_budget(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slower": 1, "slow": 4},
        max_num_seqs=4,
    )
    slower = fill_slots_with_parked(driver, scheduler, "slower", 2)
    slow = fill_slots_with_parked(driver, scheduler, "slow", 2)
    now = driver.clock.now_ns
    assert scheduler.limiter.ready_at_ns("slower", now) > scheduler.limiter.ready_at_ns(
        "slow", now
    )
    driver.add([make_request("fast", prompt_len=4, max_tokens=5)])
    driver.step()
    assert len(preempted(slower)) == 1
    assert not preempted(slow)


@MODES
def test_nothing_yields_while_the_active_cap_binds(tiny_model_dir, async_scheduling):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=3,
        max_num_active_seqs=1,
    )
    slow = fill_slots_with_parked(driver, scheduler, "slow", 2)
    busy = make_request("busy", prompt_len=4, max_tokens=1000)
    driver.add([busy])
    driver.run(2)
    assert busy.status == RequestStatus.RUNNING
    assert len(scheduler.running) == 3
    waiting = make_request("fast", prompt_len=4, max_tokens=5)
    driver.add([waiting])
    driver.run(3)
    # "busy" takes the one active place: a freed slot would not let it start.
    assert not preempted(slow)
    assert waiting.status == RequestStatus.WAITING


@MODES
def test_a_higher_priority_parked_request_never_yields_to_a_lower_one(
    tiny_model_dir, async_scheduling
):
    _scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=2,
        policy="priority",
    )
    slow = [make_request("slow", prompt_len=4, max_tokens=1000, priority=0)]
    slow.append(make_request("slow", prompt_len=4, max_tokens=1000, priority=0))
    driver.add(slow)
    driver.run(4)
    low = make_request("fast", prompt_len=4, max_tokens=5, priority=1)
    driver.add([low])
    driver.run(3)
    assert not preempted(slow)
    assert low.status == RequestStatus.WAITING
    same = make_request("fast", prompt_len=4, max_tokens=5, priority=0)
    driver.add([same])
    output = driver.step()
    assert same.request_id in output.num_scheduled_tokens
    assert len(preempted(slow)) == 1


@MODES
def test_parked_requests_yield_kv_blocks_to_a_user_with_budget(
    tiny_model_dir, async_scheduling
):
    # 16-token blocks; three parked requests of 31 tokens hold 2 blocks each.
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=16,
        num_blocks=7,
    )
    slow = [make_request("slow", prompt_len=31, max_tokens=1000) for _ in range(3)]
    driver.add(slow)
    driver.run(4)
    assert all(r.status == RequestStatus.RUNNING for r in slow)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    fast = make_request("fast", prompt_len=8, max_tokens=5)
    driver.add([fast])
    output = driver.step()
    assert fast.request_id in output.num_scheduled_tokens
    assert len(preempted(slow)) == 1


@MODES
def test_a_yielded_request_resumes_once_no_user_with_budget_needs_its_slot(
    tiny_model_dir, async_scheduling
):
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
        max_num_seqs=2,
    )
    slow = fill_slots_with_parked(driver, scheduler, "slow", 2)
    fast = make_request("fast", prompt_len=4, max_tokens=20)
    driver.add([fast])
    driver.step()
    (victim,) = preempted(slow)
    for _ in range(8):  # fast is decoding: the victim must not take its slot
        assert fast.status == RequestStatus.RUNNING
        assert victim.status == RequestStatus.PREEMPTED
        driver.step()
    driver.run(20)  # fast finishes, its slot is spare again
    assert fast.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert victim.status == RequestStatus.RUNNING
    assert len(scheduler.running) == 2


@MODES
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slot_yielding_completes_every_request_exactly_and_preempts_boundedly(
    tiny_model_dir, async_scheduling, seed
):
    """A throttled user fills every slot; other users' requests arrive at
    random. Every request finishes with all its tokens, and there are never
    more preemptions than requests of other users (each needed one slot)."""
    rng = random.Random(seed)
    scheduler, driver = setup(
        tiny_model_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 50},
        max_num_seqs=6,
        max_num_active_seqs=3,
    )
    slow = [make_request("slow", prompt_len=4, max_tokens=6) for _ in range(12)]
    driver.add(slow)
    others = []
    for step in range(3000):
        if step < 200 and rng.random() < 0.1:
            request = make_request(
                rng.choice(["b", "c"]),
                prompt_len=rng.randint(2, 20),
                max_tokens=rng.randint(1, 8),
            )
            others.append(request)
            driver.add([request])
        driver.step(step_ms=rng.choice([2, 5, 10]))
        if not scheduler.has_requests():
            break
    everyone = slow + others
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in everyone)
    assert all(r.num_output_tokens == r.max_tokens for r in everyone)
    preemptions = sum(r.num_preemptions for r in everyone)
    assert 0 < preemptions <= len(others)
    assert sum(r.num_preemptions for r in others) == 0
