"""How pacing acts on its decisions: enforce them, only record them, or neither.

- ``enforce``: throttle (the default).
- ``shadow``: decide exactly as ``enforce`` would (charges, would-be skips, every
  user's GCRA state) but throttle nobody: a request ``enforce`` would skip runs
  uncharged and is counted as a shadow skip. For switching a limiter on without
  risk, watching what it would do.
- ``off``: the kill switch. Nothing is charged or recorded; the limits table is
  kept. Switching back starts every user from its kept state, which never holds
  more than a full bucket (GCRA's burst): no budget builds up while off.
"""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """Pacing mode; the value is its name in flags, files and the control plane."""

    ENFORCE = "enforce"
    SHADOW = "shadow"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


def parse_mode(raw: object, *, field: str = "mode") -> Mode:
    """``raw`` as a ``Mode``; ValueError naming ``field`` and the choices."""
    if isinstance(raw, Mode):
        return raw
    if isinstance(raw, str):
        try:
            return Mode(raw.strip().lower())
        except ValueError:
            pass
    choices = ", ".join(mode.value for mode in Mode)
    raise ValueError(f"{field} must be one of {choices}, got {raw!r}")
