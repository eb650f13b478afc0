"""The draft service: owns the speculative trees and feeds stage 1 one level per request per step.

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
from protocol.sync.control import Verdict
from protocol.sync.synchroniser import Report, RequestState, Synchroniser
from stages.runtime.participant import Participant
from stages.speculation.batch import fresh_source
from stages.speculation.step import TreeOwner
from stages.speculation.token_sources import DraftModelSource, TokenSource, expand_packed
from stages.speculation.tree import new_ids

log = logging.getLogger("treepipe.draft")


class DraftService(Participant):
    """Token source and tree owner of every request in the batch (one :class:`TreeOwner`
    and one copy of the token source each); a draft model expands every request's level
    in one packed forward."""

    def __init__(self, name: str, sync: Synchroniser, source: TokenSource | None,
                 outbox: Outbox, width: int, topk: int, **kw: Any):
        super().__init__(name, sync, None, outbox, **kw)
        self.source = source
        self.width, self.topk = width, topk
        self.owners: dict[str, TreeOwner] = {}
        # requests drafting with the draft model share one pool, so their levels are
        # expanded in one packed forward
        self.draft_pool = source.shard.new_pool(8) if isinstance(source, DraftModelSource) \
            else None
        if self.draft_pool is not None:
            self.draft_pool.growable = True

    def begin(self, states: list[RequestState], reports: dict[str, Report]) -> None:
        """A tree owner and a fresh token source per joining request; reserve root ids."""
        for st in states:
            committed = st.prompt + st.log[:-1] if st.log else list(st.prompt)
            src = None
            if self.source is not None:
                src = fresh_source(self.source)
                if isinstance(src, DraftModelSource) and self.draft_pool is not None:
                    src.pool = self.draft_pool
                with torch.inference_mode():
                    src.reset(list(committed))
            self.owners[st.rid] = TreeOwner(src, self.width, self.topk, committed)
            reports[st.rid] = Report(root_id=int(new_ids(1)[0]))

    def advance(self, go: list[tuple[str, Verdict]], reports: dict[str, Report]) -> None:
        """Prune and grow every request's tree, send each level, then expand them all."""
        entering: list[tuple[TreeOwner, torch.Tensor]] = []
        for rid, verdict in go:
            owner = self.owners[rid]
            step = self.local_step(rid)
            with torch.inference_mode():
                if step == 1:
                    new_idx = owner.start(verdict.token, root_id=verdict.root)
                else:
                    owner.apply(verdict)
                    new_idx = owner.grow(verdict)
            tree = owner.tree
            assert tree is not None
            parents = tree.parent[new_idx]
            parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)],
                                     torch.full_like(parents, -1))
            self.send(Nodes("level", rid, self.epoch, step, tree.ids[new_idx], parent_ids,
                            tree.tokens[new_idx]))
            self.stats.nodes += int(new_idx.numel())
            entering.append((owner, new_idx))
        # the source expands the levels beside stage 1's compute of them
        with torch.inference_mode():
            packed = [(o, i) for o, i in entering if i.numel() and o.source is not None
                      and isinstance(o.source, DraftModelSource)
                      and o.source.pool is self.draft_pool]
            for owner, idx in entering:
                if all(owner is not o for o, _ in packed):
                    owner.propose(idx)
            if packed:
                props = expand_packed([o.source for o, _ in packed],  # type: ignore[misc]
                                      [o.tree for o, _ in packed],  # type: ignore[misc]
                                      [i for _, i in packed], self.topk)
                for (owner, idx), (toks, probs) in zip(packed, props, strict=True):
                    owner.store(idx, toks, probs)
        for rid, _ in go:
            reports[rid] = Report(root_id=int(new_ids(1)[0]),
                                  children=tuple(self.owners[rid].root_children()))

    def finish(self, rid: str) -> None:
        owner = self.owners.pop(rid, None)
        if owner is not None and isinstance(owner.source, DraftModelSource):
            owner.source.release()  # its draft KV blocks go back to the pool at once
