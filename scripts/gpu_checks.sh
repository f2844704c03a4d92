#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU (no network needed beyond the
# package registries): async scheduling end to end and the article's
# measurement, with async scheduling on and off, on the locally generated tiny
# model. Installs the GPU wheel (vllm 0.32.x) in .venv-gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
VENV=.venv-gpu
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e ".[gpu,dev]"
out=${OUT:-/tmp/output-rate-gpu}
mkdir -p "$out"
# Scheduler rules on the real AsyncScheduler (GPU wheel's vLLM).
"$VENV/bin/python" -m pytest -q tests/test_scheduler.py tests/test_limiter.py
for mode in async sync; do
  flag=--async-scheduling; [[ $mode == sync ]] && flag=--no-async-scheduling
  "$VENV/bin/python" -m benchmarks.article_measurement --compare-upstream \
    --server-arg="$flag" --json "$out/article-$mode.json" | tee "$out/article-$mode.txt"
done
# The async run must have used the async variant of the scheduler.
python3 -c "import json,sys; r=json.load(open('$out/article-async.json')); \
sys.exit(0 if r['scheduler']=='OutputRateAsyncScheduler' else 'async run used '+r['scheduler'])"
