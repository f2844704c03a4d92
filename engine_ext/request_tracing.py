"""Per-request throttling on vLLM's request spans (``--otlp-traces-endpoint``).

The engine core writes a finished request's throttle totals into the request's
``trace_headers`` (which vLLM returns with the final output); in the API process
a hook around vLLM's span creation hands them to ``ThrottleSpanProcessor``,
which sets them as attributes of the ``llm_request`` span as it starts.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor

#: Carried in ``trace_headers`` from the engine core to the API process; trace
#: propagators ignore headers they do not know.
STEPS_HEADER = "x-output-rate-throttled-steps"
SECONDS_HEADER = "x-output-rate-throttled-seconds"
#: Span attributes.
STEPS_ATTRIBUTE = "vllm.output_rate.throttled_steps"
SECONDS_ATTRIBUTE = "vllm.output_rate.throttled_seconds"
REQUEST_SPAN = "llm_request"

_T = TypeVar("_T")

_pending: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "output_rate_span_attributes", default=None
)


def with_throttle_headers(
    trace_headers: Mapping[str, str] | None, steps: int, seconds: float
) -> dict[str, str]:
    """``trace_headers`` plus a request's throttle totals."""
    return {
        **(trace_headers or {}),
        STEPS_HEADER: str(steps),
        SECONDS_HEADER: f"{seconds:.6f}",
    }


def throttle_attributes(trace_headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The span attributes a request's ``trace_headers`` carry (empty if none)."""
    if not trace_headers or STEPS_HEADER not in trace_headers:
        return {}
    return {
        STEPS_ATTRIBUTE: int(trace_headers[STEPS_HEADER]),
        SECONDS_ATTRIBUTE: float(trace_headers[SECONDS_HEADER]),
    }


class ThrottleSpanProcessor(SpanProcessor):
    """Sets the pending throttle attributes on the request span as it starts."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        attributes = _pending.get()
        if attributes and span.name == REQUEST_SPAN:
            span.set_attributes(attributes)


_processor = ThrottleSpanProcessor()
_registered_on: list[object] = []


def trace_request(
    create_span: Callable[[], _T], trace_headers: Mapping[str, str] | None
) -> _T:
    """Runs ``create_span()`` (vLLM's span creation for one finished request)
    with the request's throttle attributes pending for ``ThrottleSpanProcessor``."""
    attributes = throttle_attributes(trace_headers)
    if not attributes:
        return create_span()
    _register_processor()
    token = _pending.set(attributes)
    try:
        return create_span()
    finally:
        _pending.reset(token)


def _register_processor() -> None:
    """Adds the processor to the global tracer provider vLLM installed (once)."""
    provider = trace.get_tracer_provider()
    if provider not in _registered_on and hasattr(provider, "add_span_processor"):
        provider.add_span_processor(_processor)
        _registered_on.append(provider)
