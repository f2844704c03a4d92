"""Runtime hooks into vLLM 0.32 where it offers no extension point.

Installed by the ``vllm.general_plugins`` entry point (``engine_ext.plugin``) in
every vLLM process. Each hook wraps one vLLM function, calls the original, and is
idempotent. ``install()`` fails loudly if an internal it wraps has moved, so a new
vLLM version breaks at start-up, not at the first throttled request.

- ``EngineArgs.add_cli_args``: adds our flags to every vLLM parser (``vllm serve``,
  ``python -m engine_ext.serve``); the plugin hook runs right before upstream
  builds its parser, which is the moment vLLM documents for plugins to extend it.
- ``EngineArgs.from_cli_args``: checks our flags before any model loads (a bad
  one exits like an argparse error; the checks registered with
  ``pacing.attachments``, the control plane's among them), moves them into
  ``additional_config`` (the field vLLM carries to the engine-core process) and
  marks the parsed args (``GUARD_ARG``) so every API server adds the HTTP guard.
- ``vllm.entrypoints.launchers.app.init_entrypoints_middleware``: adds the HTTP
  guard before vLLM adds its own middleware, so it is the innermost one: vLLM's
  ``--api-key`` check (and CORS) answers a client before the guard reads its body
  or reveals the identity source. ``--middleware`` would put it outermost.
- ``EngineArgs.create_engine_config``: once vLLM has resolved the config (async
  scheduling, DP, spec decode...), refuses unsupported combinations and selects
  our scheduler variant.
- ``EngineCoreProc._process_engine_step``: when a step ran no model because every
  ready request was throttled, block on the input queue instead of vLLM's 1 ms
  polling sleep (see ``idle_wait_timeout_s``).
- ``EngineCoreProc.run_busy_loop``: runs the idle heartbeat alongside the loop;
  ``EngineCoreProc._handle_client_request``: when the heartbeat asks, cleans up
  idle users and sends stats without a step (see ``engine_ext.idle_stats``).
- ``OutputProcessor.do_tracing``: puts a finished request's throttle totals on its
  ``llm_request`` span (see ``engine_ext.request_tracing``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from engine_ext import idle_stats
from engine_ext.supported import check_supported
from pacing import attachments
from pacing.attestation import attested_mode, ensure_key
from pacing.settings import cli as settings_cli
from pacing.settings.checks import SettingsError
from pacing.settings.flags import REQUIRE_USER_FLAG, USER_SOURCE_FLAG
from pacing.settings.model import ADDITIONAL_CONFIG_KEY, OutputRateSettings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.output_processor import OutputProcessor

    from engine_ext.scheduler import OutputRateSchedulerMixin

#: Upper bound of one idle wait while a waiting request depends on work that
#: finishes without input (a structured-output grammar compiling, say): only a
#: step notices it is done, so the engine looks this often.
ASYNC_WORK_WAIT_CAP_S = 0.05
#: Upper bound of any other idle wait. All else that can let a step run a model
#: ends the wait at once (requests, aborts, the idle heartbeat's marker,
#: control-plane changes), and when the limiter next has budget is known, so
#: this only bounds the stall of a wake that some path fails to send. One empty
#: step a second is negligible; 20 a second (a 50 ms cap) would be most of a parked
#: engine's CPU.
IDLE_WAIT_CAP_S = 1.0

#: The attribute ``from_cli_args`` sets on the parsed args of a paced server;
#: API servers vLLM spawns (``--api-server-count``) get the args with it.
GUARD_ARG = "output_rate_http_guard"
_HOOKED = "__output_rate_hook__"


def install() -> None:
    """Installs every hook (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers import app
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.output_processor import OutputProcessor

    _wrap(EngineArgs, "add_cli_args", _add_cli_args)
    _wrap(EngineArgs, "from_cli_args", _from_cli_args)
    _wrap(EngineArgs, "create_engine_config", _create_engine_config)
    _wrap(EngineCoreProc, "_handle_client_request", _handle_client_request)
    _wrap(EngineCoreProc, "run_busy_loop", _run_busy_loop)
    _wrap(EngineCoreProc, "_process_engine_step", _process_engine_step)
    _wrap(OutputProcessor, "do_tracing", _do_tracing)
    _wrap_function(app, "init_entrypoints_middleware", _init_entrypoints_middleware)


def _require(owner: type, name: str) -> Any:
    if not hasattr(owner, name):
        raise RuntimeError(
            f"vLLM internals moved: {owner.__module__}.{owner.__qualname__}.{name} "
            "is gone; engine_ext supports vLLM 0.32.x only"
        )
    return getattr(owner, name)


def _wrap(owner: type, name: str, wrapper: Callable[..., Any]) -> None:
    """Replaces ``owner.name`` so that calls go to ``wrapper(original, ...)``.

    For a plain method ``wrapper`` receives ``(original, self, *args)``; for a
    static or class method ``(original, *args)`` with ``original`` already bound.
    """
    _require(owner, name)
    current = owner.__dict__.get(name)
    if current is None:
        raise RuntimeError(
            f"vLLM internals moved: {owner.__qualname__}.{name} is no longer "
            "defined on that class; engine_ext supports vLLM 0.32.x only"
        )
    if getattr(getattr(current, "__func__", current), _HOOKED, False):
        return
    hooked: Callable[..., Any]  # one of three shapes, below
    if isinstance(current, staticmethod):
        original = current.__func__

        def hooked(*args: Any, **kwargs: Any) -> Any:
            return wrapper(original, *args, **kwargs)

        replacement: Any = staticmethod(hooked)
    elif isinstance(current, classmethod):
        original = current.__func__

        def hooked(cls: type, *args: Any, **kwargs: Any) -> Any:
            return wrapper(functools.partial(original, cls), *args, **kwargs)

        replacement = classmethod(hooked)
    else:
        original = current

        def hooked(self: object, *args: Any, **kwargs: Any) -> Any:
            return wrapper(original, self, *args, **kwargs)

        replacement = hooked
    functools.update_wrapper(hooked, original)
    setattr(hooked, _HOOKED, True)
    setattr(owner, name, replacement)


def _wrap_function(module: ModuleType, name: str, wrapper: Callable[..., Any]) -> None:
    """Replaces the module-level function ``module.name`` so that calls from that
    module go to ``wrapper(original, ...)``."""
    current = getattr(module, name, None)
    if not callable(current):
        raise RuntimeError(
            f"vLLM internals moved: {module.__name__}.{name} is gone; "
            "engine_ext supports vLLM 0.32.x only"
        )
    if getattr(current, _HOOKED, False):
        return
    original = current

    def hooked(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    functools.update_wrapper(hooked, original)
    setattr(hooked, _HOOKED, True)
    setattr(module, name, hooked)


# -- command line -----------------------------------------------------------

#: The argument group of our flags in vLLM's parsers (``--help`` shows it).
FLAG_GROUP_TITLE = "Per-user output pacing"
FLAG_GROUP_DESCRIPTION = (
    "Cap each user's output tokens per second inside the scheduler (GCRA). "
    f"The user comes from {USER_SOURCE_FLAG} (by default "
    "vllm_xargs.output_rate_user; none: __anonymous__)."
)


def _add_cli_args(
    original: Callable[[FlexibleArgumentParser], FlexibleArgumentParser],
    parser: FlexibleArgumentParser,
) -> FlexibleArgumentParser:
    parser = original(parser)
    group = parser.add_argument_group(FLAG_GROUP_TITLE, FLAG_GROUP_DESCRIPTION)
    settings_cli.add_cli_args(group)
    return parser


def _from_cli_args(
    original: Callable[[argparse.Namespace], EngineArgs], args: argparse.Namespace
) -> EngineArgs:
    """Also checks every pacing and control-plane setting, in the process the
    operator started and before any model loads: a bad one ends the process like
    an argparse error (one line on stderr, exit code 2)."""
    engine_args = original(args)
    try:
        paced = OutputRateSettings.from_cli_args(args, engine_args.additional_config)
        if not paced.enabled:
            return engine_args
        # API servers vLLM spawns (--api-server-count) get the checked args; the
        # engine core may already hold the port by the time they run.
        if multiprocessing.parent_process() is None:
            attachments.preflight(paced)
        if attested_mode(paced.user_source, paced.require_user):
            _refuse_unguarded_front_ends(args)
            # Inherited by every process vLLM spawns from here.
            ensure_key(os.environ)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    additional = dict(engine_args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = paced.to_additional_config()
    engine_args.additional_config = additional
    setattr(args, GUARD_ARG, True)
    return engine_args


def _init_entrypoints_middleware(
    original: Callable[..., None],
    args: argparse.Namespace,
    app: FastAPI,
    *rest: Any,
    **kwargs: Any,
) -> None:
    """Adds the HTTP guard first: Starlette runs the last added middleware
    outermost, so the guard runs after vLLM's authentication, and asks for the
    same API key on the paths vLLM's check leaves out."""
    if getattr(args, GUARD_ARG, False):
        from engine_ext.api_keys import api_keys_of
        from engine_ext.http_guard import OutputRateRequestGuard

        app.add_middleware(
            OutputRateRequestGuard, api_keys=api_keys_of(args, os.environ)
        )
    original(args, app, *rest, **kwargs)


def _refuse_unguarded_front_ends(args: argparse.Namespace) -> None:
    """Front ends that never run the HTTP guard cannot serve the attested mode:
    every request would be anonymous or refused."""
    if getattr(args, "grpc", False):
        front_end = "--grpc"
    elif os.environ.get("VLLM_USE_RUST_FRONTEND", "0") not in ("", "0"):
        front_end = "VLLM_USE_RUST_FRONTEND"
    else:
        return
    raise SettingsError(
        f"{front_end} serves requests without the HTTP guard, which "
        f"{USER_SOURCE_FLAG} (other than xargs) and {REQUIRE_USER_FLAG} need"
    )


def _create_engine_config(
    original: Callable[..., VllmConfig],
    engine_args: EngineArgs,
    *args: Any,
    **kwargs: Any,
) -> VllmConfig:
    vllm_config = original(engine_args, *args, **kwargs)
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    if paced.enabled:
        from engine_ext.scheduler import scheduler_class_for

        check_supported(vllm_config)
        usage_context = kwargs.get("usage_context", args[0] if args else None)
        _enable_metrics_transport(vllm_config, paced, usage_context)
        scheduler_config = vllm_config.scheduler_config
        scheduler_config.scheduler_cls = scheduler_class_for(
            scheduler_config.async_scheduling
        )
    return vllm_config


def _enable_metrics_transport(
    vllm_config: VllmConfig,
    paced: OutputRateSettings,
    usage_context: UsageContext | None,
) -> None:
    """Lets the scheduler put its metrics into SchedulerStats, but only where our
    stat logger will take them out again (vLLM's own logging stat logger would
    crash on them)."""
    from engine_ext.metrics import transport_enabled

    additional = vllm_config.additional_config  # a dict: `paced` was read from it
    if transport_enabled(usage_context) and isinstance(additional, dict):
        metrics = dataclasses.replace(paced.metrics, emit=True)
        paced = dataclasses.replace(paced, metrics=metrics)
        additional[ADDITIONAL_CONFIG_KEY] = paced.to_additional_config()


# -- engine loop ------------------------------------------------------------


def idle_wait_timeout_s(scheduler: object, now_ns: int) -> float | None:
    """How long the engine may block after a step that ran no model: until the
    earliest refused user has budget again, at most ``ASYNC_WORK_WAIT_CAP_S``
    while a waiting request awaits asynchronous work and ``IDLE_WAIT_CAP_S``
    otherwise; ``None`` when the scheduler is not waiting on the limiter or a
    KV connector is receiving a waiting request's KV cache."""
    ready_ns: int | None = getattr(scheduler, "next_ready_ns", None)
    if ready_ns is None:
        return None
    # Only our scheduler sets next_ready_ns.
    paced = cast("OutputRateSchedulerMixin", scheduler)
    if paced.awaits_kv_transfer():
        return None  # upstream's own 1 ms poll: a step reports the transfer
    cap_s = (
        ASYNC_WORK_WAIT_CAP_S if paced.awaits_asynchronous_work() else IDLE_WAIT_CAP_S
    )
    return min(cap_s, max(0, ready_ns - now_ns) / 1e9)


def _wake_engine(engine: EngineCoreProc) -> None:
    """Ends an idle wait at once: vLLM's engine drops WAKEUP requests."""
    from vllm.v1.engine import EngineCoreRequestType

    engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def wait_for_input(engine: EngineCoreProc, timeout_s: float) -> bool:
    """Blocks on the engine's input queue for up to ``timeout_s``; a new request
    or an abort ends the wait at once and is handled. Returns whether one came."""
    try:
        request = engine.input_queue.get(timeout=timeout_s)
    except queue.Empty:
        return False
    engine._handle_client_request(*request)
    return True


def _run_busy_loop(
    original: Callable[[EngineCoreProc], None], engine: EngineCoreProc
) -> None:
    heartbeat = idle_stats.start_for(engine)
    try:
        original(engine)
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _handle_client_request(
    original: Callable[[EngineCoreProc, EngineCoreRequestType, Any], None],
    engine: EngineCoreProc,
    request_type: EngineCoreRequestType,
    request: Any,
) -> None:
    if isinstance(request, idle_stats.HeartbeatMarker):
        request.heartbeat.serve(engine)
        return
    original(engine, request_type, request)


def _process_engine_step(
    original: Callable[[EngineCoreProc], bool], engine: EngineCoreProc
) -> bool:
    if getattr(engine.scheduler, "output_rate_needs_wake_binding", False):
        # Only our scheduler has that flag.
        scheduler = cast("OutputRateSchedulerMixin", engine.scheduler)
        scheduler.output_rate_needs_wake_binding = False
        scheduler.bind_wake(functools.partial(_wake_engine, engine))
    model_executed = original(engine)
    if not model_executed:
        timeout_s = idle_wait_timeout_s(engine.scheduler, time.monotonic_ns())
        if timeout_s:
            started = time.monotonic()
            wait_for_input(engine, timeout_s)
            stats = getattr(engine.scheduler, "output_rate_stats", None)
            if stats is not None:
                stats.observe_idle_wait(time.monotonic() - started)
    return model_executed


# -- request tracing (API process) --------------------------------------------


def _do_tracing(
    original: Callable[..., None],
    processor: OutputProcessor,
    engine_core_output: EngineCoreOutput,
    *args: Any,
    **kwargs: Any,
) -> None:
    from engine_ext.request_tracing import trace_request

    return trace_request(
        lambda: original(processor, engine_core_output, *args, **kwargs),
        engine_core_output.trace_headers,
    )
