"""The SpecPipe step core (Algorithm 1): one implementation of what a verdict does.

After every step the last stage verifies the tree's root.  The verdict either
names the root's child that carries the verified token (a hit: prune the tree to
that child's subtree) or starts a new root (a miss: every speculated node is
dropped).  Proposals of dead nodes are dropped, and the tree grows by the next
fixed-width level from the cached proposals (SpecPipe §3.3.3).

The in-process engine, the draft service, the stage workers' mirrors and
``draft eval``'s schedule replay all call this module, so they cannot drift
apart.  State is per request (:class:`TreeOwner`, :class:`Mirror`); a batch of
requests in flight together is a list of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from protocol.config.recovery import NO_RECOVERY, Recovery
from protocol.sync.control import Verdict
from stages.model.early_exit import exit_head
from stages.model.grammar import DraftMask
from stages.model.kv_cache import BlockPool, StageCache
from stages.model.model import StageShard
from stages.speculation.token_sources import (
    DraftModelSource,
    TokenSource,
    expand_packed,
    sync_cache,
)
from stages.speculation.tree import Level, RankedLevel, SpecTree, rank_candidates

__all__ = ["Verdict", "decide", "root_children", "apply_verdict", "next_level", "ranked_next",
           "grammar_rows", "TreeOwner", "Mirror", "NOT_PROPOSED", "expand_entering"]

Proposal = tuple[Tensor, Tensor]  # (tokens [<=k], probabilities [<=k]) of one node
_EMPTY = torch.zeros(0, dtype=torch.long)
NOT_PROPOSED = 1 << 30  # rank of a token no width would have held


def root_children(tree: SpecTree) -> list[tuple[int, int]]:
    """(token, node id) of the root's children, one per token: the first in BFS order
    when a source proposed a token twice.  A verified token maps to its child here, in
    :func:`decide` and, from the draft service's report, in arrive.lua (a lookup)."""
    kids = tree.children(0)
    first: dict[int, int] = {}
    for t, i in zip(tree.tokens[kids].tolist(), tree.ids[kids].tolist(), strict=True):
        first.setdefault(t, i)
    return list(first.items())


def decide(tree: SpecTree, token: int, new_root: int = -1, done: bool = False) -> Verdict:
    """The verdict for ``token`` verified at ``tree``'s root: the root's child carrying it
    (:func:`root_children`), else -1; ``new_root`` is the id a miss gives the new root."""
    return Verdict(token, dict(root_children(tree)).get(token, -1), new_root, done)


def apply_verdict(tree: SpecTree, verdict: Verdict) -> tuple[SpecTree, int | None]:
    """Prune a tree by a verdict; returns the (new) tree and the verified node's id.

    No verified token: the tree is unchanged and the id is None.
    """
    if not verdict.verified:
        return tree, None
    old_root, child = tree.root_id, verdict.child
    if child >= 0 and tree.has(child):
        tree.prune_to(int(tree.index_of(torch.tensor([child]))[0]))
        return tree, old_root
    # a miss (new root id from the owner), or a hit on a node this mirror has not seen
    # yet (it is still on its way down the pipeline): the child becomes a lone root
    new_id = child if child >= 0 else verdict.root
    return SpecTree(verdict.token, tree.root_pos + 1,
                    root_id=new_id if new_id >= 0 else None), old_root


def ranked_next(tree: SpecTree, proposals: dict[int, Proposal],
                topk: int | None = None) -> RankedLevel | None:
    """Every candidate under the tree's bottom (each node's best ``topk``: all without),
    ranked (None until the whole bottom has proposals: the bottom grows only once every
    node of it has them)."""
    bottom = tree.level(tree.height)
    ids = tree.ids[bottom].tolist()
    if not all(i in proposals for i in ids):
        return None
    return rank_candidates(tree, bottom, [proposals[i][0][:topk] for i in ids],
                           [proposals[i][1][:topk] for i in ids])


def next_level(tree: SpecTree, proposals: dict[int, Proposal], width: int) -> Level:
    """Fixed-width level under the tree's bottom, from the cached proposals (by node id)."""
    ranked = ranked_next(tree, proposals)
    return ranked.top(width) if ranked is not None else Level.empty()


def grammar_rows(mask: DraftMask | None, tree: SpecTree, idx: Tensor,
                 committed: list[int]) -> Tensor | None:
    """The tokens a request's grammar allows below each node ``idx`` (bool [len(idx),
    vocab]): after the committed tokens (ending with the root's) and the node's path
    below the root.  None without a grammar: every token."""
    if mask is None or not idx.numel():
        return None
    return mask.rows(committed, [tree.path_tokens(i)[1:] for i in idx.tolist()])


