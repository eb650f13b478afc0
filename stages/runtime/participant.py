"""What every pipeline worker shares: the control loop, heartbeats and waiting for input.

A participant (stage worker or draft service) reacts to its control list in the
synchroniser: ``start`` (a request, or a restart of one under a new epoch) and
``step`` (the verdict of a finished step).  Between verdicts it waits for its
link input; while waiting it watches the control list so that a new epoch
(a restarted peer, a re-plan) interrupts a wait that would never end.
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
from protocol.sync.synchroniser import (
    LOST,
    BadRequestState,
    RequestState,
    Synchroniser,
    is_lost,
    with_reconnect,
)
from stages.runtime.stats import StepStats

log = logging.getLogger("treepipe.worker")
INPUT_POLL_S = 0.05
# link messages kept for a request or epoch this worker has not started yet; a few at
# most are in flight at once (a prefill, a level), and each may be large
EARLY_MAX = 4
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
        self.rid: str | None = None
        self.epoch = -1
        self.step = -1
        self.stop = threading.Event()
        self.dim = 0
        self.dtype = torch.float32
        self.stats = StepStats()
        self._arrived_at: float | None = None  # when the last arrive was called
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
            # step 0's barrier waits for every prefill: prefill time, not a decode step's
            if msg.step == 0:
                self.stats.prefill_s += t0 - self._arrived_at
            else:
                self.stats.barrier_s += t0 - self._arrived_at
        self._arrived_at, self._not_compute = None, 0.0
        try:
            self.handle(msg)
        except Interrupted:
            log.info("%s: step %d of %s interrupted by a control message", self.name,
                     self.step, self.rid)
        finally:
            spent = time.perf_counter() - t0 - self._not_compute
            if isinstance(msg, Start):
                self.stats.prefill_s += spent
            else:
                self.stats.compute_s += spent

    def _pause(self, e: BaseException) -> None:
        """The synchroniser is gone (restarting, paused): wait for it, then rejoin.

        The step in flight is dropped: its arrive or verdict may be lost with the
        connection (or with the last second of Redis's log).  Once Redis answers, the
        request restarts from its persisted token log under a new epoch, so the
        tokens stay those of plain decoding.  Only after ``REDIS_WAIT_S`` does the
        worker give up (and its supervisor restarts it).
        """
        rid, epoch = self.rid, self.epoch
        self.next_ctl = None  # the new epoch's start message follows
        log.warning("%s: lost the synchroniser (%s); pausing step %d of %s until it is back",
                    self.name, e, self.step, rid)
        self.rid, self.step = None, -1
        status, detail = with_reconnect(lambda: self.sync.resume(rid or "", epoch),
                                        f"{self.name} rejoin", REDIS_WAIT_S, self.stop.is_set)
        log.warning("%s: synchroniser back (%s %s); the request resumes from its token log",
                    self.name, status.lower(), detail)

    def _join(self, startup: bool) -> None:
        status, detail = self.sync.join(self.name, self.layout_id, self.participants, startup)
        if status == "RESUMED":
            log.warning("%s joined: epoch %s, the running request resumes from its token "
                        "log", self.name, detail)
        elif startup:
            log.info("%s joined (%s, plan %s)", self.name, status.lower(), detail or "-")

    def handle(self, msg: Start | Step) -> None:
        """Dispatch one control message (parsed and checked by the synchroniser client)."""
        if isinstance(msg, Start):
            self.rid, self.epoch, self.step = msg.req, msg.epoch, 0
            # epochs only grow: what is kept from older ones will never be asked for
            self.early = [n for n in self.early if n.epoch >= self.epoch]
            try:
                self.begin(msg)
            except (BadRequestState, ValueError, TypeError) as e:
                # garbage in one request's stored fields fails that request, never the
                # worker: a crash here would restart into the same request, forever
                log.error("%s: request %s cannot run: %s", self.name, msg.req, e)
                self.sync.fail(msg.req, str(e))
                self.finish()
                self.rid, self.step = None, -1
        else:
            if (msg.req, msg.epoch, msg.step) != (self.rid, self.epoch, self.step):
                log.info("%s: ignored a verdict for %s/%s/%s", self.name, msg.req,
                         msg.epoch, msg.step)
                return
            if msg.verdict.done:
                self.finish()
                self.rid, self.step = None, -1
                self._beat()  # readers of the stats see the finished request at once
                return
            self.advance(msg.verdict)

    def stale(self, msg: Start | Step) -> bool:
        """Whether ``msg`` can change nothing here: the verdict of another request, epoch
        or step (a cancelled request's late verdict), or a start of an older epoch.
        :meth:`handle` ignores such a message too; :meth:`expect` must not let it
        interrupt the running step (that stalled the next request until the input timeout).
        """
        if isinstance(msg, Step):
            return (msg.req, msg.epoch, msg.step) != (self.rid, self.epoch, self.step)
        return msg.epoch < self.epoch

    def begin(self, msg: Start) -> None:
        """Load the request from the synchroniser, prefill, and arrive at step 0."""
        raise NotImplementedError

    def current_request(self, rid: str) -> RequestState | None:
        """The request's state if this worker takes part in its epoch, else None.

        A worker of another plan (a pod of a superseded layout, or one that started
        before the pipeline re-planned) never computes in this epoch: its layers
        would be the wrong ones, and the hidden sizes match, so nothing else would
        notice.  It waits for the epoch of its own plan, or for its replacement.
        """
        st = self.sync.request(rid)
        if st.status != "running" or st.epoch != self.epoch:
            self.rid = None
            return None
        if st.layout_id != self.layout_id:
            log.warning("%s: request %s epoch %d runs plan %s, not this worker's %s; "
                        "not taking part", self.name, rid, self.epoch, st.layout_id or "-",
                        self.layout_id or "-")
            self.rid = None
            return None
        return st

    def advance(self, verdict: Verdict) -> None:
        """Apply step ``self.step``'s verdict, run step ``self.step + 1`` and arrive."""
        raise NotImplementedError

    def finish(self) -> None:
        """The request is over: drop its state."""

    def arrive(self, token: int = -1, root_id: int = -1,
               children: list[tuple[int, int]] | None = None) -> None:
        # the barrier runs from here to the verdict; the arrive call is part of it
        self._arrived_at = t = time.perf_counter()
        step = self.step
        status = self.sync.arrive(self.rid or "", self.epoch, step, self.name, token,
                                  root_id, children or [])
        self.stats.steps += step > 0
        self._not_compute += time.perf_counter() - t
        if status in ("STALE", "GONE"):
            log.info("%s: request %s epoch %d is %s; waiting for control", self.name, self.rid,
                     self.epoch, status.lower())
            self.rid, self.step = None, -1

    def send(self, nodes: messages.Nodes) -> None:
        """Send ``nodes`` to the next worker, counting the time and bytes."""
        assert self.outbox is not None
        t = time.perf_counter()
        self.outbox.send_nodes(nodes)
        dt = time.perf_counter() - t
        self.stats.send_s += dt
        self.stats.sent_bytes = self.outbox.sent_bytes
        self._not_compute += dt

    # ---- input -------------------------------------------------------------------------
    def expect(self, kind: str, step: int) -> messages.Nodes:
        """The next link message of ``kind`` for this request, epoch and ``step``; the
        wait counts as input time, not compute (see :meth:`_expect`)."""
        t = time.perf_counter()
        try:
            return self._expect(kind, step)
        finally:
            dt = time.perf_counter() - t
            if kind == "prefill":
                self.stats.prefill_s += dt
            else:
                self.stats.input_s += dt
            self._not_compute += dt

    def _expect(self, kind: str, step: int) -> messages.Nodes:
        """The next link message of ``kind`` for this request, epoch and ``step``.

        A message of a request or epoch this worker has not started yet (its peer saw
        the control message first) is kept for later, not dropped: dropping it lost the
        new epoch's prefill and stalled the request until the input timeout.
        """
        assert self.inbox is not None
        want = (self.rid, self.epoch, kind, step)
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
                                 "step %d of %s", self.name, ctl, step, self.rid)
                        continue
                    self.next_ctl = ctl  # the run loop handles it once this step is dropped
                    raise Interrupted
                if time.monotonic() > deadline:
                    # a message lost around a peer's restart: restart the request from
                    # its token log under a new epoch rather than wait forever
                    log.error("%s: no %s input for step %d within %.0f s; starting a new epoch",
                              self.name, kind, step, self.input_timeout_s)
                    self.sync.resume(self.rid or "", self.epoch)
                    raise Interrupted
                continue
            try:
                nodes = messages.parse(msg, self.dim, self.dtype)
            except FrameError as e:
                self.inbox.rejected += 1
                log.warning("%s: dropped a bad %s message: %s", self.name, msg.kind, e)
                continue
            if (nodes.req, nodes.epoch) != (self.rid, self.epoch):
                if nodes.req == self.rid and nodes.epoch < self.epoch:
                    continue  # an older epoch of this request: in flight when it changed
                # another request or a newer epoch, whose control message is on its way
                self.early = [*self.early, nodes][-EARLY_MAX:]
                continue
            if nodes.step < step:
                continue  # an older step: in flight when things changed
            if nodes.kind != kind or nodes.step != step:
                log.warning("%s: dropped a %s message for step %d while expecting %s for %d",
                            self.name, nodes.kind, nodes.step, kind, step)
                continue
            return nodes

    # ---- liveness ----------------------------------------------------------------------
    def _beat(self) -> None:
        self.sync.heartbeat(self.name, {"pid": os.getpid(), "inc": self.incarnation,
                                        "plan": self.layout_id, "req": self.rid,
                                        "epoch": self.epoch, "step": self.step,
                                        "rejected": self.inbox.rejected if self.inbox else 0,
                                        "stats": self.stats.as_dict()})

    def _heartbeats(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self._beat()
                # take over from a plan that cannot run; start a pending epoch once
                # everyone is up (protocol/sync/lua/join.lua)
                self._join(startup=False)
            except Exception as e:  # noqa: BLE001 - a lost heartbeat must not kill the worker
                log.warning("heartbeat failed: %s", e)
