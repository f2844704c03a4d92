"""The engine loop's idle wait: after a step that ran no model because every ready
request was throttled, block on the input queue; new requests and aborts end the
wait at once. And the idle-metrics heartbeat: an engine without requests still
sends what changed, on its own thread, without a step."""

from __future__ import annotations

import os
import queue
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from control.plugin import register as register_control_plane
from engine_ext import hooks, idle_stats, payload_parser
from engine_ext.plugin import register
from engine_ext.scheduler import PAYLOAD_INTERVAL_NS, OutputRateScheduler
from pacing.accounting import Accounting
from pacing.limiter import OutputRateLimiter
from pacing.shared import SharedLimiter
from protos.outputrate.v1 import output_rate_pb2 as pb
from protos.outputrate.v1 import output_rate_pb2_grpc as pb_grpc
from tools.fake_clock import FakeClock
from tools.scheduler_harness import Driver, make_request, make_scheduler

PAYLOAD_INTERVAL_MS = PAYLOAD_INTERVAL_NS / 1e6


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


@pytest.mark.parametrize(
    "name", ["_process_engine_step", "_handle_client_request", "run_busy_loop"]
)
def test_the_hooks_are_installed_on_the_engine_core(name):
    register()
    assert getattr(EngineCoreProc.__dict__[name], "__output_rate_hook__", False)


def test_with_every_stream_parked_the_wait_lasts_until_a_user_has_budget(
    tiny_model_dir,
):
    # Far beyond the 50 ms a compiling grammar allows: no empty steps meanwhile.
    scheduler, now = throttled_scheduler(tiny_model_dir, wait_s=0.4)
    assert not scheduler.awaits_asynchronous_work()
    assert hooks.idle_wait_timeout_s(scheduler, now) == pytest.approx(0.4)
    assert hooks.idle_wait_timeout_s(scheduler, scheduler.next_ready_ns + 5) == 0


def test_a_missed_wake_stalls_the_engine_at_most_the_idle_wait_cap(tiny_model_dir):
    scheduler, now = throttled_scheduler(tiny_model_dir, wait_s=30.0)
    assert hooks.idle_wait_timeout_s(scheduler, now) == hooks.IDLE_WAIT_CAP_S


def test_while_a_grammar_compiles_the_engine_looks_again_within_50_ms(
    tiny_model_dir,
):
    scheduler, now = throttled_scheduler(tiny_model_dir, wait_s=0.4)
    json_only = StructuredOutputsParams(json={"type": "object"})
    request = Request(
        request_id="grammar",
        prompt_token_ids=[10, 11, 12, 13],
        sampling_params=SamplingParams(max_tokens=5, structured_outputs=json_only),
        pooling_params=None,
    )
    # As added by the engine, before the grammar compiled in its thread pool.
    assert request.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    scheduler.add_request(request)
    assert not scheduler.schedule().num_scheduled_tokens  # no grammar, no budget
    assert scheduler.awaits_asynchronous_work()
    assert scheduler.next_ready_ns is not None
    now = scheduler.next_ready_ns - int(0.4e9)
    assert hooks.ASYNC_WORK_WAIT_CAP_S == 0.05
    assert hooks.idle_wait_timeout_s(scheduler, now) == hooks.ASYNC_WORK_WAIT_CAP_S
    # A user ready sooner than that still ends the wait first.
    soon = scheduler.next_ready_ns - int(0.02e9)
    assert hooks.idle_wait_timeout_s(scheduler, soon) == pytest.approx(0.02)


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


def test_a_control_plane_change_ends_the_idle_wait_at_once(tiny_model_dir, monkeypatch):
    # What makes waits of up to IDLE_WAIT_CAP_S safe: a new limit wakes the engine.
    monkeypatch.setattr(hooks, "IDLE_WAIT_CAP_S", 10.0)
    scheduler, ready_in = throttled_scheduler(tiny_model_dir, wait_s=10.0)
    monkeypatch.setattr(hooks.time, "monotonic_ns", lambda: ready_in)
    engine = EngineLoopStandIn(scheduler)
    threading.Timer(0.2, scheduler.output_rate_shared.wake).start()
    started = time.monotonic()
    hooks._process_engine_step(lambda _: False, engine)
    assert time.monotonic() - started < 5.0
    assert engine.handled == [(EngineCoreRequestType.WAKEUP, None)]


