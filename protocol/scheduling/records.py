"""Per-step records of a generation and the statistics derived from them.

*Pipelined time* is what the same schedule costs when every stage has its own
device: per step, the slowest participant's compute, plus the broadcast of the
verified token (one link latency) when pruning followed, plus the slowest
link's transfer.  Links carry hidden states between stages and tree levels from
the draft to stage 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("ar", "pp", "specinfer", "specpipe")  # the decoding methods of a generation


@dataclass(frozen=True)
class LinkModel:
    """Latency and bandwidth of one link between consecutive devices."""

    latency_s: float = 100e-6
    bandwidth_bytes_s: float = 10e9 / 8  # 10 GbE

    def cost(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over the link (0 when nothing moves)."""
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes else 0.0


@dataclass
class StepRecord:
    """What happened in one pipeline step."""

    stage_tokens: list[int]
    stage_s: list[float]
    prune_s: list[float]
    link_bytes: list[int]  # [draft->stage 1, stage 1->2, ..., stage m-1->m]
    draft_tokens: int = 0
    draft_s: float = 0.0
    draft_serial: bool = False  # draft ran before the stages (static tree), not beside them
    verified: int = 0  # tokens verified (committed) at the end of this step
    hits: int = 0  # of those, how many were already in the tree
    recovered: int = 0  # of the hits, how many were late correction children (re-roots)
    flushed: int = 0  # in-flight nodes dropped by a miss
    serial: bool = False  # stages ran one after another on one device (ar)
    # of stage_tokens, the prompt rows each stage computed (a prefill flowing through)
    prompt_rows: list[int] = field(default_factory=list)
    # requests (packed segments) each stage computed: each adds a fixed cost (its own
    # attention over its prefix), which a per-node cost must not absorb
    stage_requests: list[int] = field(default_factory=list)

    def pipelined_s(self, link: LinkModel) -> float:
        """Time of this step with one device per stage."""
        busy = [s + p for s, p in zip(self.stage_s, self.prune_s, strict=True)]
        if self.serial:
            return sum(busy) + self.draft_s
        compute = max(busy, default=0.0)
        compute = compute + self.draft_s if self.draft_serial else max(compute, self.draft_s)
        bcast = link.latency_s if self.verified and len(self.stage_s) > 1 else 0.0
        return compute + bcast + max((link.cost(b) for b in self.link_bytes), default=0.0)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    """Tokens and per-step records of one request."""

    method: str
    stages: int
    width: int
    topk: int
    source: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0
    link: LinkModel = field(default_factory=LinkModel)
    logits: list[Any] = field(default_factory=list)  # per token, only when asked for

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps (the first comes from the prefill)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def pipelined_s(self) -> float:
        return sum(s.pipelined_s(self.link) for s in self.steps)

    def stats(self) -> dict[str, Any]:
        """Summary numbers; TBT figures are per decode token."""
        verified = sum(s.verified for s in self.steps)
        hits = sum(s.hits for s in self.steps)
        n_steps = len(self.steps)
        dec = self.decode_tokens
        decode_wall = max(self.wall_s - self.prefill_s, 0.0)
        return {
            "method": self.method,
            "stages": self.stages,
            "width": self.width,
            "topk": self.topk,
            "source": self.source,
            "prompt_tokens": self.prompt_len,
            "new_tokens": len(self.tokens),
            "steps": n_steps,
            "tokens_per_step": dec / n_steps if n_steps else 0.0,
            "hit_rate": hits / verified if verified else 0.0,
            "flushes": sum(1 for s in self.steps if s.flushed),
            "recovered": sum(s.recovered for s in self.steps),
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "pipelined_s": self.pipelined_s,
            "tbt_wall_ms": 1e3 * decode_wall / dec if dec else 0.0,
            "tbt_pipelined_ms": 1e3 * self.pipelined_s / dec if dec else 0.0,
            "link_latency_us": self.link.latency_s * 1e6,
            "link_gbps": self.link.bandwidth_bytes_s * 8 / 1e9,
        }
