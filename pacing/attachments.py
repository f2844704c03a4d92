"""The registration point: how optional parts (the control plane) attach to the
pacing core without the vLLM adapter knowing them.

A part registers from its own ``vllm.general_plugins`` entry point, which vLLM
loads in the API-server process before it parses flags and in the engine-core
process before it builds the scheduler:

- ``register(attach)``: once the scheduler exists (engine-core process, pacing
  on), it calls ``attach(shared, settings)``, which starts the part and returns
  an ``Attachment``, or ``None`` when the settings do not ask for the part. The
  scheduler stops what was attached at its shutdown.
- ``register_preflight(check)``: the API-server process calls ``check(settings)``
  before the model loads (pacing on); it raises ``SettingsError`` naming the
  flag, and the process ends with that one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from pacing.settings.model import OutputRateSettings
from pacing.shared import SharedLimiter

# Under vLLM's logger: inside a vLLM server its handlers, format and level apply.
logger = logging.getLogger(f"vllm.{__name__}")


class Attachment(Protocol):
    """A running part, stopped at the scheduler's shutdown."""

    def stop(self) -> None: ...


Attach = Callable[[SharedLimiter, OutputRateSettings], "Attachment | None"]
Preflight = Callable[[OutputRateSettings], None]

_attach: list[Attach] = []
_preflight: list[Preflight] = []


def register(attach: Attach) -> None:
    """Adds ``attach``; registering the same function again does nothing (vLLM
    may load a plugin more than once)."""
    if attach not in _attach:
        _attach.append(attach)


def register_preflight(check: Preflight) -> None:
    """Adds ``check``; registering the same function again does nothing."""
    if check not in _preflight:
        _preflight.append(check)


def attach_all(shared: SharedLimiter, settings: OutputRateSettings) -> list[Attachment]:
    """Calls every registered ``attach`` in registration order and returns what
    they started. If one raises, stops those already started and re-raises."""
    if settings.control is not None and settings.control.enabled and not _attach:
        logger.warning(
            "a control plane is configured but no part is registered to attach: "
            "the vllm.general_plugins entry point output_rate_control was not "
            "loaded (is the package installed? does VLLM_PLUGINS leave it out?)"
        )
    started: list[Attachment] = []
    try:
        for attach in _attach:
            attachment = attach(shared, settings)
            if attachment is not None:
                started.append(attachment)
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(attachments: Iterable[Attachment]) -> None:
    """Stops ``attachments``, the last attached first."""
    for attachment in reversed(list(attachments)):
        attachment.stop()


def preflight(settings: OutputRateSettings) -> None:
    """Runs every registered start-up check on ``settings``; raises
    ``SettingsError`` for the first setting one refuses."""
    for check in _preflight:
        check(settings)
