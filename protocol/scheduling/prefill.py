"""The prefill rule: how a (re)joining request's committed rows enter the pipeline.

One rule for the in-process engine (:class:`~stages.speculation.batch.BatchRun`) and
the distributed runtime (the draft service's scheduler, and the workers through
:class:`~protocol.sync.synchroniser.RequestState`), through the scheduler's
``decide_joins`` (:mod:`protocol.scheduling.scheduler`):

* The joining requests share a budget of ``chunk`` rows entering stage 1 per step, in
  the order they joined.  A request starts its prefill in the first step whose stage 1
  has room left beside the chunks of the requests before it (:func:`room`); the ones
  behind it wait with it, so a long queue cannot starve its head.
* Its first chunk takes that room (``head`` rows, at most its rows), every later chunk
  ``chunk`` rows and the last what is left.  A request that got room had nothing left
  to feed before it, so its later chunks never share stage 1 with an earlier joiner's,
  and its layout, fixed at its first step, holds to the end.
* The chunks are pipelined, stage i computing chunk j in step j + i, so the prefill
  takes chunks + stages - 1 steps, a single chunk too: a step holds one stage's share of
  a prompt, never its pass through every stage.  ``chunk`` 0 (no budget) puts the whole
  sequence through every stage in one step.
"""

from __future__ import annotations

from dataclasses import dataclass


def room(chunk: int, load: int) -> int:
    """Rows a joiner may put into stage 1 in a step whose stage 1 already has ``load``
    rows of earlier joiners' chunks: the budget left (0: it waits), a whole chunk
    beside nothing.  Without a budget (``chunk`` 0) it is 0 and means nothing: such a
    joiner never waits and has no head."""
    if chunk < 1 or load <= 0:
        return max(chunk, 0)
    return max(chunk - load, 0)


@dataclass(frozen=True)
class PrefillLayout:
    """The chunks of one request's prefill: ``rows`` committed rows, ``chunk`` rows a
    step (0: all in one step), the first chunk ``head`` rows (0: a whole chunk)."""

    rows: int
    chunk: int
    head: int = 0

    @property
    def first(self) -> int:
        """Rows of its first chunk."""
        if self.chunk < 1:
            return self.rows
        return min(self.rows, self.head if 0 < self.head < self.chunk else self.chunk)

    def chunks(self) -> int:
        """How many chunks (1 for an empty or unchunked sequence)."""
        rest = self.rows - self.first
        return 1 + (-(-rest // self.chunk) if rest > 0 else 0)

    def steps(self, stages: int) -> int:
        """Steps its prefill takes in a pipeline of ``stages`` stages."""
        return 1 if self.chunk < 1 else self.chunks() + max(stages, 1) - 1

    def bounds(self, index: int) -> tuple[int, int]:
        """The rows ``[a, b)`` chunk ``index`` holds, so stage 1 computes ``b - a`` rows in
        prefill step ``index`` (empty before the first and past the last)."""
        if index <= 0:
            return 0, self.first if index == 0 else 0
        a = min(self.first + (index - 1) * self.chunk, self.rows)
        return a, min(a + self.chunk, self.rows)

    def rows_in(self, index: int) -> int:
        """Rows of chunk ``index`` (0 before the first and past the last)."""
        a, b = self.bounds(index)
        return b - a

    def chunk_at(self, step: int, stage: int) -> int | None:
        """The chunk stage ``stage`` (0-based) computes in prefill step ``step``, or None."""
        j = step if self.chunk < 1 else step - stage
        return j if 0 <= j < self.chunks() else None

