"""The SpecPipe schedule (Algorithm 1), written once: compute, verify, shift, grow.

Every pipeline step each stage works on what waits at its input, the last stage
verifies the root that reached it, the verdict prunes what is in flight, the
survivors move one stage on and a new level enters stage 1.  :func:`pipeline_step`
is that schedule for any number of requests (*lanes*) sharing the step; what the
work costs and what verification finds is plugged in as a :class:`StepCompute`:

* torch stages: the in-process engine (one request) and
  :class:`~stages.speculation.batch.BatchRun` (many, in packed forwards);
* remote stages: the distributed runtime's draft service, which owns every tree and
  follows what waits at each stage's input while the stage workers compute it; its step
  is split by the barrier that brings the verdicts (:func:`begin_step`, :func:`end_step`);
* truth replay: ``draft eval`` verifies against the target's known tokens;
* node-count pricing: the simulator's lanes hold node counts, not trees.

A lane is one request's side of the schedule: what waits at each stage's input
and how a verdict prunes it (:class:`TreeLane` for a real tree through its
:class:`~stages.speculation.step.TreeOwner`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from protocol.sync.control import Verdict
from stages.model.kv_cache import StageCache
from stages.speculation.step import TreeOwner
from stages.speculation.token_sources import sync_cache

__all__ = ["Flight", "Checked", "Lane", "TreeLane", "StepCompute", "pipeline_step", "begin_step",
           "end_step"]

F = TypeVar("F")  # what waits at a stage's input: a Flight, or a node count
T = TypeVar("T")  # what verification finds: a token, or a simulated outcome


@dataclass
class Flight:
    """Nodes waiting at a stage's input: their ids and what the stage consumes."""

    ids: Tensor
    x: Tensor  # token ids for stage 1, hidden states otherwise

    def keep(self, alive: Tensor) -> Flight:
        """The nodes among ``alive`` (the survivors of a verdict)."""
        m = torch.isin(self.ids, alive)
        return Flight(self.ids[m], self.x[m])


@dataclass(frozen=True)
class Checked:
    """What one verification did to a lane: hit or miss, and what it cost."""

    hit: bool
    flushed: int  # nodes in flight that a miss dropped (0 on a hit)
    owner_s: float = 0.0  # the tree owner's pruning (tree, source, proposals)
    prune_s: tuple[float, ...] = ()  # per stage: pruning its KV cache
    late: int = 0  # a hit on a correction child: the steps it trails (a re-root)


class Lane(ABC, Generic[F, T]):
    """One request's side of the schedule: what waits at each of the m stages' inputs."""

    def __init__(self, m: int, first: F):
        self.inbox: list[F | None] = [None] * m
        self.inbox[0] = first  # the first root enters stage 1

    @abstractmethod
    def size(self, f: F) -> int:
        """Nodes in ``f`` (0: nothing to compute)."""

    def is_root(self, f: F) -> bool:
        """Whether ``f``, at the last stage, is the tree's root (there to be verified)."""
        return True

    @abstractmethod
    def verify(self, found: T, out: Sequence[F | None]) -> Checked:
        """The verdict on the root (``found`` by the compute): prune the tree.  ``out``
        is what every stage produced this step."""

    @abstractmethod
    def keep(self, f: F) -> F | None:
        """What of a stage's output survives this step's verdict (all, without one)."""

    @abstractmethod
    def grow(self) -> F | None:
        """What enters stage 1 next: a new root after a miss, else the next level; it
        ends the step (the lane forgets the step's verdict)."""


class StepCompute(Protocol[F, T]):
    """What an executor plugs into :func:`pipeline_step`: the work and what it finds."""

    def forward(self, i: int, work: Sequence[tuple[Lane[F, T], F]]) -> Sequence[F]:
        """Stage i on each lane's input (called for every stage, ``work`` possibly
        empty); one output per lane."""

    def propose(self, work: Sequence[tuple[Lane[F, T], F]]) -> None:
        """The draft expands the nodes entering stage 1 this step."""

    def verify(self, roots: Sequence[tuple[Lane[F, T], F]]) -> Sequence[T]:
        """What verification finds at each root the last stage holds."""

    def settle(self, lane: Lane[F, T], checked: Checked, found: T) -> bool:
        """Book one lane's verdict (counts, the token); True when the request is done."""

    def going(self, lanes: Sequence[Lane[F, T]]) -> None:
        """The lanes that go on, before they grow (a width policy chooses here)."""

    def sent(self, lane: Lane[F, T], i: int, f: F) -> None:
        """``f`` now waits at stage i's input (i = 0: the new level from the draft)."""


def pipeline_step(lanes: Sequence[Lane[F, T]], compute: StepCompute[F, T],
                  stages: int) -> list[int]:
    """One pipeline step of every lane over ``stages`` stages (each stage's forward runs
    even with no lane there: an executor may have other rows for it, a prompt chunk);
    returns the indices of the lanes that finished (they do not shift or grow)."""
    return end_step(lanes, compute, begin_step(lanes, compute, stages))


