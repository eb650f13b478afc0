"""Per-stage KV cache: a committed prefix followed by in-flight tree entries.

Layout per layer: rows ``[0, n_prefix)`` are verified tokens in position order;
rows ``[n_prefix, n_prefix + n_tree)`` are speculative tree nodes, identified by
their tree node id, in the order the stage computed them (which is BFS order,
so ids ascend and the tree's root, when present, is the first tree row).
Pruning compacts the tree rows by index; no entry is ever recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StageCache:
    """K/V for all of one shard's layers: [layers, kv_heads, capacity, head_dim]."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        capacity = max(capacity, 16)
        self.k = torch.zeros(n_layers, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n_prefix = 0
        self.tree_ids = torch.zeros(0, dtype=torch.long)
        self._pending = 0  # rows written by the forward pass in progress

    @property
    def n_tree(self) -> int:
        return int(self.tree_ids.numel())

    @property
    def length(self) -> int:
        return self.n_prefix + self.n_tree

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _ensure(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        new_cap = max(rows, 2 * self.capacity)
        # grow with ordinary tensors even inside the shard's inference_mode forward:
        # pruning (keep / promote) runs outside it and may not update inference tensors
        with torch.inference_mode(False):
            self._grow(new_cap)

    def _grow(self, new_cap: int) -> None:
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = torch.zeros(*old.shape[:2], new_cap, old.shape[3], dtype=old.dtype,
                                device=old.device)
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows k, v [n, kv_heads, hd] for ``layer``; return all keys/values."""
        n = k.shape[0]
        start = self.length
        self._ensure(start + n)
        self.k[layer, :, start : start + n] = k.transpose(0, 1)
        self.v[layer, :, start : start + n] = v.transpose(0, 1)
        self._pending = n
        return self.k[layer, :, : start + n], self.v[layer, :, : start + n]

    def commit_write(self, ids: Tensor | None) -> None:
        """Account for the rows just written: prefix rows if ``ids`` is None, else tree rows."""
        n, self._pending = self._pending, 0
        if ids is None:
            if self.n_tree:
                raise RuntimeError("prefix rows cannot follow tree rows; promote or prune first")
            self.n_prefix += n
        else:
            if ids.numel() != n:
                raise RuntimeError(f"wrote {n} rows but got {ids.numel()} ids")
            self.tree_ids = torch.cat([self.tree_ids, ids.to(torch.long)])

    def keep(self, alive: Tensor) -> None:
        """Drop tree rows whose id is not in ``alive`` (compaction, order preserved)."""
        if not self.n_tree:
            return
        mask = torch.isin(self.tree_ids, alive)
        if bool(mask.all()):
            return
        idx = mask.nonzero().squeeze(1)
        rows = self.n_prefix + idx.to(self.k.device)
        kept = int(idx.numel())
        self.k[:, :, self.n_prefix : self.n_prefix + kept] = self.k.index_select(2, rows)
        self.v[:, :, self.n_prefix : self.n_prefix + kept] = self.v.index_select(2, rows)
        self.tree_ids = self.tree_ids[idx]

    def promote(self, node_id: int) -> None:
        """Move a verified node from the tree part into the committed prefix."""
        if not self.n_tree or int(self.tree_ids[0]) != node_id:
            raise RuntimeError(f"node {node_id} is not the first tree row of this cache")
        self.n_prefix += 1
        self.tree_ids = self.tree_ids[1:]

    def has(self, node_id: int) -> bool:
        return bool((self.tree_ids == node_id).any())

    def truncate_prefix(self, n: int) -> None:
        """Forget everything after the first ``n`` committed rows (used on re-prefill)."""
        self.n_prefix = min(self.n_prefix, n)
        self.tree_ids = self.tree_ids[:0]
