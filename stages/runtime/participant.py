"""What every pipeline worker shares: the control loop, heartbeats and waiting for input.

A participant (stage worker or draft service) steps a batch of requests in lock
step with the others.  It reacts to its control list in the synchroniser:
``start`` (a new epoch: the batch's requests, each from its token log) and
``step`` (the verdicts of a finished step, one per request, and the requests that
join in the next step).  Each step it advances every request it holds, runs a
prefill chunk of each joining one (pipelined: a prompt takes its chunks + stages - 1
steps, beside the others' steps: RequestState.prefill_steps), and arrives at the
step's one barrier with a report per request.  Between verdicts it waits for its
link input; while waiting it watches the control list so that a new epoch (a
restarted peer, a re-plan) interrupts a wait that would never end.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from protocol.links import messages
from protocol.links.frames import FrameError
from protocol.links.transport import Inbox, Outbox
from protocol.sync.control import Start, Step, Verdict
from protocol.sync.heartbeat import Heartbeat, KvUse, StepStats
from protocol.sync.synchroniser import (
    LOST,
    BadRequestState,
    Join,
    Report,
    RequestState,
    SyncError,
    Synchroniser,
    is_lost,
    with_reconnect,
)

log = logging.getLogger("treepipe.worker")
INPUT_POLL_S = 0.05
# link messages kept for later (another request of the step, a request or epoch this
# worker has not started yet): a few per request at most are in flight at once (a
# prefill, a level), each may be large, and a batch holds a bounded number of requests
EARLY_MAX = 4  # per request and epoch
EARLY_REQUESTS = 128  # distinct requests (twice the largest batch a manifest allows)
ENDED_KEPT = 1024  # ended requests whose late messages are dropped on arrival
# how long a worker waits for a lost synchroniser before it gives up and exits
REDIS_WAIT_S = 600.0


class Interrupted(Exception):
    """A control message arrived while waiting for input: drop the step."""


class Participant:
    """Base of the stage worker and the draft service."""

    def __init__(self, name: str, sync: Synchroniser, inbox: Inbox | None,
                 outbox: Outbox | None = None, input_timeout_s: float = 60.0,
                 layout_id: str = "", participants: Sequence[str] | None = None):
        self.name, self.sync, self.inbox, self.outbox = name, sync, inbox, outbox
        self.input_timeout_s = input_timeout_s
        # the stage layout this worker was started with; see protocol/sync/lua/join.lua
        self.layout_id, self.participants = layout_id, list(participants or [])
        self.incarnation = uuid.uuid4().hex
        self.early: list[messages.Nodes] = []
        # a control message popped while waiting for input, handled next (see expect)
        self.next_ctl: Start | Step | None = None
        self.epoch = -1
        self.step = -1  # the batch's step in this epoch; -1: no batch
        # the requests this worker holds, and the batch step of each one's step 0 (its
        # prefill's last step)
        self.joined: dict[str, int] = {}
        # the requests whose prefill has steps left, and their states
        self.prefilling: dict[str, RequestState] = {}
        # (request, epoch) of the requests that ended here lately, oldest first
        self.ended: dict[tuple[str, int], None] = {}
        self.joining: tuple[str, ...] = ()  # the requests whose prefill chunk runs now
        self.more = False  # requests wait in line to join (the last control message said)
        # (this worker's stage index, -1 for the draft service; the plan's stage count)
        self.position = (-1, 1)
        self.stop = threading.Event()
        self.dim = 0
        self.dtype = torch.float32
        self.stats = StepStats()
        self._arrived_at: float | None = None  # when the last arrive was called
        self._decoded = False  # whether the last arrive's step advanced a decoding request
        self._not_compute = 0.0  # time of the handled message spent outside compute

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        """Join the pipeline, then serve control messages until ``stop`` is set."""
        # heartbeat first: joining checks that every participant (this one too) is up
        self._beat()
        self._join(startup=True)
        hb = threading.Thread(target=self._heartbeats, daemon=True, name="heartbeat")
        hb.start()
        log.info("%s ready", self.name)
        try:
            while not self.stop.is_set():
                try:
                    self._serve_one()
                except LOST as e:
                    if not is_lost(e):
                        raise
                    self._pause(e)
        finally:
            self.stop.set()
            hb.join(5)
            try:
                self.sync.leave(self.name, self.incarnation)  # peers need not wait out the TTL
            except Exception as e:  # noqa: BLE001 - exiting anyway; the heartbeat expires
                log.warning("leave failed: %s", e)

    def _serve_one(self) -> None:
        msg, self.next_ctl = self.next_ctl, None
        if msg is None:
            msg = self.sync.wait_ctl(self.name, 1.0)
        if msg is None:
            return
        t0 = time.perf_counter()
        if self._arrived_at is not None and isinstance(msg, Step):
            # a barrier of a step that only prefilled (step 0 of an epoch, or a chunk of a
            # joining request while none decoded) is prefill time, not a decode step's
            if not self._decoded:
                self.stats.prefill_s += t0 - self._arrived_at
            else:
                self.stats.barrier_s += t0 - self._arrived_at
        self._arrived_at, self._not_compute = None, 0.0
        try:
            self.handle(msg)
        except Interrupted:
            # the requests' states may be half-advanced: only a new epoch goes on from here
            log.info("%s: step %d of epoch %d interrupted by a control message", self.name,
                     self.step, self.epoch)
            self.drop_all()
        finally:
            spent = time.perf_counter() - t0 - self._not_compute
            if isinstance(msg, Start):
                self.stats.prefill_s += spent
            else:
                self.stats.compute_s += spent

    def _pause(self, e: BaseException) -> None:
        """The synchroniser is gone (restarting, paused): wait for it, then rejoin.

        The step in flight is dropped: its arrive or verdict may be lost with the
        connection (or with the last second of Redis's log).  Once Redis answers, every
        request restarts from its persisted token log under a new epoch, so the
        tokens stay those of plain decoding.  Only after ``REDIS_WAIT_S`` does the
        worker give up (and its supervisor restarts it).
        """
        epoch = self.epoch if self.step >= 0 else -1
        self.next_ctl = None  # the new epoch's start message follows
        log.warning("%s: lost the synchroniser (%s); pausing step %d of epoch %d until it is "
                    "back", self.name, e, self.step, self.epoch)
        self.drop_all()
        status, detail = with_reconnect(lambda: self.sync.resume(epoch),
                                        f"{self.name} rejoin", REDIS_WAIT_S, self.stop.is_set)
        log.warning("%s: synchroniser back (%s %s); the requests resume from their token logs",
                    self.name, status.lower(), detail)

    def _join(self, startup: bool) -> None:
        status, detail = self.sync.join(self.name, self.layout_id, self.participants, startup)
        if status == "RESUMED":
            log.warning("%s joined: epoch %s, the running requests resume from their token "
                        "logs", self.name, detail)
        elif startup:
            log.info("%s joined (%s, plan %s)", self.name, status.lower(), detail or "-")

    def handle(self, msg: Start | Step) -> None:
        """Dispatch one control message (parsed and checked by the synchroniser client)."""
        if isinstance(msg, Start):
            if msg.epoch <= self.epoch:
                log.info("%s: ignored a start of epoch %d (in %d)", self.name, msg.epoch,
                         self.epoch)
                return
            self.drop_all()
            self.epoch, self.step, self.more = msg.epoch, 0, msg.more
            # epochs only grow: what is kept from older ones will never be asked for
            self.early = [n for n in self.early if n.epoch >= self.epoch]
            self._run_step([], msg.reqs)
            return
        if (msg.epoch, msg.step) != (self.epoch, self.step):
            log.info("%s: ignored the verdicts of %d/%d (in %d/%d)", self.name, msg.epoch,
                     msg.step, self.epoch, self.step)
            return
        go: list[tuple[str, Verdict]] = []
        ended = False
        self.more = msg.more
        for rid, verdict in msg.verdicts:
            if rid not in self.joined:
                continue  # this worker could not run it (it failed the request)
            if verdict.done:
                self._finish(rid)
                ended = True
            else:
                go.append((rid, verdict))
        if not msg.goes_on:
            self.drop_all()  # the batch is empty: wait for the next start
        else:
            self.step += 1
            self._run_step(go, msg.join)
        if ended:
            self._beat()  # readers of the stats see the finished requests at once

    def _run_step(self, go: list[tuple[str, Verdict]], joining: Sequence[str]) -> None:
        """One step of the batch: advance the decoding requests in ``go`` by their
        verdicts, run the next prefill chunk of the ``joining`` ones (whose prefill starts
        now) and of those still prefilling, and arrive once with every request's report."""
        reports: dict[str, Report] = {}
        decoding = [(rid, v) for rid, v in go if rid not in self.prefilling]
        self.joining = tuple(rid for rid, _ in go if rid in self.prefilling) + tuple(joining)
        if decoding:
            self.advance(decoding, reports)
        states = self._load(joining)
        if states is None:
            return  # not taking part in this epoch
        if self.joining:
            self.position = self.stage_position()
        stages = self.position[1]
        for st in states:
            # its step 0 is its prefill's last step (arrive.lua sets the same 'joined')
            self.joined[st.rid] = self.step + st.prefill_steps(stages) - 1
            self.prefilling[st.rid] = st
        chunks = [(st, self.prefill_step(rid, stages))
                  for rid, st in self.prefilling.items() if rid in self.joining]
        if chunks:
            self._prefill_timed(chunks, reports)
        for st, t in chunks:
            if t == st.prefill_steps(stages) - 1:
                self.prefilling.pop(st.rid, None)
        self.joining = ()
        self._decoded = bool(decoding)
        self.arrive(reports)

    def _prefill_timed(self, chunks: list[tuple[RequestState, int]],
                       reports: dict[str, Report]) -> None:
        """:meth:`prefill`, its compute counted as prefill time, not the step's compute
        (its input waits and sends are counted by :meth:`expect` and :meth:`send`)."""
        t, outside = time.perf_counter(), self._not_compute
        self.prefill(chunks, reports)
        spent = time.perf_counter() - t - (self._not_compute - outside)
        self.stats.prefill_s += spent
        self._not_compute += spent

    def _load(self, rids: Sequence[str]) -> list[RequestState] | None:
        """The joining requests' states; None if this worker does not take part in the epoch.

        A request whose stored fields cannot be read fails (every worker reads the same
        fields, so every worker leaves it out); the others go on.
        """
        out = []
        for rid in rids:
            try:
                st = self.sync.request(rid)
            except BadRequestState as e:
                # garbage in one request's stored fields fails that request, never the
                # worker: a crash here would restart into the same request, forever
                log.error("%s: request %s cannot run: %s", self.name, rid, e)
                self.sync.fail(rid, str(e))
                continue
            except SyncError as e:
                log.error("%s: request %s cannot run: %s", self.name, rid, e)
                continue
            if not self.takes_part(st):
                self.drop_all()
                return None
            out.append(st)
        return out

    def takes_part(self, st: RequestState) -> bool:
        """Whether this worker computes in the epoch that runs ``st``.

        A worker of another plan (a pod of a superseded layout, or one that started
        before the pipeline re-planned) never computes in this epoch: its layers
        would be the wrong ones, and the hidden sizes match, so nothing else would
        notice.  It waits for the epoch of its own plan, or for its replacement.  A
        request stored under a newer epoch means this one is over (a restart).
        """
        if st.epoch != self.epoch:
            log.info("%s: request %s runs in epoch %d, not %d; waiting for control", self.name,
                     st.rid, st.epoch, self.epoch)
            return False
        if st.layout_id != self.layout_id:
            log.warning("%s: request %s epoch %d runs plan %s, not this worker's %s; "
                        "not taking part", self.name, st.rid, self.epoch, st.layout_id or "-",
                        self.layout_id or "-")
            return False
        return True

    def stale(self, msg: Start | Step) -> bool:
        """Whether ``msg`` can change nothing here: the verdicts of another epoch or step
        (a finished batch's late verdicts), or a start of an epoch not newer than this
        one.  :meth:`handle` ignores such a message too; :meth:`expect` must not let it
        interrupt the running step (that stalled the next request until the input timeout).
        """
        if isinstance(msg, Step):
            return (msg.epoch, msg.step) != (self.epoch, self.step)
        return msg.epoch <= self.epoch

    def prefill(self, chunks: list[tuple[RequestState, int]], reports: dict[str, Report]) -> None:
        """Prefill step ``t`` of each ``(state, t)``: a stage computes the chunk
        ``state.prefill_chunk(t, stage index)`` (if any; its rows
        ``state.prefill_rows(chunk)``); the last step is the request's step 0. Add their
        reports."""
        raise NotImplementedError

    def plan_participants(self) -> list[str]:
        """The plan's participants in order: as started (``--stages``), else as registered."""
        return self.participants or self.sync.participants()

    def stage_position(self) -> tuple[int, int]:
        """(This worker's stage index, -1 for the draft service; the stage count) from the
        plan's participants: the draft service, then every stage in order."""
        names = self.plan_participants()
        index = names.index(self.name) - 1 if self.name in names else -1
        return index, max(len(names) - 1, 1)

    def advance(self, go: list[tuple[str, Verdict]], reports: dict[str, Report]) -> None:
        """Apply each request's verdict of the last step, run this step for all of them,
        and add their reports."""
        raise NotImplementedError

    def finish(self, rid: str) -> None:
        """Request ``rid`` is over (or the epoch is): drop its state."""

    def _finish(self, rid: str) -> None:
        self.finish(rid)
        self.joined.pop(rid, None)
        self.prefilling.pop(rid, None)
        # what its peers sent it in this epoch is never asked for now (a prompt chunk
        # is chunk x dim large): drop what is kept and what is still on its way; a newer
        # epoch's (a peer that started it first) is kept for that epoch
        self.early = [n for n in self.early if n.req != rid or n.epoch > self.epoch]
        self.ended[(rid, self.epoch)] = None
        while len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]

    def drop_all(self) -> None:
        """Leave the batch: drop every request's state (a new epoch restarts them)."""
        for rid in list(self.joined):
            self._finish(rid)
        self.joining = ()
        self.step = -1

    def local_step(self, rid: str) -> int:
        """Request ``rid``'s own step number in the batch's current step (0: its prefill's
        last step, below 0 its earlier chunks)."""
        return self.step - self.joined[rid]

    def arrive(self, reports: dict[str, Report]) -> None:
        # the barrier runs from here to the verdict; the arrive call is part of it
        self._arrived_at = t = time.perf_counter()
        step = self.step
        status = self.sync.arrive(self.epoch, step, self.name, reports, self.next_joins())
        self.stats.steps += self._decoded
        self._not_compute += time.perf_counter() - t
        if status == "STALE":
            log.info("%s: epoch %d is over; waiting for control", self.name, self.epoch)
            self.drop_all()

    def next_joins(self) -> list[Join]:
        """The requests that join at the next step (the scheduler's choice; only the draft
        service runs the scheduler)."""
        return []

    def prefill_step(self, rid: str, stages: int) -> int:
        """A prefilling request's prefill step now (0 .. its prefill steps - 1)."""
        st = self.prefilling[rid]
        return self.step - self.joined[rid] + st.prefill_steps(stages) - 1

    def send(self, parts: Sequence[messages.Nodes]) -> None:
        """Send every request's part of this hop to the next worker in one frame, counting
        the time and bytes."""
        assert self.outbox is not None
        t = time.perf_counter()
        self.outbox.send_nodes(parts)
        dt = time.perf_counter() - t
        self.stats.send_s += dt
        self.stats.sent_bytes = self.outbox.sent_bytes
        self._not_compute += dt

    # ---- input -------------------------------------------------------------------------
    def expect(self, rid: str, kind: str, step: int) -> messages.Nodes:
        """The next link message of ``kind`` for request ``rid``'s ``step`` in this epoch;
        the wait counts as input time, not compute (see :meth:`_expect`)."""
        t = time.perf_counter()
        try:
            return self._expect(rid, kind, step)
        finally:
            dt = time.perf_counter() - t
            if kind == "prefill":
                self.stats.prefill_s += dt
            else:
                self.stats.input_s += dt
            self._not_compute += dt

    def _keep(self, nodes: messages.Nodes) -> None:
        """Keep a message for later: at most :data:`EARLY_MAX` per request and epoch, of at
        most :data:`EARLY_REQUESTS` requests (the oldest messages go first)."""
        # a part is a view into its whole frame (every request's hop): a copy of its own
        # rows keeps the frame's memory from living as long as the part waits
        nodes = messages.Nodes(nodes.kind, nodes.req, nodes.epoch, nodes.step,
                               nodes.ids.clone(), nodes.parents.clone(), nodes.tokens.clone(),
                               *(None if t is None else t.clone()
                                 for t in (nodes.x, nodes.cand, nodes.cand_p)))
        key = (nodes.req, nodes.epoch)
        same = [i for i, n in enumerate(self.early) if (n.req, n.epoch) == key]
        drop = set(same[:max(0, len(same) + 1 - EARLY_MAX)])
        kept = [n for i, n in enumerate(self.early) if i not in drop] + [nodes]
        while len({(n.req, n.epoch) for n in kept}) > EARLY_REQUESTS:
            first = (kept[0].req, kept[0].epoch)
            kept = [n for n in kept if (n.req, n.epoch) != first]
        self.early = kept

    def _expect(self, rid: str, kind: str, step: int) -> messages.Nodes:
        """The next link message of ``kind`` for request ``rid``'s ``step`` in this epoch.

        A message of another request of the batch (the peer sent them in another order),
        or of a request or epoch this worker has not started yet (its peer saw the
        control message first), is kept for later, not dropped: dropping it lost the
        new epoch's prefill and stalled the request until the input timeout.
        """
        assert self.inbox is not None
        want = (rid, self.epoch, kind, step)
        for i, early in enumerate(self.early):
            if (early.req, early.epoch, early.kind, early.step) == want:
                return self.early.pop(i)
        deadline = time.monotonic() + self.input_timeout_s
        while True:
            msg = self.inbox.recv(INPUT_POLL_S)
            if msg is None:
                if self.stop.is_set():
                    raise Interrupted
                if self.sync.ctl_pending(self.name):
                    ctl = self.sync.pop_ctl(self.name)
                    if ctl is not None and self.stale(ctl):
                        log.info("%s: dropped a stale control message %s while waiting for "
                                 "step %d of %s", self.name, ctl, step, rid)
                        continue
                    self.next_ctl = ctl  # the run loop handles it once this step is dropped
                    raise Interrupted
                if time.monotonic() > deadline:
                    # a message lost around a peer's restart: restart the requests from
                    # their token logs under a new epoch rather than wait forever
                    log.error("%s: no %s input for step %d of %s within %.0f s; starting a "
                              "new epoch", self.name, kind, step, rid, self.input_timeout_s)
                    self.sync.resume(self.epoch)
                    raise Interrupted
                continue
            try:
                parts = messages.parse(msg, self.dim, self.dtype)
            except FrameError as e:
                self.inbox.rejected += 1
                log.warning("%s: dropped a bad %s message: %s", self.name, msg.kind, e)
                continue
            # the frame has every request's part of the hop: the one awaited, and the
            # others kept for the calls that ask for them
            found, stray = None, []
            for nodes in parts:
                verdict = self._sort(nodes, rid, kind, step)
                if verdict is True:
                    found = nodes
                elif verdict is None:
                    stray.append(f"{nodes.kind} {nodes.step}")
            if stray:  # once per frame: a buggy peer's frame may hold hundreds
                log.warning("%s: dropped %d part(s) of %s (%s) while expecting %s for step "
                            "%d", self.name, len(stray), rid, ", ".join(stray[:4]), kind, step)
            if found is not None:
                return found

    def _sort(self, nodes: messages.Nodes, rid: str, kind: str, step: int) -> bool | None:
        """True when ``nodes`` is what :meth:`_expect` waits for; else False when it is
        kept for later or dropped as stale, None when it should not be there at all."""
        if nodes.epoch < self.epoch:
            return False  # an older epoch: in flight when it changed
        if (nodes.req, nodes.epoch) in self.ended:
            return False  # sent before the request ended here (a cancel mid-prefill)
        if nodes.req != rid or nodes.epoch != self.epoch:
            # another request of this step, a newer epoch or a request that joins later,
            # whose control message is on its way
            self._keep(nodes)
            return False
        if nodes.step < step:
            return False  # an older step: in flight when things changed
        if nodes.kind == kind and nodes.step > step:
            self._keep(nodes)  # the next chunk or level, ahead of this one
            return False
        if nodes.kind != kind or nodes.step != step:
            return None
        return True

    # ---- liveness ----------------------------------------------------------------------
    def _beat(self) -> None:
        self.sync.heartbeat(self.name, Heartbeat(
            os.getpid(), self.incarnation, self.layout_id, ",".join(self.joined) or None,
            len(self.joined), self.epoch, self.step,
            self.inbox.rejected if self.inbox else 0, self.stats, self.kv_use()))

    def kv_use(self) -> KvUse | None:
        """The heartbeat's ``kv``: blocks of the KV pool, in use now and at most (None:
        this participant holds no pool)."""
        return None

    def _heartbeats(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self._beat()
                # take over from a plan that cannot run; start a pending epoch once
                # everyone is up (protocol/sync/lua/join.lua)
                self._join(startup=False)
            except Exception as e:  # noqa: BLE001 - a lost heartbeat must not kill the worker
                log.warning("heartbeat failed: %s", e)