def test_no_wait_after_a_step_that_ran_the_model(tiny_model_dir):
    scheduler, _ = throttled_scheduler(tiny_model_dir, wait_s=10.0)
    engine = EngineLoopStandIn(scheduler)
    started = time.monotonic()
    assert hooks._process_engine_step(lambda _: True, engine) is True
    assert time.monotonic() - started < 1.0


# -- idle metrics -------------------------------------------------------------

#: Freshness.check on a grid of checks: (fingerprint, payloads built, of them
#: built for our markers, asks?). Fingerprints are letters; a new one is a change.
FRESHNESS_ROWS = [
    ("a", 0, 0, True),  # c0: first check: nothing sent yet
    ("a", 0, 0, True),  # c1: still owed (the marker was not handled yet)
    ("a", 1, 1, False),  # c2: the marker's payload paid it
    ("a", 1, 1, False),  # c3: idle, nothing new
    ("b", 1, 1, True),  # c4: a change while idle
    ("b", 2, 2, False),  # c5: paid
    ("c", 2, 2, True),  # c6: a change right after: asked at once
    ("c", 3, 3, False),  # c7: paid
    ("d", 6, 3, False),  # c8: a change while steps run: theirs will pay
    ("d", 9, 3, False),  # c9: paid by a step
    ("e", 12, 3, False),  # c10: traffic ends right after this check...
    ("e", 12, 3, True),  # c11: ...and nothing paid the change seen at c10
    ("f", 12, 3, True),  # c12: another change before the marker was handled
    ("f", 13, 4, False),  # c13: one payload pays both
]


def test_freshness_asks_only_when_a_change_is_owed_and_no_step_runs():
    freshness = idle_stats.Freshness()
    for step, (fingerprint, built, asked, asks) in enumerate(FRESHNESS_ROWS):
        assert freshness.check(fingerprint, built, asked) is asks, f"c{step}"


def test_the_fingerprint_changes_when_fair_share_is_switched_without_an_rpc():
    """A global store switches fair share on an idle engine without an RPC
    there (nothing else in the fingerprint moves): the gauge is owed."""
    shared = SharedLimiter(OutputRateLimiter(10, {}), Accounting(), FakeClock())
    scheduler = SimpleNamespace(
        output_rate_shared=shared,
        limiter=shared.limiter,
        accounting=shared.accounting,
        output_rate_band_stats=SimpleNamespace(fingerprint=lambda: None),
    )
    before = idle_stats.fingerprint(scheduler)
    shared.fair_share.enabled = True
    assert idle_stats.fingerprint(scheduler) != before


