"""The fixtures of the CLI tests (tests/cli_harness.py), registered by name for
the control plane's tests. A module that defines its own ``rig`` or ``served``
(the gRPC service's tests) overrides these."""

from __future__ import annotations

from tests import cli_harness

rig, served, ctl = cli_harness.rig, cli_harness.served, cli_harness.ctl
