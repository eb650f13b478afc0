"""The messages workers exchange over a link, and their schema checks.

``level``   draft service -> stage 1: tree nodes entering the pipeline
            (ids, parent ids, tokens; the root has parent -1)
``hidden``  stage i -> stage i+1: the same nodes plus their hidden states ``x``
``prefill`` stage i -> stage i+1: hidden states of the committed sequence
            (positions 0..n-1), sent once per request and epoch

Every message carries ``req`` (request id), ``epoch`` and ``step`` in its
header, so a receiver drops what belongs to another request or an older epoch.
:func:`parse` checks names, dtypes, shapes and sizes against what the receiver
expects and raises :class:`~protocol.links.frames.FrameError` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from protocol.links.frames import FrameError, Message

KINDS = ("level", "hidden", "prefill")
MAX_ID_LEN = 128


@dataclass
class Nodes:
    """Tree nodes moving one hop down the pipeline (or the prefill rows)."""

    kind: str
    req: str
    epoch: int
    step: int
    ids: Tensor  # [n] int64
    parents: Tensor  # [n] int64, -1 for the root
    tokens: Tensor  # [n] int64
    x: Tensor | None = None  # [n, dim] hidden states (None for a level)

    def tensors(self) -> dict[str, Tensor]:
        out = {"ids": self.ids, "parents": self.parents, "tokens": self.tokens}
        if self.x is not None:
            out["x"] = self.x
        return out

    def meta(self) -> dict[str, object]:
        return {"req": self.req, "epoch": self.epoch, "step": self.step}

    def __len__(self) -> int:
        return int(self.ids.numel())


def _meta(meta: dict[str, object]) -> tuple[str, int, int]:
    req, epoch, step = meta.get("req"), meta.get("epoch"), meta.get("step")
    if not isinstance(req, str) or not 0 < len(req) <= MAX_ID_LEN:
        raise FrameError(f"meta.req must be a request id string of 1..{MAX_ID_LEN} chars")
    for name, v in (("epoch", epoch), ("step", step)):
        if type(v) is not int or v < 0:
            raise FrameError(f"meta.{name} must be a non-negative int, got {v!r}")
    assert isinstance(epoch, int) and isinstance(step, int)
    return req, epoch, step


def parse(msg: Message, dim: int, dtype: torch.dtype) -> Nodes:
    """Check a received message against the schema of its kind; hidden states [n, dim]."""
    if msg.kind not in KINDS:
        raise FrameError(f"message kind {msg.kind!r} is not one of {', '.join(KINDS)}")
    req, epoch, step = _meta(msg.meta)
    t = msg.tensors
    want = {"level": {"ids", "parents", "tokens"}, "hidden": {"ids", "parents", "tokens", "x"},
            "prefill": {"ids", "parents", "tokens", "x"}}[msg.kind]
    if set(t) != want:
        raise FrameError(f"{msg.kind} message needs tensors {sorted(want)}, got {sorted(t)}")
    n = None
    for name in ("ids", "parents", "tokens"):
        v = t[name]
        if v.dtype != torch.int64 or v.dim() != 1:
            raise FrameError(f"tensor {name!r} must be 1-D int64, got {v.dtype} {list(v.shape)}")
        if n is not None and v.numel() != n:
            raise FrameError(f"tensor {name!r} has {v.numel()} entries, ids has {n}")
        n = v.numel()
    x = t.get("x")
    if x is not None:
        rows = x.shape[0] if msg.kind == "prefill" and x.dim() == 2 else n  # prefill: no nodes
        if x.dtype != dtype or list(x.shape) != [rows, dim]:
            raise FrameError(f"tensor 'x' must be {dtype} [{rows}, {dim}], got {x.dtype} "
                             f"{list(x.shape)}; stages must run the same model and dtype")
        if not bool(torch.isfinite(x).all()):
            raise FrameError("tensor 'x' holds NaN or inf; the sender's stage is broken")
    if n and msg.kind != "prefill":
        ids = t["ids"]
        if bool((ids < 0).any()) or (n > 1 and bool((ids[1:] <= ids[:-1]).any())):
            raise FrameError("node ids must be non-negative and strictly increasing")
    return Nodes(msg.kind, req, epoch, step, t["ids"], t["parents"], t["tokens"], x)