class IdleEngine:
    """What the idle-metrics hooks use of an ``EngineCoreProc``: its scheduler and
    its real input and output queues."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()


def emitting_scheduler(tiny_model_dir, control: dict | None = None):
    """A real scheduler that puts the payload into its stats, as in the API
    server, on a fake clock, with an optional real control plane (``control``
    settings)."""

    def build(**kwargs):
        entry = kwargs["vllm_config"].additional_config["output_rate"]
        entry["metrics"] = {"emit": True}
        if control is not None:
            entry["control"] = control
            register_control_plane()  # as its entry point does in vLLM
        return OutputRateScheduler(**{**kwargs, "log_stats": True})

    scheduler = make_scheduler(
        tiny_model_dir, default_rate=1000, scheduler_cls=build, clock=FakeClock()
    )
    assert scheduler.output_rate_stats is not None
    return scheduler


def heartbeat_for(engine: IdleEngine, metrics: bool = True) -> idle_stats.IdleHeartbeat:
    """The heartbeat ``start_for`` builds, without its thread: a test calls
    ``check()`` itself."""
    return idle_stats.IdleHeartbeat(
        engine.scheduler,
        lambda marker: engine.input_queue.put_nowait(
            (EngineCoreRequestType.WAKEUP, marker)
        ),
        metrics=metrics,
    )


def handle_input(engine: IdleEngine) -> None:
    """What the engine loop does with one queued request: vLLM's handler, with
    our hook in front."""
    register()
    EngineCoreProc._handle_client_request(engine, *engine.input_queue.get_nowait())


def sent_payload(engine: IdleEngine) -> payload_parser.Payload:
    """The one output queued for the API process: stats alone, to client 0,
    with our payload, after vLLM's own wire trip."""
    client, outputs = engine.output_queue.get_nowait()
    assert engine.output_queue.empty()
    assert client == 0
    wire = MsgpackEncoder().encode(outputs)
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    assert received.outputs == []
    raw = payload_parser.take_payload(received.scheduler_stats)
    assert raw is not None
    return payload_parser.parse(raw)


def deliver(engine: IdleEngine, heartbeat) -> payload_parser.Payload:
    assert heartbeat.check() is True
    assert heartbeat.check() is False  # one marker at a time
    handle_input(engine)
    return sent_payload(engine)


def finish_requests(scheduler, users: list[str]) -> Driver:
    """Runs one short request per user to its end: the users stay tracked."""
    driver = Driver(scheduler, scheduler.clock)
    driver.add([make_request(user, prompt_len=4, max_tokens=2) for user in users])
    driver.run(6, step_ms=PAYLOAD_INTERVAL_MS)  # each step may build a payload
    assert not scheduler.has_requests()
    assert scheduler.limiter.tracked_users() == len(users)
    return driver


def test_an_idle_engine_sends_control_plane_changes_without_a_step(
    tiny_model_dir, tmp_path
):
    config = tmp_path / "limits.json"
    scheduler = emitting_scheduler(
        tiny_model_dir,
        {"address": "127.0.0.1:0", "config_path": str(config)},
    )
    [control] = scheduler.output_rate_attachments
    engine = IdleEngine(scheduler)
    heartbeat = heartbeat_for(engine)
    try:
        first = deliver(engine, heartbeat)
        assert first.default_limit == 1000
        assert heartbeat.check() is False  # nothing new since

        with grpc.insecure_channel(f"127.0.0.1:{control.port}") as channel:
            limit = pb.Limit(name="limits/idle-user", tokens_per_second=7)
            pb_grpc.OutputRateControlStub(channel).UpdateLimit(
                pb.UpdateLimitRequest(limit=limit, allow_missing=True)
            )
        changed = deliver(engine, heartbeat)
        assert changed.limits["idle-user"] == 7
        assert changed.limit_changes == 1

        # Whole at once: the watcher's own thread polls too, and must not
        # count a half-written file as a second failure.
        edit = tmp_path / "edit.json"
        edit.write_text("{not json")
        os.replace(edit, config)
        control.watcher.poll()
        reloaded = deliver(engine, heartbeat)
        assert reloaded.config_reloads == {"failure": 1}
        assert reloaded.limits["idle-user"] == 7  # the last good table stays
    finally:
        scheduler.shutdown()
    assert engine.input_queue.empty()


def test_steps_carry_the_news_while_they_run(tiny_model_dir):
    scheduler = emitting_scheduler(tiny_model_dir)
    engine = IdleEngine(scheduler)
    heartbeat = heartbeat_for(engine)
    deliver(engine, heartbeat)
    driver = Driver(scheduler, scheduler.clock)
    driver.add([make_request("u", max_tokens=3)])
    # Tokens charged: a change, carried by these steps' stats.
    driver.run(2, step_ms=PAYLOAD_INTERVAL_MS)
    assert heartbeat.check() is False
    scheduler.limiter.set_default_rate(50, scheduler.clock())
    driver.run(2, step_ms=PAYLOAD_INTERVAL_MS)
    assert heartbeat.check() is False
    assert engine.input_queue.empty()
    # Steps over: one payload settles what the last check saw, then quiet.
    assert deliver(engine, heartbeat).default_limit == 50
    assert heartbeat.check() is False


