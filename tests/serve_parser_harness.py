"""The fixtures of the tests that parse our flags through vLLM's own serve
parser (tests/scheduling/test_settings_cli*.py): the parser, with the plugin's
flags, and the control plane's default port left out of the start-up checks.

A folder's conftest.py or a test module registers the fixtures by naming them
(``serve_parser = serve_parser_harness.serve_parser``; tests/scheduling/conftest.py
does for the adapter's tests); the autouse one is registered per module.
"""

from __future__ import annotations

import pytest
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext.plugin import register

register()


@pytest.fixture(scope="module")
def serve_parser() -> FlexibleArgumentParser:
    """vLLM's own serve parser, with our plugin's flags."""
    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(autouse=True)
def default_control_port_taken_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing the flags runs the start-up checks, which bind the control
    plane's address: with the default one (127.0.0.1:50151) these tests would
    fail whenever a server on the same machine holds it. What they test is
    parsing; the port check has its own test (test_startup_checks)."""
    monkeypatch.setattr("control.preflight.check_port_free", lambda address: None)
