"""``treepipe chaos``: the argv side of the kill-and-check series (orchestrator/deploy/chaos.py)."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import fraction, options, positive_int, positive_seconds, seed
from orchestrator.deploy.chaos import KINDS, ChaosOptions, chaos_series


def cmd_chaos(a: argparse.Namespace) -> int:
    """``treepipe chaos -f MANIFEST``: up, the seeded series with kills, down."""
    return chaos_series(options(ChaosOptions, a))


def add_chaos_parser(sub: Any) -> None:
    """Register ``treepipe chaos``."""
    c = sub.add_parser("chaos", help=COMMANDS["chaos"])
    c.add_argument("-f", "--file", required=True, type=str,
                   help="TreePipeline manifest (backend local)")
    c.add_argument("--requests", type=positive_int, default=12)
    c.add_argument("--seed", type=seed, default=0)
    c.add_argument("--kill-prob", type=fraction(), default=0.75,
                   help="probability that a request sees a kill (default 0.75)")
    c.add_argument("--kinds", default=",".join(KINDS),
                   help=f"processes to kill, comma list (default {','.join(KINDS)})")
    c.add_argument("--max-new-tokens", type=positive_int, default=48)
    c.add_argument("--deadline", type=positive_seconds, default=120.0,
                   help="seconds each request may take before its client gives up")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_chaos)
