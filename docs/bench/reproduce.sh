#!/usr/bin/env bash
# The CPU tables and plots of docs/benchmarks.md: the projections, tune, simulator,
# timeline, sweeps and concurrency benches (the runtime and GPU ones, and the adaptive
# width's rotated runs, have their own commands there).  CPU,
# 1 torch thread per job, niced: the development machine has 2 cores shared with
# other jobs, so the two independent chains below run side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
TP="nice -n 10 .venv/bin/treepipe"

chain_a() {  # tune -> bench at the chosen (w, k) -> simulator check -> timeline
  $TP tune --model smollm2-135m --stages 4 --draft hybrid --widths 1,2,4,8,16,32 --topks 4,8 \
    --prompts humaneval:4 --verify-prompts humaneval:4-8 --max-new-tokens 24 --threads 1 \
    --out docs/bench/tune
  W=$(.venv/bin/python -c "import json;print(json.load(open('docs/bench/tune/tune.json'))['choice']['w'])")
  K=$(.venv/bin/python -c "import json;print(json.load(open('docs/bench/tune/tune.json'))['choice']['k'])")
  $TP bench --model smollm2-135m --stages 4 --sources ngram,hybrid --width "$W" --topk "$K" \
    --prompts humaneval:4 --max-new-tokens 32 --threads 1 --records \
    --tune docs/bench/tune/tune.json --out docs/bench/methods
  $TP simulate docs/bench/methods/records.json --out docs/bench/simulate
  $TP timeline --records docs/bench/methods/records.json --method specpipe --source hybrid \
    --prompt-index 0 --out docs/bench/timeline
}

chain_b() {  # the figure sweeps
  $TP sweep topk --model smollm2-135m --prompts humaneval:4 --max-new-tokens 32 \
    --drafts layers:2,layers:4,layers:8,layers:15,layers:22,layers:29,ngram,hybrid --threads 1 --out docs/bench/sweeps
  $TP sweep layer-time --model smollm2-135m --context 2048 --threads 1 --clock cpu \
    --out docs/bench/sweeps
  $TP sweep width --model smollm2-135m --stages 4 --draft hybrid --prompts humaneval:2 \
    --max-new-tokens 16 --threads 1 --out docs/bench/sweeps
}

$TP project --out docs/bench/project
$TP project --calibrate l40 --out docs/bench/project-l40
$TP project --batch 1,2,4,8,16,32 --out docs/bench/project-batch
chain_a > "${TMPDIR:-/tmp}/treepipe-chain_a.log" 2>&1 &
chain_b > "${TMPDIR:-/tmp}/treepipe-chain_b.log" 2>&1 &
wait

# Under load (SpecPipe-DB): timed rows compared with each other, so run alone, after the
# chains above, on an otherwise idle machine.
$TP bench --model smollm2-135m --stages 4 --methods pp,specinfer,specpipe --sources ngram \
  --prompts humaneval:8 --max-new-tokens 32 --threads 1 --width 8 --topk 8 \
  --concurrency 1,2,4,8 --widths 1,2,4,8,adaptive --repeats 2 --out docs/bench/concurrency
$TP bench --model smollm2-135m --stages 4 --methods specpipe --sources replay:0.6-0.95:40 \
  --prompts humaneval:8 --max-new-tokens 32 --threads 1 --width 8 --topk 8 \
  --concurrency 1,2,4,8 --widths 1,2,4,8,adaptive --repeats 3 --out docs/bench/concurrency-replay
$TP bench --model smollm2-135m --stages 4 --methods specpipe --sources ngram \
  --prompts humaneval:16 --max-new-tokens 16 --threads 1 --width 4 --topk 4 \
  --concurrency 16 --widths 4 --no-warmup --out docs/bench/kv16
