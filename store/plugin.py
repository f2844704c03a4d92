"""The store's ``vllm.general_plugins`` entry point (``output_rate_store``, loaded
by vLLM in every process): with ``--output-rate-store`` set, attaches the global
budget to the pacing core through its registration point
(``pacing.attachments``), as the control plane attaches itself; the vLLM
adapter never learns of Redis."""

from __future__ import annotations

from pacing import attachments
from pacing.settings.model import OutputRateSettings
from pacing.shared import SharedLimiter


def register() -> None:
    """Registers the store's start in the engine-core process (each
    data-parallel rank is a client of its own) and its start-up check in the
    API-server process; safe to call more than once."""
    attachments.register(_attach)
    attachments.register_preflight(_preflight)


def _attach(
    shared: SharedLimiter, settings: OutputRateSettings
) -> attachments.Attachment | None:
    if settings.store is None:
        return None
    from store.runtime import attach  # redis loads only where a store is used

    return attach(shared, settings.store)


def _preflight(settings: OutputRateSettings) -> None:
    if settings.store is None:
        return
    from store.preflight import check

    check(settings.store)
