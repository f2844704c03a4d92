"""``benchmarks.profile_share``: which sampled stacks count as our code's, per
server process, read from py-spy's raw format; and the real py-spy attached to a
real process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.profile_share import (
    API_SERVER,
    Profile,
    Share,
    our_frame,
    profile,
    role_of,
    shares,
)

ROOT = 'process 100:"python -m engine_ext.serve model"'
CORE = 'process 101:"VLLM::EngineCore"'
WORKER = 'process 102:"VLLM::Worker"'
LOOP = "run_busy_loop (vllm/v1/engine/core.py:900)"
HOOK = "hooked (engine_ext/hooks.py:131)"
STEP = "step (vllm/v1/engine/core.py:400)"
OURS = "free_step (engine_ext/scheduling/steps.py:160)"
COUNTER = "__init__ (collections/__init__.py:600)"
#: py-spy's --format raw: frames joined by ';', a space, the sample count.
RAW = [
    # Our hook wraps vLLM's loop, which steps: vLLM's time, not ours.
    f"{ROOT};{CORE};{HOOK};{LOOP};{STEP} 50",
    # vLLM's step calls our scheduler, which calls the standard library: ours.
    f"{ROOT};{CORE};{HOOK};{LOOP};{STEP};{OURS};{COUNTER} 7",
    f"{ROOT};{CORE};{HOOK};{LOOP};{STEP};{OURS} 3",
    # Only the standard library below the process frame: nobody's code of ours.
    f"{ROOT};{CORE};select (selectors.py:10) 5",
    f"{ROOT};{WORKER};forward (vllm/model_executor/x.py:1) 40",
    f"{ROOT};record (engine_ext/metrics.py:463) 2",
    f"{ROOT};serve (uvicorn/server.py:1) 8",
]


def test_a_sample_is_ours_when_our_frame_is_innermost_before_vllms() -> None:
    assert our_frame([ROOT, CORE, HOOK, LOOP, STEP]) is None
    assert our_frame([ROOT, CORE, HOOK, LOOP, STEP, OURS, COUNTER]) == OURS
    assert our_frame([ROOT, CORE, "select (selectors.py:10)"]) is None


def test_a_thread_of_ours_blocked_in_a_wait_is_not_our_work() -> None:
    heartbeat = "Periodic._run (pacing/periodic.py:36)"
    assert our_frame([ROOT, CORE, heartbeat, "wait (threading.py:622)"]) is None
    idle_wait = "wait_for_input (engine_ext/hooks.py:253)"
    assert our_frame([ROOT, CORE, idle_wait, "get (queue.py:180)"]) is None
    # The same modules above the innermost frame say nothing.
    run = "run (threading.py:1000)"
    assert our_frame([ROOT, CORE, run, heartbeat, COUNTER]) == heartbeat


def test_each_stack_is_counted_under_the_process_it_was_sampled_in() -> None:
    assert role_of([ROOT, "serve (uvicorn/server.py:1)"]) == API_SERVER
    assert role_of([ROOT, CORE, LOOP]) == "engine core"
    assert role_of([ROOT, WORKER, LOOP]) == "worker"
    assert role_of([ROOT, 'process 103:"python -c x"', LOOP]) == "other"


def test_shares_sum_samples_and_ours_per_process() -> None:
    found = shares([*RAW, "", "not a stack line"])
    assert found["engine core"] == Share(65, 10, {OURS: 10})
    assert found["worker"] == Share(40, 0, {})
    assert found[API_SERVER] == Share(10, 2, {"record (engine_ext/metrics.py:463)": 2})


def test_the_wall_share_divides_our_samples_by_the_ticks_of_the_run() -> None:
    found = Profile(shares(RAW), seconds=2.0, rate=10)  # 20 ticks per thread
    assert found.wall_share("engine core") == pytest.approx(10 / 20)
    assert found.wall_share("worker") == 0.0
    assert found.wall_share() == pytest.approx(12 / 20)


#: Once imported, spends about as long in our limiter as in a loop of its own,
#: forever.
HALF_OURS = textwrap.dedent(
    """
    import time
    from pacing.limiter import OutputRateLimiter

    limiter = OutputRateLimiter(1_000_000, {})
    print("ready", flush=True)
    while True:
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            limiter.try_take("u", time.monotonic_ns())
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            pass
    """
)


def test_py_spy_attached_to_a_real_process_finds_our_code_in_it() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", HALF_OURS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        found = profile(child.pid, lambda: time.sleep(0.05), seconds=2)
    finally:
        child.kill()
        child.wait()
    share = found.shares[API_SERVER]  # a lone process reads as the root one
    assert share.samples > 0
    # About half: the limiter's loop and the bare one alternate every 10 ms.
    assert 0.2 < share.ours / share.samples < 0.8
    assert all("pacing/limiter.py" in frame for frame in share.frames)
