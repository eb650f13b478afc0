"""Dynamic speculative token tree (SpecPipe §3.2): token index I, probabilities P, mask M.

Nodes are kept in BFS order, node 0 is the root (the last verified token).
``mask[i, j]`` is True when node j is node i's ancestor or i itself, which is
exactly the attention pattern a node needs over the tree.  Every node also has
a globally unique, increasing ``id`` so that stage KV caches, stage buffers and
the draft can prune their own copies by id without sharing indices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

_ids = itertools.count(1)


def new_ids(n: int) -> Tensor:
    """Fresh node ids (increasing, unique within the process)."""
    return torch.tensor([next(_ids) for _ in range(n)], dtype=torch.long)


@dataclass
class Level:
    """A tree level to append: parent indices into the tree, tokens and their probabilities."""

    parents: Tensor  # [n] long, indices of nodes in the tree's current bottom level
    tokens: Tensor  # [n] long
    probs: Tensor  # [n] float64, probability of the token given its parent
    ids: Tensor | None = None  # [n] node ids chosen by the tree's owner; fresh ids if None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @classmethod
    def empty(cls) -> Level:
        z = torch.zeros(0, dtype=torch.long)
        return cls(z, z.clone(), torch.zeros(0, dtype=torch.float64))


class SpecTree:
    """Speculative tree rooted at the last verified token at absolute position ``root_pos``."""

    def __init__(self, root_token: int, root_pos: int, root_id: int | None = None):
        self.tokens = torch.tensor([root_token], dtype=torch.long)  # I
        self.probs = torch.ones(1, dtype=torch.float64)  # P (given parent)
        self.cum = torch.ones(1, dtype=torch.float64)  # product of P along the path
        self.mask = torch.ones(1, 1, dtype=torch.bool)  # M
        self.parent = torch.full((1,), -1, dtype=torch.long)
        self.depth = torch.zeros(1, dtype=torch.long)
        # a worker mirroring another process's tree takes the owner's id
        self.ids = new_ids(1) if root_id is None else torch.tensor([root_id], dtype=torch.long)
        self.root_pos = root_pos

    # ---- queries -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def root_id(self) -> int:
        return int(self.ids[0])

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @property
    def height(self) -> int:
        """Depth of the deepest level (0 for a lone root)."""
        return int(self.depth.max())

    def level(self, d: int) -> Tensor:
        """Indices of the nodes at depth d."""
        return (self.depth == d).nonzero().squeeze(1)

    def positions(self, idx: Tensor) -> Tensor:
        """Absolute sequence positions of nodes."""
        return self.root_pos + self.depth[idx]

    def index_of(self, ids: Tensor) -> Tensor:
        """Tree indices of node ids (ids ascend in BFS order, so a binary search suffices)."""
        idx = torch.searchsorted(self.ids, ids)
        if idx.numel() and (bool((idx >= len(self)).any()) or not torch.equal(self.ids[idx], ids)):
            raise KeyError("node id not in tree")
        return idx

    def alive(self, ids: Tensor) -> Tensor:
        """Boolean mask: which of ``ids`` are still tree nodes."""
        return torch.isin(ids, self.ids)

    def child_with_token(self, node: int, token: int) -> int | None:
        """Index of node's child carrying ``token``, if any."""
        hit = ((self.parent == node) & (self.tokens == token)).nonzero()
        return int(hit[0, 0]) if hit.numel() else None

    def has(self, node_id: int) -> bool:
        """Whether a node id is in the tree."""
        return bool((self.ids == node_id).any())

    def children(self, node: int) -> Tensor:
        return (self.parent == node).nonzero().squeeze(1)

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root to ``node`` inclusive."""
        return self.tokens[self.mask[node]].tolist()  # ancestors are earlier in BFS order

    def attention_mask(self, query_idx: Tensor, key_idx: Tensor) -> Tensor:
        """Tree mask [q, k]: query node may attend key node (ancestor or self)."""
        return self.mask[query_idx][:, key_idx]

    # ---- updates -------------------------------------------------------------
    def append_level(self, level: Level) -> Tensor:
        """Layer appending: add a level under the current bottom; returns the new indices."""
        if len(level) == 0:
            return torch.zeros(0, dtype=torch.long)
        order = torch.sort(level.parents, stable=True).indices  # keep BFS order
        parents, tokens, probs = level.parents[order], level.tokens[order], level.probs[order]
        n, k = len(self), int(parents.numel())
        rows = self.mask[parents]  # ancestors of each parent
        new_mask = torch.zeros(n + k, n + k, dtype=torch.bool)
        new_mask[:n, :n] = self.mask
        new_mask[n:, :n] = rows
        new_mask[n:, n:] = torch.eye(k, dtype=torch.bool)
        self.mask = new_mask
        self.tokens = torch.cat([self.tokens, tokens])
        self.probs = torch.cat([self.probs, probs.to(torch.float64)])
        self.cum = torch.cat([self.cum, self.cum[parents] * probs.to(torch.float64)])
        self.parent = torch.cat([self.parent, parents])
        self.depth = torch.cat([self.depth, self.depth[parents] + 1])
        ids = new_ids(k) if level.ids is None else level.ids.to(torch.long)[order]
        if ids.numel() and bool(ids[0] <= self.ids[-1]):
            raise ValueError("node ids must ascend in BFS order; new ids must exceed the tree's")
        self.ids = torch.cat([self.ids, ids])
        return torch.arange(n, n + k)

    def prune_to(self, node: int) -> None:
        """To-subtree pruning: ``node`` becomes the root; everything outside its subtree goes."""
        keep = self.mask[:, node]  # column of M: the subtree of node
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(int(keep.sum()))
        self.root_pos += int(self.depth[node])
        base_cum = self.cum[node]
        self.tokens, self.probs = self.tokens[keep], self.probs[keep]
        self.cum = self.cum[keep] / base_cum
        self.mask = self.mask[keep][:, keep]
        self.depth = self.depth[keep] - self.depth[node]
        self.ids = self.ids[keep]
        self.parent = remap[self.parent[keep].clamp(min=0)]
        self.parent[0] = -1
        self.probs[0] = 1.0


@dataclass
class RankedLevel:
    """Every candidate of the next level, best first by cumulative probability.

    ``parents`` are tree indices; rank r is position r here.  A fixed-width level
    is the first w of them (:meth:`top`), so the rank of the verified token says
    which widths would have held it (the adaptive width policy learns from that).
    """

    parents: Tensor
    tokens: Tensor
    probs: Tensor
    proposed: Tensor  # each candidate's position in the proposals' (parent, child) order

    def top(self, width: int) -> Level:
        """The ``width`` best candidates, back in the proposals' (parent, child) order."""
        keep = torch.sort(self.proposed[:width]).indices
        return Level(self.parents[keep], self.tokens[keep], self.probs[keep])

    def by_parent(self, tree: SpecTree) -> dict[int, dict[int, int]]:
        """Parent node id -> {token: rank}: the first (best) rank of each token under it."""
        out: dict[int, dict[int, int]] = {}
        for rank, (par, tok) in enumerate(zip(tree.ids[self.parents].tolist(),
                                              self.tokens.tolist(), strict=True)):
            out.setdefault(par, {}).setdefault(tok, rank)
        return out


