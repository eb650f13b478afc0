"""``treepipe tune``: the argv side of choosing w and k (orchestrator/lab/benchmarks/tune.py)."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import options
from orchestrator.cli.lab_flags import prompts_spec
from orchestrator.cli.sweep_commands import add_run_flags
from orchestrator.lab.benchmarks.tune import DEFAULT_TOPKS, DEFAULT_WIDTHS, TuneOptions, tune


def add_tune_parser(subparsers: Any) -> None:
    """Register ``treepipe tune``."""

    t = subparsers.add_parser(
        "tune", help=COMMANDS["tune"],
        description="Measure t_i(w) and P(w, k) on this hardware with this draft, predict "
                    "TBT with Eq. (1) for every candidate and report the best (w, k); "
                    "--verify runs it on held-out prompts.")
    add_run_flags(t, "humaneval:4", 32)
    t.add_argument("--widths", default=DEFAULT_WIDTHS,
                   help=f"candidates (default {DEFAULT_WIDTHS})")
    t.add_argument("--topks", default=DEFAULT_TOPKS, help=f"candidates (default {DEFAULT_TOPKS})")
    t.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="also run every candidate on --verify-prompts, interleaved, and "
                        "check the choice's prediction there (default on)")
    t.add_argument("--verify-prompts", type=prompts_spec, default="humaneval:4-8",
                   help="held-out prompts for --verify (default humaneval:4-8)")
    t.set_defaults(func=cmd_tune)


def cmd_tune(a: argparse.Namespace) -> int:
    """``treepipe tune``: measure, predict, choose and (optionally) verify."""
    return tune(options(TuneOptions, a))
