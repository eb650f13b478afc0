"""SmolLM2 ``ar`` on a CPU in several configurations and transformers' ``generate``, all in
one process and interleaved per prompt, so a shared machine's drift between runs (20 % on
CPU-2) cannot decide a comparison: float32 against bfloat16 (what ``--dtype auto`` picks),
bfloat16 with the measured attention kernel against torch's fused one alone, and
transformers in both dtypes (its fastest is the reference of issue 43).

    python docs/bench/execution/ar_ab.py [THREADS] [--model FOLDER] [--prompts SPEC] [--compiled]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from orchestrator.lab.benchmarks.bench import hf_generate, load_hf_model
from orchestrator.lab.benchmarks.sweeps import prompt_ids
from orchestrator.models.loading import EngineSpec, build_engine
from orchestrator.models.registry import resolve_model
from stages.model.linear_tuning import set_upcast_from

TOKENS = 48


def ours(engine, upcast: int | None) -> Callable[[list[int]], float]:  # type: ignore[no-untyped-def]
    """ms a decoded token of ``engine``'s ar, its attention set for the call."""
    tuned = engine.shards[0].layers[0].self_attn.upcast_from

    def run(prompt: list[int]) -> float:
        for shard in engine.shards:
            set_upcast_from(shard, tuned if upcast is None else upcast)
        res = engine.generate(prompt, TOKENS + 1, method="ar")
        for shard in engine.shards:
            set_upcast_from(shard, tuned)
        return 1e3 * (res.wall_s - res.prefill_s) / TOKENS
    return run


def theirs(model) -> Callable[[list[int]], float]:  # type: ignore[no-untyped-def]
    """ms a decoded token of transformers' greedy generate."""
    def run(prompt: list[int]) -> float:
        _, wall, prefill = hf_generate(model, prompt, TOKENS + 1, [], "cpu")
        return 1e3 * (wall - prefill) / TOKENS
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("threads", nargs="?", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="humaneval:4", help="a --prompts spec of treepipe bench")
    ap.add_argument("--compiled", action="store_true",
                    help="also bfloat16 compiled (a minute or more of compiling)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engines, tok = {}, None
    for dt in ("float32", "bfloat16"):
        engines[dt], tok, _ = build_engine(EngineSpec(model=a.model, stages=1, draft="none",
                                                      dtype=dt, device="cpu",
                                                      execution="tuned"))
    if a.compiled:
        engines["compiled"], _, _ = build_engine(EngineSpec(
            model=a.model, stages=1, draft="none", dtype="bfloat16", device="cpu",
            execution="compiled"))
    folder = resolve_model(a.model)
    runs = {"bfloat16, tuned": ours(engines["bfloat16"], None),
            "bfloat16, tuned, fused attention": ours(engines["bfloat16"], 0),
            "float32, tuned": ours(engines["float32"], None)}
    if a.compiled:
        runs["bfloat16, compiled"] = ours(engines["compiled"], None)
    for dt in ("float32", "bfloat16"):
        runs[f"transformers {dt}"] = theirs(load_hf_model(folder, getattr(torch, dt), "cpu",
                                                          ignore_eos=True))
    ids = prompt_ids(a.prompts, False, tok)
    for run in runs.values():
        run(ids[0][:16])  # warm
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for p in ids:
        for name, run in runs.items():
            ms[name].append(run(p))
    mean = {name: sum(v) / len(v) for name, v in ms.items()}
    best_hf = min(v for k, v in mean.items() if k.startswith("transformers"))
    print(f"{a.model} ar, {a.threads} threads, {a.prompts} x {TOKENS} tokens, ms a "
          f"decoded token (prefill left out), mean over prompts, interleaved per prompt "
          f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}):\n")
    print("| configuration | ms a token | per prompt | transformers' fastest / this |")
    print("|---|--:|---|--:|")
    for name, v in ms.items():
        print(f"| {name} | {mean[name]:.1f} | {' / '.join(f'{x:.1f}' for x in v)} | "
              f"{best_hf / mean[name]:.2f}x |")


if __name__ == "__main__":
    main()