def rank_candidates(tree: SpecTree, parents: Tensor, cand_tokens: list[Tensor],
                    cand_probs: list[Tensor]) -> RankedLevel:
    """Rank the proposed children of ``parents`` by cumulative probability.

    ``cand_tokens[j]``/``cand_probs[j]`` are the top-k children proposed for tree
    node ``parents[j]``.  Ties keep the earlier parent and the higher-ranked child.
    """
    counts = torch.tensor([t.numel() for t in cand_tokens], dtype=torch.long)
    if not len(cand_tokens) or int(counts.sum()) == 0:
        z = torch.zeros(0, dtype=torch.long)
        return RankedLevel(z, z.clone(), torch.zeros(0, dtype=torch.float64), z.clone())
    par = torch.repeat_interleave(parents, counts)
    toks = torch.cat(cand_tokens).to(torch.long)
    probs = torch.cat(cand_probs).to(torch.float64)
    order = torch.sort(tree.cum[par] * probs, descending=True, stable=True).indices
    return RankedLevel(par[order], toks[order], probs[order], order)


def fixed_width_level(tree: SpecTree, parents: Tensor, cand_tokens: list[Tensor],
                      cand_probs: list[Tensor], width: int) -> Level:
    """Keep the ``width`` candidates with the highest cumulative probability (§3.3.3)."""
    return rank_candidates(tree, parents, cand_tokens, cand_probs).top(width)