def begin_step(lanes: Sequence[Lane[F, T]], compute: StepCompute[F, T],
               stages: int) -> list[list[F | None]]:
    """The first half of :func:`pipeline_step`: every stage on what waits at its input,
    and the draft's expansion of what entered stage 1; returns each lane's stage outputs.

    An executor whose step is split by a barrier (the distributed runtime's draft
    service: its stages compute in other processes, the verdicts come at the barrier)
    calls the halves on either side of it."""
    return _compute(lanes, compute, stages)


def end_step(lanes: Sequence[Lane[F, T]], compute: StepCompute[F, T],
             out: Sequence[list[F | None]]) -> list[int]:
    """The second half of :func:`pipeline_step`: verification, pruning, then the survivors
    shift and a new level grows; ``out`` is :func:`begin_step`'s, lane by lane.  Returns
    the indices of the lanes that finished."""
    done = _verify(lanes, compute, out)
    going = [k for k in range(len(lanes)) if k not in done]
    compute.going([lanes[k] for k in going])
    for k in going:
        _shift_and_grow(lanes[k], compute, out[k])
    return sorted(done)


def _compute(lanes: Sequence[Lane[F, T]], compute: StepCompute[F, T],
             m: int) -> list[list[F | None]]:
    """1. node-wise computation: every stage on what waits at its input."""
    out: list[list[F | None]] = [[None] * m for _ in lanes]
    for i in range(m):
        work = [(k, f) for k, lane in enumerate(lanes)
                if (f := lane.inbox[i]) is not None and lane.size(f)]
        res = compute.forward(i, [(lanes[k], f) for k, f in work])
        for (k, _), o in zip(work, res, strict=True):
            out[k][i] = o
    entering = [(lane, f) for lane in lanes
                if (f := lane.inbox[0]) is not None and lane.size(f)]
    compute.propose(entering)
    return out


def _verify(lanes: Sequence[Lane[F, T]], compute: StepCompute[F, T],
            out: Sequence[list[F | None]]) -> set[int]:
    """Verification at the last stage and 2. pruning propagation, lane by lane."""
    arrived = [(k, f) for k, lane in enumerate(lanes)
               if (f := out[k][-1]) is not None and lane.is_root(f)]
    found = compute.verify([(lanes[k], f) for k, f in arrived])
    done: set[int] = set()
    for (k, _), x in zip(arrived, found, strict=True):
        if compute.settle(lanes[k], lanes[k].verify(x, out[k]), x):
            done.add(k)
    return done


def _shift_and_grow(lane: Lane[F, T], compute: StepCompute[F, T],
                    out: list[F | None]) -> None:
    """3. transmission: the survivors move one stage on, then a new level enters stage 1."""
    for i in range(len(out) - 1, 0, -1):
        prev = out[i - 1]
        lane.inbox[i] = lane.keep(prev) if prev is not None else None
        kept = lane.inbox[i]
        if kept is not None:
            compute.sent(lane, i, kept)
    lane.inbox[0] = lane.grow()
    first = lane.inbox[0]
    if first is not None:
        compute.sent(lane, 0, first)


class TreeLane(Lane[Flight, int]):
    """A request's real tree through its owner; verification finds the target's token.

    ``caches`` (one per stage, none for a replay) are pruned with the tree.
    """

    def __init__(self, owner: TreeOwner, m: int, caches: Sequence[StageCache] = ()):
        assert owner.tree is not None, "start the owner's tree first"
        super().__init__(m, Flight(owner.tree.ids[:1], owner.tree.tokens[:1]))
        self.owner, self.caches = owner, list(caches)
        self.verdict: Verdict | None = None  # this step's, until it grows
        # the id a miss gives the new root: -1 takes a fresh one; the runtime's draft
        # service reserves it a step ahead, for the barrier to tell every stage
        self.new_root = -1

    def size(self, f: Flight) -> int:
        """Nodes in ``f``."""
        return int(f.ids.numel())

    def verify(self, found: int, out: Sequence[Flight | None]) -> Checked:
        """Decide the verdict for the verified token, prune the tree and every cache."""
        owner = self.owner
        assert owner.tree is not None
        verdict = self.verdict = owner.decide(found, self.new_root)
        flushed = 0 if verdict.hit else len(owner.tree) - 1
        late = owner.lateness(verdict.child) if verdict.hit and owner.recovery.k else 0
        t = time.perf_counter()
        verified = owner.apply(verdict)
        owner_s = time.perf_counter() - t
        assert verified is not None and owner.tree is not None
        prune_s = []
        for cache in self.caches:
            t = time.perf_counter()
            sync_cache(cache, owner.tree, [verified])
            prune_s.append(time.perf_counter() - t)
        return Checked(verdict.hit, flushed, owner_s, tuple(prune_s), late)

    def keep(self, f: Flight) -> Flight:
        """The nodes of ``f`` still in the tree."""
        assert self.owner.tree is not None
        return f.keep(self.owner.tree.ids)

    def grow(self) -> Flight:
        """The owner's next level (or new root) as a flight into stage 1."""
        tree = self.owner.tree
        assert tree is not None
        idx = self.owner.grow(self.verdict)  # grows the tree: index its ids after
        self.verdict = None
        return Flight(tree.ids[idx], tree.tokens[idx])

    def index(self, f: Flight) -> Tensor:
        """Tree indices of ``f``'s nodes."""
        assert self.owner.tree is not None
        return self.owner.tree.index_of(f.ids)
