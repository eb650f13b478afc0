"""``treepipe runtime-bench``: the argv side of the runtime benchmarks
(orchestrator/lab/benchmarks/runtime_bench.py)."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    manifest_file,
    name_list,
    options,
    out_file,
    positive_int,
    positive_int_list,
)
from orchestrator.lab.benchmarks.runtime_bench import RuntimeBenchOptions, runtime_bench


def cmd_runtime_bench(a: argparse.Namespace) -> int:
    """``treepipe runtime-bench``: print Markdown tables and write JSON."""
    return runtime_bench(options(RuntimeBenchOptions, a))


def add_runtime_bench_parser(sub: Any) -> None:
    """Register ``treepipe runtime-bench``."""

    p = sub.add_parser("runtime-bench", help=COMMANDS["runtime-bench"])
    p.add_argument("--stages", type=positive_int, default=3,
                   help="stage processes in the synchroniser barrier (plus the draft)")
    p.add_argument("--steps", type=positive_int, default=2000,
                   help="barrier steps to time")
    p.add_argument("--messages", type=positive_int, default=1000,
                   help="link messages to time per transport and width")
    p.add_argument("--dim", type=positive_int, default=576, help="hidden size (SmolLM2: 576)")
    # the modes that run alone, and --tbt (which runs beside the default benchmarks only):
    # one at a time, as any two would have one silently win
    alone = p.add_mutually_exclusive_group()
    alone.add_argument("--hop-requests", type=positive_int, default=None, metavar="B",
                       help="only this: one link hop of B requests' hidden states, sent as a "
                            "frame per request and as one frame (zmq and grpc, secure)")
    p.add_argument("--hop-width", type=positive_int, default=16,
                   help="with --hop-requests: nodes per request")
    alone.add_argument("--tbt", type=manifest_file, default=None, metavar="MANIFEST",
                       help="also measure the wall TBT of treepipe up on this manifest")
    p.add_argument("--prompt", default="Write a Python function that returns the n-th "
                                       "Fibonacci number.",
                   help="chat prompt of the --tbt request")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens per request (--tbt, --batch, --overload, --long-join's "
                        "decoders)")
    alone.add_argument("--batch", type=manifest_file, default=None, metavar="MANIFEST",
                       help="only this: a pool of --requests requests through treepipe up on "
                            "MANIFEST at each --concurrency (wall-clock throughput and TBT)")
    alone.add_argument("--overload", type=manifest_file, default=None, metavar="MANIFEST",
                       help="only this: --clients callers at once through treepipe up on MANIFEST "
                            "(served, refused, health latency)")
    alone.add_argument("--long-join", type=manifest_file, default=None, metavar="MANIFEST",
                       help="only this: a --prompt-tokens prompt joins --requests decoding "
                            "requests through treepipe up on MANIFEST, at each --chunks prefill "
                            "chunk (the decoders' largest gap, the long request's TTFT)")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024,
                   help="with --long-join: tokens of each joining prompt")
    p.add_argument("--joiners", type=positive_int, default=1,
                   help="with --long-join: prompts that join at once (they share the prefill "
                        "chunk as a budget of rows a step)")
    p.add_argument("--chunks", type=positive_int_list, default=[64, 256, 4096],
                   metavar="C,C,...", help="with --long-join: limits.prefillChunk values to "
                                           "compare (one at or above --prompt-tokens: the "
                                           "whole prompt in one step)")
    p.add_argument("--clients", type=positive_int, default=150,
                   help="with --overload: callers at once")
    p.add_argument("--requests", type=positive_int, default=8,
                   help="with --batch: requests in the pool, each a different prompt; "
                        "with --long-join: the decoding requests")
    p.add_argument("--concurrency", type=positive_int_list, default=None, metavar="B,B,...",
                   help="with --batch: requests in flight at once (default 1 and --requests)")
    p.add_argument("--sources", type=name_list, default=None, metavar="SRC,SRC,...",
                   help="with --batch: draft sources to compare, e.g. none,ngram (none: pp; "
                        "default the manifest's)")
    p.add_argument("--widths", type=name_list, default=None, metavar="W,W,...",
                   help="with --batch: tree widths to compare, fixed or adaptive[:CAP] (up to "
                        "the manifest's width), e.g. 2,16,adaptive (default the manifest's)")
    p.add_argument("--out", type=out_file, default=None, help="write the JSON report here")
    p.set_defaults(func=cmd_runtime_bench)
