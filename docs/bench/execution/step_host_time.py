"""Host time of a stage step's bookkeeping: packing the rows, rotary tables, padding.

On a GPU this work runs on the CPU before the step's kernels (or its CUDA graph) can
start, so it adds to every step; on a CPU it is measured alone here. One request over
400 committed rows of the tiny test model, a tree level of N rows; minimum of 200.

    python docs/bench/execution/step_host_time.py
"""

from __future__ import annotations

import time

import torch

from stages.model.model import PagedRows, Segment, rope_cos_sin
from stages.model.step_buckets import pad_step
from tests.tiny_models import target_whole


def main() -> None:
    torch.set_num_threads(1)
    shard = target_whole()
    cache = shard.new_cache(2100)
    shard(torch.randint(0, 64, (400,)), torch.arange(400), cache)

    def once(n: int) -> tuple[float, float, float]:
        seg = Segment(cache, n, torch.eye(n, dtype=torch.bool), torch.arange(n))
        t0 = time.perf_counter()
        kv = PagedRows.pack([seg], torch.device("cpu"))
        t1 = time.perf_counter()
        cos, sin = rope_cos_sin(shard.inv_freq, torch.full((n,), 400), torch.float64)
        t2 = time.perf_counter()
        pad_step(torch.zeros(n, shard.args.dim, dtype=torch.float64), cos, sin, kv.rows,
                 kv.pool.scratch_slot)
        t3 = time.perf_counter()
        cache._pending = 0  # the level is dropped, not written
        return t1 - t0, t2 - t1, t3 - t2

    print("| rows | pack µs | rotary µs | pad to bucket µs |\n|--:|--:|--:|--:|")
    for n in (1, 4, 16):
        best = [min(x) for x in zip(*(once(n) for _ in range(200)), strict=True)]
        print(f"| {n} | " + " | ".join(f"{1e6 * b:.0f}" for b in best) + " |")


if __name__ == "__main__":
    main()
