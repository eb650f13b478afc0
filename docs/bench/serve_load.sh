#!/usr/bin/env bash
# vllm bench serve-style load against `treepipe serve`: pp (--draft none), then specpipe
# (--draft ngram), each at 1, 4 and 8 concurrent clients (docs/benchmarks.md, "Serving
# load").  Each server starts on a free port, is probed until /health answers, gets
# `treepipe bench-serve` and is stopped with SIGTERM (as Ctrl-C: serve takes everything down).
# Writes $OUT_DIR/{pp,specpipe}.json and .md and prints both tables at the end; the
# servers' logs stay in treepipe's run folders serveload-pp and serveload-specpipe.
# The default workload (16 prompts, 64 in, 64 out) takes a few minutes on a 2-core CPU;
# scale it with the variables below, e.g.
#   SERVE_LOAD_PROMPTS=64 SERVE_LOAD_OUTPUT_LEN=128 docs/bench/serve_load.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${SERVE_LOAD_MODEL:-smollm2-135m}
STAGES=${SERVE_LOAD_STAGES:-2}
PROMPTS=${SERVE_LOAD_PROMPTS:-16}
INPUT_LEN=${SERVE_LOAD_INPUT_LEN:-64}
OUTPUT_LEN=${SERVE_LOAD_OUTPUT_LEN:-64}
LEVELS=${SERVE_LOAD_CONCURRENCY:-1,4,8}
VOCAB=${SERVE_LOAD_VOCAB_SIZE:-49152}  # SmolLM2's; set it for another model
OUT_DIR=${SERVE_LOAD_OUT:-docs/bench/serve-load}
if [[ -x .venv/bin/treepipe ]]; then TP=${TREEPIPE:-.venv/bin/treepipe}; else TP=${TREEPIPE:-treepipe}; fi
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
# the server decodes as many requests together as the most clients, so none waits in its queue
MOST=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -1)
LOGS=${TMPDIR:-/tmp}/serve_load.$$
mkdir -p "$OUT_DIR" "$LOGS"
SERVE_PID=""

stop_server() {
  if [[ -n "$SERVE_PID" ]] && kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -TERM "$SERVE_PID"
    wait "$SERVE_PID" || true
  fi
  SERVE_PID=""
}
trap stop_server EXIT

# start `treepipe serve` with draft $2 as run $1; sets SERVE_PID and BASE (the API's URL)
start_server() {
  local label=$1 draft=$2 log="$LOGS/$1.log"
  $TP serve "$MODEL" --stages "$STAGES" --draft "$draft" --port 0 --grpc-port 0 \
    --concurrency "$MOST" --name "serveload-$label" >"$log" 2>"$LOGS/$label.err" &
  SERVE_PID=$!
  BASE=""
  for _ in $(seq 600); do  # up to 10 minutes: the first start measures kernels
    BASE=$(sed -n 's/^OpenAI API: \([^ ]*\).*/\1/p' "$log")
    [[ -n "$BASE" ]] && break
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then
      echo "serve_load.sh: treepipe serve ($label) stopped:" >&2; cat "$LOGS/$label.err" >&2
      exit 1
    fi
    sleep 1
  done
  [[ -n "$BASE" ]] || { echo "serve_load.sh: treepipe serve ($label) did not come up" >&2; exit 1; }
  # /health answers 200 once Redis and every worker of the plan are up
  $PY - "${BASE%/v1}/health" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"serve_load.sh: {sys.argv[1]} never answered 200")
PY
}

run() {  # one server: start, load, stop
  local label=$1 draft=$2
  start_server "$label" "$draft"
  echo "== $label: treepipe serve $MODEL --stages $STAGES --draft $draft at $BASE" >&2
  $TP bench-serve --base-url "$BASE" --num-prompts "$PROMPTS" --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" --vocab-size "$VOCAB" --max-concurrency "$LEVELS" \
    --label "$label" --out "$OUT_DIR/$label.json" | tee "$OUT_DIR/$label.md"
  stop_server
}

run pp none
run specpipe ngram
echo
echo "## $MODEL, $STAGES stages, $PROMPTS prompts, input $INPUT_LEN, output $OUTPUT_LEN ($(date -u +%F))"
echo
grep '^|' "$OUT_DIR/pp.md"
grep '^| specpipe ' "$OUT_DIR/specpipe.md"
rm -rf "$LOGS"
