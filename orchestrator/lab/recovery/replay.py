"""The SpecPipe truth replay, observed step by step (what miss recovery needs to know).

:func:`observed_replay` is ``draft_eval.simulate_specpipe``'s loop with one addition: it
records, per step, how many live nodes every stage holds and how many enter stage 1,
and, per verification, its step, its outcome and what the root's own proposals and
issued children were.  ``simulate_specpipe`` returns only totals (hits, verified,
steps, and the kept heights), so the projection could not be built on it; a test checks
that both loops agree on those totals.  The seam the step loop would need so that this
copy can go: an observer called once per step with (step, the stages' node ids after
pruning, the verdict and the root's children), e.g. ``simulate_specpipe(...,
observe=callback)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    """``simulate_specpipe`` (same schedule, same verdicts through the step core), observed."""
    rp = Replay(stages, width)
    source.reset(list(prompt))
    owner = TreeOwner(source, width, topk, list(prompt))
    owner.start(truth[0])
    assert owner.tree is not None
    done = 1
    inbox: list[torch.Tensor | None] = [None] * stages
    inbox[0] = owner.tree.ids[:1].clone()
    while done < len(truth):
        rp.steps += 1
        tree = owner.tree
        assert tree is not None
        out = [ids if ids is not None and ids.numel() else None for ids in inbox]
        rp.entering.append(int(out[0].numel()) if out[0] is not None else 0)
        rp.held.append([int(o.numel()) if o is not None else 0 for o in out])
        if out[0] is not None:
            owner.propose(tree.index_of(out[0]))
        verdict = None
        if out[-1] is not None:
            kids = owner.tree.tokens[owner.tree.children(0)].tolist()
            top1 = _top1(owner)
            verdict = owner.decide(truth[done])
            rp.verifications.append(Verification(done, truth[done], rp.steps, verdict.hit,
                                                 top1 == truth[done], kids))
            owner.apply(verdict)
            done += 1
            if done == len(truth):
                break
        tree = owner.tree
        assert tree is not None
        for i in range(stages - 1, 0, -1):
            prev = out[i - 1]
            inbox[i] = prev[torch.isin(prev, tree.ids)] if prev is not None else None
        new_idx = owner.grow(verdict)
        inbox[0] = tree.ids[new_idx]
    return rp


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
