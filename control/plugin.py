"""The control plane's ``vllm.general_plugins`` entry point (``output_rate_control``,
loaded by vLLM in every process): attaches the control plane to the pacing core
through its registration point, ``pacing.attachments``."""

from __future__ import annotations

from pacing import attachments
from pacing.settings.model import OutputRateSettings
from pacing.shared import SharedLimiter


def register() -> None:
    """Registers the control plane's start (engine-core process) and its start-up
    checks (API-server process); safe to call more than once."""
    attachments.register(_attach)
    attachments.register_preflight(_preflight)


# gRPC and the rest load only where pacing is on and the part is used.


def _attach(
    shared: SharedLimiter, settings: OutputRateSettings
) -> attachments.Attachment | None:
    from control.runner import attach

    return attach(shared, settings)


def _preflight(settings: OutputRateSettings) -> None:
    from control.preflight import check

    if settings.control is not None:
        check(settings.control, settings.policy.default_rate)
