"""A participant's heartbeat: what it writes every second, and what readers take from it.

:class:`Heartbeat` is the one typed form on both sides of the wire (a JSON object in
``tp:P:hb:W``): the participant builds one, :meth:`Synchroniser.heartbeats` parses
each (a malformed field reads as absent, never as a crash), and join.lua reads only
its ``plan``.

Where a worker's time goes (:class:`StepStats`): cumulative per-step timings.

Every participant splits its wall time into computing (model forwards, tree and
cache work), waiting at the step barrier (from calling ``arrive`` to holding the
verdict), waiting for link input and sending link messages.  The figures are
cumulative since the process started, so a reader (``treepipe top``, the
gateway's ``/metrics``, ``treepipe runtime-bench``) takes differences between
two heartbeats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StepStats:
    """Cumulative timings of one worker; the keys of a heartbeat's ``stats`` object."""

    steps: int = 0  # decode steps: arrivals at the barrier of a step that advanced a request
    compute_s: float = 0.0  # decode work: tree levels' forwards, tree and KV-cache work, proposals
    barrier_s: float = 0.0  # decode steps: arrive -> verdict in hand
    input_s: float = 0.0  # decode steps: waiting for the step's link message
    send_s: float = 0.0  # encoding and queueing link messages
    sent_bytes: int = 0  # link bytes sent
    nodes: int = 0  # tree nodes computed (stage) or proposed (draft) in decode steps
    # prefill: the chunks' compute and input waits, and the whole of a step that only
    # prefilled (step 0 of an epoch, a joiner's chunk while nothing decoded)
    prefill_s: float = 0.0
    levels: int = 0  # draft: levels grown (one per request and decode step)
    widths: int = 0  # draft: their widths summed (adaptive or fixed): / levels = mean width

    def as_dict(self) -> dict[str, Any]:
        """The heartbeat's ``stats`` object."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StepStats | None:
        """Read a heartbeat's ``stats``; None when it has none (an older worker)."""
        if not isinstance(d, dict):
            return None
        try:
            return cls(**{k: type(getattr(cls, k))(d[k]) for k in cls.__dataclass_fields__
                          if k in d})
        except (TypeError, ValueError):
            return None

    def minus(self, other: StepStats) -> StepStats:
        """What happened between ``other`` (earlier) and this sample."""
        return StepStats(**{k: getattr(self, k) - getattr(other, k)
                            for k in self.__dataclass_fields__})

    def plus(self, other: StepStats) -> StepStats:
        """Both samples' figures together (e.g. several requests' deltas)."""
        return StepStats(**{k: getattr(self, k) + getattr(other, k)
                            for k in self.__dataclass_fields__})


def _int(raw: object, default: int = 0) -> int:
    """A whole number of a heartbeat (an integral float too), else ``default``."""
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return default
    if isinstance(raw, float) and (not math.isfinite(raw) or raw != int(raw)):
        return default
    return int(raw)


@dataclass(frozen=True)
class KvUse:
    """A participant's KV pool: its blocks, those in use now and at most, and whether it
    is fixed (the pipeline admits by the smallest fixed pool its participants report)."""

    blocks: int
    used: int = 0
    peak: int = 0
    block_size: int = 16
    fixed: bool = False

    def to_json(self) -> dict[str, int]:
        """The heartbeat's ``kv`` object."""
        return {"blocks": self.blocks, "used": self.used, "peak": self.peak,
                "block_size": self.block_size, "fixed": int(self.fixed)}

    @classmethod
    def from_json(cls, raw: object) -> KvUse | None:
        """A heartbeat's ``kv`` (None: no pool, or one that is no whole number of blocks)."""
        if not isinstance(raw, Mapping):
            return None
        blocks = _int(raw.get("blocks"), -1)
        if not 0 <= blocks < 2 ** 53:
            return None
        fixed = raw.get("fixed")
        return cls(blocks, _int(raw.get("used")), _int(raw.get("peak")),
                   _int(raw.get("block_size"), 16),
                   fixed is True or (not isinstance(fixed, bool) and isinstance(fixed, int | float)
                                     and fixed != 0))

    @property
    def fixed_blocks(self) -> int:
        """The blocks the pool holds the pipeline to: 0 for a pool that grows."""
        return self.blocks if self.fixed and self.blocks >= 1 else 0


@dataclass(frozen=True)
class Heartbeat:
    """What a participant reports every second: its process (``pid``, ``inc``: this
    incarnation), the stage layout it runs (``plan``), the requests it holds, where it
    is (``epoch``, ``step``), link messages its inbox refused, its step timings and its
    KV pool (None: it holds none)."""

    pid: int | None = None
    inc: str = ""
    plan: str = ""
    req: str | None = None  # ids of the requests it holds, comma-separated
    reqs: int = 0
    epoch: int = 0
    step: int = 0
    rejected: int = 0
    stats: StepStats | None = None
    kv: KvUse | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to Redis (``treepipe status --json`` shows it too)."""
        return {"pid": self.pid, "inc": self.inc, "plan": self.plan, "req": self.req,
                "reqs": self.reqs, "epoch": self.epoch, "step": self.step,
                "rejected": self.rejected,
                "stats": self.stats.as_dict() if self.stats is not None else None,
                "kv": self.kv.to_json() if self.kv is not None else None}

    @classmethod
    def from_json(cls, raw: object) -> Heartbeat | None:
        """A heartbeat as written (None: not a JSON object); a malformed field reads as
        absent."""
        if not isinstance(raw, Mapping):
            return None
        pid, req = raw.get("pid"), raw.get("req")
        return cls(_int(pid) if pid is not None else None, str(raw.get("inc") or ""),
                   str(raw.get("plan") or ""), str(req) if req else None,
                   _int(raw.get("reqs")), _int(raw.get("epoch")), _int(raw.get("step")),
                   _int(raw.get("rejected")), StepStats.from_dict(raw.get("stats")),
                   KvUse.from_json(raw.get("kv")))
