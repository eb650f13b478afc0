"""The SpecPipe truth replay, observed step by step (what miss recovery needs to know).

:func:`observed_replay` runs ``draft_eval.simulate_specpipe``'s replay (the shared step
loop, :func:`~stages.speculation.loop.pipeline_step`) and records, per step, how many
live nodes every stage holds and how many enter stage 1, and, per verification, its
step, its outcome and what the root's own proposals and issued children were.
``simulate_specpipe`` returns only totals (hits, verified, steps, and the kept
heights); a test checks that both agree on those totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from orchestrator.lab.drafting.draft_eval import LevelStats, TruthReplay
from stages.speculation.loop import Checked, Flight, Lane, TreeLane, pipeline_step
from stages.speculation.step import TreeOwner
from stages.speculation.token_sources import TokenSource


@dataclass
class Verification:
    """One verification of the replay: the target's token ``truth[index]`` at the root."""

    index: int  # position in truth (1 .. len(truth) - 1)
    token: int  # truth[index]
    step: int  # 1-based step whose last stage verified it
    hit: bool  # one of the root's issued children carried the token
    top1: bool  # the source's own best proposal for the root was the token
    children: list[int]  # tokens of the root's issued children (what a correction must avoid)


@dataclass
class Replay:
    """What one replay saw, per step and per verification."""

    stages: int
    width: int
    steps: int = 0
    entering: list[int] = field(default_factory=list)  # per step: nodes entering stage 1
    # per step: live nodes held by stage s (index s - 1) during the step, as the level
    # entering stage 1 was chosen (the previous barrier's pruning applied)
    held: list[list[int]] = field(default_factory=list)
    verifications: list[Verification] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(v.hit for v in self.verifications)


def _top1(owner: TreeOwner) -> int | None:
    assert owner.tree is not None
    prop = owner.proposals.get(owner.tree.root_id)
    if prop is None or not prop[0].numel():
        return None
    toks, probs = prop
    return int(toks[int(torch.argmax(probs))])


def observed_replay(source: TokenSource, prompt: list[int], truth: list[int], stages: int,
                    width: int, topk: int) -> Replay:
    """``simulate_specpipe``'s replay (the shared step loop, :class:`TruthReplay`'s
    compute), observed: what every stage holds as each step starts, and what each
    verification found."""
    rp = Replay(stages, width)
    source.reset(list(prompt))
    owner = TreeOwner(source, width, topk, list(prompt))
    owner.start(truth[0])
    lane = TreeLane(owner, stages)
    replay = _ObservedTruth(lane, truth, rp)
    while replay.done < len(truth):
        rp.steps += 1
        held = [lane.size(f) if f is not None else 0 for f in lane.inbox]
        rp.entering.append(held[0])
        rp.held.append(held)
        if pipeline_step([lane], replay, stages):
            break
    return rp


class _ObservedTruth(TruthReplay):
    """:class:`TruthReplay` that records each verification: the root's issued children
    and the source's own best proposal, read before the verdict prunes them."""

    def __init__(self, lane: TreeLane, truth: list[int], rp: Replay):
        super().__init__(lane, truth, LevelStats())
        self.rp = rp
        self._seen: tuple[list[int], int | None] = ([], None)

    def verify(self, roots: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[int]:
        """The truth, after noting what the root offered."""
        owner = self.lane.owner
        assert owner.tree is not None
        self._seen = (owner.tree.tokens[owner.tree.children(0)].tolist(), _top1(owner))
        return super().verify(roots)

    def settle(self, lane: Lane[Flight, int], checked: Checked, found: int) -> bool:
        """Record the verification, then count it."""
        kids, top1 = self._seen
        self.rp.verifications.append(Verification(self.done, found, self.rp.steps,
                                                  checked.hit, top1 == found, kids))
        return super().settle(lane, checked, found)


def replay_to_json(rp: Replay) -> dict:
    """A replay as plain JSON (so projections can be redone without replaying)."""
    return {"stages": rp.stages, "width": rp.width, "steps": rp.steps, "entering": rp.entering,
            "held": rp.held, "verifications": [
                [v.index, v.token, v.step, int(v.hit), int(v.top1), v.children]
                for v in rp.verifications]}


def replay_from_json(d: dict) -> Replay:
    rp = Replay(d["stages"], d["width"], d["steps"], d["entering"], d["held"])
    rp.verifications = [Verification(i, t, s, bool(h), bool(t1), list(c))
                        for i, t, s, h, t1, c in d["verifications"]]
    return rp


__all__ = ["Verification", "Replay", "observed_replay", "replay_to_json", "replay_from_json"]
