"""The scheduler: every decision of what a SpecPipe-DB step holds, in one place.

In vLLM's EngineCore shape: :meth:`Scheduler.schedule` returns the next step's
:class:`~protocol.scheduling.plan.StepPlan` (who leaves, who joins, which prompt rows
enter stage 1, each level's width); the executor runs it and reports back with
:meth:`Scheduler.update` (the verified tokens' ranks: the widths of the levels it
grows now) and :meth:`Scheduler.close` (prompts that finished prefilling, requests
that finished, the step's records).  The rules:

* **Admission**: requests join in arrival order while the batch has a slot, with a
  fixed KV pool the request's worst case fits beside the worst cases of those
  running, and (pipelined methods) stage 1 has prefill room for its first chunk; the
  first that does not fit waits, first in line (nothing running is ever disturbed).
* **One step ahead** (pipelined methods): each plan decides who joins at the *next*
  step (``StepPlan.next``) from what is known when the step starts, because in the
  distributed runtime the draft service decides while the step runs and the step's
  barrier applies it.  So a request always joins at a step boundary, an idle
  pipeline's too (after one empty step), and blocks freed by a step's ends are
  offered at the boundary after next.
* **Prefill budget**: the prefill rule of :mod:`protocol.scheduling.prefill`: joiners
  share ``prefill_chunk`` rows entering stage 1 per step, in arrival order; a
  joiner's first chunk takes the room left, which fixes its layout.
* **Width**: a fixed width, or the adaptive policy (:class:`~protocol.scheduling.
  width.AdaptiveWidth`), which chooses every going request's next level together.

Torch-free: the plan holds request ids and row bounds, never tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from protocol.scheduling.plan import (
    Admission,
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


def decide_joins(queue: Iterable[Ticket], *, held: int, load: int, slots: int,
                 budget: int | None, chunk: int, pipelined: bool = True) -> list[Admission]:
    """The admission rule: up to ``slots`` of ``queue``, in order, that fit beside
    ``held`` KV blocks per stage and (pipelined) ``load`` prompt rows already entering
    stage 1 in the step they join; the first that does not fit ends the list, so it
    waits first in line.

    A ticket's own ``budget`` and ``chunk`` win over ``budget`` (None or 0: no KV
    budget) and ``chunk`` (0: a whole prompt in one step, no prefill budget).  A
    request alone always fits: one priced above a whole pool (a re-plan to more stages)
    runs by itself rather than wait for ever, holding up the line behind it.
    """
    out: list[Admission] = []
    for t in queue:
        if len(out) >= slots:
            break
        b = t.budget if t.budget is not None else budget
        c = chunk_of(t, chunk)
        if b and held > 0 and held + t.blocks > b:
            break  # waits for blocks; the running requests are not disturbed
        head = room(c, load)
        if pipelined and c >= 1 and not head:
            break  # waits for prefill room
        out.append(Admission(t.rid, head))
        held += t.blocks
        if pipelined:
            load += PrefillLayout(t.rows, c, head).first
    return out


def refuse_entry(held: Sequence[int], need: int, *, slots: int,
                 budget: int) -> tuple[str, str] | None:
    """Whether a distributed pipeline's gateway may put a request in the joining line,
    beside the ``held`` worst cases (KV blocks per stage) of the requests running or in
    line: ``('BUSY', '')`` when they fill the ``slots``, ``('TOOBIG', 'need/budget')``
    when its ``need`` exceeds a whole pool of ``budget`` blocks (0: no budget), ``('FULL',
    'held/need/budget')`` when it does not fit beside them; None: it may.  A gateway
    waits and retries on BUSY and FULL, and refuses the request on TOOBIG."""
    if len(held) >= slots:
        return ("BUSY", "")
    if budget > 0:
        if need > budget:
            return ("TOOBIG", f"{need}/{budget}")
        if sum(held) + need > budget:
            return ("FULL", f"{sum(held)}/{need}/{budget}")
    return None


def choose_widths(policy: AdaptiveWidth, ranks: Iterable[tuple[RequestId, int | None]],
                  going: Sequence[RequestId]) -> dict[RequestId, int]:
    """The width policy's step: it learns each verified token's rank among its draft's
    proposals, then chooses the next width of every going request together."""
    for rid, rank in ranks:
        policy.observe(rid, rank)
    return policy.choose(list(going)) if going else {}


def chunk_of(t: Ticket, chunk: int) -> int:
    """The prefill chunk a ticket's layout uses."""
    return t.chunk if t.chunk is not None else chunk


