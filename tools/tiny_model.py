"""Write a tiny random-weight Llama with a locally trained tokenizer, offline."""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump whenever the layout or any dimension changes so stale dirs get rebuilt.
LAYOUT_VERSION = "1"
MARKER_NAME = ".tiny_model_version"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

SEED = 0
VOCAB_SIZE = 300
# head_dim = 128 / 2 = 64: the vLLM CPU attention kernel rejects head_dim 16.
HIDDEN_SIZE = 128
NUM_ATTENTION_HEADS = 2
NUM_KEY_VALUE_HEADS = 1
NUM_HIDDEN_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITION_EMBEDDINGS = 2048

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]

# No BOS in the template: the tokenizer's post-processor already prepends it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# One string reads better than a 100-item list; split in _corpus.
_WORD_TEXT = (
    "the a an one two some every this that my your our their "
    "cat dog bird fish model token server user request reply queue batch "
    "time rate limit engine world river house tree stone light water "
    "runs jumps reads writes sends waits serves sleeps grows shines flows "
    "quick slow small large bright quiet happy busy early late green blue "
    "and but so then while because before after with without over under "
    "hello thanks please yes no why how what when where who is are was were "
    "0 1 2 3 4 5 6 7 8 9 . , ? ! : ; ' -"
)


def _corpus(lines: int = 600) -> Iterator[str]:
    """Yield deterministic pseudo-English lines so BPE learns common merges."""
    rng = random.Random(SEED)
    words_list = _WORD_TEXT.split()
    for _ in range(lines):
        words = rng.choices(words_list, k=rng.randint(4, 14))
        line = " ".join(words)
        yield line[0].upper() + line[1:] + rng.choice([".", "?", "!"])


def _is_complete(path: pathlib.Path) -> bool:
    marker = path / MARKER_NAME
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return marker.read_text().strip() == LAYOUT_VERSION
    except OSError:
        return False


def _build_tokenizer() -> PreTrainedTokenizerFast:
    # Heavy imports stay local so the fast "already there" path is instant.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # Full byte alphabet so any input text is encodable without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend BOS like Llama tokenizers do; vLLM relies on add_special_tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write(out: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        # Special ids must match the tokenizer or generation never stops.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # Fixed seed so the same DIR content is produced on every machine/run.
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / MARKER_NAME).write_text(LAYOUT_VERSION + "\n")
    _relax_permissions(out)


def _relax_permissions(out: pathlib.Path) -> None:
    # mkdtemp (and safetensors) create owner-only modes; a shared model dir
    # must be readable by e.g. a server running under another user.
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for child in out.iterdir():
        child.chmod(0o666 & ~umask)


def _check_replaceable(target: pathlib.Path) -> None:
    # Only an empty dir or an older layout of ours may be wiped; never
    # delete a directory someone else put files in.
    if (
        target.is_dir()
        and not (target / MARKER_NAME).exists()
        and any(target.iterdir())
    ):
        raise FileExistsError(f"{target} is not empty and was not written by us")
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(target)


def ensure_tiny_model(path: str | os.PathLike[str]) -> pathlib.Path:
    """Create the tiny model in ``path`` unless a current one is already there."""
    target = pathlib.Path(path).expanduser().resolve()
    if _is_complete(target):
        return target

    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so readers (and concurrent
    # callers) never see a half-written model.
    staging = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    )
    try:
        _write(staging)
        if target.exists():
            if _is_complete(target):  # another process won the race
                return target
            _check_replaceable(target)
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Lost a race to a concurrent writer; accept its result if valid.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", metavar="DIR", help="output directory")
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
