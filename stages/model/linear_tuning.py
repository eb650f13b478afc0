"""Measured CPU kernels: for each weight and row count the matmul kernel that ran
fastest, and the context from which one-row attention runs in float32.

Which of BLAS's small-n ``linear``, oneDNN's transposed product, oneDNN's packed
weight and (bf16) ATen's own GEMV reads a weight fastest depends on the CPU, the
weight's shape and the rows per step (:func:`stages.model.model.linear`). A rule
measured on one machine was up to 40 % slow on another, so a shard measures its own
weights at load: for each group of same-role weights (every layer's QKV, output,
gate/up, down projection; the LM head) and each row bucket it times every kernel over
the whole group, after reading a buffer of 1.5x the CPU's largest cache where the
shard's weights outgrow it (so the weights come from memory as in a step, not from
cache), and stores the winner on each weight. A kernel must beat the untuned rule by :data:`MARGIN`
to replace it, so noise does not flip choices. The choices are kept in a JSON file per
CPU, torch version and thread count, so the next load reads them instead of measuring
again.

Attention at one query row is measured too: torch's fused kernel in the model's dtype
against the same kernel on values upcast to float32
(:func:`stages.model.model.upcast_attention`), whose costs grow differently with the
keys, so what is stored is the context from which the latter wins.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from stages.model.execution_modes import host_cpuinfo
from stages.model.model import (
    CPU_KERNELS,
    ROW_BUCKETS,
    UNTUNED,
    StageShard,
    packed_weight,
    sdpa_attention,
    upcast_attention,
)

MARGIN = 0.03  # a kernel replaces the untuned choice only when this much faster
MIN_ELEMENTS = 1 << 16  # smaller weights (the tiny test models) keep the untuned rule
REPEATS = 5
# bumped when a kernel's reach changes, so choices measured without it are measured again
# (2: bf16 weights gained the packed kernel; 3: the native kernel, attention; 4: attention's
# margin; 5: attention at one row only; 6: upcast attention is the float32 fused kernel;
# 7: weights timed from memory where the shard outgrows the CPU's cache; 8: 16-bit CPU
# attention folds its query heads)
KERNEL_SET = 8


def weight_groups(shard: StageShard) -> dict[str, list[Tensor]]:
    """The shard's float matmul weights by role; every weight of a group has one shape.
    An int8 weight (:mod:`stages.model.quantization`) has one kernel and is left out."""
    groups: dict[str, list[Tensor]] = {}
    for layer in shard.layers:
        att, mlp = layer.self_attn, layer.mlp
        for role, w in (("qkv", att.wqkv), ("o", att.o_proj), ("gate_up", mlp.w13),
                        ("down", mlp.down_proj)):
            w = w.weight if isinstance(w, nn.Linear) else w
            if isinstance(w, Tensor):
                groups.setdefault(role, []).append(w)
    if isinstance(shard.lm_head, nn.Linear):
        groups["lm_head"] = [shard.lm_head.weight]
    return groups


def machine_key() -> str:
    """What a choice depends on besides the weight: the CPU, torch and its threads."""
    cpu = platform.processor() or platform.machine()
    for line in host_cpuinfo().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (f"{cpu}|torch {torch.__version__}|{torch.get_num_threads()} threads"
            f"|kernels {KERNEL_SET}")


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
EVICT_MAX = 256 << 20  # bytes an eviction read is capped at (large server L3s)


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int:
    """The largest CPU cache of this machine in bytes (Linux sysfs; 32 MiB where it
    cannot tell)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for f in caches.glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        digits, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
        if digits.isdigit():
            largest = max(largest, int(digits) * unit)
    return largest or 32 << 20


def _best_time(run: Callable[[], object], evict: Tensor | None = None) -> float:
    """The least thread CPU time of :data:`REPEATS` calls of ``run`` (warmed by the
    caller), each after reading ``evict`` (untimed: the CPU's caches then hold none of
    the weights ``run`` reads, as in a step over more weights than they hold)."""
    best = float("inf")
    for _ in range(REPEATS):
        if evict is not None:
            evict.sum()
        t = time.thread_time()
        run()
        best = min(best, time.thread_time() - t)
    return best


