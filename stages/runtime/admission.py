"""The distributed runtime's scheduler: the scheduling core, fed by the joining line.

The draft service runs the scheduler of a distributed pipeline (docs/architecture.md
says why).  :class:`LineScheduler` keeps the core's
:class:`~protocol.scheduling.scheduler.Scheduler` (the one the in-process engine
runs) in step with the pipeline: its queue is the head of the joining line in Redis,
priced as the scheduler's tickets with the pools the participants report; the step's
barrier (arrive.lua) applies each plan's joiners; ends and cancels come back as
verdicts.  Each step it makes one :class:`~protocol.scheduling.plan.StepPlan`, as
the in-process engine does, so the two schedules can be compared plan by plan
(``TREEPIPE_PLAN_TRACE``: a file the plans are appended to, one JSON line each).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from protocol.scheduling.kv_blocks import kv_limit
from protocol.scheduling.plan import Admission, Decoding, Prefilling, StepPlan, Ticket
from protocol.scheduling.prefill import PrefillLayout
from protocol.scheduling.scheduler import Scheduler, StepOutputs, decide_joins
from protocol.scheduling.width import AdaptiveWidth
from protocol.sync.synchroniser import (
    BadRequestState,
    Join,
    RequestState,
    SyncError,
    Synchroniser,
)

log = logging.getLogger("treepipe.draft")
LINE_READ = 16  # requests of the line read per step at most: the first that waits ends it
TRACE_ENV = "TREEPIPE_PLAN_TRACE"  # a file each plan is appended to (off when unset)
# no batch limit of its own: the gateways' entry rule (slots) bounds the batch
UNBOUNDED = 1 << 30


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
        tickets = [ticket_of(st, stages, pool) for st in line]
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


def ticket_of(st: RequestState, stages: int, pool: int | None) -> Ticket:
    """A request as the scheduler prices it: the rows it prefills, its KV worst case at
    ``stages`` stages, its own prefill chunk, and its KV budget held to ``pool``."""
    return Ticket(st.rid, st.prefill_rows_total(), st.kv_need(stages), chunk=st.chunk,
                  budget=kv_limit(st.kv_budget, st.kv_cap, pool))


class LineScheduler:
    """The core's :class:`Scheduler` as the draft service runs it, one per epoch."""

    def __init__(self, sync: Synchroniser, width: int, adaptive: bool = False):
        self.sync, self.width, self.adaptive = sync, width, adaptive
        self.line = JoiningLine(sync)
        self.epoch = -1
        self.core = Scheduler(UNBOUNDED, width)
        self.states: dict[str, RequestState] = {}  # every request it decided or runs
        self.seen: set[str] = set()  # the requests seen in line in this epoch
        self.trace = os.environ.get(TRACE_ENV) or None
        self._cancelled: list[str] = []  # leave at the next plan (for the trace)
        # the ranks of tokens verified before a cancel ended their requests, learnt at the
        # next width step (Scheduler.update's rule)
        self._kept: list[tuple[str, int | None]] = []
        # the step prices of each width choice since the last plan, and the estimates it
        # read (for the trace)
        self._prices: list[list[tuple[float, float]]] = []
        self._read: list[dict[str, list]] = []
        self.start(-1, None)

    def start(self, epoch: int, policy: AdaptiveWidth | None) -> None:
        """A new epoch: a fresh scheduler (its requests restart from their token logs).

        The width policy forgets the requests the old one held: a restarted request is
        a new one to it (its pooled estimates stay).  The core forgets each request
        that leaves its plan; the draft service forgets none itself, as its barrier
        ends a cancelled request before the width step that still counts it."""
        old = self.core.policy
        if old is not None:
            for rid in [r.ticket.rid for r in self.core.running] + \
                    [t.rid for _, t in self.core.decided]:
                old.forget(rid)
        self.epoch, self.states, self.seen = epoch, {}, set()
        self._kept = []
        # kv_budget 0: every ticket carries the budget its gateway read (held to the pools)
        self.core = Scheduler(UNBOUNDED, self.width, kv_budget=0, policy=policy,
                              adaptive=self.adaptive)

    def use(self, policy: AdaptiveWidth) -> None:
        """The adaptive width policy chooses the widths from now on."""
        self.core.policy = policy

    def resume(self, st: RequestState, stages: int) -> None:
        """A request the epoch's start restarts: it joins at the epoch's first plan."""
        if not self.core.holds(st.rid):
            self.states[st.rid] = st
            self.core.resume(Admission(st.rid, st.head), ticket_of(st, stages, None))

    def barrier(self, ended: Sequence[str], joined: Sequence[str],
                ranks: Sequence[tuple[str, int | None]] = ()) -> None:
        """A barrier's outcome: the requests it ended (a cancelled one leaves at the next
        plan, as the engine's cancel does, and the ``ranks`` of the tokens it verified
        before that are learnt; the others are done) and those it let join."""
        rank = dict(ranks)
        ours = [rid for rid in ended if self.core.holds(rid)]
        for rid, got in zip(ours, self.sync.requests(ours) if ours else [], strict=True):
            self.states.pop(rid, None)
            if not isinstance(got, SyncError) and got.status == "cancelled":
                self.core.cancel(rid)
                self._cancelled.append(rid)
                if rid in rank:
                    self._kept.append((rid, rank[rid]))
            else:
                self.core.close((), done=[rid])
        self.core.joined(set(joined))

    def update(self, ranks: Sequence[tuple[str, int | None]],
               going: Sequence[str]) -> dict[str, int]:
        """The verdicts' ranks (and those the last barrier kept of cancelled requests):
        each going request's next width (the core's width step).
        Requests are taken in the order they joined, as the in-process engine takes
        them (the verdicts come sorted by id; the policy's choice depends on order)."""
        known = self._in_order(rid for rid in going
                               if isinstance(self.core_state(rid), Decoding))
        if len(known) < len(going):
            log.warning("the scheduler does not hold %s as decoding; their widths stay",
                        sorted(set(going) - set(known)))
        kept, self._kept = dict(self._kept), []
        rank = {**kept, **dict(ranks)}
        policy = self.core.policy
        priced = policy.priced if policy is not None else None
        out = self.core.update(StepOutputs(tuple((r, rank[r]) for r in self._in_order(rank)
                                                 if r in known or r in kept), tuple(known)))
        if policy is not None and policy.priced is not priced:  # it chose: a fresh table
            self._prices.append(sorted(policy.priced.items()))
            self._read.append(policy.read)
        return {str(k): w for k, w in out.items()}

    def observe_levels(self, offered: Sequence[tuple[str, int]]) -> None:
        """How many proposals each new level could draw from, in joining order."""
        n = dict(offered)
        for rid in self._in_order(n):
            self.core.observe_level(rid, n[rid])

    def _in_order(self, rids: Iterable[str]) -> list[str]:
        """``rids`` in the order the core admitted them."""
        wanted = set(rids)
        return [str(r.ticket.rid) for r in self.core.running if r.ticket.rid in wanted]

    def core_state(self, rid: str) -> Prefilling | Decoding | None:
        """The request's state in the core (None: it does not run there)."""
        return next((r for r in self.core.running if r.ticket.rid == rid), None)

    def plan(self, more: bool, names: Sequence[str], plan: str, stages: int,
             started: Sequence[str]) -> list[Join]:
        """The step's plan, made while it runs: the line as it stands (read only when the
        last barrier said requests wait), then who joins at the next step; ``started``
        finished their prefill in it."""
        tickets: list[Ticket] = []
        if more:
            line = self.line.read(self.epoch)
            if line:
                pool = self.sync.kv_pool(names, plan)
                tickets = [ticket_of(st, stages, pool) for st in line]
                self.states.update({st.rid: st for st in line})
        if self._kept:  # no request went on to a width step: learn them before they leave
            self.update([], [])
        self.core.line_is(tickets)
        seen = [t.rid for t in tickets if t.rid not in self.seen]
        self.seen.update(seen)
        step = self.core.schedule()
        self.core.close((), started=[r for r in started
                                      if isinstance(self.core_state(r), Prefilling)])
        self._write(step, seen)
        joins = []
        for a in step.next:
            st = self.states[str(a.rid)]
            steps = PrefillLayout(st.prefill_rows_total(), st.chunk, a.head).steps(stages)
            joins.append(Join(st.rid, a.head, steps))
        return joins

    def _write(self, step: StepPlan, seen: Sequence[object]) -> None:
        """Append the plan to the trace file, with the requests first seen in line, the
        cancels it applies and the step prices of the width choices made since the last
        plan (the inputs an in-process replay needs: measured step times differ), with
        the estimates each choice read (a replay checks its own against them)."""
        cancelled, self._cancelled = self._cancelled, []
        prices, self._prices = self._prices, []
        read, self._read = self._read, []
        if self.trace is None:
            return
        row = {"epoch": self.epoch, "seen": list(seen), "cancelled": cancelled,
               "plan": dataclasses.asdict(step), "prices": prices,
               "estimates": read}
        try:
            with Path(self.trace).open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            log.warning("cannot write the plan trace %s (%s); tracing stops", self.trace, e)
            self.trace = None
