"""The messages workers exchange over a link, and their schema checks.

A link frame carries every request's part of one hop in one step (kind ``nodes``):
one frame per hop and step, however many requests are in flight, so a batch of B
requests costs one encode, one MAC and one send per hop instead of B.  Each part is
one of

``level``   draft service -> stage 1: tree nodes entering the pipeline
            (ids, parent ids, tokens; the root has parent -1)
``hidden``  stage i -> stage i+1: the same nodes plus their hidden states ``x``
``prefill`` stage i -> stage i+1: hidden states of a chunk of the committed sequence
``exit``    stage J -> draft service: miss recovery's token channel, the early exit's
            top-K candidates (``cand``) and probabilities (``cand_p``) [n, K] of the
            nodes stage J computed (``--recovery early-exit:J:K``)

and names its request, epoch and step, so a receiver drops what belongs to another
request or an older epoch, part by part.  The frame's meta lists the parts as
``[request, kind, epoch, step, nodes, rows]``; their nodes (ids, parents, tokens)
and hidden-state rows (``x``) follow each other in the frame's tensors in that order.
:func:`parse` checks names, dtypes, shapes and sizes against what the receiver
expects and raises :class:`~protocol.links.frames.FrameError` with one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from protocol.links.frames import FrameError, Message

FRAME_KIND = "nodes"
KINDS = ("level", "hidden", "prefill", "exit")
MAX_CANDIDATES = 1024  # an exit part's K at most (protocol.config.recovery.MAX_RECOVERY_K)
MAX_ID_LEN = 128
MAX_PARTS = 256  # requests in one frame: the largest batch a manifest allows, four times


@dataclass
class Nodes:
    """One request's tree nodes moving one hop down the pipeline (or its prefill rows)."""

    kind: str
    req: str
    epoch: int
    step: int
    ids: Tensor  # [n] int64
    parents: Tensor  # [n] int64, -1 for the root
    tokens: Tensor  # [n] int64
    x: Tensor | None = None  # [n, dim] hidden states ([rows, dim] for a prefill; None: level)
    cand: Tensor | None = None  # exit: [n, K] int64 candidate tokens per node
    cand_p: Tensor | None = None  # exit: [n, K] float32 their probabilities

    def rows(self) -> int:
        """Hidden-state rows it carries (0 for a level)."""
        return 0 if self.x is None else int(self.x.shape[0])

    def __len__(self) -> int:
        return int(self.ids.numel())


def encode(parts: Sequence[Nodes]) -> tuple[str, dict[str, Any], dict[str, Tensor]]:
    """One frame's kind, meta and tensors for ``parts`` (at least one)."""
    meta = {"parts": [[p.req, p.kind, p.epoch, p.step, len(p), p.rows()] for p in parts]}
    tensors = {name: torch.cat([getattr(p, name) for p in parts])
               for name in ("ids", "parents", "tokens")}
    xs = [p.x for p in parts if p.x is not None]
    if xs:
        tensors["x"] = torch.cat(xs)
    exits = [p for p in parts if p.kind == "exit"]
    if exits:
        tensors["cand"] = torch.cat([_need(p.cand) for p in exits])
        tensors["cand_p"] = torch.cat([_need(p.cand_p) for p in exits])
    return FRAME_KIND, meta, tensors


def _need(t: Tensor | None) -> Tensor:
    """An exit part's candidate tensor (a part without them is a sender's bug)."""
    if t is None:
        raise ValueError("an exit part needs cand and cand_p")
    return t


def _part(entry: object) -> tuple[str, str, int, int, int, int]:
    """One checked ``[request, kind, epoch, step, nodes, rows]`` entry of the meta."""
    if not isinstance(entry, list) or len(entry) != 6:
        raise FrameError("each entry of meta.parts must be [request, kind, epoch, step, "
                         "nodes, rows]")
    req, kind, *nums = entry
    if not isinstance(req, str) or not 0 < len(req) <= MAX_ID_LEN:
        raise FrameError(f"a part's request must be an id string of 1..{MAX_ID_LEN} chars")
    if kind not in KINDS:
        raise FrameError(f"part kind {kind!r} is not one of {', '.join(KINDS)}")
    for name, v in zip(("epoch", "step", "nodes", "rows"), nums, strict=True):
        if type(v) is not int or v < 0:
            raise FrameError(f"a part's {name} must be a non-negative int, got {v!r}")
    epoch, step, n, rows = nums
    if kind == "level" and rows:
        raise FrameError("a level part carries no hidden-state rows")
    if kind == "hidden" and rows != n:
        raise FrameError(f"a hidden part has {rows} rows for {n} nodes; they must match")
    if kind == "prefill" and n:
        raise FrameError("a prefill part carries rows, not nodes")
    if kind == "exit" and rows:
        raise FrameError("an exit part carries candidates, not hidden-state rows")
    return req, kind, epoch, step, n, rows


