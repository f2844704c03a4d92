"""The committed code in ``protos/`` is exactly what ``protos/generate.py``
produces from the ``.proto`` files with the pinned grpcio-tools."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from protos import generate

ROOT = Path(__file__).resolve().parents[2]


def _pinned_grpcio_tools() -> str:
    pin = re.search(r'"grpcio-tools==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin, "pyproject.toml's dev extras must pin grpcio-tools with =="
    return pin.group(1)


def _generated_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name.endswith(generate.GENERATED)
    }


def test_committed_code_was_generated_by_the_pinned_grpcio_tools():
    module = generate.PROTOS / "outputrate/v1/output_rate_pb2_grpc.py"
    stamped = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", module.read_text())
    assert stamped is not None
    assert stamped.group(1) == _pinned_grpcio_tools()


def test_regenerated_protos_match_the_committed_code(tmp_path):
    pinned = _pinned_grpcio_tools()
    installed = importlib.metadata.version("grpcio-tools")
    if installed != pinned:
        pytest.fail(
            f"grpcio-tools {installed} is installed, pyproject.toml pins {pinned}: "
            "reinstall the dev extras (scripts/setup.sh)"
        )
    assert generate.main(tmp_path) == 0
    regenerated = _generated_files(tmp_path)
    committed = _generated_files(generate.PROTOS)
    assert regenerated, "protoc generated nothing"
    assert sorted(regenerated) == sorted(committed)
    stale = [name for name in committed if committed[name] != regenerated[name]]
    assert not stale, (
        f"{stale} differ from what protos/generate.py produces: run "
        "`python protos/generate.py` and commit the result"
    )
