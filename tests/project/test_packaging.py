"""The wheel holds only what runs in production: ``pacing``, ``engine_ext``,
``control``, ``protos`` and ``store``, never the development tools, tests or
benchmarks."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_PACKAGES = {"pacing", "engine_ext", "control", "protos", "store"}
DEV_MODULES = {
    "demo",
    "tiny_model",
    "local_server",
    "measure",
    "e2e_prometheus",
    "scheduler_harness",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built offline from a copy of the source tree (a copy, so the
    build's ``build/`` and ``*.egg-info`` stay out of the checkout)."""
    src = tmp_path_factory.mktemp("src") / "project"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    """The file names inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_top_level_packages_are_exactly_the_runtime_ones(
    wheel_names: list[str],
) -> None:
    top_level = {
        PurePosixPath(name).parts[0]
        for name in wheel_names
        if not PurePosixPath(name).parts[0].endswith(".dist-info")
    }
    assert top_level == RUNTIME_PACKAGES


def test_wheel_holds_no_development_tool(wheel_names: list[str]) -> None:
    stems = {PurePosixPath(name).stem for name in wheel_names}
    assert stems.isdisjoint(DEV_MODULES), sorted(stems & DEV_MODULES)


def test_wheel_holds_every_runtime_module(wheel_names: list[str]) -> None:
    source = {
        path.relative_to(ROOT).as_posix()
        for package in RUNTIME_PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert source <= set(wheel_names), sorted(source - set(wheel_names))


def test_wheel_declares_every_plugin_entry_point(wheel: Path) -> None:
    """vLLM loads the adapter, the control plane and the store each from its own
    entry point (docs/development.md, "What runs where"): without the second no
    control plane ever starts, without the third no store is ever used."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(name).decode())
    assert dict(entry_points["vllm.general_plugins"]) == {
        "output_rate": "engine_ext.plugin:register",
        "output_rate_control": "control.plugin:register",
        "output_rate_store": "store.plugin:register",
    }
