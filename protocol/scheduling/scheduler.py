"""The scheduler: every decision of what a SpecPipe-DB step holds, in one place.

In vLLM's EngineCore shape: :meth:`Scheduler.schedule` returns the next step's
:class:`~protocol.scheduling.plan.StepPlan` (who leaves, who joins, which prompt rows
enter stage 1, each level's width); the executor runs it and reports back with
:meth:`Scheduler.update` (the verified tokens' ranks: the widths of the levels it
grows now) and :meth:`Scheduler.close` (prompts that finished prefilling, requests
that finished, the step's records).  The rules:

* **Admission**: requests join in arrival order while the batch has a slot and, with
  a fixed KV pool, the request's worst case fits beside the worst cases of those
  running; the first that does not fit waits, first in line (nothing running is
  ever disturbed).
* **Prefill budget** (pipelined methods): the prefill rule of
  :mod:`protocol.scheduling.prefill`: joiners share ``prefill_chunk`` rows entering
  stage 1 per step, in arrival order.
* **Width**: a fixed width, or the adaptive policy (:class:`~protocol.scheduling.
  width.AdaptiveWidth`), which chooses every going request's next level together.

Torch-free: the plan holds request ids and row bounds, never tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol.scheduling.plan import (
    Chunk,
    Decoding,
    Prefilling,
    RequestId,
    StepPlan,
    Ticket,
)
from protocol.scheduling.prefill import PrefillLayout, room
from protocol.scheduling.records import StepRecord
from protocol.scheduling.width import AdaptiveWidth


@dataclass(frozen=True)
class StepOutputs:
    """What verification found: each verified request's token rank among its draft's
    proposals (None: not proposed; in verification order), and the requests whose
    trees go on to the next step."""

    ranks: tuple[tuple[RequestId, int | None], ...] = ()
    going: tuple[RequestId, ...] = ()


class Scheduler:
    """Admission, the prefill budget, the KV budget and the width policy of one pipeline."""

    def __init__(self, max_batch: int, width: int, *, kv_budget: int | None = None,
                 prefill_chunk: int = 0, pipelined: bool = True,
                 policy: AdaptiveWidth | None = None):
        """``kv_budget``: blocks per stage that the running requests' worst cases may
        hold (None: no fixed pool).  ``pipelined``: prompts enter stage 1 in chunks under
        the ``prefill_chunk`` budget (else the executor prefills a joiner whole before
        the step).  ``policy``: the adaptive width, up to ``width`` (None: fixed)."""
        self.max_batch, self.width, self.kv_budget = max_batch, width, kv_budget
        self.prefill_chunk, self.pipelined, self.policy = prefill_chunk, pipelined, policy
        self.queue: deque[Ticket] = deque()
        self.running: list[Prefilling | Decoding] = []  # in admission order
        self.cancelled: set[RequestId] = set()
        self.reserved = 0  # blocks per stage the running requests' worst cases hold
        self.steps = 0  # plans made so far

    # ---- requests ------------------------------------------------------------------
    def fits_alone(self, ticket: Ticket) -> bool:
        """Whether the request's worst case fits the KV budget at all."""
        return self.kv_budget is None or ticket.blocks <= self.kv_budget

    def add(self, ticket: Ticket) -> None:
        """Queue a request; it joins at a step boundary with room."""
        self.queue.append(ticket)

    def cancel(self, rid: RequestId) -> bool:
        """Cancel a request: a queued one is dropped now (True), a running one leaves
        at the next plan."""
        for t in list(self.queue):
            if t.rid == rid:
                self.queue.remove(t)
                return True
        if any(r.ticket.rid == rid for r in self.running):
            self.cancelled.add(rid)
        return False

    @property
    def idle(self) -> bool:
        """Nothing queued or running."""
        return not self.queue and not self.running

    def state(self, rid: RequestId) -> Prefilling | Decoding:
        """A running request's scheduling state."""
        return next(r for r in self.running if r.ticket.rid == rid)

    # ---- the plan ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan: cancelled requests leave, queued ones join while there is
        room, and the prefilling ones' next chunks enter stage 1."""
        leave = tuple(r.ticket.rid for r in self.running if r.ticket.rid in self.cancelled)
        self._retire(leave)
        admit = self._admit()
        chunks = self._feed() if self.pipelined else ()
        widths = tuple((r.ticket.rid, r.width) for r in self.running
                       if isinstance(r, Decoding))
        plan = StepPlan(self.steps, leave, admit, chunks, widths)
        self.steps += 1
        return plan

    def _admit(self) -> tuple[RequestId, ...]:
        admitted: list[RequestId] = []
        while self.queue and len(self.running) < self.max_batch:
            need = self.queue[0].blocks if self.kv_budget is not None else 0
            if self.kv_budget is not None and self.reserved + need > self.kv_budget:
                break  # waits for blocks; the running requests are not disturbed
            t = self.queue.popleft()
            self.reserved += need
            self.running.append(Prefilling(t) if self.pipelined else self._decoding(t))
            admitted.append(t.rid)
        return tuple(admitted)

    def _feed(self) -> tuple[Chunk, ...]:
        """Prompt chunks into stage 1 by the prefill rule, starting new prefills in order."""
        chunks: list[Chunk] = []
        prefilling = [r for r in self.running if isinstance(r, Prefilling)]
        load = sum(self._next_chunk(r, chunks) for r in prefilling if r.layout is not None)
        for r in prefilling:
            if r.layout is None:
                space = room(self.prefill_chunk, load)
                if not space:
                    break  # it waits first in line, and those behind it with it
                r.layout = PrefillLayout(r.ticket.rows, self.prefill_chunk, space)
                load += self._next_chunk(r, chunks)
        order = {r.ticket.rid: k for k, r in enumerate(self.running)}
        return tuple(sorted(chunks, key=lambda c: order[c.rid]))

    @staticmethod
    def _next_chunk(r: Prefilling, chunks: list[Chunk]) -> int:
        """Its next chunk (if any is left) onto ``chunks``; returns its rows."""
        assert r.layout is not None
        a, b = r.layout.bounds(r.fed)
        if b <= a:
            return 0
        chunks.append(Chunk(r.ticket.rid, r.fed, a, b))
        r.fed += 1
        return b - a

    # ---- what the executor reports -----------------------------------------------------
    def update(self, out: StepOutputs) -> dict[RequestId, int]:
        """The step's verdicts: the policy learns each verified rank, then chooses the
        width of every going request's next level (returned, and kept for the plan)."""
        if self.policy is not None:
            for rid, rank in out.ranks:
                self.policy.observe(rid, rank)
        if self.policy is not None and out.going:
            for rid, w in self.policy.choose(list(out.going)).items():
                self._decoding_state(rid).width = w
        return {rid: self._decoding_state(rid).width for rid in out.going}

    def observe_level(self, rid: RequestId, offered: int) -> None:
        """How many proposals a request's new level could draw from (the policy's cap)."""
        if self.policy is not None and offered >= 0:
            self.policy.observe_level(rid, offered)

    def close(self, records: Iterable[StepRecord], started: Sequence[RequestId] = (),
              done: Sequence[RequestId] = ()) -> None:
        """The step is over: ``started`` finished their prefill (their trees start),
        the policy learns the step's cost, and ``done`` leave with their blocks."""
        for rid in started:
            k = next(k for k, r in enumerate(self.running) if r.ticket.rid == rid)
            self.running[k] = self._decoding(self.running[k].ticket)
        if self.policy is not None:
            for rec in records:
                self.policy.observe_step(rec)
        self._retire(done)

    def _decoding(self, t: Ticket) -> Decoding:
        # an adaptive tree starts one node wide: the policy widens it once it has seen it
        return Decoding(t, 1 if self.policy is not None else self.width)

    def _decoding_state(self, rid: RequestId) -> Decoding:
        st = self.state(rid)
        assert isinstance(st, Decoding), f"request {rid} is still prefilling"
        return st

    def _retire(self, rids: Iterable[RequestId]) -> None:
        for rid in rids:
            st = self.state(rid)
            self.running.remove(st)
            self.cancelled.discard(rid)
            self.reserved -= st.ticket.blocks if self.kv_budget is not None else 0
            if self.policy is not None:
                self.policy.forget(rid)
