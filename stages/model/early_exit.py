"""Early-exit draft (Mirror-SD Eq. 6): a small adapter on a middle layer's hidden state.

``p(. | y<t) = softmax(W_LM · norm(f_adapt(h^(l_e))))`` with ``f_adapt`` a two-layer
MLP (dim -> dim/2 -> dim, ReLU) added residually to ``h^(l_e)``, the target's own
final norm and its shared LM head.  The second projection starts at zero, so an
untrained adapter is exactly the plain early exit (``layers:N``) and training
(Eq. 15, here a soft cross-entropy against the target's top-k distribution) can
only start from there.

At run time the adapter is a draft whose body *is* the target's first ``l_e``
layers: in a pipeline the stage holding layer ``l_e`` already computes
``h^(l_e)`` for every tree node, so the draft's extra cost there is the adapter
and the LM head.  In the in-process engine the source runs those layers itself
(:class:`~stages.speculation.token_sources.EarlyExitSource`), which gives the same tokens.
"""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from protocol.config.recovery import Recovery
from stages.model.checkpoint import ModelError
from stages.model.model import RMSNorm, StageShard, linear

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_META = "early_exit.json"
ADAPTER_KIND = "treepipe-early-exit-adapter"
log = logging.getLogger("treepipe.recovery")


class ExitAdapter(nn.Module):
    """``h + W_up relu(W_down h)``: the Mirror-SD early-exit MLP, residual and zero-started."""

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or dim // 2
        self.down = nn.Linear(dim, hidden, bias=True)
        self.up = nn.Linear(hidden, dim, bias=True)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(torch.relu(self.down(h)))


class AdaptedNorm(nn.Module):
    """Adapter followed by the target's final norm; replaces a cut shard's ``norm``.

    StageShard applies ``norm`` to its last layer's output, so putting the adapter
    inside that slot makes an adapted early exit an ordinary whole-model shard that
    every engine path (tree cache, pruning, batching) already handles.
    """

    def __init__(self, adapter: ExitAdapter, norm: RMSNorm):
        super().__init__()
        self.adapter, self.final_norm = adapter, norm

    def forward(self, h: Tensor) -> Tensor:
        return self.final_norm(self.adapter(h))


def attach_adapter(cut: StageShard, adapter: ExitAdapter) -> StageShard:
    """Put ``adapter`` in front of the final norm of ``cut`` (a ``layers:N`` early-exit draft)."""
    if cut.norm is None or isinstance(cut.norm, AdaptedNorm):
        raise ModelError("attach the adapter to a plain early-exit cut (layers:N) once")
    p = next(cut.parameters())
    cut.norm = AdaptedNorm(adapter.to(device=p.device, dtype=p.dtype), cut.norm)
    return cut


