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

from protocol.links.messages import Nodes
from protocol.links.transport import Outbox
from protocol.sync.control import Start, Verdict
from protocol.sync.synchroniser import Synchroniser
from stages.runtime.participant import Participant
from stages.speculation.step import TreeOwner
from stages.speculation.token_sources import TokenSource
from stages.speculation.tree import new_ids

log = logging.getLogger("treepipe.draft")


class DraftService(Participant):
    """Token source and tree owner in the step barrier."""

    def __init__(self, name: str, sync: Synchroniser, source: TokenSource | None,
                 outbox: Outbox, width: int, topk: int, **kw: Any):
        super().__init__(name, sync, None, outbox, **kw)
        self.source = source
        self.width, self.topk = width, topk
        self.owner: TreeOwner | None = None

    def begin(self, msg: Start) -> None:
        st = self.current_request(msg.req)
        if st is None:
            return
        committed = st.prompt + st.log[:-1] if st.log else list(st.prompt)
        self.owner = TreeOwner(self.source, self.width, self.topk, committed)
        if self.source is not None:
            with torch.inference_mode():
                self.source.reset(list(committed))
        self.arrive(root_id=int(new_ids(1)[0]))

    def advance(self, verdict: Verdict) -> None:
        owner = self.owner
        assert owner is not None
        with torch.inference_mode():
            if self.step == 0:
                new_idx = owner.start(verdict.token, root_id=verdict.root)
            else:
                owner.apply(verdict)
                new_idx = owner.grow(verdict)
        tree = owner.tree
        assert tree is not None
        self.step += 1
        parents = tree.parent[new_idx]
        parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)],
                                 torch.full_like(parents, -1))
        assert self.rid is not None
        self.send(Nodes("level", self.rid, self.epoch, self.step, tree.ids[new_idx], parent_ids,
                        tree.tokens[new_idx]))
        self.stats.nodes += int(new_idx.numel())
        # the source expands the level beside stage 1's compute of it
        with torch.inference_mode():
            owner.propose(new_idx)
        self.arrive(root_id=int(new_ids(1)[0]), children=owner.root_children())

    def finish(self) -> None:
        self.owner = None
