"""Batching limits a pipeline's processes and its manifest share (defined with the
pipeline config in :mod:`protocol.config.limits`; kept here for the control plane's
imports)."""

from __future__ import annotations

from protocol.config.limits import DEFAULT_PREFILL_CHUNK_ROWS, MAX_CONCURRENCY

__all__ = ["DEFAULT_PREFILL_CHUNK_ROWS", "MAX_CONCURRENCY"]
