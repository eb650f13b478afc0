"""Batching limits a pipeline's processes and its manifest share.

A leaf module (no pydantic, no torch), so the gateway reads them without loading the
manifest schema; it sits in protocol/ so that :mod:`protocol.config.pipeline`, which the
device processes import, bounds its numbers by the same limits.
"""

from __future__ import annotations

# requests in one batch at most: each adds a packed segment and a verdict per step, and
# the KV budget grows with it (the planner checks that it fits)
MAX_CONCURRENCY = 64
# prompt rows a joining request prefills per step: a long prompt enters in chunks, so
# the requests already decoding wait one chunk's forward per step, not the whole prompt's
DEFAULT_PREFILL_CHUNK_ROWS = 512
