"""The distributed runtime's admission: the line to join, read for the scheduling core.

The draft service runs the scheduler of a distributed pipeline (docs/architecture.md
says why).  Each step it reads the head of the joining line and the pools the
participants report, prices them as the scheduler's tickets, and lets
:func:`~protocol.scheduling.scheduler.decide_joins` (the rule the in-process engine
runs too) choose who joins at the next step; the step's barrier (arrive.lua) applies
the choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from protocol.scheduling.kv_blocks import kv_limit
from protocol.scheduling.plan import Ticket
from protocol.scheduling.prefill import PrefillLayout
from protocol.scheduling.scheduler import decide_joins
from protocol.sync.synchroniser import Join, RequestState, Synchroniser

LINE_READ = 16  # requests of the line read per step at most: the first that waits ends it


def next_joins(sync: Synchroniser, names: Sequence[str], plan: str, stages: int,
               held: int, prefilling: Iterable[tuple[RequestState, int]]) -> list[Join]:
    """Who joins at the next step: the line's head as far as the KV budget (beside the
    ``held`` blocks of the batch's worst cases, at ``stages`` stages, in the pools the
    participants ``names`` of ``plan`` report) and stage 1's prefill room (beside the
    chunks of the ``prefilling`` requests, each at its prefill step now) allow."""
    line = sync.queued(LINE_READ)
    if not line:
        return []
    pool = sync.kv_pool(names, plan)
    load = 0
    for st, t in prefilling:
        chunk = st.prefill_chunk(t + 1, 0)
        if chunk is not None:
            a, b = st.prefill_rows(chunk)
            load += b - a
    tickets = [Ticket(st.rid, st.prefill_rows_total(), st.kv_need(stages), chunk=st.chunk,
                      budget=kv_limit(st.kv_budget, st.kv_cap, pool)) for st in line]
    by_id = {st.rid: st for st in line}
    return [Join(a.rid, a.head, PrefillLayout(by_id[a.rid].prefill_rows_total(),
                                              by_id[a.rid].chunk, a.head).steps(stages))
            for a in decide_joins(tickets, held=held, load=load, slots=len(tickets),
                                  budget=None, chunk=0)]
