#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU (no network needed beyond the
# package registries): the side-by-side comparison with stock vLLM
# (benchmarks.compare_stock: scheduler step, throughput, isolation, parked CPU,
# smoothness, limiter) and the article's measurement, with async scheduling on
# and off, speculative decoding with async scheduling, and prompt budgets'
# flood (a second user's stream beside a flood of distinct long prompts,
# unlimited vs held to 1,000 prompt tok/s) and classes of service end to end
# (ceilings, bands), on the locally generated tiny model. Installs the GPU
# wheel (vllm 0.32.x) in .venv-gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
VENV=.venv-gpu
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e ".[gpu,dev]"
out=${OUT:-/tmp/output-rate-gpu}
mkdir -p "$out"
# Scheduler rules on the real Scheduler / AsyncScheduler of the GPU wheel's vLLM:
# the thin class, each concern module, and what upstream.py relies on.
"$VENV/bin/python" -m pytest -q tests/scheduling/test_scheduler*.py \
  tests/scheduling/test_scheduling_*.py tests/core/test_limiter.py
for mode in async sync; do
  flag=--async-scheduling; [[ $mode == sync ]] && flag=--no-async-scheduling
  "$VENV/bin/python" -m benchmarks.compare_stock "$flag" \
    --json "$out/compare-$mode.json" | tee "$out/compare-$mode.txt"
  "$VENV/bin/python" -m benchmarks.article_measurement \
    --server-arg="$flag" --json "$out/article-$mode.json" | tee "$out/article-$mode.txt"
done
# Speculative decoding with async scheduling (vLLM runs draft-model drafting
# async on GPUs only): pacing end to end, and paced untriggered vs stock.
# Compiled, as served on GPUs (the suite's servers otherwise run eager).
OUTPUT_RATE_EAGER_SERVERS=0 "$VENV/bin/python" -m pytest -q tests/e2e/test_e2e_spec_decode.py
"$VENV/bin/python" -m benchmarks.compare_stock --async-scheduling --only throughput \
  --speculative draft_model --throughput-runs 5 --json "$out/compare-spec.json" \
  | tee "$out/compare-spec.txt"
# Prompt budgets (issue 41): user s streams 4 x 450 tokens beside user p's
# flood of distinct ~400-token prompts (max_tokens 1, 8 at a time, cancelled
# when s is done), s alone, beside p unlimited and beside p at 1,000 prompt
# tok/s (benchmarks.prompt_budgets part 3: one server, about a minute).
"$VENV/bin/python" -m benchmarks.prompt_budgets --only flood --flood-cycles 3 \
  --json "$out/prompt-flood.json" | tee "$out/prompt-flood.txt"
# Classes of service (issue 42): a ceiling borrowed alone and given back to
# 12 saturating streams, an interactive band ahead of a saturated batch band,
# on four slots (async scheduling: the GPU wheel's default).
OUTPUT_RATE_EAGER_SERVERS=0 "$VENV/bin/python" -m pytest -q -s \
  tests/e2e/test_e2e_classes_of_service.py | tee "$out/classes-of-service.txt"
# The async runs must have used the async variant of the scheduler.
python3 -c "import json,sys; a=json.load(open('$out/article-async.json'))['scheduler']; \
c=json.load(open('$out/compare-async.json'))['schedulers']['paced']; \
sys.exit(0 if a==c=='OutputRateAsyncScheduler' else f'async runs used {a}, {c}')"
