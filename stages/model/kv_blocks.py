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


__all__ = ["DEFAULT_BLOCK_SIZE", "blocks_for", "request_blocks"]
