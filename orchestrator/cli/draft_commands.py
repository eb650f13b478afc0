"""``treepipe draft distill``, ``eval``, ``vocab`` and ``recovery``: argument parsing only."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.cli.flags import (
    count,
    finite,
    fraction,
    int_list,
    options,
    out_file,
    out_folder,
    positive_int,
    positive_int_list,
    recovery_list,
    resolve_exit,
    seed,
    shown,
)
from orchestrator.cli.lab_flags import prompts_spec
from orchestrator.lab.drafting.distill import DistillOptions, default_drafts_dir, distill
from orchestrator.lab.drafting.draft_eval import DraftEvalOptions, evaluate_draft
from orchestrator.lab.drafting.vocab import DraftVocabOptions, write_draft_vocab
from orchestrator.lab.recovery.measure import HELDOUT, RecoveryOptions, measure_recovery
from orchestrator.models.loading import DEFAULT_HYBRID_DRAFT
from protocol.config.recovery import NO_RECOVERY, Recovery, parse_recovery


def add_draft_training_parsers(dsub: Any) -> None:
    """Register ``distill``, ``eval`` and ``vocab`` under the ``treepipe draft`` group."""

    d = dsub.add_parser(
        "distill", help="train a draft (or early-exit adapter) for a target by distillation",
        description="Build teacher data offline (the target's continuations of prompts cut "
                    "from installed packages' sources, and plain windows of those files), then "
                    "train a draft cut from the target on the target's top-k distribution. "
                    "Resumable: rerun with the same --out to continue.")
    d.add_argument("--target", default="smollm2-135m", help="target model name or folder")
    d.add_argument("--out", type=out_folder, default=default_drafts_dir() / "smollm2-135m-l6",
                   help="output folder: a checkpoint --draft accepts (default %(default)s)")
    d.add_argument("--layers", type=positive_int, default=6,
                   help="draft layers, initialised from the target's first N (default 6)")
    d.add_argument("--early-exit", type=positive_int, default=None, metavar="L",
                   help="train a Mirror-SD early-exit adapter on layer L's hidden state instead")
    d.add_argument("--minutes", type=finite(0, 1e7, lo_open=True), default=None,
                   help="wall-clock budget for this run, data included (default: no limit)")
    d.add_argument("--steps", type=positive_int, default=240,
                   help="training steps in all (LR schedule horizon, default 240)")
    d.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step")
    d.add_argument("--lr", type=finite(0, 10, lo_open=True), default=8e-4)
    d.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast for training (fp32 master weights)")
    d.add_argument("--ckpt-every", type=positive_int, default=25, help="checkpoint every N steps")
    d.add_argument("--snapshot-every", type=count(0), default=50,
                   help="keep a copy in OUT/steps/ every N steps, for learning curves (0: off)")
    d.add_argument("--data", type=Path, default=None,
                   help="teacher-data folder to build or reuse (default OUT/data)")
    d.add_argument("--data-share", type=fraction(), default=0.35,
                   help="share of --minutes the data phase may use (default 0.35)")
    d.add_argument("--seq-len", type=positive_int, default=192)
    d.add_argument("--gen-prompt-len", type=positive_int, default=96)
    d.add_argument("--gen-sequences", type=count(0), default=160,
                   help="target continuations to generate (default 160)")
    d.add_argument("--corpus-sequences", type=count(0), default=1024,
                   help="plain text windows to label (default 1024)")
    d.add_argument("--teacher-topk", type=positive_int, default=32,
                   help="target top-k kept per token (default 32)")
    d.add_argument("--device", default="cpu", help="cpu or cuda")
    d.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (default 2)")
    d.add_argument("--seed", type=seed, default=0)
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=_distill)

    e = dsub.add_parser(
        "eval", help="top-k hit ratios and level hit rate of a draft against the target",
        description="Greedy-decode the target on held-out prompts, then measure how often the "
                    "draft's top-k holds the target's next token (SpecPipe Fig. 7) and the "
                    "level hit rate P(w) of a SpecPipe tree (width w, top-k per node, m stages) "
                    "grown by the draft along the target's output.")
    e.add_argument("--target", default="smollm2-135m", help="target model name or folder")
    e.add_argument("--draft", required=True,
                   help="ngram, hybrid, layers:N, a distilled draft or adapter folder")
    e.add_argument("--draft-model", default="layers:4", help="draft used by --draft hybrid")
    e.add_argument("--draft-vocab", default="", metavar="FILE[:K]",
                   help="also evaluate the draft with its LM head reduced to FILE's first K ids "
                        "(`treepipe draft vocab`): hit rates and draft time side by side")
    e.add_argument("--prompts", type=prompts_spec, default="humaneval:16",
                   help="humaneval:N (first N problems) or a JSONL file (default humaneval:16)")
    e.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template")
    e.add_argument("--max-new-tokens", type=positive_int, default=64)
    e.add_argument("--width", type=positive_int_list, default=[16],
                   help="tree width(s) w, comma list")
    e.add_argument("--topk", type=positive_int_list, default=[8], help="top-k per node, comma list")
    e.add_argument("--stages", type=positive_int, default=4,
                   help="pipeline stages m (the tree depth the level is chosen at)")
    e.add_argument("--recovery", type=recovery_list, default=[NO_RECOVERY],
                   metavar="none|draft:K,...",
                   help="miss recovery setting(s) to replay, comma list (default none; "
                        "early-exit needs the target: treepipe bench --recovery)")
    e.add_argument("--ks", type=positive_int_list, default=[1, 2, 4, 8, 16, 32, 64],
                   help="k values of the top-k hit ratio (default 1,2,4,8,16,32,64)")
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    e.add_argument("--cache", type=Path, default=None,
                   help="file caching the target's greedy continuations (default: under the "
                        "treepipe cache)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_eval)
    _add_vocab_parser(dsub)
    _add_recovery_parser(dsub)


def _add_recovery_parser(dsub: Any) -> None:
    """Register ``treepipe draft recovery`` (docs/bench/recovery.md)."""
    r = dsub.add_parser(
        "recovery", help="project SpecPipe miss recovery from early exits (issue 40's measure)",
        description="Replay SpecPipe against the target's greedy tokens, read each early "
                    "exit's top-kappa at every verified token's parent, and project how many "
                    "misses a correction branch would catch and the steps per token with "
                    "re-rooting (docs/bench/recovery.md).")
    r.add_argument("--target", default="smollm2-135m", help="target model name or folder")
    r.add_argument("--prompts", type=prompts_spec, default=None,
                   help=f"humaneval:N or a JSONL file (default: the held-out set, {HELDOUT} "
                        "of the treepipe source tree)")
    r.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template")
    r.add_argument("--max-new-tokens", type=positive_int, default=64)
    r.add_argument("--sources", default="ngram,hybrid", help="token sources, comma list")
    r.add_argument("--draft-model", default=DEFAULT_HYBRID_DRAFT,
                   help="draft used by the hybrid source")
    r.add_argument("--stages", type=positive_int_list, default=[4, 8],
                   help="pipeline stage counts m, comma list (default 4,8)")
    r.add_argument("--width", type=positive_int, default=16, help="tree width w (node budget)")
    r.add_argument("--topk", type=positive_int, default=8, help="top-k per node")
    r.add_argument("--kappas", type=positive_int_list, default=[1, 2, 4, 8],
                   help="exit top-kappa values, comma list (default 1,2,4,8)")
    r.add_argument("--lags", type=int_list(0), default=[0, 1],
                   help="steps between an exit and its corrections entering stage 1, comma "
                        "list (default 0,1)")
    r.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    r.add_argument("--normal-widths", type=positive_int_list, default=[],
                   help="also replay at these narrower widths, corrections filling the rest "
                        "of --width's budget")
    r.add_argument("--traces", type=Path, default=None,
                   help="keep replays here and reuse them (projections without replaying)")
    r.add_argument("--json", type=Path, default=None, help="write every row here")
    r.add_argument("--print", type=Path, default=None, dest="print_json",
                   help="print the tables of a --json report and stop")
    r.add_argument("--heads", type=exit_heads, default=(), metavar="HEAD,...",
                   help=f"compare these early-exit heads, comma list: {HEADS} (as after "
                        "--recovery early-exit:J:K+); default: the plain exit with any "
                        "cached adapter")
    r.add_argument("--exit-layers", type=positive_int_list, default=[], metavar="L,...",
                   help="more exit layers for the agreement table (e.g. 8,15,23)")
    r.add_argument("--no-replay", action="store_true",
                   help="agreement (and --cost-layers) only: no replay, no projection")
    r.add_argument("--cost-layers", type=positive_int_list, default=[], metavar="L,...",
                   help="time each head's top-8 on 1 and 16 nodes at these exit layers")
    r.set_defaults(func=_recovery)


def _add_vocab_parser(dsub: Any) -> None:
    """Register ``treepipe draft vocab``."""
    v = dsub.add_parser(
        "vocab", help="most frequent target output tokens: a reduced draft vocabulary",
        description="Run the target greedily on prompts, count its output tokens (and prompt "
                    "tokens unless --no-count-prompts) and write the --size most frequent "
                    "ids, most frequent first, as JSON for --draft-vocab FILE[:K].")
    v.add_argument("--model", default="smollm2-135m", help="target model name or folder")
    v.add_argument("--prompts", type=prompts_spec, default="humaneval:16-80",
                   help="humaneval:N, humaneval:A-B or a JSONL file (default humaneval:16-80, "
                        "disjoint from draft eval's default humaneval:16)")
    v.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template")
    v.add_argument("--max-new-tokens", type=positive_int, default=64)
    v.add_argument("--size", type=positive_int, default=8192,
                   help="ids to write, most frequent first (default 8192)")
    v.add_argument("--count-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="count prompt tokens as well as output tokens (default on)")
    v.add_argument("--out", type=out_file, required=True, help="JSON file to write")
    v.add_argument("--dtype", default="float32", help="target dtype (default float32)")
    v.add_argument("--device", default="cpu", help="cpu or cuda")
    v.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=_vocab)


def _distill(a: argparse.Namespace) -> int:
    return distill(options(DistillOptions, a))


def _eval(a: argparse.Namespace) -> int:
    return evaluate_draft(options(DraftEvalOptions, a))


def _vocab(a: argparse.Namespace) -> int:
    return write_draft_vocab(options(DraftVocabOptions, a))


HEADS = "full, vocab=FILE[:N], draft, adapter=PATH|auto, or several joined by +"


def exit_heads(text: str) -> tuple[Recovery, ...]:
    """argparse type: ``full,vocab=FILE:N,adapter=auto+vocab=FILE:N`` -> early-exit
    settings (``--recovery early-exit:1:8+HEAD``), their files read."""
    heads = []
    for h in text.split(","):
        # the errors name the setting built here, which the user never wrote: keep only
        # what is wrong with the head (and, for its spelling, say what a head is)
        try:
            head = parse_recovery("early-exit:1:8" + ("" if h == "full" else "+" + h))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"head {shown(h)}: {str(e).split(': ', 1)[-1]}; "
                                             f"a head is {HEADS}") from None
        try:
            heads.append(resolve_exit(head))  # its vocabulary file and adapter, read
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"head {shown(h)}: {str(e).split(': ', 1)[-1]}"
                                             ) from None
    return tuple(heads)


def _recovery(a: argparse.Namespace) -> int:
    return measure_recovery(options(RecoveryOptions, a))


__all__ = ["add_draft_training_parsers"]
