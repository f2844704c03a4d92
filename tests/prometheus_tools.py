"""Finding Debian's ``prometheus`` package binaries (promtool, prometheus) in tests."""

from __future__ import annotations

import os
import shutil

import pytest


def require_binary(name: str) -> str:
    """The path of executable ``name``. When it is missing the calling test fails
    with CI=true (CI must run it) and is skipped otherwise, saying how to install."""
    path = shutil.which(name)
    if path is None:
        message = (
            f"{name} not on PATH: install Debian's prometheus package "
            "(apt-get install -y prometheus, or scripts/setup.sh --with-test-services)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path
