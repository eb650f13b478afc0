"""Compiled stage forwards: each decoder layer's step as a ``torch.compile`` graph.

Eager PyTorch pays Python and dispatch for some 70 small operations per layer and
step. Compiled, a layer's pointwise work (RMSNorm, RoPE, SiLU gating, residuals, the
KV writes and gathers) fuses into a few C++ or Triton kernels, and the matmuls stay the
kernels :func:`stages.model.model.linear` measured fastest (an opaque op in the graph).
One graph serves every layer of every shard of the same shape (:func:`layer_call`
takes the layer as an argument), so compile time is one layer's, not a stage's.
Sizes that vary every step (rows, requests, keys, the pool's slots) are symbols from
the first graph on, so the graphs :data:`WARM_SHAPES` compile serve every step; sizes
of one (a lone row, a lone request) and a step without a mask get their own. What
compiles is cached on disk (``cache_dir``), so a restarted worker loads its graphs
instead of compiling them again. On a GPU each step of the
stage's compiled layers is also replayed as a CUDA graph (:mod:`stages.model.cuda_graphs`).

Why per layer and not the whole stage as one graph: in torch 2.13 a stage-wide graph
with every layer a nested compile region gave wrong results after a recompile (a
layer's subgraph reused across graphs of other shapes), and a stage-wide graph without
nested regions took each layer's compile time again and, on CPU, mutated the one pool
tensor of all layers far more slowly. Packing the rows (:class:`PagedRows`), the KV
bookkeeping and the LM head stay eager.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.model.cuda_graphs import StepGraphs
from stages.model.execution_modes import EXECUTION_MODES, resolve_execution
from stages.model.kv_cache import StageCache
from stages.model.model import RowIndex, Segment, StageShard, layer_call

# graphs per compiled function: sizes of one specialise (rows, requests), masks come and
# go; torch's default of 8 would fall back to eager without saying so
RECOMPILE_LIMIT = 32


@dataclass(frozen=True)
class WarmShape:
    """A step shape to compile before the first request: ``requests`` segments of
    ``rows`` entries each, as tree nodes (``tree``) or committed rows."""

    name: str
    requests: int
    rows: int
    tree: bool


# what a pipeline step meets: a lone committed row (ar, pp and a prompt's last chunk),
# a lone tree row (a level of width one; every padded step of one row), a tree level, a
# prompt chunk, and a batch of requests' levels; with the varying sizes compiled as
# symbols (_mark_varying), these graphs serve every later step (test_execution.py)
WARM_SHAPES = (WarmShape("1 row", 1, 1, False), WarmShape("1 tree row", 1, 1, True),
               WarmShape("tree level", 1, 3, True), WarmShape("prompt chunk", 1, 5, False),
               WarmShape("batch of levels", 2, 2, True), WarmShape("batch of roots", 3, 1, True))
WARM_PREFIX = 4  # committed rows each warm request holds before its shape's step


def use_compile_cache(cache_dir: Path | None) -> None:
    """Keep inductor's (and Triton's) compiled artefacts under ``cache_dir``, unless the
    user pointed them elsewhere."""
    if cache_dir is None:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton"))


def _configure() -> None:
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch releases
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))


def compile_shard(shard: StageShard, cache_dir: Path | None = None, warm: bool = True,
                  progress: bool = True) -> dict[str, float]:
    """Run ``shard``'s layers as a compiled graph from now on; with ``warm``, compile the
    shapes a step meets before returning (a progress bar on stderr). Returns the seconds
    each warm shape took (compiling, or loading from the cache)."""
    use_compile_cache(cache_dir)
    shard.layer_fn = compiled_layer_call()
    return warm_up(shard, progress) if warm else {}


def prepare(shard: StageShard, execution: str, cache_dir: Path | None = None,
            progress: bool = True, kernel_file: Path | None = None,
            cuda_graphs: bool = True, warm: bool = True) -> dict[str, float]:
    """Make ``shard`` run as ``execution`` (:data:`EXECUTION_MODES`): measure (or read
    from ``kernel_file``, default ``cache_dir/kernels.json``) its CPU matmul kernels, and
    compile its layers (graphs cached under ``cache_dir``; ``warm``: run the warm shapes
    now) and, on a GPU with ``cuda_graphs``, replay its steps as CUDA graphs; returns the
    compile seconds per warm shape (empty unless compiled and warmed)."""
    from stages.model.linear_tuning import tune_shard, untune_shard

    if execution not in EXECUTION_MODES:
        raise ValueError(f"unknown execution {execution!r}; use one of "
                         f"{', '.join(EXECUTION_MODES)}")
    device = next(shard.parameters()).device
    execution = resolve_execution(execution, device.type)
    if execution == "eager":
        untune_shard(shard)
        eager(shard)
        return {}
    if kernel_file is None and cache_dir is not None:
        kernel_file = cache_dir / "kernels.json"
    tune_shard(shard, kernel_file, progress)
    if execution == "tuned":
        eager(shard)
        return {}
    eager(shard)
    if cuda_graphs and device.type == "cuda":
        shard.step_fn = StepGraphs(shard.layer_loop)
    return compile_shard(shard, cache_dir, warm=warm, progress=progress)


def eager(shard: StageShard) -> None:
    """Back to eager PyTorch (``--eager``): layer by layer, no graphs."""
    shard.layer_fn = layer_call
    shard.step_fn = shard.layer_loop


_COMPILED: list[Callable[..., torch.Tensor]] = []


def compiled_layer_call() -> Callable[..., torch.Tensor]:
    """The process's one compiled :func:`layer_call` (dynamo keeps its graphs by code
    object, so one wrapper is all there is to share)."""
    if not _COMPILED:
        _configure()
        graph = torch.compile(layer_call)

        def call(layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                 rows: RowIndex) -> torch.Tensor:
            _mark_varying(h, cos, sin, pk, pv, rows)
            return graph(layer, h, cos, sin, pk, pv, rows)

        _COMPILED.append(call)
    return _COMPILED[0]


def _mark_varying(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pk: torch.Tensor,
                  pv: torch.Tensor, rows: RowIndex) -> None:
    """Compile the sizes that change from step to step as symbols from the first graph on:
    rows, requests, rows per request, keys and the pool's slots (it grows). Otherwise each
    graph starts static and recompiles at its first other size, a second or more a time
    (a SpecPipe-DB batch met some 20 such recompiles). Sizes of one still specialise."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (h, cos, sin, rows.write, rows.unpad):
        mark(t, 0)
    mark(rows.read, (0, 1))
    mark(rows.pad, (0, 1))
    if rows.mask is not None:
        mark(rows.mask, (0, 2, 3))
    mark(pk, 1)
    mark(pv, 1)


