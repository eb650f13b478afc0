"""The typed options the lab's engine-running commands share (sweeps, tune, timeline).

One field per flag, named as the flag's dest: orchestrator/cli builds them from the
parsed command line, and nothing in the lab reads an argparse namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.config.recovery import Recovery


@dataclass(frozen=True)
class EngineOptions:
    """The flags of every command that builds an engine (``add_engine_flags``)."""

    model: str
    stages: int
    draft: str
    draft_model: str
    draft_vocab: str
    width: int
    topk: int
    dtype: str
    device: str
    execution: str
    quantize: str  # none | int8 (stages.model.quantization)
    link_latency_us: float
    link_gbps: float
    recovery: Recovery  # --recovery (protocol.config.recovery)


@dataclass(frozen=True)
class RunOptions(EngineOptions):
    """An engine run over prompts that writes a report (sweeps and tune)."""

    prompts: str
    max_new_tokens: int
    chat: bool
    threads: int | None
    out: Path
