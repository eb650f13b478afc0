"""Weight-only int8 against float32 for SmolLM2's gate/up matmul on this CPU (issue 43's
optional ``--quantize``): 16 weights of [3072, 576], more than the caches hold, each
product timed per weight, mean of 200 rounds, 1 thread.

torch's ``_weight_int8pack_mm`` (int8 weights, one scale per output row) is vectorised
for bf16 activations; with float32 activations it is not.

    python docs/bench/execution/int8_matmul.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROUNDS, WEIGHTS = 200, 16


def per_weight_us(fn: Callable[[], object]) -> float:
    """Mean microseconds of one product (``fn`` runs all the weights once)."""
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(ROUNDS):
        fn()
    return (time.perf_counter() - t) / ROUNDS / WEIGHTS * 1e6


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(3072, 576, generator=gen) for _ in range(WEIGHTS)]
    scales = [w.abs().amax(1) / 127 for w in ws]
    qs = [torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
          for w, s in zip(ws, scales, strict=True)]
    int8mm = torch.ops.aten._weight_int8pack_mm
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, 1 thread")
    print("| rows | float32 µs | int8, float32 activations µs | int8, bf16 activations µs |")
    print("|--:|--:|--:|--:|")
    for rows in (1, 4, 16):  # int8 with float32 activations takes 0.1 s a product at 64
        x = torch.randn(rows, 576, generator=gen)
        xb = x.to(torch.bfloat16)
        sb = [s.to(torch.bfloat16) for s in scales]
        f32 = per_weight_us(lambda: [F.linear(x, w) for w in ws])  # noqa: B023
        i8 = per_weight_us(lambda: [int8mm(x, q, s) for q, s in zip(qs, scales, strict=True)])  # noqa: B023
        i8b = per_weight_us(lambda: [int8mm(xb, q, s) for q, s in zip(qs, sb, strict=True)])  # noqa: B023
        print(f"| {rows} | {f32:.0f} | {i8:.0f} | {i8b:.0f} |", flush=True)


if __name__ == "__main__":
    main()