class TreeOwner:
    """The tree owner's state for one request: tree, proposal cache, token source, tokens.

    ``committed`` ends with the root's token once :meth:`start` ran.  With no token
    source the tree never grows past its root: plain pipeline parallelism (pp).
    ``width`` may change between steps (an adaptive width policy); width 0 grows
    nothing, so the request runs as pp until its width rises again.  With
    ``track_ranks`` every grown level remembers its candidates' ranks, so
    :meth:`rank_of` tells which widths would have held a verified token.  With ``mask``
    (the request's ``response_format``) the source proposes only tokens its grammar allows
    on each node's path (:meth:`allowed`), the seam every executor drafts through.

    With ``recovery`` K > 0 over ``stages`` m (``draft:K``, speculative speculative
    decoding's pre-speculation) a level may also hold *correction children*: a live
    node's top-K proposals that earlier levels left out, issued late.  When the node's own
    children miss but a correction carries the target's token, the verdict re-roots there
    (a hit on that child) instead of flushing: the pipeline idles for the correction's
    lateness, not m steps (:meth:`_budgeted`).
    """

    def __init__(self, source: TokenSource | None, width: int, topk: int,
                 committed: list[int], track_ranks: bool = False,
                 mask: DraftMask | None = None, recovery: Recovery = NO_RECOVERY,
                 stages: int = 0):
        self.source, self.width, self.topk = source, width, topk
        self.mask = mask
        self.recovery, self.stages = recovery, stages
        self.exits: dict[int, Proposal] = {}  # node id -> the early exit's top-K
        self.steps = 0  # levels grown so far (one a step)
        self.born: dict[int, int] = {}  # node id -> the step it entered stage 1
        self.committed = committed
        self.tree: SpecTree | None = None
        self.proposals: dict[int, Proposal] = {}
        self.track_ranks = track_ranks
        self.ranks: dict[int, dict[int, int]] = {}  # parent id -> {token: rank in its level}
        self.available = -1  # candidates the last grown level could take (-1: none ranked)

    def start(self, token: int, root_id: int | None = None) -> Tensor:
        """Root the first tree at ``token`` (committed now); returns the root's index."""
        self.tree = SpecTree(token, len(self.committed), root_id=root_id)
        self.committed.append(token)
        self.proposals, self.ranks, self.exits = {}, {}, {}
        self.born = {self.tree.root_id: self.steps}
        return torch.zeros(1, dtype=torch.long)

    def decide(self, token: int, new_root: int = -1) -> Verdict:
        """The verdict for ``token`` verified at the current root."""
        assert self.tree is not None
        return decide(self.tree, token, new_root)

    def apply(self, verdict: Verdict) -> int | None:
        """Prune tree, source state and proposal cache by ``verdict``; commit its token.

        Returns the verified node's id (None when nothing was verified); callers
        prune their KV caches with it through :func:`~stages.speculation.token_sources.sync_cache`.
        """
        assert self.tree is not None
        self.tree, verified = apply_verdict(self.tree, verdict)
        if verified is None:
            return None
        self.committed.append(verdict.token)
        if self.source is not None:
            self.source.sync(self.tree, [verified])
            alive = set(self.tree.ids.tolist())
            self.proposals = {k: v for k, v in self.proposals.items() if k in alive}
            self.ranks = {k: v for k, v in self.ranks.items() if k in alive}
            self.born = {k: v for k, v in self.born.items() if k in alive}
            self.exits = {k: v for k, v in self.exits.items() if k in alive}
        return verified

    def grow(self, verdict: Verdict | None) -> Tensor:
        """Indices of the nodes entering stage 1 next: the new root after a miss, else
        the next fixed-width level (nothing without a source)."""
        assert self.tree is not None
        self.available = -1  # until a level is ranked below
        self.steps += 1
        if verdict is not None and verdict.miss:
            self.born[self.tree.root_id] = self.steps
            return torch.zeros(1, dtype=torch.long)
        if self.source is None:
            return _EMPTY
        ranked = ranked_next(self.tree, self.proposals, self.topk)
        if ranked is not None and self.track_ranks:
            self.ranks.update(ranked.by_parent(self.tree))
            self.available = int(ranked.tokens.numel())
        if self.recovery.k:
            level = self._budgeted()
        elif ranked is not None:
            level = ranked.top(self.width)
        else:
            return _EMPTY
        idx = self.tree.append_level(level)
        for nid in self.tree.ids[idx].tolist():
            self.born[nid] = self.steps
        return idx

    def _budgeted(self) -> Level:
        """The step's ``width`` nodes with recovery on: the on-time candidates first, then
        correction children in the slots they leave.

        A child issued the step after its parent entered stage 1 is on time: each such
        parent offers its top-k proposals, ranked by cumulative probability as without
        recovery.  A child issued d steps later trails its siblings by d steps, so if it
        carries the target's token the pipeline idles d steps where a flush idles m - 1:
        older nodes offer their corrections (their top-K draft proposals, or with
        ``early-exit:J:K`` the early exit's top-K once stage J has computed them), ranked
        by expected steps saved, cumulative probability x (m - 1 - d), while that is a
        step or more.  A token already under its node is not offered again."""
        tree = self.tree
        assert tree is not None
        cum = tree.cum.tolist()
        cands: list[tuple[bool, float, int, int, int, float]] = []
        for i, nid in enumerate(tree.ids.tolist()):
            late = self.steps - self.born.get(nid, self.steps) - 1
            gain = self.stages - 1 - late
            if late < 0 or gain < 1:
                continue
            for j, (tok, p) in enumerate(self._offers(nid, late)):
                cands.append((late > 0, -cum[i] * p * gain, i, j, tok, p))
        cands.sort()
        issued = set(zip(tree.parent.tolist(), tree.tokens.tolist(), strict=True))
        chosen = []
        for c in cands:
            if len(chosen) == self.width:
                break
            if (c[2], c[4]) not in issued:
                issued.add((c[2], c[4]))
                chosen.append(c)
        if not chosen:
            return Level.empty()
        chosen.sort(key=lambda c: (c[2], c[3]))  # tree order, each node's offers' order
        return Level(torch.tensor([c[2] for c in chosen], dtype=torch.long),
                     torch.tensor([c[4] for c in chosen], dtype=torch.long),
                     torch.tensor([c[5] for c in chosen], dtype=torch.float64))

    def _offers(self, nid: int, late: int) -> list[tuple[int, float]]:
        """(token, probability) a node offers as children ``late`` steps after its own
        level's time: its best top-k proposals on time, then its corrections."""
        out: list[tuple[int, float]] = []
        if nid in self.proposals and (late == 0 or not self.recovery.exit_stage):
            toks, probs = self.proposals[nid]  # best first (store)
            n = self.topk if late == 0 else self.recovery.k
            out += zip(toks[:n].tolist(), probs[:n].tolist(), strict=True)
        if nid in self.exits:
            toks, probs = self.exits[nid]
            out += zip(toks.tolist(), probs.tolist(), strict=True)
        return out

    def note_exit(self, head: StageShard, h: Tensor, layer: int, idx: Tensor) -> None:
        """Recovery's token channel: the early exit at ``layer`` (``head``: the last stage,
        with the norm and LM head; the head variant and adapter are the recovery
        setting's, :func:`~stages.model.early_exit.exit_head`) on the states ``h`` of the
        nodes ``idx`` that the exit stage just computed; their top-K become their
        correction candidates."""
        assert self.tree is not None
        if self.source is None:  # pp: nothing grows under the root
            return
        ids = self.tree.ids[idx].tolist()
        exit_ = exit_head(head, layer, self.recovery)
        # +draft: the exit re-ranks the node's own draft proposals (cached by propose when
        # the node entered stage 1, so always there by the time stage J has computed it)
        cands = [self.proposals.get(nid, (_EMPTY, _EMPTY))[0] for nid in ids] \
            if exit_.by_candidates else None
        toks, probs = exit_.top(h, self.recovery.k, self.allowed(idx), cands)
        self.store_exits(ids, toks, probs)

    def store_exits(self, ids: list[int], toks: Tensor, probs: Tensor) -> None:
        """Correction candidates [n, K] for the live nodes ``ids``: from :meth:`note_exit`,
        or computed elsewhere (a middle stage's worker, over the token channel)."""
        for nid, tk, pr in zip(ids, toks, probs, strict=True):
            keep = pr > 0  # a grammar row allowing fewer than K
            self.exits[nid] = (tk[keep], pr[keep])

    def lateness(self, child: int) -> int:
        """Steps the root's child ``child`` (an id) trails an on-time child: 0 for a level's
        own node, d > 0 for a correction issued d steps late (a hit on it re-roots)."""
        assert self.tree is not None
        if child not in self.born:
            return 0
        return self.born[child] - self.born[self.tree.root_id] - 1

    def rank_of(self, token: int) -> int | None:
        """Rank of ``token`` among the candidates of the level under the root, by
        cumulative probability (hit with width w iff rank < w); :data:`NOT_PROPOSED`
        when no candidate carried it, None when the root has no proposals yet.

        A root whose level never grew (width 0) is ranked among its own proposals.
        Call before :meth:`apply`.
        """
        assert self.tree is not None
        root = self.tree.root_id
        if root in self.ranks:
            return self.ranks[root].get(token, NOT_PROPOSED)
        if root not in self.proposals:
            return None
        ranked = self.proposals[root][0].tolist()  # best first (store)
        return ranked.index(token) if token in ranked else NOT_PROPOSED

    def propose(self, idx: Tensor) -> None:
        """Expand the nodes ``idx`` entering stage 1 and cache their proposals by id."""
        assert self.tree is not None
        if self.source is None or not idx.numel():
            return
        toks, probs = self.source.expand(self.tree, idx, self.committed, self.draft_k,
                                         self.allowed(idx))
        self.store(idx, toks, probs)

    @property
    def draft_k(self) -> int:
        """Proposals the source makes per node: the level's top-k, or more for draft:K's
        correction candidates (each level still ranks only a node's best ``topk``)."""
        return self.topk if self.recovery.exit_stage else max(self.topk, self.recovery.k)

    def allowed(self, idx: Tensor) -> Tensor | None:
        """:func:`grammar_rows` of the nodes ``idx`` (None: no grammar), for
        :meth:`propose` and for a packed draft forward
        (:func:`~stages.speculation.token_sources.expand_packed`)."""
        assert self.tree is not None
        return grammar_rows(self.mask, self.tree, idx, self.committed)

    def store(self, idx: Tensor, toks: list[Tensor], probs: list[Tensor]) -> None:
        """Cache proposals (from :meth:`propose`, or a packed draft forward elsewhere) for
        nodes ``idx``, best first: every reader (a level's top-k, the corrections past it,
        a token's rank) slices them in that one order.  The sources already return them
        so; the stable sort keeps their order among equal probabilities."""
        assert self.tree is not None
        for nid, tk, pr in zip(self.tree.ids[idx].tolist(), toks, probs, strict=True):
            order = torch.sort(pr, descending=True, stable=True).indices
            self.proposals[nid] = (tk[order], pr[order])

    def root_children(self) -> list[tuple[int, int]]:
        """:func:`root_children` of the tree: what the draft service reports."""
        assert self.tree is not None
        return root_children(self.tree)


