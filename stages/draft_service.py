"""The draft service: owns the speculative tree and feeds stage 1 one level per step.

It runs the token-source half of the in-process engine's SpecPipe loop: expand
the level that enters stage 1 (beside stage 1's compute), and after each
verdict prune the tree, its own cache and the cached proposals, then pick the
next fixed-width level from those proposals.  With no token source it sends
only a new root after each verified token, which is plain pipeline
parallelism (``pp``).  At each barrier it tells the synchroniser the root's
children (token -> node id) so that every stage can prune its mirror of the
tree the same way, and reserves the id a new root takes on a miss.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from orchestrator.sync import Synchroniser
from protocol.transport import Outbox
from stages.engine import next_level
from stages.participant import Participant
from stages.token_sources import TokenSource
from stages.tree import SpecTree, new_ids
from stages.worker import apply_verdict

log = logging.getLogger("treepipe.draft")


class DraftService(Participant):
    """Token source and tree owner in the step barrier."""

    def __init__(self, name: str, sync: Synchroniser, source: TokenSource | None,
                 outbox: Outbox, width: int, topk: int, **kw: Any):
        super().__init__(name, sync, None, **kw)
        self.source, self.outbox = source, outbox
        self.width, self.topk = width, topk
        self.tree: SpecTree | None = None
        self.committed: list[int] = []
        self.proposals: dict[int, tuple[Tensor, Tensor]] = {}

    def begin(self, msg: dict[str, Any]) -> None:
        st = self.current_request(msg["req"])
        if st is None:
            return
        self.committed = st.prompt + st.log[:-1] if st.log else list(st.prompt)
        self.tree, self.proposals = None, {}
        if self.source is not None:
            with torch.inference_mode():
                self.source.reset(list(self.committed))
        self.arrive(root_id=int(new_ids(1)[0]))

    def advance(self, verdict: dict[str, Any]) -> None:
        token = int(verdict["token"])
        if self.step == 0:
            self.tree = SpecTree(token, len(self.committed), root_id=int(verdict["root"]))
            self.committed.append(token)
            new_idx = torch.zeros(1, dtype=torch.long)
        else:
            assert self.tree is not None
            miss = token >= 0 and int(verdict["child"]) < 0
            if token >= 0:
                self.tree, verified = apply_verdict(self.tree, verdict)
                self.committed.append(token)
                if self.source is not None:
                    with torch.inference_mode():
                        self.source.sync(self.tree, [verified] if verified is not None else [])
                    alive = set(self.tree.ids.tolist())
                    self.proposals = {k: v for k, v in self.proposals.items() if k in alive}
            if miss:
                new_idx = torch.zeros(1, dtype=torch.long)  # the new root enters stage 1
            elif self.source is not None:
                new_idx = self.tree.append_level(next_level(self.tree, self.proposals,
                                                            self.width))
            else:
                new_idx = torch.zeros(0, dtype=torch.long)
        tree = self.tree
        self.step += 1
        parents = tree.parent[new_idx]
        parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)],
                                 torch.full_like(parents, -1))
        self.outbox.send("level", {"req": self.rid, "epoch": self.epoch, "step": self.step},
                         {"ids": tree.ids[new_idx], "parents": parent_ids,
                          "tokens": tree.tokens[new_idx]})
        if self.source is not None and new_idx.numel():
            with torch.inference_mode():
                toks, probs = self.source.expand(tree, new_idx, self.committed, self.topk)
            for nid, tk, pr in zip(tree.ids[new_idx].tolist(), toks, probs, strict=True):
                self.proposals[nid] = (tk, pr)
        kids = tree.children(0)
        children = list(zip(tree.tokens[kids].tolist(), tree.ids[kids].tolist(), strict=True))
        self.arrive(root_id=int(new_ids(1)[0]), children=children)

    def finish(self) -> None:
        self.tree, self.proposals = None, {}
