"""The distributed runtime's admission: the line to join, read for the scheduling core.

The draft service runs the scheduler of a distributed pipeline (docs/architecture.md
says why).  Each step in which requests wait it reads the head of the joining line and
the pools the participants report, prices them as the scheduler's tickets, and lets
:func:`~protocol.scheduling.scheduler.decide_joins` (the rule the in-process engine
runs too) choose who joins at the next step; the step's barrier (arrive.lua) applies
the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from protocol.scheduling.kv_blocks import kv_limit
from protocol.scheduling.plan import Ticket
from protocol.scheduling.prefill import PrefillLayout
from protocol.scheduling.scheduler import decide_joins
from protocol.sync.synchroniser import (
    BadRequestState,
    Join,
    RequestState,
    SyncError,
    Synchroniser,
)

log = logging.getLogger("treepipe.draft")
LINE_READ = 16  # requests of the line read per step at most: the first that waits ends it


class JoiningLine:
    """The head of the joining line, each waiting request's state read once per epoch
    (a request's stored fields do not change while it waits; its log changes only on a
    resume, which starts a new epoch), so a step in which requests wait costs the
    scheduler two round trips: the line's ids and the pools."""

    def __init__(self, sync: Synchroniser):
        self.sync = sync
        self.epoch = -1
        self.states: dict[str, RequestState] = {}

    def read(self, epoch: int) -> list[RequestState]:
        """The running requests first in line, in order."""
        if epoch != self.epoch:
            self.epoch, self.states = epoch, {}
        rids = self.sync.line(LINE_READ)
        new = [r for r in rids if r not in self.states]
        for rid, got in zip(new, self.sync.requests(new) if new else [], strict=True):
            if isinstance(got, BadRequestState):
                # every worker would fail it as it joins: fail it now, or it holds the line
                log.error("request %s cannot run: %s", rid, got)
                self.sync.fail(rid, str(got))
            elif not isinstance(got, SyncError) and got.status == "running":
                self.states[rid] = got
        self.states = {r: self.states[r] for r in rids if r in self.states}
        return list(self.states.values())

    def next_joins(self, epoch: int, names: Sequence[str], plan: str, stages: int, held: int,
                   prefilling: Iterable[tuple[RequestState, int]]) -> list[Join]:
        """Who joins at the next step: the line's head as far as the KV budget (beside the
        ``held`` blocks of the batch's worst cases, at ``stages`` stages, in the pools the
        participants ``names`` of ``plan`` report) and stage 1's prefill room (beside the
        chunks of the ``prefilling`` requests, each at its prefill step now) allow."""
        line = self.read(epoch)
        if not line:
            return []
        pool = self.sync.kv_pool(names, plan)
        # stage 1 computes chunk t + 1 of each in the next step (none past its last)
        load = sum(st.layout().rows_in(t + 1) for st, t in prefilling)
        tickets = [Ticket(st.rid, st.prefill_rows_total(), st.kv_need(stages), chunk=st.chunk,
                          budget=kv_limit(st.kv_budget, st.kv_cap, pool)) for st in line]
        joins = []
        for a in decide_joins(tickets, held=held, load=load, slots=len(tickets), budget=None,
                              chunk=0):
            st = self.states[str(a.rid)]
            steps = PrefillLayout(st.prefill_rows_total(), st.chunk, a.head).steps(stages)
            joins.append(Join(st.rid, a.head, steps))
        return joins


def next_joins(sync: Synchroniser, names: Sequence[str], plan: str, stages: int, held: int,
               prefilling: Iterable[tuple[RequestState, int]]) -> list[Join]:
    """:meth:`JoiningLine.next_joins` read afresh (a test's or a benchmark's scheduler)."""
    return JoiningLine(sync).next_joins(-1, names, plan, stages, held, prefilling)
