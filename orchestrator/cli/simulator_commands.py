"""``treepipe simulate`` and ``treepipe project``: the argv side of the simulator
(orchestrator/lab/benchmarks/simulator.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import count, fraction, options, out_folder, seed
from orchestrator.lab.benchmarks.recovery_projection import (
    RECOVERY_TOKENS,
    project_paper_recovery,
)
from orchestrator.lab.benchmarks.simulator import (
    BATCH_TOKENS,
    PaperSetting,
    ProjectOptions,
    SimulateOptions,
    project_paper,
    simulate_records,
)


def add_simulator_parsers(subparsers: Any) -> None:
    """Register ``treepipe simulate`` (validation on records) and ``treepipe project``."""
    s = subparsers.add_parser(
        "simulate", help=COMMANDS["simulate"],
        description="Fit a per-stage time profile and the hit/miss trace to a run recorded "
                    "with `treepipe bench --records`, re-run each method's schedule in the "
                    "simulator and compare with the engine's own pipelined time.")
    s.add_argument("records", type=Path, help="records.json written by treepipe bench --records")
    s.add_argument("--out", type=out_folder, default=None, help="folder for simulate.json/.md")
    s.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    s.set_defaults(func=cmd_simulate)

    p = subparsers.add_parser(
        "project", help=COMMANDS["project"],
        description="Project PP, SpecInfer and SpecPipe TBT to the SpecPipe paper's setting "
                    "(Llama-3.1-70B, 8 stages of RTX 3090, 10 GbE, Llama-3.2-1B draft on an "
                    "L40, w=64, k=16) from the numbers the paper gives; print them beside "
                    "the paper's HumanEval-X figures with the assumptions and a "
                    "sensitivity table.")
    p.add_argument("--calibrate", default="fig11", metavar="fig11|l40|FILE",
                   help="per-layer time from Figure 11's PP TBT (default), §3.3.1's L40 run, "
                        "or a sweep_layer_time.json measured by `treepipe sweep layer-time` "
                        "for one layer of the projected model (its curve replaces the "
                        "calibrated constant and the Figure 9 shape)")
    p.add_argument("--hit-rate", type=fraction(), default=PaperSetting.hit_rate,
                   help="SpecPipe level hit rate at w=64, k=16 (default 0.95)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--tokens", type=count(1), default=None,
                   help=f"decode tokens simulated per method (default {PaperSetting.new_tokens})"
                        f", per request with --batch (default {BATCH_TOKENS}), per setting "
                        f"with --recovery (default {RECOVERY_TOKENS})")
    p.add_argument("--batch", default=None, metavar="B,B,...",
                   help="multi-request projection (§4.4, Figures 16/17) at these batch sizes, "
                        "e.g. 1,2,4,8,16,32: throughput and TBT of continuous-batched PP, "
                        "SpecInfer, SpecPipe (turns) and SpecPipe-DB at the fixed and the "
                        "adaptive width")
    p.add_argument("--recovery", action="store_true",
                   help="miss recovery projection: TBT of early-exit:J:K for J = 1..m-1 and "
                        "draft:K, K in 1,2,4,8,16,32, with 0, 16 or 32 of the width left to "
                        "corrections, the (J, K) the model picks and why, and the check "
                        "against the engine's SmolLM2 run (project_recovery.json/.md)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a PaperSetting field, e.g. --set stages=4 --set "
                        "layers_per_stage=20 --set 'topk_hit={\"1\": 0.8, \"32\": 0.99}' "
                        "(repeatable): the same simulator for another setting")
    p.add_argument("--out", type=out_folder, default=None, help="folder for project.json/.md "
                   "(project_batch.*, project_recovery.* with those flags)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.set_defaults(func=cmd_project)


def cmd_simulate(a: argparse.Namespace) -> int:
    """``treepipe simulate RECORDS``: validate the simulator on a recorded run."""
    return simulate_records(options(SimulateOptions, a))


def cmd_project(a: argparse.Namespace) -> int:
    """``treepipe project``: the projection to the paper's testbed."""
    o = options(ProjectOptions, a)
    return project_paper_recovery(o) if o.recovery else project_paper(o)