class Scheduler:
    """Admission, the prefill budget, the KV budget and the width policy of one pipeline."""

    def __init__(self, max_batch: int, width: int, *, kv_budget: int | None = None,
                 prefill_chunk: int = 0, pipelined: bool = True,
                 policy: AdaptiveWidth | None = None, adaptive: bool | None = None):
        """``kv_budget``: blocks per stage that the running requests' worst cases may
        hold (None: no fixed pool).  ``pipelined``: prompts enter stage 1 in chunks under
        the ``prefill_chunk`` budget (else the executor prefills a joiner whole before
        the step).  ``policy``: the adaptive width, up to ``width`` (None: fixed).
        ``adaptive``: trees start one node wide (default: with a policy), also while
        the policy is still to come (:meth:`~stages.runtime.admission.LineScheduler.use`)."""
        self.max_batch, self.width, self.kv_budget = max_batch, width, kv_budget
        self.prefill_chunk, self.pipelined, self.policy = prefill_chunk, pipelined, policy
        self.adaptive = policy is not None if adaptive is None else adaptive
        self.queue: deque[Ticket] = deque()
        self.running: list[Prefilling | Decoding] = []  # in admission order
        self.cancelled: set[RequestId] = set()
        # pipelined: who joins at the next plan, with their tickets (their blocks are held)
        self.decided: list[tuple[Admission, Ticket]] = []
        self.reserved = 0  # blocks per stage the running requests' worst cases hold
        self.steps = 0  # plans made so far
        # the levels grown since the last plan: (request, proposals it could draw from)
        self.levels: list[tuple[RequestId, int]] = []

    # ---- requests ------------------------------------------------------------------
    def fits_alone(self, ticket: Ticket) -> bool:
        """Whether the request's worst case fits the KV budget at all."""
        return self.kv_budget is None or ticket.blocks <= self.kv_budget

    def add(self, ticket: Ticket) -> None:
        """Queue a request; it joins at a step boundary with room."""
        self.queue.append(ticket)

    def cancel(self, rid: RequestId) -> bool:
        """Cancel a request: a queued one is dropped now (True), a running one (or one
        decided to join) leaves at the next plan."""
        for t in list(self.queue):
            if t.rid == rid:
                self.queue.remove(t)
                return True
        if any(r.ticket.rid == rid for r in self.running) or \
                any(t.rid == rid for _, t in self.decided):
            self.cancelled.add(rid)
        return False

    @property
    def idle(self) -> bool:
        """Nothing queued, decided or running."""
        return not self.queue and not self.running and not self.decided

    def state(self, rid: RequestId) -> Prefilling | Decoding:
        """A running request's scheduling state."""
        return next(r for r in self.running if r.ticket.rid == rid)

    # ---- the plan ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan: cancelled requests leave, the requests decided last time
        join (unpipelined: those with room now), the prefilling ones' next chunks enter
        stage 1, and the next step's joiners are decided."""
        leave = tuple(r.ticket.rid for r in self.running if r.ticket.rid in self.cancelled)
        self._learn_levels(leave)
        self._retire(leave)
        leave += self._forget_decided()
        if not self.pipelined:
            admit = self._join(self._decide(0, len(self.queue)))
        else:
            admit, self.decided = self._join(self.decided), []
        chunks = self._feed() if self.pipelined else ()
        self.decided = self._decide(self._next_load(), len(self.queue)) \
            if self.pipelined else []
        widths = tuple((r.ticket.rid, r.width) for r in self.running
                       if isinstance(r, Decoding))
        plan = StepPlan(self.steps, leave, admit, chunks, widths,
                        tuple(a for a, _ in self.decided))
        self.steps += 1
        return plan

    def _decide(self, load: int, most: int) -> list[tuple[Admission, Ticket]]:
        """Up to ``most`` of the queue, in order, that fit beside the running and decided
        ones (slots, KV blocks, and stage 1's ``load`` prefill rows), with their tickets;
        their blocks are held from now on."""
        slots = min(most, self.max_batch - len(self.running) - len(self.decided))
        out = decide_joins(self.queue, held=self.reserved, load=load, slots=slots,
                           budget=self.kv_budget, chunk=self.prefill_chunk,
                           pipelined=self.pipelined)
        tickets = [self.queue.popleft() for _ in out]
        self.reserved += sum(self._blocks(t) for t in tickets)
        return list(zip(out, tickets, strict=True))

    def _join(self, admitted: list[tuple[Admission, Ticket]]) -> tuple[Admission, ...]:
        """The admitted requests start: prefilling with their layouts, or (unpipelined)
        decoding, the executor prefilling them whole before the step."""
        for a, t in admitted:
            self.running.append(
                Prefilling(t, PrefillLayout(t.rows, chunk_of(t, self.prefill_chunk), a.head))
                if self.pipelined else self._decoding(t))
        return tuple(a for a, _ in admitted)

    def _forget_decided(self) -> tuple[RequestId, ...]:
        """Decided joiners cancelled before they joined leave; their blocks go back."""
        gone = tuple(t.rid for _, t in self.decided if t.rid in self.cancelled)
        for _, t in self.decided:
            if t.rid in gone:
                self.reserved -= self._blocks(t)
                self.cancelled.discard(t.rid)
        self.decided = [(a, t) for a, t in self.decided if t.rid not in gone]
        return gone

    def _feed(self) -> tuple[Chunk, ...]:
        """Each prefilling request's next chunk into stage 1, in arrival order."""
        chunks: list[Chunk] = []
        for r in self.running:
            if isinstance(r, Prefilling):
                a, b = r.layout.bounds(r.fed)
                if b > a:
                    chunks.append(Chunk(r.ticket.rid, r.fed, a, b))
                    r.fed += 1
        return tuple(chunks)

    def _next_load(self) -> int:
        """Prefill rows stage 1 computes in the next step from the requests running."""
        return sum(r.layout.rows_in(r.fed) for r in self.running if isinstance(r, Prefilling))

    def _blocks(self, t: Ticket) -> int:
        """The blocks a request's worst case holds against the budget (0: no budget)."""
        return t.blocks if self.kv_budget is not None else 0

    # ---- a distributed pipeline: its line is in Redis, its barrier applies the joins ----
    def line_is(self, tickets: Iterable[Ticket]) -> None:
        """The joining line as it stands now (gateways add to it and cancels take from it
        outside this process): the queue becomes its tickets that are neither decided
        nor running, in order."""
        known = {r.ticket.rid for r in self.running} | {t.rid for _, t in self.decided}
        self.queue = deque(t for t in tickets if t.rid not in known)

    def joined(self, rids: Collection[RequestId]) -> None:
        """The requests a barrier let join: a decided one it did not (cancelled in line,
        or the line moved under it) is forgotten, its blocks freed; still in line, it is
        decided again."""
        for _, t in self.decided:
            if t.rid not in rids:
                self.reserved -= self._blocks(t)
        self.decided = [(a, t) for a, t in self.decided if t.rid in rids]

    def resume(self, admission: Admission, ticket: Ticket) -> None:
        """A request a new epoch restarts from its log: it joins at the next plan."""
        self.decided.append((admission, ticket))
        self.reserved += self._blocks(ticket)

    def holds(self, rid: RequestId) -> bool:
        """Whether the request is running or decided to join."""
        return any(r.ticket.rid == rid for r in self.running) or \
            any(t.rid == rid for _, t in self.decided)

    # ---- what the executor reports -----------------------------------------------------
    def update(self, out: StepOutputs) -> dict[RequestId, int]:
        """The step's verdicts: the policy learns the verified ranks of the requests that go
        on or were cancelled, then chooses the width of every going request's next level
        (returned, and kept for the plan), in admission order."""
        if self.policy is not None:
            # one rule for both executors, which learn a request's end at different
            # times: a token that ended its request by the stop rule teaches the rates
            # nothing (the runtime's barrier ends the request before its draft service
            # ranks it); a cancel keeps the token its step verified, which is ranked, and
            # the request still counts in that step's choice (the engine's cancel lands
            # after it: the cancelled request's width is chosen and never used)
            cancelled = {rid for rid, _ in out.ranks if rid in self.cancelled}
            learn = set(out.going) | cancelled
            ranks = [(rid, rank) for rid, rank in out.ranks if rid in learn]
            choosing = [r.ticket.rid for r in self.running if r.ticket.rid in learn]
            for rid, w in choose_widths(self.policy, ranks, choosing).items():
                self._decoding_state(rid).width = w
        return {rid: self._decoding_state(rid).width for rid in out.going}

    def observe_level(self, rid: RequestId, offered: int) -> None:
        """How many proposals a request's new level could draw from (the policy's cap),
        learnt at the next plan (:meth:`_learn_levels`)."""
        if self.policy is not None and offered >= 0:
            self.levels.append((rid, offered))

    def _learn_levels(self, leave: Collection[RequestId]) -> None:
        """The policy learns the levels grown since the last plan, but those of requests
        that ``leave`` at it: such a level never runs.  A request cancelled after its
        width step still counts in it (:meth:`update`), and the engine then grows its
        level, while the runtime's barrier has ended it before it grows one: learnt, it
        would make the two executors' estimates differ, and so their choices."""
        levels, self.levels = self.levels, []
        if self.policy is not None:
            for rid, offered in levels:
                if rid not in leave and self.holds(rid):
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
        return Decoding(t, 1 if self.adaptive else self.width)

    def _decoding_state(self, rid: RequestId) -> Decoding:
        st = self.state(rid)
        assert isinstance(st, Decoding), f"request {rid} is still prefilling"
        return st

    def _retire(self, rids: Iterable[RequestId]) -> None:
        for rid in rids:
            st = self.state(rid)
            self.running.remove(st)
            self.cancelled.discard(rid)
            self.reserved -= self._blocks(st.ticket)
            if self.policy is not None:
                self.policy.forget(rid)
