"""float32 against bfloat16 ``ar`` (SmolLM2, ``tuned``), both engines in one process and
interleaved per prompt, so a shared machine's drift between runs (20 % on CPU-2) cannot
decide which dtype ``--dtype auto`` should pick on a CPU.

    python docs/bench/execution/dtype_ab.py [THREADS]
"""

from __future__ import annotations

import sys
import time

import torch

from orchestrator.lab.benchmarks.sweeps import prompt_ids
from orchestrator.models.loading import EngineSpec, build_engine

MODEL, PROMPTS, TOKENS = "smollm2-135m", "humaneval:4", 48


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    built = {dt: build_engine(EngineSpec(model=MODEL, stages=1, draft="none", dtype=dt,
                                         device="cpu", execution="tuned"))
             for dt in ("float32", "bfloat16")}
    engines = {dt: engine for dt, (engine, _, _) in built.items()}
    ids = prompt_ids(PROMPTS, False, built["float32"][1])
    for e in engines.values():
        e.generate(ids[0], 4, method="ar")  # warm
    ms: dict[str, list[float]] = {dt: [] for dt in engines}
    for p in ids:
        for dt, e in engines.items():
            t = time.perf_counter()
            e.generate(p, 1, method="ar")
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            e.generate(p, TOKENS + 1, method="ar")
            ms[dt].append(1e3 * (time.perf_counter() - t - prefill) / TOKENS)
    mean = {dt: sum(v) / len(v) for dt, v in ms.items()}
    print(f"{MODEL} ar, tuned, {threads} threads, {PROMPTS} x {TOKENS} tokens, ms a token "
          f"(prefill subtracted), per prompt:")
    for dt, v in ms.items():
        print(f"  {dt}: {' / '.join(f'{x:.1f}' for x in v)}; mean {mean[dt]:.1f}")
    print(f"  bfloat16 {mean['float32'] / mean['bfloat16']:.2f}x float32's speed")


if __name__ == "__main__":
    main()
