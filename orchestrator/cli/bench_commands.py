"""``treepipe bench``: the argv side of the benchmark (orchestrator/lab/benchmarks/bench.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    add_engine_flags,
    int_range,
    options,
    out_folder,
    positive_int,
    positive_int_list,
)
from orchestrator.cli.lab_flags import prompts_spec
from orchestrator.lab.benchmarks.bench import DEFAULT_METHODS, DEFAULT_SOURCES, BenchOptions, bench
from stages.speculation.batch import DEFAULT_PREFILL_CHUNK


def add_bench_parser(subparsers: Any) -> None:
    """Register the ``bench`` subcommand (engine flags plus benchmark flags)."""

    b = subparsers.add_parser(
        "bench", help=COMMANDS["bench"],
        description="Run every (method, source) row on the same prompts, interleaved per "
                    "prompt, and report tokens/step, hit rate, TBT and the Eq. (2) "
                    "prediction.  --draft is ignored: --sources names the token sources.")
    add_engine_flags(b)
    b.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma list of methods (default {DEFAULT_METHODS})")
    b.add_argument("--sources", default=DEFAULT_SOURCES,
                   help="comma list of token sources for specinfer/specpipe: ngram, hybrid, "
                        "layers:N, a draft model path, or replay:P / replay:P-Q "
                        "(benchmarks only: the target's own output, hit with probability P, "
                        f"or P rising toward Q with the width) (default "
                        f"{DEFAULT_SOURCES})")
    b.add_argument("--prompts", type=prompts_spec, default="humaneval:8",
                   help="humaneval:N (first N HumanEval problems) or a JSONL file with a "
                        "'prompt' or 'messages' field per line (default humaneval:8)")
    b.add_argument("--max-new-tokens", type=positive_int, default=64)
    b.add_argument("--chat", action="store_true",
                   help="wrap plain prompts in the model's chat template")
    b.add_argument("--stop-at-eos", dest="ignore_eos", action="store_false",
                   help="stop at end-of-sequence (default: ignore it, so every run produces "
                        "--max-new-tokens tokens)")
    b.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's current setting)")
    b.add_argument("--hf", action="store_true",
                   help="also time Hugging Face transformers greedy generate on the same "
                        "model folder and compare its tokens with ar's")
    b.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed generation per row before timing (default on)")
    b.add_argument("--out", type=out_folder, default=None,
                   help="folder to write bench.json and bench.md into")
    b.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    b.add_argument("--records", action="store_true",
                   help="also write OUT/records.json: every run's per-step records, for "
                        "treepipe simulate and treepipe timeline (needs --out)")
    b.add_argument("--tune", type=Path, default=None,
                   help="a tune.json from treepipe tune: show its predicted TBT for this "
                        "(w, k) beside the measured one")
    b.add_argument("--concurrency", type=positive_int_list, default=None,
                   help="multi-request mode (SpecPipe-DB): comma list of batch sizes B, e.g. "
                        "1,2,4,8; the prompts form a pool and a new request starts whenever "
                        "fewer than B run. Rows ar, pp, specinfer and specpipe (plus "
                        "specpipe-serial: one request in flight at a time); reports "
                        "throughput and mean/p99 TBT in pipelined (modelled) time")
    b.add_argument("--widths", default=None,
                   help="with --concurrency: comma list of tree-width policies for the "
                        "specpipe rows, side by side: fixed widths and adaptive (each "
                        "request's width chosen every step, up to --width) or adaptive:CAP, "
                        "e.g. 1,2,4,adaptive (default: --width)")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="with --concurrency: run every (row, B) this many times, interleaved, "
                        "and report the run of median throughput (default %(default)s)")
    b.add_argument("--lengths", type=int_range, default=None, metavar="LOW-HIGH",
                   help="with --concurrency: each request asks for its own number of new "
                        "tokens, spread evenly over LOW..HIGH in a fixed shuffled order, so "
                        "requests end at different steps as in real traffic (default: "
                        "every request --max-new-tokens)")
    b.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help="with --concurrency: prompt tokens entering stage 1 per step over all "
                        "joining requests (pp, specpipe; default %(default)s)")
    b.add_argument("--runtime", action="store_true",
                   help="also run the pp and specpipe rows through real local pipelines "
                        "(one process per stage and the draft, Redis, the gateway; one "
                        "thread each), interleaved per prompt, and report their wall-clock "
                        "TBT beside the engine's pipelined TBT with where the time goes")
    b.add_argument("--transport", default="zmq", choices=("zmq", "grpc"),
                   help="link transport of the --runtime pipelines (default zmq)")
    b.set_defaults(func=cmd_bench)


def cmd_bench(a: argparse.Namespace) -> int:
    """``treepipe bench``: every row on the same prompts; a report on stdout."""
    return bench(options(BenchOptions, a))
