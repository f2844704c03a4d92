"""Shared fixtures: the locally generated tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_ext.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random-weight Llama, generated once per test run (no network)."""
    cached = os.environ.get("OUTPUT_RATE_TINY_MODEL")
    path = Path(cached) if cached else tmp_path_factory.mktemp("tiny") / "model"
    return str(ensure_tiny_model(path))
