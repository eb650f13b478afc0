"""A participant's KV pool: allocated at start from the KV budget, reported in heartbeats."""

from __future__ import annotations

import torch

from protocol.errors import TreepipeError
from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE
from protocol.sync.heartbeat import KvUse
from stages.model.kv_cache import BlockPool
from stages.model.model import StageShard


def kv_pool(shard: StageShard, kv_blocks: int | None, who: str) -> BlockPool:
    """The KV pool of a stage (or of the draft service's draft model): ``kv_blocks``
    blocks allocated now, so that a device without the memory fails at start and not
    mid-request (TreepipeError naming the fix); None: a pool that grows with the
    requests."""
    if kv_blocks is None:  # the gateway bounds the requests, and so the blocks
        return shard.new_pool(8, growable=True)
    try:
        return shard.new_pool(kv_blocks)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        device = next(shard.parameters()).device
        raise TreepipeError(
            f"{who}: cannot allocate its KV pool of {kv_blocks} blocks "
            f"({kv_blocks * DEFAULT_BLOCK_SIZE} tokens) on {device}: "
            f"{str(e).splitlines()[0]}; lower memory.kvTokens (or --kv-tokens)") from None


def kv_use(pool: BlockPool) -> KvUse:
    """A heartbeat's ``kv``: the pool's blocks, in use now and at most, and whether it is
    fixed (the gateway admits by the smallest fixed pool reported)."""
    return KvUse(pool.n_blocks, pool.used_blocks, pool.peak_used, pool.block_size,
                 not pool.growable)
