"""Measured CPU matmul kernels: for each weight and row count, the kernel that ran fastest.

Which of BLAS's small-n ``linear``, oneDNN's transposed product and oneDNN's packed
weight reads a weight fastest depends on the CPU, the weight's shape and the rows per
step (:func:`stages.model.model.linear`). A rule measured on one machine was up to 40 %
slow on another, so a shard measures its own weights at load: for each group of
same-role weights (every layer's QKV, output, gate/up, down projection; the LM head) and
each row bucket it times every kernel over the whole group (so the weights stream from
memory as in a step, not from cache), and stores the winner on each weight. A kernel
must beat the untuned rule by :data:`MARGIN` to replace it, so noise does not flip
choices. The choices are kept in a JSON file per CPU, torch version and thread count, so
the next load reads them instead of measuring again.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from stages.model.execution_modes import host_cpuinfo
from stages.model.model import CPU_KERNELS, ROW_BUCKETS, UNTUNED, StageShard, packed_weight

MARGIN = 0.03  # a kernel replaces the untuned choice only when this much faster
MIN_ELEMENTS = 1 << 16  # smaller weights (the tiny test models) keep the untuned rule
REPEATS = 5
# bumped when a kernel's reach changes, so choices measured without it are measured again
# (2: bf16 weights gained the packed kernel)
KERNEL_SET = 2


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


def _time(kernel: str, weights: Sequence[Tensor], x: Tensor) -> float:
    fn = CPU_KERNELS[kernel]
    for w in weights[:2]:  # warm: first calls pack, allocate, dispatch
        fn(x, w)
    best = float("inf")
    for _ in range(REPEATS):
        t = time.thread_time()
        for w in weights:
            fn(x, w)
        best = min(best, time.thread_time() - t)
    return best


def measure(weights: Sequence[Tensor]) -> list[str]:
    """The fastest kernel for each of :data:`ROW_BUCKETS` rows over ``weights``."""
    w0 = weights[0]
    kernels = [k for k in CPU_KERNELS if k != "packed" or packed_weight(w0) is not None]
    choices = []
    for bucket, default in zip(ROW_BUCKETS, UNTUNED, strict=True):
        x = torch.randn(bucket, w0.shape[1], dtype=w0.dtype)
        times = {k: _time(k, weights, x) for k in kernels}
        if default not in times:  # no packing here: the untuned rule falls back to plain
            default = "plain"
        best = min(times, key=times.__getitem__)
        choices.append(best if times[best] < (1 - MARGIN) * times[default] else default)
    return choices


def tunable(w: Tensor) -> bool:
    """Whether a weight is worth measuring: a CPU float32/bf16 matrix of some size."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.numel() >= MIN_ELEMENTS
            and w.dtype in (torch.float32, torch.bfloat16))


def tune_shard(shard: StageShard, cache_file: Path | None = None,
               progress: bool = True) -> dict[str, list[str]]:
    """Choose each weight group's kernels (from ``cache_file`` where it has them, else
    measured) and store them on the weights; returns role -> kernel per row bucket."""
    from tqdm import tqdm

    groups = {role: ws for role, ws in weight_groups(shard).items() if tunable(ws[0])}
    if not groups:
        return {}
    machine = machine_key()
    store = _read(cache_file)
    known = store.setdefault(machine, {})
    chosen: dict[str, list[str]] = {}
    todo = []
    for role, ws in groups.items():
        key = f"{tuple(ws[0].shape)}|{ws[0].dtype}|{len(ws)}"
        if isinstance(known.get(key), list) and len(known[key]) == len(ROW_BUCKETS) and all(
                k in CPU_KERNELS for k in known[key]):
            chosen[role] = known[key]
        else:
            todo.append((role, key, ws))
    with torch.inference_mode():
        for role, key, ws in tqdm(todo, desc=f"measuring matmul kernels, layers "
                                  f"{shard.start}-{shard.end - 1}", unit="weight",
                                  file=sys.stderr, disable=not progress or not todo):
            chosen[role] = known[key] = measure(ws)
    for role, ws in groups.items():
        for w in ws:
            w._treepipe_kernels = tuple(chosen[role])  # type: ignore[attr-defined]
    if todo and cache_file is not None:
        _write(cache_file, store)
    return chosen


def untune_shard(shard: StageShard) -> None:
    """Back to the untuned rule (``--no-tune``, and tests that need it)."""
    for ws in weight_groups(shard).values():
        for w in ws:
            if hasattr(w, "_treepipe_kernels"):
                del w._treepipe_kernels


def _read(path: Path | None) -> dict[str, dict[str, list[str]]]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a damaged cache is measured again, not fatal
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, store: dict[str, dict[str, list[str]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)  # atomic: stages loading at once never read half a file


__all__ = ["MARGIN", "machine_key", "measure", "tune_shard", "tunable",
           "untune_shard", "weight_groups"]
