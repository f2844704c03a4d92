"""A throttled request's span carries its throttled-step count and total
throttled time (vLLM request tracing on), checked with the OpenTelemetry SDK's
in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from vllm.tracing import instrument_manual
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.output_processor import OutputProcessor

from engine_ext import hooks
from engine_ext.plugin import register
from engine_ext.request_tracing import (
    SECONDS_ATTRIBUTE,
    SECONDS_HEADER,
    STEPS_ATTRIBUTE,
    STEPS_HEADER,
)
from tools.fake_clock import FakeClock
from tools.scheduler_harness import Driver, make_request, make_scheduler


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The process-wide tracer provider vLLM would install, exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def finish_throttled_request(tiny_model_dir, tracing: bool):
    clock = FakeClock()
    scheduler = make_scheduler(
        tiny_model_dir,
        default_rate=10,
        clock=clock,
        otlp_traces_endpoint="http://127.0.0.1:4317" if tracing else None,
    )
    driver = Driver(scheduler, clock)
    request = make_request("u", prompt_len=4, max_tokens=5)
    request.trace_headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    driver.add([request])
    while not request.is_finished():
        driver.step(step_ms=20)
    return request


def test_finished_request_carries_its_throttle_totals(tiny_model_dir):
    request = finish_throttled_request(tiny_model_dir, tracing=True)
    headers = request.trace_headers
    # 5 tokens at 10 tok/s, 20 ms steps: at 0 and 20 ms (the burst), then at
    # 100, 200 and 300 ms. Refused: 40-80 ms (3 steps, 60 ms to the next
    # dispatch), 120-180 and 220-280 ms (4 steps, 80 ms each).
    assert int(headers[STEPS_HEADER]) == 11
    assert float(headers[SECONDS_HEADER]) == pytest.approx(0.22)
    assert headers["traceparent"].startswith("00-")


def test_nothing_is_tracked_without_request_tracing(tiny_model_dir):
    request = finish_throttled_request(tiny_model_dir, tracing=False)
    assert STEPS_HEADER not in request.trace_headers


def test_request_span_gets_the_throttle_attributes(exporter):
    register()
    assert getattr(
        OutputProcessor.__dict__["do_tracing"], "__output_rate_hook__", False
    )
    output = EngineCoreOutput(
        request_id="r-1",
        new_token_ids=[],
        trace_headers={STEPS_HEADER: "12", SECONDS_HEADER: "0.240000"},
    )

    def vllm_span(processor, engine_core_output):
        instrument_manual(span_name="llm_request", start_time=1, attributes={"a": 1})

    hooks._do_tracing(vllm_span, None, output)
    hooks._do_tracing(
        vllm_span, None, EngineCoreOutput(request_id="r-2", new_token_ids=[])
    )
    first, second = exporter.get_finished_spans()[-2:]
    assert first.attributes[STEPS_ATTRIBUTE] == 12
    assert first.attributes[SECONDS_ATTRIBUTE] == pytest.approx(0.24)
    assert first.attributes["a"] == 1
    assert STEPS_ATTRIBUTE not in second.attributes
