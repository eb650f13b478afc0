"""A stage step padded to fixed shapes: what one captured CUDA graph replays.

A graph replays one set of tensor shapes, but a step's shapes vary with every level
and batch: its packed rows (N), requests (B), rows of the longest request (n_max) and
keys of the longest request (T_max). Each is padded up to a power of two (keys to at
least :data:`MIN_KEYS`), so a few graphs serve every step. Padding changes no real row:

- padded rows are zeros with zero rotary tables; they write their K/V to the pool's
  scratch slot (:attr:`~stages.model.kv_cache.BlockPool.scratch_slot`), which no request
  holds, and see one key, so attention stays finite; their outputs are dropped;
- padded keys read slot 0 under a False mask;
- a padded request is all padding rows.

The mask is always explicit here (an unpadded lone row runs without one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from stages.model.model import RowIndex

# steps with more rows than this (long prompt chunks) run unpadded and uncaptured:
# they are matmul-bound, and a graph per chunk size would hold memory for little gain
MAX_BUCKET_ROWS = 256
MIN_KEYS = 64  # the smallest key bucket: a short prompt's first steps share one graph


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above ``max(n, least)``."""
    return 1 << (max(n, least) - 1).bit_length()


class BucketKey(NamedTuple):
    """The padded shape of a step: one captured graph each."""

    rows: int
    requests: int
    per_request: int
    keys: int


class PaddedStep(NamedTuple):
    """A step's inputs padded to :class:`BucketKey` shapes; ``n`` real rows lead."""

    key: BucketKey
    n: int
    h: Tensor
    cos: Tensor
    sin: Tensor
    rows: RowIndex


def bucket_key(n: int, rows: RowIndex) -> BucketKey:
    """The bucket of a step of ``n`` packed rows laid out as ``rows``."""
    b, t = rows.read.shape
    return BucketKey(bucket(n), bucket(b), bucket(rows.pad.shape[1]), bucket(t, MIN_KEYS))


def _pad(t: Tensor, sizes: tuple[int, ...], value: int = 0) -> Tensor:
    """``F.pad`` that costs nothing where the step already fills its bucket."""
    return t if not any(sizes) else F.pad(t, sizes, value=value)


def pad_step(h: Tensor, cos: Tensor, sin: Tensor, rows: RowIndex,
             scratch_slot: int) -> PaddedStep | None:
    """``h``/``cos``/``sin``/``rows`` padded to their bucket; None past
    :data:`MAX_BUCKET_ROWS` rows."""
    n = h.shape[0]
    key = bucket_key(n, rows)
    if key.rows > MAX_BUCKET_ROWS:
        return None
    b, t = rows.read.shape
    n_max = rows.pad.shape[1]
    extra = (0, 0, 0, key.rows - n)
    mask = torch.zeros(key.requests, 1, key.per_request, key.keys, dtype=torch.bool,
                       device=h.device)
    mask[:b, :, :n_max, :t] = True if rows.mask is None else rows.mask
    if (key.requests, key.per_request) != (b, n_max):  # (pack set its own padding rows)
        mask[..., 0] |= ~mask.any(-1)  # padded rows and requests see key 0, not nothing
    unpad = rows.unpad
    if key.per_request != n_max:  # a packed entry's place moves with the wider requests
        unpad = unpad // n_max * key.per_request + unpad % n_max
    return PaddedStep(key, n, _pad(h, extra), _pad(cos, extra), _pad(sin, extra), RowIndex(
        write=_pad(rows.write, (0, key.rows - n), value=scratch_slot),
        read=_pad(rows.read, (0, key.keys - t, 0, key.requests - b)),
        pad=_pad(rows.pad, (0, key.per_request - n_max, 0, key.requests - b)),
        unpad=_pad(unpad, (0, key.rows - n)),
        mask=mask))


__all__ = ["MAX_BUCKET_ROWS", "MIN_KEYS", "BucketKey", "PaddedStep", "bucket", "bucket_key",
           "pad_step"]
