"""argparse types of the lab's commands (bench, sweeps, tune, timeline, draft): they read
a file through the lab's own loaders, so the serving commands' flags (flags.py) never
import the lab."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.cli.flags import text_file


def prompts_spec(text: str) -> str:
    """argparse type of ``--prompts``: ``humaneval:N`` / ``humaneval:A-B`` (the command
    checks and loads those) or a JSONL file of prompts, read and checked here, so that a
    bad file is refused before a model is loaded rather than after."""
    if text.startswith("humaneval:"):
        return text
    text_file(text)
    from orchestrator.lab.benchmarks.prompts import load_prompts
    from protocol.errors import TreepipeError

    try:
        load_prompts(text)
    except TreepipeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def records_file(text: str) -> Path:
    """argparse type: a records file of ``treepipe bench --records``, read and checked."""
    text_file(text)
    from orchestrator.lab.benchmarks.simulator import load_records  # imports torch
    from protocol.errors import TreepipeError

    try:
        load_records(Path(text))
    except TreepipeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Path(text)