class Mirror:
    """A stage's copy of the owner's tree (same node ids) and its KV cache."""

    def __init__(self, cache: StageCache):
        self.cache = cache
        self.tree: SpecTree | None = None

    def start(self, token: int, pos: int, root_id: int) -> None:
        """Root the first tree at ``token`` (absolute position ``pos``) with the owner's id."""
        self.tree = SpecTree(token, pos, root_id=root_id)

    def apply(self, verdict: Verdict) -> int | None:
        """Prune the tree and the KV cache by ``verdict``; returns the verified node's id."""
        assert self.tree is not None
        self.tree, verified = apply_verdict(self.tree, verdict)
        if verified is not None:
            sync_cache(self.cache, self.tree, [verified])
        return verified

    def alive(self, ids: Tensor, parents: Tensor) -> Tensor:
        """Which received nodes still belong to the tree: the root, or children of its nodes."""
        assert self.tree is not None
        return (ids == self.tree.root_id) | torch.isin(parents, self.tree.ids)

    def append(self, ids: Tensor, parents: Tensor, tokens: Tensor) -> None:
        """Append received (alive) nodes that are new to the mirror as the next level."""
        assert self.tree is not None
        fresh = ids != self.tree.root_id
        if bool(fresh.any()):
            self.tree.append_level(Level(self.tree.index_of(parents[fresh]), tokens[fresh],
                                         torch.ones(int(fresh.sum()), dtype=torch.float64),
                                         ids[fresh]))


def expand_entering(entering: Sequence[tuple[TreeOwner, Tensor]],
                    pool: BlockPool | None) -> int:
    """The draft expands the nodes entering stage 1 (their node ids in each owner's tree):
    requests drafting on the shared draft ``pool`` in one packed forward, any other source
    request by request; a request without a source (pp) has nothing to expand.  Returns
    the nodes expanded."""
    packed: list[tuple[TreeOwner, Tensor]] = []
    n = 0
    for owner, ids in entering:
        if owner.source is None or owner.tree is None:
            continue
        idx = owner.tree.index_of(ids)
        n += int(idx.numel())
        if isinstance(owner.source, DraftModelSource) and pool is not None \
                and owner.source.pool is pool and idx.numel():
            packed.append((owner, idx))
        else:
            owner.propose(idx)
    if packed:
        props = expand_packed([o.source for o, _ in packed],  # type: ignore[misc]
                              [o.tree for o, _ in packed],  # type: ignore[misc]
                              [i for _, i in packed], packed[0][0].draft_k,
                              [o.allowed(i) for o, i in packed])
        for (owner, idx), (toks, probs) in zip(packed, props, strict=True):
            owner.store(idx, toks, probs)
    return n
