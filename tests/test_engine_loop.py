"""The engine loop's idle wait: after a step that ran no model because every ready
request was throttled, block on the input queue; new requests and aborts end the
wait at once."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc

from engine_ext import hooks
from engine_ext.plugin import register
from tests.scheduler_harness import Driver, FakeClock, make_request, make_scheduler


class EngineLoopStandIn:
    """The three things the hook uses of an ``EngineCoreProc``: its scheduler, its
    real input queue, and the request handler (recording what it was given)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.input_queue: queue.Queue = queue.Queue()
        self.handled: list[tuple] = []

    def _handle_client_request(self, request_type, request) -> None:
        self.handled.append((request_type, request))


def throttled_scheduler(tiny_model_dir, wait_s: float):
    """A scheduler whose only user is out of budget for ``wait_s`` seconds."""
    clock = FakeClock()
    scheduler = make_scheduler(tiny_model_dir, default_rate=1, clock=clock)
    driver = Driver(scheduler, clock)
    driver.add([make_request("u", prompt_len=4, max_tokens=50)])
    driver.run(2)
    assert scheduler.next_ready_ns is not None
    # Pretend the engine's monotonic clock is wait_s before the ready time.
    return scheduler, scheduler.next_ready_ns - int(wait_s * 1e9)


def test_the_hook_is_installed_on_the_engine_core():
    register()
    step = EngineCoreProc.__dict__["_process_engine_step"]
    assert getattr(step, "__output_rate_hook__", False)


def test_timeout_is_the_earliest_ready_time_capped_at_50_ms(tiny_model_dir):
    scheduler, now = throttled_scheduler(tiny_model_dir, wait_s=0.02)
    assert hooks.idle_wait_timeout_s(scheduler, now) == pytest.approx(0.02)
    assert hooks.idle_wait_timeout_s(scheduler, now - 10**9) == hooks.IDLE_WAIT_CAP_S
    assert hooks.idle_wait_timeout_s(scheduler, scheduler.next_ready_ns + 5) == 0


def test_no_wait_when_the_scheduler_is_not_waiting_on_the_limiter(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir, default_rate=None)
    assert hooks.idle_wait_timeout_s(scheduler, 0) is None
    engine = EngineLoopStandIn(scheduler)
    started = time.monotonic()
    assert hooks._process_engine_step(lambda _: False, engine) is False
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "request_type", [EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT]
)
def test_idle_wait_ends_on_new_input_well_before_the_timeout(
    tiny_model_dir, monkeypatch, request_type
):
    # A 10 s cap makes "woken early" unmistakable on a noisy machine.
    monkeypatch.setattr(hooks, "IDLE_WAIT_CAP_S", 10.0)
    scheduler, ready_in = throttled_scheduler(tiny_model_dir, wait_s=10.0)
    monkeypatch.setattr(hooks.time, "monotonic_ns", lambda: ready_in)
    engine = EngineLoopStandIn(scheduler)
    payload = object()
    threading.Timer(0.2, engine.input_queue.put, [(request_type, payload)]).start()
    started = time.monotonic()
    executed = hooks._process_engine_step(lambda _: False, engine)
    waited = time.monotonic() - started
    assert executed is False
    assert engine.handled == [(request_type, payload)]
    assert waited < 5.0


def test_idle_wait_times_out_without_input(tiny_model_dir, monkeypatch):
    scheduler, ready_in = throttled_scheduler(tiny_model_dir, wait_s=0.03)
    monkeypatch.setattr(hooks.time, "monotonic_ns", lambda: ready_in)
    engine = EngineLoopStandIn(scheduler)
    started = time.monotonic()
    hooks._process_engine_step(lambda _: False, engine)
    assert time.monotonic() - started >= 0.025
    assert engine.handled == []


def test_no_wait_after_a_step_that_ran_the_model(tiny_model_dir):
    scheduler, _ = throttled_scheduler(tiny_model_dir, wait_s=10.0)
    engine = EngineLoopStandIn(scheduler)
    started = time.monotonic()
    assert hooks._process_engine_step(lambda _: True, engine) is True
    assert time.monotonic() - started < 1.0
