#!/usr/bin/env bash
# The GPU-machine runs behind docs/benchmarks.md "GPU runs" (issue 13 item 5).
#   bash docs/bench/gpu/device_run.sh tests OUT      the engine's lossless tests on CUDA
#   bash docs/bench/gpu/device_run.sh gpu OUT        tests, then Figure 9 on 8B/70B layer
#                                                    shapes and the tree-kernel check
#   bash docs/bench/gpu/device_run.sh pipeline OUT   8 stages x 2 CPU threads, real processes
# Needs python3 with torch; the packages that machine lacks are installed from ./.whl
# (see the device tool's README) when that folder exists.
set -uo pipefail
mode=$1 out=$2
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
tp() { python3 -m orchestrator "$@"; }
cuda_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    | tee -a "$out/gpu.txt"
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
small-tests)  # the lossless tests besides the 512 cases of test_lossless_tiny.py
  TREEPIPE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --tb=short -k "not cli_refuses" tests/test_lossless_dtypes.py tests/test_tree_attention.py \
    tests/test_batch_lossless.py tests/test_replay.py > "$out/cuda_small_tests.log" 2>&1
  tail -n 3 "$out/cuda_small_tests.log"
  ;;
esac
