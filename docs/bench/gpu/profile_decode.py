"""Where a decoded token's time goes: ``ar`` through every stage under torch.profiler.

On the H200 an 8-stage, 1B-shaped ``ar`` took 6.4 ms a token against a 0.8 ms memory
floor (docs/benchmarks.md, "Execution"); this names what fills the rest: the ops and
runtime calls by host time, and the calls that make the host wait for the GPU (stream
synchronisations and copies from pageable memory) per token.

    python docs/bench/gpu/profile_decode.py MODEL_FOLDER [--stages 8] [--device cuda]
        [--dtype auto] [--execution auto] [--tokens 32] [--out FOLDER]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from orchestrator.models.loading import EngineSpec, build_engine
from stages.model.execution_modes import resolve_dtype

# runtime calls after which the host waits on the device
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "aten::item", "aten::_local_scalar_dense")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--execution", default="auto")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None, help="folder for trace.json")
    a = ap.parse_args()
    spec = EngineSpec(model=a.model, stages=a.stages, draft="none",
                      dtype=resolve_dtype(a.dtype, a.device), device=a.device,
                      execution=a.execution)
    engine, _, _ = build_engine(spec)
    prompt = list(range(1, 65))
    engine.generate(prompt, a.tokens, method="ar")  # warm: compiles, graphs, kernels
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    engine.generate(prompt, a.tokens, method="ar")
    sync()
    wall = (time.perf_counter() - t) / a.tokens
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        engine.generate(prompt, a.tokens, method="ar")
        sync()
    events = prof.key_averages()
    print(f"{a.model}: {a.stages} stages, {spec.dtype}, {a.execution}, {a.device}; "
          f"ar {1e3 * wall:.2f} ms a token (unprofiled, prefill included)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=30))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=15))
    print("| call the host waits on | calls per token | host ms per token |\n|---|--:|--:|")
    for e in events:
        if e.key in WAITS:
            print(f"| {e.key} | {e.count / a.tokens:.1f} | "
                  f"{e.self_cpu_time_total / 1e3 / a.tokens:.3f} |")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(a.out / "trace.json"))


if __name__ == "__main__":
    main()
