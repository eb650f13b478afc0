"""Which activation dtype ``--quantize int8`` runs on a CPU: whole-model ``ar`` on SmolLM2,
1 thread, process CPU time per token (steadier than wall time on a shared machine), for
float32 and bfloat16 models with and without int8 weights, each measured twice (the
better is printed last). stages/model/quantization.py's KERNEL_DTYPES cites its result.

    python docs/bench/execution/int8_activations.py
"""

from __future__ import annotations

import time

import torch

from orchestrator.models.loading import EngineSpec, build_engine

CONFIGS = (("float32", "none"), ("float32", "int8"), ("bfloat16", "int8"), ("bfloat16", "none"))
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
N_NEW = 32


def main() -> None:
    torch.set_num_threads(1)
    best: dict[tuple[str, str], float] = {}
    for _ in range(2):
        for dtype, quantize in CONFIGS:
            engine, tok, _ = build_engine(EngineSpec(stages=1, draft="none", dtype=dtype,
                                                     quantize=quantize))
            ids = tok.encode(PROMPT)
            engine.generate(ids, 4, method="ar")  # warm
            t = time.process_time()
            out = engine.generate(ids, N_NEW, method="ar")
            ms = (time.process_time() - t) / len(out.tokens) * 1e3
            best[dtype, quantize] = min(ms, best.get((dtype, quantize), ms))
            print(f"{dtype} {quantize}: {ms:.1f} ms/token (CPU time)", flush=True)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, 1 thread, the better of two:")
    for (dtype, quantize), ms in best.items():
        print(f"| {dtype} | {quantize} | {ms:.1f} |")


if __name__ == "__main__":
    main()
