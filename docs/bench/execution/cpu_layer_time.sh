#!/usr/bin/env bash
# Step time of SmolLM2-135M layers against the memory floor on this CPU, per execution mode
# and dtype (docs/benchmarks.md, "Execution: step time against the memory floor").
#   bash docs/bench/execution/cpu_layer_time.sh [OUT]   (default: docs/bench/execution)
# Eight consecutive layers, so the weights stream from memory as in a stage's step; one
# thread, this thread's CPU time (the machine may be shared).
set -euo pipefail
out=${1:-docs/bench/execution}
for run in "float32 eager" "float32 tuned" "float32 compiled" "bfloat16 tuned"; do
  set -- $run
  treepipe sweep layer-time --model smollm2-135m --layers 8 --tokens 1,4,16,64 \
    --context 512 --threads 1 --clock cpu --repeats 10 --dtype "$1" --execution "$2" \
    --out "$out/cpu-$1-$2"
done
