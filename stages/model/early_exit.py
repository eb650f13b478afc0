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
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from stages.model.checkpoint import ModelError
from stages.model.model import RMSNorm, StageShard

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_META = "early_exit.json"
ADAPTER_KIND = "treepipe-early-exit-adapter"


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


def exit_top(shard: StageShard, h: Tensor, layer: int, k: int,
             allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The early exit's top-``k`` (token ids, probabilities) [n, k] at ``layer`` for the
    states ``h`` of n tree nodes (the last stage's ``shard`` holds the norm and head): the
    token channel of miss recovery.  ``allowed`` (bool [n, vocab]) masks a grammar's
    forbidden tokens first (probability 0: no candidate)."""
    logits = exit_logits(shard, h, layer)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), -torch.inf)
    probs = torch.softmax(logits.to(torch.float64), dim=-1).nan_to_num(0.0)
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return top.indices.cpu(), top.values.cpu()


def cached_adapters(root: Path, target: str) -> dict[int, tuple[ExitAdapter, Path]]:
    """Trained exit adapters for ``target`` under ``root`` (``<cache>/drafts``), by exit
    layer; the newest folder wins when two share a layer."""
    found: dict[int, tuple[ExitAdapter, Path]] = {}
    if not root.is_dir():
        return found
    folders = sorted((p for p in root.iterdir() if is_adapter_folder(p)),
                     key=lambda p: (p / ADAPTER_META).stat().st_mtime)
    for folder in folders:
        adapter, meta = load_adapter(folder)
        if str(meta.get("target", "")) in (target, ""):
            found[int(meta["exit_layer"])] = (adapter, folder)
    return found


__all__ = ["ExitAdapter", "AdaptedNorm", "attach_adapter", "save_adapter", "load_adapter",
           "is_adapter_folder", "boundary_states", "exit_logits",
           "cached_adapters"]
