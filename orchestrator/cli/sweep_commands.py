"""``treepipe sweep width|topk|layer-time``: the argv side of the sweeps
(orchestrator/lab/benchmarks/sweeps.py)."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    add_engine_flags,
    add_execution_flags,
    options,
    out_folder,
    positive_int,
)
from orchestrator.cli.lab_flags import prompts_spec
from orchestrator.lab.benchmarks.sweeps import (
    DEFAULT_LAYER_TOKENS,
    DEFAULT_TOPKS,
    DEFAULT_WIDTHS,
    LayerTimeOptions,
    TopkSweepOptions,
    WidthSweepOptions,
    sweep_layer_time,
    sweep_topk,
    sweep_width,
)
from orchestrator.models.architectures import KNOWN_ARCHITECTURES
from stages.model.execution_modes import DEFAULT_DTYPE


def add_run_flags(p: argparse.ArgumentParser, prompts: str, tokens: int) -> None:
    """The engine flags and the prompts, tokens, threads and output of a measured run."""

    add_engine_flags(p)
    p.add_argument("--prompts", type=prompts_spec, default=prompts,
                   help=f"humaneval:N, humaneval:A-B or a JSONL file (default {prompts})")
    p.add_argument("--max-new-tokens", type=positive_int, default=tokens)
    p.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=out_folder, required=True, help="folder for the JSON and PNG")


def add_sweep_parser(subparsers: Any) -> None:
    """Register ``treepipe sweep width|topk|layer-time``."""

    sw = subparsers.add_parser("sweep", help=COMMANDS["sweep"])
    ssub = sw.add_subparsers(dest="sweep_command", required=True)

    w = ssub.add_parser("width", help="SpecPipe TBT and accuracy over w × k (Figure 10)")
    add_run_flags(w, "humaneval:2", 24)
    w.add_argument("--widths", default=DEFAULT_WIDTHS, help=f"default {DEFAULT_WIDTHS}")
    w.add_argument("--topks", default=DEFAULT_TOPKS, help=f"default {DEFAULT_TOPKS}")
    w.set_defaults(func=cmd_sweep_width)

    t = ssub.add_parser("topk", help="top-k hit ratio of token sources (Figure 7)")
    add_run_flags(t, "humaneval:4", 64)
    t.add_argument("--drafts", default="layers:2,layers:4,layers:8,layers:15,ngram",
                   help="comma list of token sources to compare")
    t.add_argument("--ks", default="1,2,4,8,16,32", help="k values (default 1,2,4,8,16,32)")
    t.set_defaults(func=cmd_sweep_topk)

    lt = ssub.add_parser("layer-time", help="layer time against tokens per step (Figure 9)")
    lt.add_argument("--model", default="smollm2-135m")
    lt.add_argument("--shape", default=None, choices=sorted(KNOWN_ARCHITECTURES),
                    help="time one random-weight layer of this known shape instead of "
                         "--model's (e.g. llama-3.1-70b on a GPU)")
    lt.add_argument("--dtype", default=DEFAULT_DTYPE,
                    help="auto (default): bfloat16 on a GPU and on a CPU with bf16 units, "
                         "float32 on other CPUs")
    lt.add_argument("--device", default="cpu", help="cpu or cuda")
    lt.add_argument("--tokens", default=DEFAULT_LAYER_TOKENS, help="token counts to time")
    lt.add_argument("--context", type=positive_int, default=2048,
                    help="committed context length (Figure 9 uses 2048)")
    lt.add_argument("--repeats", type=positive_int, default=20)
    lt.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    lt.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this thread's CPU time (needs --threads 1 on cpu; "
                         "leaves out time other processes took on a shared machine)")
    lt.add_argument("--layers", type=positive_int, default=1,
                    help="time this many consecutive layers and report per layer: on a CPU "
                         "one layer's weights stay in cache between repeats, a stage's do not")
    add_execution_flags(lt)
    lt.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="with --execution compiled on a GPU: compiled layers alone, without "
                         "replaying each step as a CUDA graph (to see what each part gives)")
    lt.add_argument("--out", type=out_folder, required=True, help="folder for the JSON and PNG")
    lt.set_defaults(func=cmd_sweep_layer_time)


def cmd_sweep_width(a: argparse.Namespace) -> int:
    """``treepipe sweep width``: TBT and accuracy over w × k (Figure 10)."""
    return sweep_width(options(WidthSweepOptions, a))


def cmd_sweep_topk(a: argparse.Namespace) -> int:
    """``treepipe sweep topk``: token sources' top-k hit ratio (Figure 7)."""
    return sweep_topk(options(TopkSweepOptions, a))


def cmd_sweep_layer_time(a: argparse.Namespace) -> int:
    """``treepipe sweep layer-time``: one layer's time against tokens per step (Figure 9)."""
    return sweep_layer_time(options(LayerTimeOptions, a))
