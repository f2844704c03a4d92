"""Tests for the offline tiny-model generator (no vLLM, runs in seconds)."""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoTokenizer

from tools import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # Module scope: generation costs a few seconds, share it across tests.
    return tiny_model.ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_files_exist(model_dir: pathlib.Path) -> None:
    for name in (*tiny_model.REQUIRED_FILES, tiny_model.MARKER_NAME):
        assert (model_dir / name).is_file(), name


def test_config_dims(model_dir: pathlib.Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == 128
    assert cfg["num_attention_heads"] == 2
    assert cfg["num_key_value_heads"] == 1
    assert cfg["num_hidden_layers"] == 2
    assert cfg["intermediate_size"] == 256
    assert cfg["max_position_embeddings"] == 2048
    # The vLLM CPU attention kernel needs head_dim 64 here.
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["dtype"] == "bfloat16"


def test_tokenizer_matches_config(model_dir: pathlib.Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == cfg["vocab_size"]
    assert 250 <= len(tok) <= 320
    assert tok.bos_token == "<s>"
    assert tok.eos_token == "</s>"
    assert tok.pad_token == "<pad>"
    assert tok.unk_token == "<unk>"
    assert tok.bos_token_id == cfg["bos_token_id"]
    assert tok.eos_token_id == cfg["eos_token_id"]
    assert tok.pad_token_id == cfg["pad_token_id"]


def test_tokenizer_round_trip(model_dir: pathlib.Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "Hello world, the quick server sends 42 replies!"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template(model_dir: pathlib.Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    rendered = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "system: be brief\nuser: hi\nassistant:"
    plain = tok.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("assistant:")


def test_second_call_is_noop(model_dir: pathlib.Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert tiny_model.ensure_tiny_model(model_dir) == model_dir
    after = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert after == before


def test_stale_layout_is_regenerated(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / tiny_model.MARKER_NAME).write_text("old\n")
    (target / "config.json").write_text("{}")
    (target / "leftover.bin").write_text("x")
    tiny_model.ensure_tiny_model(target)
    assert (target / tiny_model.MARKER_NAME).read_text().strip() == (
        tiny_model.LAYOUT_VERSION
    )
    assert not (target / "leftover.bin").exists()
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 128


def test_refuses_foreign_dir(tmp_path: pathlib.Path) -> None:
    (tmp_path / "notes.txt").write_text("not ours")
    with pytest.raises(FileExistsError):
        tiny_model.ensure_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").is_file()
    # The staging dir must not be left behind.
    staging = f".{tmp_path.name}."
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(staging)]


def test_main_prints_path(
    model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tiny_model.main([str(model_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)
