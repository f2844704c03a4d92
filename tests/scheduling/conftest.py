"""vLLM's serve parser with the plugin's flags (tests/serve_parser_harness.py),
registered by name for the adapter's tests. Its autouse fixture
(``default_control_port_taken_or_not``) stays registered in each module that
wants it."""

from __future__ import annotations

from tests import serve_parser_harness

serve_parser = serve_parser_harness.serve_parser