def test_an_idle_engine_drops_idle_users_by_time_metrics_or_not(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir, default_rate=1000, clock=FakeClock())
    assert scheduler.output_rate_stats is None
    engine = IdleEngine(scheduler)
    heartbeat = heartbeat_for(engine, metrics=False)
    driver = finish_requests(scheduler, ["u1", "u2", "u3"])
    assert heartbeat.check() is False  # the steps cleaned up less than 1 s ago
    driver.clock.advance_ms(1000)
    assert heartbeat.check() is True
    handle_input(engine)
    assert scheduler.limiter.tracked_users() == 0
    assert engine.output_queue.empty()  # no metrics, no stats
    assert heartbeat.check() is False


def test_an_idle_cleanup_shows_on_the_metrics(tiny_model_dir):
    scheduler = emitting_scheduler(tiny_model_dir)
    engine = IdleEngine(scheduler)
    heartbeat = heartbeat_for(engine)
    deliver(engine, heartbeat)
    driver = finish_requests(scheduler, ["u1", "u2"])
    assert heartbeat.check() is False  # steps ran
    driver.clock.advance_ms(1000)
    assert heartbeat.check() is True
    handle_input(engine)
    assert sent_payload(engine).tracked_users == 0


def test_a_plain_wakeup_is_still_dropped_by_vllm(tiny_model_dir):
    engine = IdleEngine(emitting_scheduler(tiny_model_dir))
    engine.input_queue.put((EngineCoreRequestType.WAKEUP, None))
    handle_input(engine)
    assert engine.output_queue.empty()


def test_a_failing_stats_build_is_logged_not_raised_and_retried(
    tiny_model_dir, monkeypatch, caplog
):
    scheduler = emitting_scheduler(tiny_model_dir)
    engine = IdleEngine(scheduler)
    heartbeat = heartbeat_for(engine)

    def broken():
        raise RuntimeError("stats broke")

    monkeypatch.setattr(scheduler, "make_stats", broken)
    assert heartbeat.check() is True
    with caplog.at_level("ERROR", logger="vllm.engine_ext.idle_stats"):
        handle_input(engine)  # on the engine thread: must not raise
    assert "sending idle metrics failed" in caplog.text
    assert engine.output_queue.empty()
    monkeypatch.undo()
    assert deliver(engine, heartbeat).default_limit == 1000


def test_the_heartbeat_thread_queues_a_marker_for_the_engine(tiny_model_dir):
    engine = IdleEngine(emitting_scheduler(tiny_model_dir))
    heartbeat = idle_stats.IdleHeartbeat(
        engine.scheduler, engine.input_queue.put_nowait, period_s=0.01, metrics=True
    )
    heartbeat.start()
    try:
        marker = engine.input_queue.get(timeout=60)
    finally:
        heartbeat.stop()
    assert isinstance(marker, idle_stats.HeartbeatMarker)


def test_the_busy_loop_runs_the_heartbeat_only_with_pacing_on(tiny_model_dir):
    def heartbeat_running() -> bool:
        return any(
            t.name == "output-rate-idle-heartbeat" for t in threading.enumerate()
        )

    seen: list[bool] = []

    def busy_loop(engine) -> None:
        seen.append(heartbeat_running())

    for scheduler in (
        emitting_scheduler(tiny_model_dir),
        make_scheduler(tiny_model_dir, default_rate=100),  # pacing, no metrics
        make_scheduler(tiny_model_dir, default_rate=None),  # pacing off
    ):
        hooks._run_busy_loop(busy_loop, IdleEngine(scheduler))
        assert not heartbeat_running()
    assert seen == [True, True, False]
