"""Paged per-stage KV: a pool of fixed-size blocks and a block table per request.

A :class:`BlockPool` holds K/V for all of one shard's layers as
``[layers, kv_heads, n_blocks * block_size + 1, head_dim]`` (a *slot* is one row of
one block; the last slot belongs to no block: padded rows of a bucketed step write
there, see :mod:`stages.model.step_buckets`).  A :class:`StageCache` is one request's
view of a pool: its block table maps the request's logical rows to slots.

Logical layout of a request: rows ``[0, n_prefix)`` are verified tokens in
position order; rows ``[n_prefix, n_prefix + n_tree)`` are speculative tree
nodes, identified by their tree node id, in the order the stage computed them
(BFS order, so ids ascend and the tree's root, when present, is the first tree
row).  Pruning compacts the tree rows by copying slots; promotion moves a
boundary; no entry is ever recomputed.  Blocks are taken as rows arrive and
given back as soon as rows go (pruning, a finished request), so memory follows
the tokens actually held.

The single-request path uses the same class with a private pool that grows
(``StageCache(...)`` without a pool); many requests on one stage share a fixed pool.
"""

from __future__ import annotations

import torch
from torch import Tensor

from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE, blocks_for


class PoolExhausted(RuntimeError):
    """A fixed pool has no free block left (callers admit requests so this cannot happen)."""


class BlockPool:
    """Fixed-size KV blocks for one shard's layers, with a free list."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, growable: bool = False):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 row, got {n_blocks} x {block_size}")
        self.block_size, self.growable = block_size, growable
        # plain tensors even when created inside an inference_mode forward: pruning
        # (keep / promote) runs outside it and may not update inference tensors
        with torch.inference_mode(False):
            self.k = torch.zeros(n_layers, n_kv_heads, n_blocks * block_size + 1, head_dim,
                                 dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))  # pop() gives block 0 first
        self.peak_used = 0  # the most blocks in use at once so far

    @property
    def n_blocks(self) -> int:
        return (self.k.shape[2] - 1) // self.block_size

    @property
    def scratch_slot(self) -> int:
        """A slot no request holds: where padded rows write what nobody reads."""
        return self.k.shape[2] - 1

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self.free)

    @property
    def bytes_per_row(self) -> int:
        """K and V bytes one token row holds over all of the pool's layers."""
        k = self.k
        return 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()

    def allocate(self) -> int:
        """One free block (a growable pool doubles when full)."""
        if not self.free:
            if not self.growable:
                raise PoolExhausted(f"all {self.n_blocks} KV blocks are in use")
            self._grow(2 * self.n_blocks)
        block = self.free.pop()
        self.peak_used = max(self.peak_used, self.used_blocks)
        return block

    def reserve(self, n_blocks: int) -> None:
        """Grow a growable pool to at least ``n_blocks`` now (a fixed one stays)."""
        if self.growable and n_blocks > self.n_blocks:
            self._grow(n_blocks)

    def release(self, blocks: list[int]) -> None:
        """Give blocks back to the free list."""
        self.free.extend(reversed(blocks))

    def _grow(self, n_blocks: int) -> None:
        old = self.n_blocks
        with torch.inference_mode(False):
            for name in ("k", "v"):
                t = getattr(self, name)
                grown = torch.zeros(*t.shape[:2], n_blocks * self.block_size + 1, t.shape[3],
                                    dtype=t.dtype, device=t.device)
                grown[:, :, : old * self.block_size] = t[:, :, : old * self.block_size]
                setattr(self, name, grown)
        self.free = list(range(n_blocks - 1, old - 1, -1)) + self.free


