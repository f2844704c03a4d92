"""The ``vllm.general_plugins`` entry point (loaded by vLLM in every process)."""

from __future__ import annotations


def register() -> None:
    """Installs the runtime hooks; safe to call more than once."""
    from engine_ext import hooks

    hooks.install()
