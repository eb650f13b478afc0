"""Paged tree attention with FlexAttention: queries read the block pool in place.

:class:`~stages.model.model.PagedRows` gathers each request's keys into a dense,
padded ``[B, kv_heads, T_max, hd]`` copy and hands SDPA a boolean mask, which on
a GPU sends it down the math path. Here one :class:`FlexPlan` per packed forward
turns every request's block table into a flex ``BlockMask`` over the pool itself
(as PyTorch's ``PagedAttention`` does): a query tile lists the physical pool
blocks its request owns, so attention touches only those slots and no keys are
copied. Blocks that every query of the tile sees whole (the committed prefix)
are "full" blocks and skip the mask; the rest (the causal tail, the tree rows)
run ``mask_mod``, which maps a pool slot back to the request's logical row and
reads the tree's visibility from a small per-query bool tensor.

Block sizes: flex's KV sparsity block must be the pool's block size (16 by
default), because a request's pool blocks are scattered: a bigger flex block
would span other requests' slots. The CPU template takes any size (its key chunk
is the sparse block; 16 costs about 1.2x a 128-key chunk on dense keys). CUDA's
prefill kernel needs the sparse block to be a multiple of its BLOCK_N (64 or 128
in the default configs), so there a 16-row pool needs
``kernel_options={"BLOCK_N": 16}`` or the pool a bigger block size; its decoding
kernel clamps BLOCK_N itself (untested here: no GPU). The Q block is
:data:`Q_BLOCK` rows (one tile per request up to that many new rows). The plan
is built once per forward and reused by every layer; only :func:`attend` runs
per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from stages.model.model import Segment

try:  # flex arrived in torch 2.5; older or stripped builds get the dense path
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - every supported torch has it
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

Q_BLOCK = 128  # query rows per flex tile: a request's level or decode step is one tile
MIN_WIDTH = 16  # smallest tree-visibility width (bucketed like the row counts)

# compiled once per process with static shapes: inductor's CPU flex template fails to
# build with symbolic sizes in torch 2.13 (C++ error: `cur_qSplitSize5` undeclared), so
# the plan pads every varying size to a power-of-two bucket (requests, rows per
# request, tree width); each bucket compiles once, and the pool's size is fixed anyway.
# Dynamo keeps at most torch._dynamo.config.recompile_limit (8) graphs per code object
# and falls back to eager flex past it: a caller that sees more buckets must raise it.
_flex = (torch.compile(flex_attention, dynamic=False, fullgraph=True)
         if flex_attention is not None else None)


def bucket(n: int, least: int = 1) -> int:
    """The power of two at least ``n`` (and ``least``): the padded size of a dimension."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def flex_available(device: torch.device | str = "cpu") -> bool:
    """Whether compiled FlexAttention can run on ``device`` (else use model.paged_attention)."""
    if _flex is None:
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    if dev.type == "cpu":
        # inductor's CPU flex template needs AVX2 (flex_cpu.check_cpu_supported)
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
        return bool(check_cpu_supported())
    return False


@dataclass
class FlexPlan:
    """One packed forward's flex layout: ``B`` requests (padded to a bucket) of ``n_max``
    query rows each (padded to a bucket); reused by every layer of the forward."""

    block_mask: BlockMask
    pad: Tensor  # [B * n_max] packed row each padded query row takes
    unpad: Tensor  # [N] padded row of each packed row
    n_max: int