class StageCache:
    """One request's K/V on one stage: a block table into a :class:`BlockPool`."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, pool: BlockPool | None = None):
        """A cache in ``pool``, or (no pool) with its own growable pool first sized for
        ``capacity`` rows: the single-request path is a pool of one request."""
        self.pool = pool if pool is not None else BlockPool(
            n_layers, n_kv_heads, head_dim, blocks_for(max(capacity, 1), block_size), dtype,
            device, block_size, growable=True)
        self.blocks: list[int] = []
        # the pool slot of each row the blocks hold, on the pool's device: read every step,
        # rebuilt only when the blocks change (one copy per block, not per step)
        self._slot_table: Tensor | None = None
        self.n_prefix = 0
        self.tree_ids = torch.zeros(0, dtype=torch.long)
        self._pending = 0  # rows written by the forward pass in progress

    @classmethod
    def in_pool(cls, pool: BlockPool) -> StageCache:
        """An empty cache whose blocks come from a shared pool."""
        k = pool.k
        return cls(k.shape[0], k.shape[1], k.shape[3], 0, k.dtype, k.device, pool.block_size,
                   pool)

    @property
    def n_tree(self) -> int:
        return int(self.tree_ids.numel())

    @property
    def length(self) -> int:
        return self.n_prefix + self.n_tree

    @property
    def capacity(self) -> int:
        """Rows the blocks held now can take."""
        return len(self.blocks) * self.pool.block_size

    @property
    def k(self) -> Tensor:
        """This request's keys [layers, kv_heads, length, hd] (a gathered copy)."""
        return self.pool.k.index_select(2, self.slots(self.length))

    @property
    def v(self) -> Tensor:
        """This request's values [layers, kv_heads, length, hd] (a gathered copy)."""
        return self.pool.v.index_select(2, self.slots(self.length))

    def slots(self, rows: int, start: int = 0) -> Tensor:
        """Pool slots of logical rows ``[start, rows)`` (a read-only view)."""
        if self._slot_table is None:
            bs = self.pool.block_size
            table = torch.tensor(self.blocks, dtype=torch.long)
            self._slot_table = (table[:, None] * bs + torch.arange(bs)).view(-1).to(
                self.pool.k.device)
        return self._slot_table[start:rows]

    def _ensure(self, rows: int) -> None:
        while self.capacity < rows:
            self.blocks.append(self.pool.allocate())
            self._slot_table = None

    def _shrink(self) -> None:
        """Give back blocks past the rows held."""
        need = blocks_for(self.length, self.pool.block_size)
        if len(self.blocks) > need:
            self.pool.release(self.blocks[need:])
            del self.blocks[need:]
            self._slot_table = None

    def reserve(self, n: int) -> tuple[Tensor, Tensor]:
        """Room for ``n`` new rows: (slots of the new rows, slots of all rows incl. new)."""
        start = self.length
        self._ensure(start + n)
        self._pending = n
        every = self.slots(start + n)
        return every[start:], every

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows k, v [n, kv_heads, hd] for ``layer``; return all keys/values.

        For callers outside a packed forward; the shard itself writes through
        :meth:`reserve` slots directly into the pool.
        """
        new, every = self.reserve(k.shape[0])
        self.pool.k[layer][:, new] = k.transpose(0, 1)
        self.pool.v[layer][:, new] = v.transpose(0, 1)
        return self.pool.k[layer].index_select(1, every), self.pool.v[layer].index_select(1, every)

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
        kept = int(idx.numel())
        if kept:
            src = self.slots(self.n_prefix + self.n_tree, self.n_prefix)[idx]
            dst = self.slots(self.n_prefix + kept, self.n_prefix)
            # gather first: source and destination slots may overlap
            for t in (self.pool.k, self.pool.v):
                t[:, :, dst] = t.index_select(2, src)
        self.tree_ids = self.tree_ids[idx]
        self._shrink()

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
        self._shrink()

    def release(self) -> None:
        """Give every block back to the pool (the request finished or was cancelled)."""
        self.pool.release(self.blocks)
        self.blocks = []
        self._slot_table = None
        self.n_prefix, self.tree_ids = 0, self.tree_ids[:0]
