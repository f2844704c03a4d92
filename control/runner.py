"""Wires the control plane together inside the engine-core process: config
file, service, server, file watcher. The one place that does.

How the scheduler (``engine_ext.scheduler``) runs it; ``shared`` is a
``pacing.shared.SharedLimiter``::

    # __init__, after the limiter and the accounting exist:
    self.output_rate_shared = SharedLimiter(
        self.limiter,
        self.accounting,
        lambda: self.clock(),
        request_counts=lambda: self._request_counts,
    )
    self.output_rate_control = serve_from_additional_config(
        self.output_rate_shared, self.vllm_config.additional_config
    )

    # schedule(): the whole step under the lock, ending with on_step
    with self.output_rate_shared.lock:
        output = self._paced_schedule(*args, **kwargs)

    # shutdown(): before upstream's
    if self.output_rate_control is not None:
        self.output_rate_control.stop()

and, once the engine exists (``EngineCoreProc``), the idle-wait wake-up, which
``engine_ext.hooks`` binds at the engine's first step::

    shared.set_wake(lambda: engine.input_queue.put_nowait(
        (EngineCoreRequestType.WAKEUP, None)))
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from control.persistence import (
    DEFAULT_POLL_INTERVAL_S,
    ConfigFile,
    ConfigWatcher,
    load_at_start,
)
from control.server import ControlServer, create_server
from control.service import LimitsService
from control.settings import ControlSettings
from control.table import TableDocument
from pacing.shared import SharedLimiter

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class ControlPlane:
    """A running control plane."""

    service: LimitsService
    server: ControlServer
    port: int
    watcher: ConfigWatcher | None

    def stop(self, grace_s: float = 1.0) -> None:
        """Health NOT_SERVING, then stops the server (``grace_s`` for calls in
        flight) and the file watcher."""
        self.server.stop(grace_s).wait()
        if self.watcher is not None:
            self.watcher.stop()


def serve(
    shared: SharedLimiter,
    settings: ControlSettings,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
) -> ControlPlane:
    """Loads the config file into ``shared``'s limiter (the limiter's current
    table counts as the flags), starts the server on ``settings.address`` and
    marks it SERVING. Raises on a bad config file, bad TLS or token files, or an
    address it may not or cannot bind; nothing keeps running then."""
    with shared.lock:
        flags = TableDocument(
            default_rate=shared.limiter.default_rate,
            user_rates=shared.limiter.user_rates,
        )
    file = None if settings.config_path is None else ConfigFile(settings.config_path)
    service = LimitsService(shared, persist=None if file is None else file.write)
    watcher = None
    if file is not None:
        start_table = load_at_start(file, flags)
        service.reload(lambda: start_table)
        watcher = ConfigWatcher(file, service, flags, interval_s=poll_interval_s)
    server, port = create_server(
        settings.address,
        service,
        auth_token=settings.auth_token(),
        tls=settings.tls(),
        tracer_provider=tracer_provider,
    )
    server.start()
    if watcher is not None:
        watcher.start()
    server.set_serving()
    logger.info(
        "output-rate control plane listening on %s (port %d)", settings.address, port
    )
    return ControlPlane(service=service, server=server, port=port, watcher=watcher)


def serve_from_additional_config(
    shared: SharedLimiter, additional_config: Mapping[str, Any] | None
) -> ControlPlane | None:
    """``serve`` with the settings in ``additional_config``; ``None`` when the
    control plane is switched off (address ``off``)."""
    settings = ControlSettings.from_additional_config(additional_config)
    if not settings.enabled:
        return None
    return serve(shared, settings)