def _time(kernel: str, weights: Sequence[Tensor], x: Tensor, evict: Tensor | None) -> float:
    fn = CPU_KERNELS[kernel]

    def run() -> None:
        for w in weights:
            fn(x, w)

    for w in weights[:2]:  # warm: first calls pack, allocate, dispatch
        fn(x, w)
    return _best_time(run, evict)


def measure(weights: Sequence[Tensor], evict: Tensor | None = None) -> list[str]:
    """The fastest kernel for each of :data:`ROW_BUCKETS` rows over ``weights``, each
    timing after reading ``evict`` where given (see :func:`tune_shard`)."""
    w0 = weights[0]
    kernels = [k for k in CPU_KERNELS if (k != "packed" or packed_weight(w0) is not None)
               and (k != "native" or w0.dtype != torch.float32)]  # float32: native is plain
    choices = []
    for bucket, default in zip(ROW_BUCKETS, UNTUNED, strict=True):
        x = torch.randn(bucket, w0.shape[1], dtype=w0.dtype)
        times = {k: _time(k, weights, x, evict) for k in kernels}
        if default not in times:  # no packing here: the untuned rule falls back to plain
            default = "plain"
        best = min(times, key=times.__getitem__)
        choices.append(best if times[best] < (1 - MARGIN) * times[default] else default)
    return choices


ATTENTION_KEYS = (64, 128, 256, 512, 1024, 2048)  # contexts attention kernels are timed at
ATTENTION_CALLS = 4  # calls per timing: one short call is near the clock's resolution
ATTENTION_PASSES = 3
# the upcast must win by this much: timed alone it runs on a warm cache, in a step its
# float32 copies do not (CPU-2, 2 threads: float32-score products timed alone won from 128
# keys, yet ar over 130-180 keys ran 2-5 % slower with them than with the fused kernel)
ATTENTION_MARGIN = 0.2


def _time_attention(fn, q: Tensor, k: Tensor, v: Tensor,  # type: ignore[no-untyped-def]
                    mask: Tensor | None) -> float:
    def run() -> None:
        for _ in range(ATTENTION_CALLS):
            fn(q, k, v, mask)

    fn(q, k, v, mask)  # warm
    return _best_time(run)


def measure_attention(heads: int, kv_heads: int, hd: int, dtype: torch.dtype) -> int:
    """The fewest of :data:`ATTENTION_KEYS` keys from which :func:`upcast_attention`
    beats torch's fused kernel at one query row by :data:`ATTENTION_MARGIN`, at that
    context and every longer one (0: at none). Each is the best of
    :data:`ATTENTION_PASSES` sweeps over every context: on CPU-2 a first sweep read the
    upcast's longest context 5x slow (1.0 against 0.2 ms), with the allocator's state
    the fresh process left, and so chose a threshold of 256 keys where it won from 64."""
    q = torch.randn(1, heads, 1, hd, dtype=dtype)
    kvs = {t: [torch.randn(1, kv_heads, t, hd, dtype=dtype) for _ in range(2)]
           for t in ATTENTION_KEYS}
    best: dict[tuple[int, bool], float] = {}
    for _ in range(ATTENTION_PASSES):
        for t, (k, v) in kvs.items():
            for up in (True, False):
                # a lone row attends unmasked (PagedRows builds no mask for it)
                took = _time_attention(upcast_attention if up else sdpa_attention,
                                       q, k, v, None)
                best[t, up] = min(best.get((t, up), took), took)
    keys_from = 0
    for t in reversed(ATTENTION_KEYS):
        if best[t, True] >= (1 - ATTENTION_MARGIN) * best[t, False]:
            break
        keys_from = t
    return keys_from


