"""Keeps the pacing metrics fresh, and the limiter clean, while the engine is idle.

vLLM sends ``SchedulerStats``, and with them our metrics payload, only from an
engine step, and an engine without requests runs none: its busy loop blocks on
the input queue. Without help, a limit set over gRPC, a rejected edit of the
limits file or an RPC count would reach ``/metrics`` only with the next request,
and idle users would stay in the limiter until then.

So a heartbeat thread in the engine-core process checks every ``PERIOD_S``:

- whether the scheduler's idle-user cleanup is due (``cleanup_due``; steps do it
  while they run);
- with our metrics on, whether what the payload reports changed
  (``fingerprint``), no payload has been built since, and no step has built one
  since the previous check either (``Freshness``).

Then it puts a ``HeartbeatMarker`` on the engine's input queue as a WAKEUP
request. The engine thread handles it between steps (``hooks`` wraps
``EngineCoreProc._handle_client_request``), so nothing races with
``schedule()``: it runs ``cleanup_when_idle()`` and, if asked, builds the
scheduler's stats and sends them without request outputs (``send_stats``), as
vLLM itself does after a step without any. A change is on ``/metrics`` within
about two periods (one more for the limits file's poll); with traffic, steps
carry it and no marker is sent for it.

Stats-only outputs go to client 0, as upstream's ``update_from_output`` sends
them when a step has no request outputs. With ``--api-server-count`` > 1 that
is the first API server; payload counters are deltas and gauges keep the most
recent value across API processes (``engine_ext.metrics``), so it does not
matter which one records them. Data parallelism is refused with pacing on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pacing.periodic import Periodic

# Under vLLM's logger so that its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")

#: Seconds between two heartbeat checks.
PERIOD_S = 1.0
#: The engine client that receives stats-only outputs (upstream's choice too).
STATS_CLIENT_INDEX = 0

_NEVER_CHECKED = object()


class Freshness:
    """Decides, one check at a time, whether the engine must send stats without
    a step (pure: no threads, no clock).

    A change seen at a check is owed a payload built after that check. Any
    payload pays it; a check asks for stats only if no step built a payload
    since the previous check (so a busy engine is never asked). The first check
    counts as a change: the first payload creates every series at zero.
    """

    def __init__(self) -> None:
        self._fingerprint: object = _NEVER_CHECKED
        self._by_steps: int | None = None
        #: A payload numbered above this one is owed; None: nothing owed.
        self._owed_after: int | None = None

    def check(self, fingerprint: object, built: int, asked: int) -> bool:
        """Whether to ask for stats now. ``fingerprint`` (see ``fingerprint()``)
        must be read before ``built``, the number of payloads whose build had
        started by then: a payload counted later then reports the change.
        ``asked`` of them were built because we asked: they are no steps."""
        if fingerprint != self._fingerprint:
            self._owed_after = built
        elif self._owed_after is not None and built > self._owed_after:
            self._owed_after = None
        by_steps = built - asked
        steps_ran = self._by_steps is not None and by_steps != self._by_steps
        self._fingerprint, self._by_steps = fingerprint, by_steps
        return self._owed_after is not None and not steps_ran


def fingerprint(scheduler: Any) -> tuple[object, ...]:
    """What the metrics payload of ``scheduler`` (an ``OutputRateSchedulerMixin``)
    reports that can change without a step: control-plane counters (every limit
    change bumps ``limit_changes``), the default limits (output, prompt and
    ceiling) and whether any holder has a ceiling, the bands' waiting requests,
    the event totals, the
    tracked users, the fair-share switch (a store may switch it without an RPC
    here) and, with a store, its traffic and state (an idle engine's
    claimer still sends heartbeats, and the store may stop answering). Equal
    fingerprints: nothing new to report.

    Read without the shared limiter's lock from any thread: the parts are ints
    and a locked snapshot, and a read torn by a running step only sees news that
    the step's own payload reports.
    """
    shared = scheduler.output_rate_shared
    store = shared.store_stats
    return (
        shared.control_snapshot(),
        scheduler.limiter.default_rate,
        shared.prompt.limiter.default_rate,
        shared.ceilings.table.default_rate,
        shared.ceilings.active,
        scheduler.output_rate_band_stats.fingerprint(),
        dataclasses.astuple(scheduler.accounting.total),
        scheduler.limiter.tracked_users(),
        shared.fair_share.enabled,
        None if store is None else store.fingerprint(),
    )


class HeartbeatMarker:
    """The input-queue request that asks the engine thread to act for the
    heartbeat: sent as a WAKEUP, so an engine without our hook drops it."""

    def __init__(self, heartbeat: IdleHeartbeat) -> None:
        self.heartbeat = heartbeat


class IdleHeartbeat:
    """Checks every ``period_s`` in a daemon thread and hands a
    ``HeartbeatMarker`` to ``request`` (which queues it for the engine thread)
    when the idle-user cleanup is due or, with ``metrics``, ``Freshness`` says
    stats are owed. At most one marker is outstanding: a slow engine is not
    flooded.
    """

    def __init__(
        self,
        scheduler: Any,
        request: Callable[[HeartbeatMarker], None],
        period_s: float = PERIOD_S,
        *,
        metrics: bool,
    ) -> None:
        self._scheduler = scheduler
        self._request = request
        self._freshness = Freshness() if metrics else None
        self._marker = HeartbeatMarker(self)
        self._outstanding = False
        self._stats_wanted = False
        self._asked_built = 0  # payloads built for our markers
        self._periodic = Periodic("output-rate-idle-heartbeat", period_s, self._tick)
        self._failed = False

    def check(self) -> bool:
        """One check; returns whether it asked the engine thread to act."""
        if self._outstanding:
            return False
        scheduler = self._scheduler
        cleanup = scheduler.cleanup_due(scheduler.clock())
        stats = self._freshness is not None and self._freshness.check(
            fingerprint(scheduler),
            scheduler.output_rate_payloads_built,
            self._asked_built,
        )
        if not (cleanup or stats):
            return False
        # Set before queueing: the engine thread reads them, then clears.
        self._stats_wanted = stats
        self._outstanding = True
        self._request(self._marker)
        return True

    def serve(self, engine: Any) -> None:
        """Handles our marker on ``engine``'s thread. Never raises: this runs on
        a vLLM thread."""
        scheduler = self._scheduler
        before = scheduler.output_rate_payloads_built
        try:
            scheduler.cleanup_when_idle()
        except Exception:
            logger.exception("idle-user cleanup failed")
        try:
            if self._stats_wanted:
                send_stats(engine)
        finally:
            self._asked_built += scheduler.output_rate_payloads_built - before
            self._outstanding = False

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        """Stops checking and waits for the thread to end."""
        self._periodic.stop()

    def _tick(self) -> None:
        try:
            self.check()
        except Exception:  # a broken check must not end the heartbeat
            if not self._failed:
                logger.exception("idle heartbeat check failed")
                self._failed = True


def send_stats(engine: Any) -> None:
    """Sends ``engine``'s scheduler stats (our payload inside) to the API
    process now, without a step. Engine thread only: ``make_stats`` is what a
    step would call there. Never raises: this runs on a vLLM thread."""
    from vllm.v1.engine import EngineCoreOutputs

    try:
        stats = engine.scheduler.make_stats_with_payload()
        if stats is not None:
            engine.output_queue.put_nowait(
                (STATS_CLIENT_INDEX, EngineCoreOutputs(scheduler_stats=stats))
            )
    except Exception:
        logger.exception("sending idle metrics failed")


def start_for(engine: Any) -> IdleHeartbeat | None:
    """Starts the heartbeat for ``engine`` (an ``EngineCoreProc``) if its
    scheduler paces; with metrics when it emits our payload and vLLM logs
    stats. ``None`` with pacing off."""
    from vllm.v1.engine import EngineCoreRequestType

    scheduler = engine.scheduler
    limiter = getattr(scheduler, "limiter", None)  # upstream's has none
    if limiter is None or not limiter.enabled:
        return None
    heartbeat = IdleHeartbeat(
        scheduler,
        lambda marker: engine.input_queue.put_nowait(
            (EngineCoreRequestType.WAKEUP, marker)
        ),
        metrics=scheduler.output_rate_stats is not None,
    )
    heartbeat.start()
    return heartbeat