def parse(msg: Message, dim: int, dtype: torch.dtype) -> list[Nodes]:
    """Check a received frame and split it into its parts; hidden states [rows, dim]."""
    if msg.kind != FRAME_KIND:
        raise FrameError(f"message kind {msg.kind!r} is not {FRAME_KIND!r}")
    entries = msg.meta.get("parts")
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_PARTS:
        raise FrameError(f"meta.parts must list 1..{MAX_PARTS} parts")
    parts = [_part(e) for e in entries]
    if len({p[:4] for p in parts}) < len(parts):
        raise FrameError("two parts name the same request, kind, epoch and step")
    t = msg.tensors
    has_x = any(kind in ("hidden", "prefill") for _, kind, *_ in parts)
    has_exit = any(kind == "exit" for _, kind, *_ in parts)
    want = {"ids", "parents", "tokens"} | ({"x"} if has_x else set()) | \
        ({"cand", "cand_p"} if has_exit else set())
    if set(t) != want:
        raise FrameError(f"frame needs tensors {sorted(want)}, got {sorted(t)}")
    n = sum(p[4] for p in parts)
    for name in ("ids", "parents", "tokens"):
        v = t[name]
        if v.dtype != torch.int64 or v.dim() != 1:
            raise FrameError(f"tensor {name!r} must be 1-D int64, got {v.dtype} {list(v.shape)}")
        if v.numel() != n:
            raise FrameError(f"tensor {name!r} has {v.numel()} entries, the parts {n} nodes")
    x = t.get("x")
    if x is not None:
        rows = sum(p[5] for p in parts)
        if x.dtype != dtype or list(x.shape) != [rows, dim]:
            raise FrameError(f"tensor 'x' must be {dtype} [{rows}, {dim}], got {x.dtype} "
                             f"{list(x.shape)}; stages must run the same model and dtype")
        if not bool(torch.isfinite(x).all()):
            raise FrameError("tensor 'x' holds NaN or inf; the sender's stage is broken")
    cands = _candidates(t, [p[4] for p in parts if p[1] == "exit"]) if has_exit else []
    out = []
    ids_all = t["ids"].split([p[4] for p in parts])
    parents_all = t["parents"].split([p[4] for p in parts])
    tokens_all = t["tokens"].split([p[4] for p in parts])
    xs = x.split([p[5] for p in parts]) if x is not None else [None] * len(parts)
    for (req, kind, epoch, step, k, _), ids, par, tok, xp in zip(
            parts, ids_all, parents_all, tokens_all, xs, strict=True):
        if k and (bool((ids < 0).any()) or (k > 1 and bool((ids[1:] <= ids[:-1]).any()))):
            raise FrameError("node ids must be non-negative and strictly increasing per part")
        cand, cand_p = cands.pop(0) if kind == "exit" else (None, None)
        out.append(Nodes(kind, req, epoch, step, ids, par, tok,
                         xp if kind in ("hidden", "prefill") else None, cand, cand_p))
    return out


def _candidates(t: dict[str, Tensor], sizes: list[int]) -> list[tuple[Tensor, Tensor]]:
    """The exit parts' checked (cand, cand_p) [n, K], in order."""
    cand, prob = t["cand"], t["cand_p"]
    if cand.dtype != torch.int64 or cand.dim() != 2 or \
            not 1 <= cand.shape[1] <= MAX_CANDIDATES or cand.shape[0] != sum(sizes):
        raise FrameError(f"tensor 'cand' must be int64 [{sum(sizes)}, K] with 1 <= K <= "
                         f"{MAX_CANDIDATES}, got {cand.dtype} {list(cand.shape)}")
    if prob.dtype != torch.float32 or prob.shape != cand.shape:
        raise FrameError(f"tensor 'cand_p' must be float32 {list(cand.shape)}, got "
                         f"{prob.dtype} {list(prob.shape)}")
    if bool((cand < 0).any()) or not bool(((prob >= 0) & (prob <= 1)).all()):
        raise FrameError("exit candidates must be token ids >= 0 with probabilities in [0, 1]")
    return list(zip(cand.split(sizes), prob.split(sizes), strict=True))
