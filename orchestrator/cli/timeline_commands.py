"""``treepipe timeline``: the argv side of a request's device timeline
(orchestrator/lab/benchmarks/timeline.py)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    add_engine_flags,
    count,
    options,
    out_folder,
    positive_int,
    shown,
)
from orchestrator.cli.lab_flags import prompts_spec, records_file
from orchestrator.lab.benchmarks.timeline import TimelineOptions, timeline


def zoom_window(text: str) -> str:
    """argparse type of ``--zoom START:END``: finite milliseconds, END above START (the
    text itself goes on to the timeline, which splits it again)."""
    lo, sep, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi)
    except ValueError:
        a = b = math.nan
    if not sep or not (math.isfinite(a) and math.isfinite(b) and a < b):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not START:END in ms with finite "
                                         "START < END, e.g. 120:180")
    return text


def add_timeline_parser(subparsers: Any) -> None:
    """Register ``treepipe timeline``."""

    t = subparsers.add_parser(
        "timeline", help=COMMANDS["timeline"],
        description="Draw one request as one row per device (draft and stages) in pipelined "
                    "time: compute, pruning and transfer in different colours, flushes as "
                    "red lines.  Reads a run from --records (treepipe bench --records) or "
                    "generates one with the engine flags.")
    add_engine_flags(t)
    t.add_argument("--records", type=records_file, default=None,
                   help="records.json from treepipe bench --records (else run one request)")
    t.add_argument("--method", default="specpipe", help="method to draw (default specpipe)")
    t.add_argument("--source", default=None, help="with --records: token source of the run")
    t.add_argument("--prompt-index", type=count(0), default=0, help="with --records: prompt index")
    t.add_argument("--prompts", type=prompts_spec, default="humaneval:1",
                   help="without --records: the first prompt of this set is generated")
    t.add_argument("--max-new-tokens", type=positive_int, default=64)
    t.add_argument("--zoom", type=zoom_window, default=None,
                   help="zoom window START:END in ms")
    t.add_argument("--out", type=out_folder, required=True, help="folder for timeline.png/.json")
    t.set_defaults(func=cmd_timeline)


def cmd_timeline(a: argparse.Namespace) -> int:
    """``treepipe timeline``: a Figure-12-style device timeline of one request."""
    return timeline(options(TimelineOptions, a))
