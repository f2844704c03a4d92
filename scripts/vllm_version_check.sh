#!/usr/bin/env bash
# Scheduler-level tests against another vLLM release: vLLM's real Scheduler /
# AsyncScheduler, no server, no GPU needed.
#
#   scripts/vllm_version_check.sh VERSION     e.g. 0.33.0
#
# Creates .venv-vllm-VERSION (or $VLLM_CHECK_VENV), installs the GPU wheel of
# vLLM VERSION there (from $VLLM_WHEELS too, when set: a folder of downloaded
# wheels), then this package, and runs the scheduler-level tests. Where vLLM's
# full install does not resolve (0.34.0 pins a flashinfer-python release the
# registry lacks), vLLM goes in with --no-deps and each of its requirements that
# does resolve is installed on its own; those that do not are listed.
# Exit status: pytest's.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 VERSION" >&2; exit 2; }
version=$1
cd "$(dirname "$0")/.."
venv=${VLLM_CHECK_VENV:-.venv-vllm-$version}
python=${PYTHON:-python3.11}
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
[[ -n ${VLLM_WHEELS:-} ]] && pip+=(--find-links "$VLLM_WHEELS")

if ! "${pip[@]}" "vllm==$version"; then
  echo "== full install of vllm==$version failed; --no-deps route" >&2
  "${pip[@]}" --no-deps "vllm==$version"
  "${pip[@]}" packaging
  mapfile -t requirements < <("$venv/bin/python" - <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement

for line in requires("vllm") or ():
    requirement = Requirement(line)
    if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        requirement.marker = None
        print(requirement)
EOF
  )
  if ! "${pip[@]}" "${requirements[@]}"; then
    unresolved=()
    for requirement in "${requirements[@]}"; do
      "${pip[@]}" "$requirement" || unresolved+=("$requirement")
    done
    echo "== requirements of vllm==$version left out: ${unresolved[*]:-none}" >&2
  fi
fi
"${pip[@]}" -e ".[dev]"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/scheduling/test_scheduler*.py tests/scheduling/test_scheduling_*.py \
  tests/store/test_claims_scheduler.py