def save_adapter(folder: Path, adapter: ExitAdapter, exit_layer: int, target: str,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write ``adapter.safetensors`` and ``early_exit.json`` (exit layer, target) to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous()
               for k, v in adapter.state_dict().items()}
    tmp = folder / (ADAPTER_FILE + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(folder / ADAPTER_FILE)
    meta = {"kind": ADAPTER_KIND, "exit_layer": exit_layer, "target": target,
            "dim": adapter.down.in_features, "hidden": adapter.down.out_features,
            **(extra or {})}
    (folder / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return folder


def is_adapter_folder(folder: Path) -> bool:
    """True when ``folder`` holds an early-exit adapter rather than a draft model."""
    return (Path(folder) / ADAPTER_META).is_file()


def load_adapter(folder: Path) -> tuple[ExitAdapter, dict[str, Any]]:
    """The adapter in ``folder`` and its metadata (exit layer, hidden size, target)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / ADAPTER_META).read_text(encoding="utf-8"))
        if meta.get("kind") != ADAPTER_KIND:
            raise ValueError(f"kind is {meta.get('kind')!r}")
        adapter = ExitAdapter(int(meta["dim"]), int(meta["hidden"]))
        adapter.load_state_dict(load_file(folder / ADAPTER_FILE), strict=True)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"{folder} is not a usable early-exit adapter ({e}); retrain it with "
                         "`treepipe draft distill --early-exit N`") from e
    return adapter.eval(), meta


def boundary_states(shard: StageShard, ids: list[int], layers: list[int]) -> dict[int, Tensor]:
    """Hidden states ``h^(l)`` [n, dim] after each layer ``l`` in ``layers`` (1-based, as an
    exit layer is counted) for the causal sequence ``ids``, and the final head's normed
    state under key ``shard.args.n_layers`` (what the last stage's LM head reads).

    ``shard`` is the whole model.  By losslessness a tree node's state at a stage boundary
    equals the state of the same token at the same position on its path, so one
    teacher-forced forward over a committed sequence gives every exit's view of every
    node on that path.
    """
    if not (shard.is_first and shard.is_last):
        raise ValueError("boundary_states needs the whole model (one shard)")
    wanted = {layer - 1 for layer in layers if 1 <= layer < shard.args.n_layers}
    index = {id(layer): j for j, layer in enumerate(shard.layers)}
    seen: dict[int, Tensor] = {}
    plain = shard.layer_fn

    def capture(layer: nn.Module, h: Tensor, *rest: Any) -> Tensor:
        out = plain(layer, h, *rest)
        j = index[id(layer)]
        if j in wanted:
            seen[j + 1] = out.detach().clone()
        return out

    shard.layer_fn = capture
    try:
        x = torch.tensor(ids, dtype=torch.long)
        final = shard(x, torch.arange(len(ids)), shard.new_cache(len(ids) + 16))
    finally:
        shard.layer_fn = plain
    seen[shard.args.n_layers] = final
    return seen


def exit_logits(shard: StageShard, h: Tensor, layer: int,
                adapter: ExitAdapter | None = None) -> Tensor:
    """Logits of the early exit at ``layer`` for states ``h`` from :func:`boundary_states`:
    the final norm and the shared LM head (Mirror-SD Eq. 6), after ``adapter`` if given.
    The final layer's states are already normed."""
    assert shard.norm is not None and shard.lm_head is not None
    with torch.inference_mode():
        if layer < shard.args.n_layers:
            h = shard.norm(adapter(h) if adapter is not None else h)
        return shard.logits(h)


class ExitHead:
    """Miss recovery's early exit at one layer (Mirror-SD Eq. 6 as a token channel): the
    exit adapter if any, the target's final norm, then the LM head over all its rows, over
    the rows of a reduced vocabulary (``rows``: token ids, as ``--draft-vocab``), or over
    each node's own candidate tokens only (``by_candidates``).  Every variant only chooses
    which correction candidates are offered, so recovery stays lossless with any of them.
    """

    def __init__(self, head: StageShard, layer: int, rows: Tensor | None = None,
                 adapter: ExitAdapter | None = None, by_candidates: bool = False,
                 adapter_path: str = ""):
        assert head.norm is not None and head.lm_head is not None
        if rows is not None and by_candidates:
            raise ValueError("an exit head scores a reduced vocabulary or candidates, not both")
        self.head, self.layer, self.by_candidates = head, layer, by_candidates
        lm = head.lm_head
        # an int8 head (--quantize int8) is read dequantized: the exit only ranks candidates
        w = lm.weight.detach() if isinstance(lm, nn.Linear) else \
            lm.dequantized(head.norm.weight.dtype)
        self.vocab = vocab = int(w.shape[0])
        self.ids: Tensor | None = None
        self.weight = w
        if rows is not None:
            rows = rows.to(dtype=torch.long).cpu()
            bad = rows[(rows < 0) | (rows >= vocab)]
            if bad.numel() or not rows.numel():
                raise ModelError(f"exit head: {rows.numel()} rows with ids outside the "
                                 f"target's vocabulary of {vocab} (e.g. "
                                 f"{bad[:1].tolist()}); was the vocabulary built for "
                                 "another model?")
            self.ids = rows
            # copied once: a step then reads N x dim instead of V x dim (the point of it)
            self.weight = w[rows.to(w.device)].clone()
        self.adapter = None
        if adapter is not None and adapter.down.in_features != w.shape[1]:
            raise ModelError(f"exit adapter {adapter_path} is for hidden size "
                             f"{adapter.down.in_features}, the target's is {w.shape[1]}; "
                             "was it trained for another model?")
        if adapter is not None:
            self.adapter = adapter.to(device=w.device, dtype=w.dtype).eval()
        self.adapter_path = adapter_path

    def describe(self) -> str:
        """One line for the log: which exit runs (plain or adapter path) and its head."""
        head = ("the node's draft proposals only" if self.by_candidates else
                f"{self.weight.shape[0]} of {self.vocab} LM-head rows"
                if self.ids is not None else "the full LM head")
        ad = f"adapter {self.adapter_path}" if self.adapter is not None else "plain (no adapter)"
        return f"early exit at layer {self.layer}: {ad}, {head}"

    def normed(self, h: Tensor) -> Tensor:
        """The final norm of the (adapted) states ``h`` [n, dim] of the exit layer."""
        assert self.head.norm is not None
        with torch.inference_mode():
            if self.layer < self.head.args.n_layers:
                h = self.head.norm(self.adapter(h) if self.adapter is not None else h)
            return h

    def top(self, h: Tensor, k: int, allowed: Tensor | None = None,
            candidates: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Top-``k`` (token ids, probabilities) [n, k] for the states ``h`` of n tree
        nodes; probabilities are over the head's tokens (the subset's, or each node's
        ``candidates``, renormalised), 0 where fewer than k are left (no candidate).
        ``allowed`` (bool [n, vocab]) masks a grammar's forbidden tokens first."""
        x = self.normed(h)
        with torch.inference_mode():
            if self.by_candidates:
                ids, logits = self._candidate_logits(x, candidates)
            else:
                logits = linear(x, self.weight)
                ids = None if self.ids is None else self.ids.to(x.device).expand_as(logits)
            if allowed is not None:
                cols = allowed.to(logits.device)
                cols = cols if ids is None else cols.gather(1, ids.clamp(min=0))
                logits = logits.masked_fill(~cols, -torch.inf)
            probs = torch.softmax(logits.to(torch.float64), dim=-1).nan_to_num(0.0)
            top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
            toks = top.indices if ids is None else ids.gather(1, top.indices)
        return toks.cpu(), top.values.cpu()

    def _candidate_logits(self, x: Tensor, candidates: list[Tensor] | None
                          ) -> tuple[Tensor, Tensor]:
        """Ids [n, C] (-1: padding) and their logits [n, C] (-inf at padding): only each
        node's own candidates' rows of the LM head, C = the most any node has."""
        assert candidates is not None and len(candidates) == x.shape[0]
        width = max([1, *(int(c.numel()) for c in candidates)])
        ids = torch.full((x.shape[0], width), -1, dtype=torch.long)
        for i, c in enumerate(candidates):
            ids[i, :c.numel()] = c.to(torch.long)
        ids = ids.to(x.device)
        rows = self.weight[ids.clamp(min=0)]  # [n, C, dim]
        logits = torch.bmm(rows, x.unsqueeze(-1)).squeeze(-1)
        return ids, logits.masked_fill(ids < 0, -torch.inf)


# built once per (last stage, layer, setting): a reduced head copies its rows once
_HEADS: weakref.WeakKeyDictionary[StageShard, dict[tuple[int, Any], ExitHead]] = \
    weakref.WeakKeyDictionary()


def exit_head(head: StageShard, layer: int, recovery: Recovery) -> ExitHead:
    """The :class:`ExitHead` that ``recovery`` (``early-exit:J:K`` and its options) names at
    ``layer`` on the last stage ``head``, built on first use and logged then.

    The vocabulary's ids and the adapter folders come resolved in ``recovery.rows`` and
    ``recovery.adapters``; an explicit adapter for another layer is refused (ModelError)."""
    per = _HEADS.setdefault(head, {})
    key = (layer, recovery)
    if key in per:
        return per[key]
    if recovery.vocab and not recovery.rows:
        raise ModelError(f"--recovery {recovery.name}: the vocabulary's ids were not read; "
                         "pass the setting through the command line or resolve its rows")
    adapter, path = None, ""
    found = dict(recovery.adapters)
    if recovery.adapter and recovery.adapter != "auto":
        if layer not in found:
            have = ", ".join(str(k) for k in sorted(found)) or "none"
            raise ModelError(f"--recovery {recovery.name}: the adapter is for layer {have}, "
                             f"but stage {recovery.exit_stage} ends at layer {layer}; train one "
                             f"with `treepipe draft distill --early-exit {layer}`")
    if layer in found and recovery.adapter:
        path = found[layer]
        adapter, _ = load_adapter(Path(path))
    rows = torch.tensor(recovery.rows, dtype=torch.long) if recovery.vocab else None
    built = ExitHead(head, layer, rows, adapter, recovery.draft_only, path)
    log.info("--recovery %s: %s", recovery.name, built.describe())
    per[key] = built
    return built


def cached_adapters(root: Path, target: str | None) -> dict[int, tuple[ExitAdapter, Path]]:
    """Trained exit adapters for ``target`` (None: any) under ``root`` (``<cache>/drafts``),
    by exit layer; the newest folder wins when two share a layer."""
    found: dict[int, tuple[ExitAdapter, Path]] = {}
    if not root.is_dir():
        return found
    folders = sorted((p for p in root.iterdir() if is_adapter_folder(p)),
                     key=lambda p: (p / ADAPTER_META).stat().st_mtime)
    for folder in folders:
        adapter, meta = load_adapter(folder)
        if target is None or str(meta.get("target", "")) in (target, ""):
            found[int(meta["exit_layer"])] = (adapter, folder)
    return found


__all__ = ["ExitAdapter", "AdaptedNorm", "attach_adapter", "save_adapter", "load_adapter",
           "is_adapter_folder", "boundary_states", "exit_logits",
           "ExitHead", "exit_head", "cached_adapters"]
