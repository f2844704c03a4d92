"""Wires the control plane together inside the engine-core process: config
file, service, server, file watcher. The one place that does.

``attach`` is what the scheduler calls once it exists, with pacing on, through
the core's registration point (``pacing.attachments``; ``control.plugin``
registers it). It returns the running ``ControlPlane``, which the scheduler
stops at its shutdown, or ``None`` when the settings ask for none. From then
on the control plane works on the ``pacing.shared.SharedLimiter`` it was given:
the scheduler holds the facade's lock for each whole step, the control plane
takes it for every read and write, and a change wakes an idle-waiting engine
through the facade.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from opentelemetry import trace

from control import secrets
from control.persistence import (
    DEFAULT_POLL_INTERVAL_S,
    ConfigFile,
    ConfigWatcher,
    FileCopy,
    load_at_start,
)
from control.server import ControlServer, create_server
from control.service.operations import LimitsService
from control.table import table_in_force
from pacing import global_limits
from pacing.modes import Mode
from pacing.policy.document import Document
from pacing.policy.model import Policy
from pacing.settings.flags import ADDRESS_FLAG
from pacing.settings.model import ControlSettings, OutputRateSettings
from pacing.shared import ControlPlaneSnapshot, SharedLimiter

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class ControlPlane:
    """A running control plane."""

    service: LimitsService
    #: ``None`` (and ``port`` 0) with ``--output-rate-control-address off``:
    #: the limits file alone, loaded and watched.
    server: ControlServer | None
    port: int
    watcher: ConfigWatcher | None

    def stop(self, grace_s: float = 1.0) -> None:
        """Health NOT_SERVING, then stops the server (``grace_s`` for calls in
        flight) and the file watcher."""
        if self.server is not None:
            self.server.stop(grace_s).wait()
        if self.watcher is not None:
            self.watcher.stop()

    def snapshot(self) -> ControlPlaneSnapshot:
        """Its cumulative counters now; the metrics read them through the
        facade (``SharedLimiter.control_snapshot``)."""
        watcher = self.watcher
        return ControlPlaneSnapshot(
            limit_changes=self.service.limit_changes,
            config_reloads=(
                {}
                if watcher is None
                else {"success": watcher.successes, "failure": watcher.failures}
            ),
            rpcs={} if self.server is None else self.server.rpc_counts.snapshot(),
        )


def serve(
    shared: SharedLimiter,
    settings: ControlSettings,
    *,
    mode: Mode | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    global_store: bool = False,
    listen: bool = True,
) -> ControlPlane:
    """Loads the config file into ``shared``'s limiter, mode and fair-share
    ledger (the limiter's current table, the ledger's weights and switch and
    ``mode``, by default ``shared``'s, count as the flags),
    starts the server on ``settings.address``, marks it SERVING and hands its
    counters to ``shared`` for the metrics. Raises on a bad config file, bad TLS
    or token files, or an address it may not or cannot bind; nothing keeps
    running then.

    With ``global_store`` the table lives in the store (``store.limits_sync``,
    started after this): changes go to the store first; the file gives the
    start-up table and becomes the engine's durable copy of the store's
    (``FileCopy``, registered on the ``pacing.global_limits`` hub), written
    with every version the engine makes or applies, so a store that loses its
    data is restored from the engines' files. It is not watched (an edit on
    one engine would make it differ from the others). Without a file, a
    store's changes live in Redis alone: logged as a warning.

    Without ``listen`` no server starts: the limits file is loaded and
    watched all the same (the policy the operator wrote holds whether or not
    the network API is on)."""
    flags = _flags_table(shared, mode)
    file = None if settings.config_path is None else ConfigFile(settings.config_path)
    service = LimitsService(
        shared,
        persist=None if file is None or global_store else file.write,
        global_store=global_store,
    )
    start = Document(flags) if file is None else load_at_start(file, flags)
    service.reload(lambda: start.policy)
    if global_store:
        _keep_durably(shared, file, start)
    watcher = None
    if file is not None and not global_store:
        watcher = ConfigWatcher(file, service, flags, interval_s=poll_interval_s)
    server: ControlServer | None = None
    port = 0
    if listen:
        server, port = create_server(
            settings.address,
            service,
            auth_token=secrets.auth_token(settings),
            tls=secrets.tls(settings),
            tracer_provider=tracer_provider,
        )
        server.start()
    if watcher is not None:
        watcher.start()
    if server is not None:
        server.set_serving()
        logger.info(
            "output-rate control plane listening on %s (port %d)",
            settings.address,
            port,
        )
    else:
        logger.info(
            "output-rate limits file %s loaded and watched; no control plane "
            "listens (%s off)",
            settings.config_path,
            ADDRESS_FLAG,
        )
    plane = ControlPlane(service=service, server=server, port=port, watcher=watcher)
    shared.set_control_snapshot(plane.snapshot)
    return plane


def _flags_table(shared: SharedLimiter, mode: Mode | None) -> Policy:
    """The policy ``shared`` holds (the flags'), with ``mode`` (else its own)."""
    with shared.lock:
        policy = table_in_force(shared)
    return policy if mode is None else dataclasses.replace(policy, mode=mode)


def _keep_durably(
    shared: SharedLimiter, file: ConfigFile | None, start: Document
) -> None:
    """Makes ``file`` the durable copy of the store's table (before the store's
    sync starts: it starts from the file's version)."""
    if file is None:
        logger.warning(
            "output-rate control plane: with a store and no limits file, changes "
            "live only in Redis; a store that loses its data loses them (give "
            "every engine --user-output-rate-config to keep them)"
        )
        return
    global_limits.hub(shared).durable = FileCopy(file, start.store_version)


def attach(shared: SharedLimiter, settings: OutputRateSettings) -> ControlPlane | None:
    """``serve`` with ``settings.control``, the start-up mode of ``settings``
    and, with ``--output-rate-store``, the table in the store. Address ``off``
    serves no RPCs but still loads and watches the limits file. ``None`` when
    there is nothing to run: no ``control`` section (an offline ``LLM``
    without one), address ``off`` without a file, or a data-parallel rank
    other than 0 (one control plane per server), which starts from the file
    read once and then follows rank 0's changes through the store."""
    control = settings.control
    if control is None:
        return None
    if shared.engine_index != 0:
        logger.info(
            "output-rate control plane: served by data-parallel rank 0, not %d",
            shared.engine_index,
        )
        if control.config_path is not None:
            _start_from_file(shared, control.config_path, settings.mode)
        return None
    if not control.enabled and control.config_path is None:
        return None
    return serve(
        shared,
        control,
        mode=settings.mode,
        global_store=settings.store is not None,
        listen=control.enabled,
    )


def _start_from_file(shared: SharedLimiter, path: str, mode: Mode) -> None:
    """The table ``serve`` would start with, applied without writing or
    watching the file: a rank that does not serve the control plane enforces
    the file's limits from its first step, not only once the store's table
    arrives."""
    flags = _flags_table(shared, mode)
    start = load_at_start(ConfigFile(path), flags, create=False)
    LimitsService(shared).reload(lambda: start.policy)
