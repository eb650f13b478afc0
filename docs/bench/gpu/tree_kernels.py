"""Tree-mask attention on CUDA: kernels per forward must not grow with the node count.

One random Llama-3.1-8B-shaped decoder layer (bf16) holds 2048 committed rows; a tree
level of n nodes (each a child of a random earlier node, so the mask is a real tree's
ancestor mask) goes through it.  The profiler counts the CUDA kernels of one forward:
a Python loop over nodes would launch more kernels as n grows, a masked SDPA does not.
It also prints which attention kernel SDPA chose, and checks the bf16 output against
float32 on the same weights (relative error, METHOD.md's ranges).

    python3 docs/bench/gpu/tree_kernels.py   # on a machine with a CUDA GPU
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from orchestrator.models.architectures import KNOWN_ARCHITECTURES
from orchestrator.models.random_model import shape_args
from stages.model.model import random_layer
from stages.speculation.tree import new_ids

CONTEXT = 2048


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask of a random tree of n nodes in BFS order (node 0 the root)."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=gen))
        m[i] |= m[p]
    return m


def forward(shard, x, mask, cache):
    pos = torch.full((x.shape[0],), CONTEXT, dtype=torch.long)
    out = shard(x, pos, cache, mask, new_ids(x.shape[0]))
    cache.keep(torch.zeros(0, dtype=torch.long))  # drop the level again
    return out


def main() -> int:
    args = shape_args(KNOWN_ARCHITECTURES["llama-3.1-8b"], context=CONTEXT + 512)
    layer = args.n_layers // 2
    gen = torch.Generator().manual_seed(0)
    shards = {dt: random_layer(args, layer, dt, "cuda") for dt in (torch.bfloat16, torch.float32)}
    ctx = torch.randn(CONTEXT, args.dim, generator=gen)
    caches = {}
    for dt, sh in shards.items():
        caches[dt] = sh.new_cache(CONTEXT + 512)
        sh(ctx.to("cuda", dt), torch.arange(CONTEXT), caches[dt])
    rows, ok = [], True
    for n in (1, 4, 16, 64, 256):
        mask, x = tree_mask(n, gen), torch.randn(n, args.dim, generator=gen)
        outs = {}
        for dt, sh in shards.items():
            forward(sh, x.to("cuda", dt), mask, caches[dt])  # warm-up
            torch.cuda.synchronize()
            outs[dt] = forward(sh, x.to("cuda", dt), mask, caches[dt]).float()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward(shards[torch.bfloat16], x.to("cuda", torch.bfloat16), mask,
                    caches[torch.bfloat16])
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        attn = sorted({e.name for e in kernels if any(s in e.name.lower() for s in
                                                      ("flash", "efficient", "fmha", "attention",
                                                       "softmax"))})
        ref = outs[torch.float32]
        err = float((outs[torch.bfloat16] - ref).norm() / ref.norm())
        rows.append((n, len(kernels), err, attn))
    base = rows[0][1]
    print("| nodes | CUDA kernels per forward | bf16 vs fp32 rel. error | attention kernels |")
    print("|--:|--:|--:|---|")
    for n, k, err, attn in rows:
        print(f"| {n} | {k} | {err:.2e} | {', '.join(a[:60] for a in attn) or '-'} |")
        ok = ok and k <= base + 2 and err < 2e-2
    print("kernels independent of node count and bf16 error in range:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
