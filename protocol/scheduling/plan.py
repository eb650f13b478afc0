"""What the scheduler hands an executor: one typed plan per pipeline step.

A :class:`StepPlan` says which requests leave before the step, which join, which
prompt rows enter stage 1 and how wide each request's newest level is.  Executors
(the in-process :class:`~stages.speculation.batch.BatchRun`; the distributed runtime
next) run it and report back; equal plans on two executors mean equal schedules.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from protocol.scheduling.prefill import PrefillLayout

RequestId = Hashable


@dataclass(frozen=True)
class Ticket:
    """What the scheduler knows of a request: its id, the rows it prefills and the KV
    blocks its worst case holds on each stage."""

    rid: RequestId
    rows: int
    blocks: int = 0
    # its own prefill chunk and KV budget in blocks, where they differ from the
    # scheduler's (a distributed request carries what its gateway gave it)
    chunk: int | None = None
    budget: int | None = None


@dataclass(frozen=True)
class Admission:
    """A request that joins: its id, and the rows of its first prefill chunk (``head``: the
    room stage 1 had for it; 0: a whole chunk), which fix its prefill layout."""

    rid: RequestId
    head: int = 0


@dataclass(frozen=True)
class Chunk:
    """Prompt rows ``[start, stop)`` of request ``rid`` entering stage 1 as its prefill
    chunk number ``index``."""

    rid: RequestId
    index: int
    start: int
    stop: int


@dataclass
class Prefilling:
    """A request whose committed rows are still entering the pipeline."""

    ticket: Ticket
    layout: PrefillLayout  # fixed when it was let in, by the room stage 1 had then
    fed: int = 0  # chunks that entered stage 1 so far


@dataclass
class Decoding:
    """A request whose tree is in flight, with the width of its next level."""

    ticket: Ticket
    width: int


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions, in the order an executor applies them."""

    step: int
    leave: tuple[RequestId, ...] = ()  # cancelled: gone before the step, blocks freed
    admit: tuple[Admission, ...] = ()  # join now, in order
    chunks: tuple[Chunk, ...] = ()  # prompt rows into stage 1, in arrival order
    # the width each decoding request's level entering stage 1 was grown with
    widths: tuple[tuple[RequestId, int], ...] = ()
    # pipelined: the requests that join at the next step, decided now (a distributed
    # pipeline's barrier applies them: see Scheduler)
    next: tuple[Admission, ...] = ()
