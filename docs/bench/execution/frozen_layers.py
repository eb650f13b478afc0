"""What inductor's C++ GEMM template would give a CPU: SmolLM2 ``ar`` with each layer
compiled separately, its weights frozen into the graph and ``max_autotune`` choosing
between oneDNN and the template, against the default ``tuned`` mode, same process.

A prototype behind docs/benchmarks.md ("A stage step on a CPU", what holds it back), not
a mode: every process compiles each layer's graphs again (inductor's cache cannot keep
graphs with oneDNN-packed constants), about 90 s for SmolLM2 on CPU-2.

    python docs/bench/execution/frozen_layers.py [--model smollm2-135m] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
import types

import torch
import torch.nn.functional as F

import stages.model.model as model
from orchestrator.models.loading import EngineSpec, build_engine

PROMPT = list(range(1, 65))
TOKENS = 48


def per_token_ms(engine) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    out = engine.generate(PROMPT, TOKENS, method="ar")
    return 1e3 * (time.perf_counter() - t) / TOKENS, out


def plain_linear(x: torch.Tensor, w: torch.Tensor | torch.nn.Module) -> torch.Tensor:
    """F.linear on the weight, so the frozen graph holds it as a constant."""
    if isinstance(w, torch.nn.Module) and not isinstance(w, torch.nn.Linear):
        return w(x)
    if isinstance(w, torch.nn.Linear):
        w = w.weight
    return plain_linear(x[None], w)[0] if x.dim() == 1 else F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine, _, _ = build_engine(EngineSpec(model=a.model, stages=1, draft="none", dtype=a.dtype,
                                           device="cpu", execution="tuned"))
    per_token_ms(engine)
    tuned, ref = per_token_ms(engine)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    dynamo_config.recompile_limit = dynamo_config.cache_size_limit = 64
    model.linear = plain_linear
    shard = engine.shards[0]
    graphs = {}
    for i, layer in enumerate(shard.layers):
        # fused weights become parameters, so freezing folds them in
        layer.self_attn.wqkv = torch.nn.Parameter(layer.self_attn.wqkv, requires_grad=False)
        layer.mlp.w13 = torch.nn.Parameter(layer.mlp.w13, requires_grad=False)
        # one code object per layer: dynamo keeps graphs per code object, and the frozen
        # weights differ by layer
        code = model.layer_call.__code__.replace(co_name=f"layer_call_{i}")
        graphs[id(layer)] = torch.compile(types.FunctionType(code, model.layer_call.__globals__))
    shard.layer_fn = lambda layer, *rest: graphs[id(layer)](layer, *rest)
    t = time.perf_counter()
    per_token_ms(engine)
    per_token_ms(engine)  # the shapes a second prompt adds
    compile_s = time.perf_counter() - t
    frozen, out = per_token_ms(engine)
    print(f"{a.model}, {a.dtype}, {a.threads} threads, ar over {TOKENS} tokens: tuned "
          f"{tuned:.1f} ms a token, frozen layers {frozen:.1f} ({tuned / frozen:.2f}x; "
          f"compiling {compile_s:.0f} s); tokens equal: {out == ref}")


if __name__ == "__main__":
    main()