def warm_up(shard: StageShard, progress: bool = True) -> dict[str, float]:
    """Run every :data:`WARM_SHAPES` step once on a scratch cache; seconds per shape.

    Where one-row steps change attention kernel at some context (a CPU's measured
    ``upcast_from``), the one-row shapes run again past it: the compiled graph guards on
    it, and a step crossing it unwarmed would compile mid-request."""
    from tqdm import tqdm

    upcast_from = shard.layers[0].self_attn.upcast_from
    todo = [(shape, WARM_PREFIX) for shape in WARM_SHAPES]
    if WARM_PREFIX < upcast_from < shard.args.max_seq_len - 64:
        todo += [(shape, upcast_from) for shape in WARM_SHAPES if shape.rows == 1]
    seconds: dict[str, float] = {}
    bar = tqdm(todo, desc=f"compiling layers {shard.start}-{shard.end - 1}",
               unit="shape", file=sys.stderr, disable=not progress)
    for shape, prefix in bar:
        name = shape.name if prefix == WARM_PREFIX else f"{shape.name}, {prefix} keys"
        bar.set_postfix_str(name)
        t = time.perf_counter()
        _run_shape(shard, shape, prefix)
        seconds[name] = time.perf_counter() - t
    bar.close()
    return seconds


def _run_shape(shard: StageShard, shape: WarmShape, prefix: int = WARM_PREFIX) -> None:
    """One packed forward of ``shape`` after ``prefix`` committed rows a request, over
    scratch caches that go away afterwards."""
    pool = shard.new_pool(8, growable=True)
    caches = [StageCache.in_pool(pool) for _ in range(shape.requests)]
    inputs: Callable[[int], torch.Tensor] = (
        (lambda n: torch.zeros(n, dtype=torch.long)) if shard.is_first
        else (lambda n: torch.zeros(n, shard.args.dim, dtype=pool.k.dtype,
                                    device=pool.k.device)))
    # every cache gets a committed prefix first, as a running request has
    shard.forward_packed(inputs(prefix * shape.requests),
                         torch.arange(prefix).repeat(shape.requests),
                         [Segment(c, prefix) for c in caches])
    n = shape.rows
    segments = [Segment(c, n, torch.ones(n, n, dtype=torch.bool).tril() if shape.tree else None,
                        torch.arange(n) if shape.tree else None) for c in caches]
    shard.forward_packed(inputs(n * shape.requests),
                         torch.arange(prefix, prefix + n).repeat(shape.requests), segments)
    for c in caches:
        c.release()


__all__ = ["EXECUTION_MODES", "WARM_SHAPES", "compile_shard",
           "compiled_layer_call", "eager", "prepare", "use_compile_cache", "warm_up"]
