"""Time one stage's forward alone, or two stages' forwards at once (run two copies).

    OMP_NUM_THREADS=1 NN=2 python docs/bench/wall/contention.py 0 15            # alone
    OMP_NUM_THREADS=1 NN=2 python docs/bench/wall/contention.py 0 15 & \\
    OMP_NUM_THREADS=1 NN=2 python docs/bench/wall/contention.py 15 30; wait     # at once

Arguments: the layer range of SmolLM2-135M's shard; NN: tree nodes per forward.
A 100-token prefill first, then 40 timed forwards of NN nodes each (the last stage
also computes the logits, as the runtime's verifying stage does).
"""

import os
import sys
import time

import torch

from orchestrator.models.registry import resolve_model
from stages.model.checkpoint import load_shard

start, end = map(int, sys.argv[1:3])
nn = int(os.environ.get("NN", "1"))
shard = load_shard(resolve_model("smollm2-135m"), start, end, torch.float32)
cache = shard.new_cache(400)
with torch.inference_mode():
    x = torch.arange(100) if shard.is_first else torch.randn(100, shard.args.dim)
    shard(x, torch.arange(100), cache)
    times = []
    for i in range(40):
        xi = torch.full((nn,), 5) if shard.is_first else torch.randn(nn, shard.args.dim)
        t = time.perf_counter()
        h = shard(xi, torch.arange(100 + i * nn, 100 + (i + 1) * nn), cache)
        if shard.is_last:
            shard.logits(h[0])
        times.append(time.perf_counter() - t)
print(f"layers [{start}, {end}), {nn} nodes: median {1e3 * sorted(times)[20]:.1f} ms")