def build_plan(tables: list[list[int]], n_prefix: list[int], n_tree: list[int],
               tree_masks: list[Tensor | None], n_new: list[int], block_size: int,
               n_pool_blocks: int, device: torch.device | str = "cpu") -> FlexPlan:
    """The flex plan for requests with block tables ``tables`` (already reserved for the
    new rows), ``n_prefix`` committed and ``n_tree`` cached tree rows, and ``n_new`` new
    rows each seeing the prefix plus ``tree_masks[b]`` [n, n_tree + n] of the tree rows
    (None: causal over new committed rows), as :meth:`PagedRows.pack` defines them."""
    if _flex is None:
        raise RuntimeError("this torch has no FlexAttention; use model.paged_attention")
    n_req = len(tables)
    B, n_max = bucket(n_req), bucket(max(n_new))
    # only tree levels need bits; causal rows are a limit alone
    width = bucket(max([t + n for t, n, tm in zip(n_tree, n_new, tree_masks, strict=True)
                        if tm is not None] + [0]), MIN_WIDTH)
    # per padded query row: rows [0, lim) are visible whole; tree row t is visible when
    # bits[b, i, t]; one spare False column so mask_mod can clamp its index into it.
    # Padding requests see row 0 only and list no block, so flex skips them.
    lim = torch.ones(B, n_max, dtype=torch.int32)
    bits = torch.zeros(B, n_max, width + 1, dtype=torch.bool)
    n_tiles = -(-n_max // Q_BLOCK)
    # flex checks that the index rows span the whole key length (the pool), so they are
    # n_pool_blocks wide: O(B x tiles x pool blocks) int32 to zero, once per forward
    kv_num = torch.zeros(B, 1, n_tiles, dtype=torch.int32)
    kv_idx = torch.zeros(B, 1, n_tiles, n_pool_blocks, dtype=torch.int32)
    full_num = torch.zeros(B, 1, n_tiles, dtype=torch.int32)
    full_idx = torch.zeros(B, 1, n_tiles, n_pool_blocks, dtype=torch.int32)
    # pool block -> logical block of the request that owns it (a block has one owner)
    logical = torch.zeros(n_pool_blocks, dtype=torch.int32)
    prefix = torch.zeros(B, dtype=torch.int32)
    pad = [0] * (B * n_max)
    unpad: list[int] = []
    start = 0
    for b in range(n_req):
        p, t, n, tm = n_prefix[b], n_tree[b], n_new[b], tree_masks[b]
        if n == 0:  # nothing to attend: left as a padding request
            continue
        length = p + t + n
        table = torch.tensor(tables[b], dtype=torch.int32)
        if table.numel() * block_size < length:
            raise ValueError(f"request {b}: {table.numel()} blocks cannot hold {length} rows")
        if tm is None:  # committed rows: all earlier rows, causally
            lim[b, :n] = torch.arange(p + t + 1, length + 1, dtype=torch.int32)
        else:
            if tuple(tm.shape) != (n, t + n):
                raise ValueError(f"request {b}: tree mask {tuple(tm.shape)} is not {(n, t + n)}")
            lim[b, :n] = p
            bits[b, :n, :t + n] = tm
        # padding rows copy the last real row, so the blocks listed are the real rows'
        lim[b, n:] = lim[b, n - 1]
        bits[b, n:] = bits[b, n - 1]
        prefix[b] = p
        logical[table.long()] = torch.arange(table.numel(), dtype=torch.int32)
        for k in range(n_tiles):
            rows = lim[b, k * Q_BLOCK:(k + 1) * Q_BLOCK]
            # blocks below every row's limit are full (no mask); the rest up to the
            # highest visible row (the causal limit, or the whole request for a tree)
            full = int(rows.min()) // block_size
            used = -(-(int(rows.max()) if tm is None else length) // block_size)
            full_num[b, 0, k], kv_num[b, 0, k] = full, used - full
            full_idx[b, 0, k, :full] = table[:full]
            kv_idx[b, 0, k, :used - full] = table[full:used]
        pad[b * n_max:(b + 1) * n_max] = [start + min(i, n - 1) for i in range(n_max)]
        unpad += range(b * n_max, b * n_max + n)
        start += n
    dev = torch.device(device)
    lim, bits, logical, prefix = (x.to(dev) for x in (lim, bits, logical, prefix))

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        row = logical[kv // block_size] * block_size + kv % block_size
        t = (row - prefix[b]).clamp(0, width)
        return (row < lim[b, q]) | (bits[b, q, t] & (row >= prefix[b]))

    block_mask = BlockMask.from_kv_blocks(
        kv_num.to(dev), kv_idx.to(dev), full_num.to(dev), full_idx.to(dev),
        BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(n_max, n_pool_blocks * block_size),
        compute_q_blocks=False)  # inference only: no dq
    return FlexPlan(block_mask, torch.tensor(pad, device=dev), torch.tensor(unpad, device=dev),
                    n_max)


def plan_for(segments: list[Segment], device: torch.device | str = "cpu") -> FlexPlan:
    """:func:`build_plan` for a packed forward's segments, after
    :meth:`PagedRows.pack` reserved their new rows (so the block tables cover them)."""
    pool = segments[0].cache.pool
    return build_plan([list(s.cache.blocks) for s in segments],
                      [s.cache.n_prefix for s in segments], [s.cache.n_tree for s in segments],
                      [s.tree_mask for s in segments], [s.n for s in segments],
                      pool.block_size, pool.n_blocks, device)


def attend(plan: FlexPlan, q: Tensor, pk: Tensor, pv: Tensor) -> Tensor:
    """Packed queries q [N, heads, hd] against one layer's pool keys/values
    pk, pv [kv_heads, S, hd] (new rows already written); returns [N, heads, hd]."""
    if _flex is None:
        raise RuntimeError("this torch has no FlexAttention; use model.paged_attention")
    n_heads, hd = q.shape[1], q.shape[2]
    qb = q.index_select(0, plan.pad).view(-1, plan.n_max, n_heads, hd).transpose(1, 2)
    # the pool is one batch that every request's tiles index into (flex broadcasts it);
    # its blocks only: the scratch slot after them is no block's
    slots = plan.block_mask.seq_lengths[1]
    out = _flex(qb, pk[:, :slots].unsqueeze(0), pv[:, :slots].unsqueeze(0),
                block_mask=plan.block_mask, scale=1.0 / math.sqrt(hd),
                enable_gqa=n_heads != pk.shape[0])
    return out.transpose(1, 2).reshape(-1, n_heads, hd).index_select(0, plan.unpad)


__all__ = ["MIN_WIDTH", "Q_BLOCK", "FlexPlan", "attend", "bucket", "build_plan", "flex_available",
           "plan_for"]
