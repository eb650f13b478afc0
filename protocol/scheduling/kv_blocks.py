"""KV block arithmetic: the blocks that rows and requests need.

Torch-free, so the planner (``treepipe plan``, the launcher) sizes memory with the
same arithmetic as :mod:`stages.model.kv_cache` without importing torch.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16


def blocks_for(rows: int, block_size: int) -> int:
    """Blocks needed to hold ``rows`` rows."""
    return -(-rows // block_size)


def request_blocks(tokens: int, stages: int, width: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Worst-case blocks one request holds on one stage: ``tokens`` committed rows
    (prompt + max new tokens) plus the most tree rows a stage can hold at once
    (m in-flight levels of w nodes and the root's level), plus one block of slack
    for a compaction that straddles a block edge."""
    return blocks_for(tokens + (stages + 1) * width + 1, block_size) + 1


def pool_blocks(kv_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks of a stage pool holding a budget of ``kv_tokens`` rows: whole blocks only,
    so the pool never takes more memory than the planner counted."""
    return kv_tokens // block_size


def longest_request(blocks: int, stages: int, width: int,
                    block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The most tokens (prompt + max new) one request may have to fit ``blocks`` blocks
    alone (0: none fits)."""
    tokens = (blocks - 1) * block_size - (stages + 1) * width - 1
    return max(tokens, 0)


def budget_tokens(concurrency: int, context: int, stages: int, width: int,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The default KV budget of a stage, in rows: ``concurrency`` requests of a whole
    ``context`` each at its worst case (:func:`request_blocks`), so every request the
    gateway accepts fits beside ``concurrency - 1`` others."""
    return concurrency * request_blocks(context, stages, width, block_size) * block_size


def kv_limit(stored: int, cap: int | None, pool: int | None) -> int:
    """The KV budget in blocks (0: none) of a request whose gateway read ``stored`` blocks
    when it admitted it and caps it at ``cap`` (its own ``--kv-tokens``; 0: none, None: a
    gateway of an earlier version, for which ``stored`` stands), held to the pipeline's
    pools now (``pool``: the smallest fixed pool its participants report, 0: none is
    fixed, None: unknown while one does not beat).  So a re-plan re-prices every running
    request against the new plan's pools at once."""
    if pool is None:
        return stored
    cap = stored if cap is None else cap
    if pool == 0:
        return cap if cap > 0 else stored
    if 0 < cap < pool:
        return cap
    return pool


__all__ = ["DEFAULT_BLOCK_SIZE", "blocks_for", "budget_tokens", "kv_limit",
           "longest_request", "pool_blocks", "request_blocks"]
