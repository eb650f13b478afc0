"""Where a worker's time goes: cumulative per-step timings reported in heartbeats.

Every participant splits its wall time into computing (model forwards, tree and
cache work), waiting at the step barrier (from calling ``arrive`` to holding the
verdict), waiting for link input and sending link messages.  The figures are
cumulative since the process started, so a reader (``treepipe top``, the
gateway's ``/metrics``, ``treepipe runtime-bench``) takes differences between
two heartbeats.
"""

from __future__ import annotations

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