def tunable(w: Tensor) -> bool:
    """Whether a weight is worth measuring: a CPU float32/bf16 matrix of some size."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.numel() >= MIN_ELEMENTS
            and w.dtype in (torch.float32, torch.bfloat16))


def tune_shard(shard: StageShard, cache_file: Path | None = None,
               progress: bool = True) -> dict[str, list[str] | int]:
    """Choose each weight group's kernels and the attention's (from ``cache_file`` where it
    has them, else measured) and store them on the weights and layers; returns role ->
    kernel per row bucket, and for "attention" the keys from which one row upcasts."""
    from tqdm import tqdm

    groups = {role: ws for role, ws in weight_groups(shard).items() if tunable(ws[0])}
    args, dtype = shard.args, shard.layers[0].input_layernorm.weight.dtype
    # attention runs in the model's dtype even where the weights are int8 (not in groups)
    attention = (shard.layers[0].input_layernorm.weight.device.type == "cpu"
                 and dtype in (torch.float32, torch.bfloat16)
                 and args.dim * args.dim >= MIN_ELEMENTS)
    if not groups and not attention:
        return {}
    machine = machine_key()
    store = _read(cache_file)
    known = store.setdefault(machine, {})
    chosen: dict[str, list[str] | int] = {}
    todo = []
    # A step reads every weight of the shard once; where they outgrow the CPU's largest
    # cache, each comes from memory, and so must each timing's. A group alone may fit
    # (8 layers' [576, 576] SmolLM2 weights: 5 MiB bf16), and timed from cache it chose
    # kernels that were slower in a step: CPU-2, 1 thread, bf16 one-row step of 8 layers
    # 8.7 ms tuned from cache, 7.1 ms tuned from memory (float32 10.5 against 9.7).
    llc = last_level_cache_bytes()
    from_memory = sum(w.numel() * w.element_size() for ws in groups.values() for w in ws) > llc
    where = "|from memory" if from_memory else ""
    keys = {role: f"{tuple(ws[0].shape)}|{ws[0].dtype}|{len(ws)}{where}"
            for role, ws in groups.items()}
    if attention:
        keys["attention"] = f"attention|{args.n_heads}x{args.n_kv_heads}x{args.head_dim}|{dtype}"
    for role, key in keys.items():
        hit = known.get(key)
        if _usable(role, hit):
            chosen[role] = hit  # type: ignore[assignment]
        else:
            todo.append((role, key))
    with torch.inference_mode():
        # read before each timing: one and a half times the cache, so the weights leave
        # it (a one-time cost: some 700 reads of 48 MiB over SmolLM2's groups, about
        # 1.5 s at CPU-2's 25-30 GB/s)
        weights_todo = any(role != "attention" for role, _ in todo)
        evict = (torch.ones(min(3 * llc // 2, EVICT_MAX) // 4) if from_memory and weights_todo
                 else None)
        for role, key in tqdm(todo, desc=f"measuring kernels, layers "
                              f"{shard.start}-{shard.end - 1}", unit="kernel",
                              file=sys.stderr, disable=not progress or not todo):
            chosen[role] = known[key] = (
                measure_attention(args.n_heads, args.n_kv_heads, args.head_dim, dtype)
                if role == "attention" else measure(groups[role], evict))
    for role, ws in groups.items():
        for w in ws:
            w._treepipe_kernels = tuple(chosen[role])  # type: ignore[attr-defined]
    set_upcast_from(shard, chosen.get("attention", 0))  # type: ignore[arg-type]
    if todo and cache_file is not None:
        _write(cache_file, store)
    return chosen


def untune_shard(shard: StageShard) -> None:
    """Back to the untuned rule (``--no-tune``, and tests that need it)."""
    for ws in weight_groups(shard).values():
        for w in ws:
            if hasattr(w, "_treepipe_kernels"):
                del w._treepipe_kernels
    set_upcast_from(shard, 0)


def set_upcast_from(shard: StageShard, keys: int) -> None:
    """From how many keys every layer's one-row steps attend in float32 (0:
    never; :func:`stages.model.model.paged_attention`)."""
    for layer in shard.layers:
        layer.self_attn.upcast_from = keys


def _usable(role: str, hit: object) -> bool:
    """Whether a cached choice is one this code can apply: a context for attention, a
    known kernel per row bucket for a weight group (else it is measured again)."""
    if role == "attention":
        return type(hit) is int and hit >= 0
    return (isinstance(hit, list) and len(hit) == len(ROW_BUCKETS)
            and all(k in CPU_KERNELS for k in hit))


def _read(path: Path | None) -> dict[str, dict[str, list[str] | int]]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a damaged cache is measured again, not fatal
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, store: dict[str, dict[str, list[str] | int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = _read(path)  # what stages tuning at the same time wrote meanwhile stays
    for machine, choices in store.items():
        fresh.setdefault(machine, {}).update(choices)
    store = fresh
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one per process: none moves another's
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)  # atomic: stages loading at once never read half a file


__all__ = ["MARGIN", "last_level_cache_bytes", "machine_key", "measure", "measure_attention",
           "set_upcast_from", "tune_shard", "tunable", "untune_shard", "weight_groups"]
