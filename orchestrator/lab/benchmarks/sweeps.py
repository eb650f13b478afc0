"""``treepipe sweep``: the paper's parameter figures on our model and hardware.

* ``sweep width`` (Figure 10): SpecPipe TBT and level accuracy over tree width
  w × draft top-k k.
* ``sweep topk`` (Figure 7): how often the target's greedy token is among a
  token source's top-k proposals, for several sources.
* ``sweep layer-time`` (Figure 9): one decoder layer's time against the number
  of tokens it processes in a step, at a fixed context length.

Each writes ``<name>.json`` and ``<name>.png`` into ``--out``.  Any ``--draft``
that ``treepipe generate`` accepts works (ngram, hybrid, layers:N, a model path).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.lab.benchmarks.figures import pyplot, save
from orchestrator.lab.benchmarks.options import EngineOptions, RunOptions
from orchestrator.lab.benchmarks.prompts import load_prompts
from orchestrator.models.architectures import KNOWN_ARCHITECTURES
from orchestrator.models.loading import (
    EngineSpec,
    build_engine,
    check_device,
    make_source,
    torch_dtype,
    uses_draft_model,
)
from orchestrator.models.random_model import shape_args
from orchestrator.models.registry import cache_dir, resolve_model
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.compiled import prepare
from stages.model.execution_modes import resolve_execution
from stages.model.model import random_layer
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource
from stages.speculation.tree import SpecTree, new_ids

DEFAULT_WIDTHS = "1,2,4,8,16,32,48,64,80,112,128"  # §4.1
DEFAULT_TOPKS = "2,4,8,16,32"  # §4.1
DEFAULT_LAYER_TOKENS = "1,2,4,8,16,24,32,48,64,80,96,112,128,160,192,256"


def int_list(text: str, flag: str) -> list[int]:
    """Parse a comma list of positive integers for ``flag``."""

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TreepipeError(f"{flag} must be a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise TreepipeError(f"{flag} needs one or more integers >= 1, got {text!r}")
    return list(dict.fromkeys(vals))


# ---- measuring one (w, k) point ---------------------------------------------------------


def stage_busy(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Measured per-step costs of SpecPipe runs, the inputs of Eq. (1).

    ``t_i``: mean compute + pruning of stage i over the steps it worked;
    ``draft``: mean draft time over the steps it worked (it runs beside stage 1);
    ``comm``: mean broadcast + slowest transfer per step;
    ``verify_step`` / ``refill_step``: mean cost of a step that verified a token /
    of one that did not (pipeline fill, refill after a miss, bubble), each the
    step's own max over its busy stages and the draft plus its communication
    (None when the runs have no such step).  The mean of per-step maxima, not
    the max of per-stage means: with noisy times the latter underestimates.
    """
    m = results[0].stages
    busy: list[list[float]] = [[] for _ in range(m)]
    draft: list[float] = []
    comm: list[float] = []
    verify: list[float] = []
    refill: list[float] = []
    for res in results:
        for s in res.steps:
            b = [s.stage_s[i] + s.prune_s[i] for i in range(m)]
            for i in range(m):
                if s.stage_tokens[i]:
                    busy[i].append(b[i])
            if s.draft_tokens:
                draft.append(s.draft_s)
            bcast = res.link.latency_s if s.verified and m > 1 else 0.0
            c = bcast + max((res.link.cost(x) for x in s.link_bytes), default=0.0)
            comm.append(c)
            (verify if s.verified else refill).append(max(max(b), s.draft_s) + c)
    return {"t_i": [statistics.fmean(x) if x else 0.0 for x in busy],
            "draft": statistics.fmean(draft) if draft else 0.0,
            "comm": statistics.fmean(comm) if comm else 0.0,
            "verify_step": statistics.fmean(verify) if verify else None,
            "refill_step": statistics.fmean(refill) if refill else None}


def eq1_predict(costs: dict[str, Any], hit_rate: float, m: int,
                decode_per_request: float | None = None) -> float:
    """Predicted seconds per token from Eq. (1) with measured t_i(w) and P(w).

    Eq. (1) is max_i t_i(w) + (1 - P) * sum_i t_i(w): one step per token, plus a
    refill after each miss.  In our schedule a miss costs the m-1 steps in which
    the new root crosses stages 1..m-1 (its verification on stage m is the next
    token's own step), and in refill step j the stages behind the root already
    work on the next levels, so each step costs the max over the busy stages.
    Both terms are therefore taken from measured steps: ``verify_step`` for
    max_i t_i(w) and (m-1) x ``refill_step`` for the sum.  Without such steps
    they fall back to the per-stage means (stage 1 at least the draft, which
    runs beside it).  With ``decode_per_request`` the m-1 steps that fill the
    pipeline at the start of every request are spread over its tokens.
    """
    t = list(costs["t_i"])
    t[0] = max(t[0], costs["draft"])
    step = costs.get("verify_step") or max(t) + costs["comm"]
    refill = costs.get("refill_step") or (
        sum(max(t[:j + 1]) for j in range(m - 1)) / max(m - 1, 1) + costs["comm"])
    tbt = step + (1.0 - hit_rate) * (m - 1) * refill
    if decode_per_request:
        tbt += (m - 1) * refill / decode_per_request
    return tbt


def measure_point(engine: PipelineEngine, prompts: Sequence[list[int]], new_tokens: int,
                  stop: Sequence[int], method: str = "specpipe") -> dict[str, Any]:
    """Run ``method`` on every prompt and summarise the runs (one sweep point)."""
    # inference mode: a KV cache that grows during a forward pass (a wide tree outgrowing
    # the draft's cache) holds inference tensors that pruning may not update outside it
    with torch.inference_mode():
        results = [engine.generate(p, new_tokens, None, method, stop) for p in prompts]
    return summarise(results, engine)


def summarise(results: Sequence[GenerationResult], engine: PipelineEngine) -> dict[str, Any]:
    """One sweep point from runs of one method at the engine's (w, k)."""
    method = results[0].method
    dec = sum(r.decode_tokens for r in results)
    steps = sum(len(r.steps) for r in results)
    verified = sum(s.verified for r in results for s in r.steps)
    hits = sum(s.hits for r in results for s in r.steps)
    pipelined = sum(r.pipelined_s for r in results)
    wall = sum(max(r.wall_s - r.prefill_s, 0.0) for r in results)
    hit_rate = hits / verified if verified else 0.0
    costs = stage_busy(results)
    m = engine.m
    point = {
        "method": method, "w": engine.width, "k": engine.topk, "prompts": len(results),
        "decode_tokens": dec, "steps": steps, "tokens_per_step": dec / steps if steps else 0.0,
        "hit_rate": hit_rate,
        "flushes": sum(1 for r in results for s in r.steps if s.flushed),
        "tbt_pipelined_ms": 1e3 * pipelined / dec if dec else None,
        "tbt_wall_ms": 1e3 * wall / dec if dec else None,
        "t_i_ms": [1e3 * t for t in costs["t_i"]], "draft_ms": 1e3 * costs["draft"],
        "comm_ms": 1e3 * costs["comm"],
    }
    if method == "specpipe" and dec:
        point["eq1_ms"] = 1e3 * eq1_predict(costs, hit_rate, m, dec / len(results))
        point["eq1_steady_ms"] = 1e3 * eq1_predict(costs, hit_rate, m)
    return point


# ---- shared setup ------------------------------------------------------------------------


def _spec(a: EngineOptions, draft: str | None = None) -> Any:

    return EngineSpec(model=a.model, stages=a.stages, draft=draft or a.draft,
                      draft_model=a.draft_model, width=a.width, topk=a.topk, dtype=a.dtype,
                      device=a.device, link_latency_us=a.link_latency_us, link_gbps=a.link_gbps,
                      draft_vocab=a.draft_vocab if uses_draft_model(draft or a.draft) else "",
                      execution=a.execution, recovery=a.recovery, quantize=a.quantize)


def prompt_ids(prompts: str, chat: bool, tok: Any) -> list[list[int]]:
    """Token ids of ``--prompts`` (chat-wrapped with ``--chat``)."""

    return [p.ids(tok, chat) for p in load_prompts(prompts)]




def _setup_threads(device: str, threads: int | None) -> int:
    check_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _write(out: Path, name: str, report: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


def _config(a: RunOptions, threads: int) -> dict[str, Any]:
    keep = ("model", "stages", "draft", "draft_model", "dtype", "device", "prompts",
            "max_new_tokens", "link_latency_us", "link_gbps")
    return {**{k: getattr(a, k) for k in keep if hasattr(a, k)}, "threads": threads,
            "torch": torch.__version__, "argv": sys.argv[1:]}


# ---- sweep width (Figure 10) ---------------------------------------------------------------


@dataclass(frozen=True)
class WidthSweepOptions(RunOptions):
    widths: str
    topks: str


def sweep_width(o: WidthSweepOptions) -> int:
    """TBT and accuracy of SpecPipe over w × k (Figure 10)."""
    from tqdm import tqdm


    widths, topks = int_list(o.widths, "--widths"), int_list(o.topks, "--topks")
    threads = _setup_threads(o.device, o.threads)
    base, tok, _ = build_engine(_spec(o))
    if base.source is None:
        raise TreepipeError("sweep width needs a token source; pass --draft ngram|hybrid|layers:N")
    ids = prompt_ids(o.prompts, o.chat, tok)
    stop: list[int] = []  # EOS ignored: every point decodes the same number of tokens
    base.generate(ids[0], min(o.max_new_tokens, 16), None, "specpipe", stop)  # warm-up
    pp = measure_point(base, ids, o.max_new_tokens, stop, "pp")
    points = []
    grid = [(w, k) for k in topks for w in widths]
    for w, k in tqdm(grid, desc="sweep width", unit="point", file=sys.stderr,
                     dynamic_ncols=True):
        eng = PipelineEngine(base.shards, base.source, w, k, base.link, recovery=base.recovery)
        points.append(measure_point(eng, ids, o.max_new_tokens, stop))
    report = {"figure": "10", "config": _config(o, threads), "widths": widths, "topks": topks,
              "pp": pp, "points": points}
    _write(o.out, "sweep_width", report)
    plot_width(report, o.out / "sweep_width.png")
    sys.stdout.write(width_markdown(report))
    return 0


def width_markdown(report: dict[str, Any]) -> str:
    """Table: pipelined TBT (ms) and accuracy per w (rows) and k (columns)."""
    ks, ws = report["topks"], report["widths"]
    pts = {(p["w"], p["k"]): p for p in report["points"]}
    head = "| w | " + " | ".join(f"TBT k={k}" for k in ks) + " | " + \
        " | ".join(f"acc k={k}" for k in ks) + " |"
    lines = [head, "|--:|" + "--:|" * (2 * len(ks))]
    for w in ws:
        tb = " | ".join(f"{pts[(w, k)]['tbt_pipelined_ms']:.1f}" for k in ks)
        ac = " | ".join(f"{pts[(w, k)]['hit_rate']:.2f}" for k in ks)
        lines.append(f"| {w} | {tb} | {ac} |")
    pp = report["pp"]
    best = min(report["points"], key=lambda p: p["tbt_pipelined_ms"])
    lines += ["", f"pp (no speculation): {pp['tbt_pipelined_ms']:.1f} ms. Lowest SpecPipe TBT: "
              f"{best['tbt_pipelined_ms']:.1f} ms at w = {best['w']}, k = {best['k']} "
              f"(accuracy {best['hit_rate']:.2f})."]
    return "\n".join(lines) + "\n"


def plot_width(report: dict[str, Any], path: Path) -> None:
    """Figure 10 layout: TBT (left) and accuracy (right) against w, one line per k."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for k in report["topks"]:
        pts = sorted((p for p in report["points"] if p["k"] == k), key=lambda p: p["w"])
        ws = [p["w"] for p in pts]
        ax1.plot(ws, [p["tbt_pipelined_ms"] for p in pts], marker="o", ms=3, label=f"k={k}")
        ax2.plot(ws, [p["hit_rate"] for p in pts], marker="o", ms=3, label=f"k={k}")
    ax1.axhline(report["pp"]["tbt_pipelined_ms"], color="grey", ls="--", lw=1, label="pp")
    ax1.set(xlabel="tree width w", ylabel="TBT pipelined (ms)", title="TBT")
    ax2.set(xlabel="tree width w", ylabel="accuracy (level hit rate)", title="Accuracy",
            ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"SpecPipe on {cfg['model']}, m={cfg['stages']}, draft {cfg['draft']} "
                 f"({cfg['device']})", fontsize=10)
    save(fig, path)


# ---- sweep topk (Figure 7) ----------------------------------------------------------------


def source_ranks(source: Any, context: list[int], continuation: list[int], kmax: int
                 ) -> list[int]:
    """For each continuation token, its rank among the source's top-``kmax`` (kmax if absent).

    A draft model scores every position in one causal forward; other sources
    are asked node by node through the ``TokenSource`` API.
    """

    seq = context + continuation
    n0 = len(context)
    ranks = []
    if isinstance(source, DraftModelSource):
        shard = source.shard
        cache = shard.new_cache(len(seq) + 1)
        h = shard(torch.tensor(seq[:-1], dtype=torch.long), torch.arange(len(seq) - 1), cache)
        top = source.top_proposals(h[n0 - 1:], kmax)[0].tolist()  # reduced head if any
        for j, tok in enumerate(continuation):
            ranks.append(top[j].index(tok) if tok in top[j] else kmax)
        return ranks
    for j, tok in enumerate(continuation):
        prefix = seq[:n0 + j]
        source.reset(prefix[:-1])
        tree = SpecTree(prefix[-1], len(prefix) - 1)
        toks, _ = source.expand(tree, torch.zeros(1, dtype=torch.long), prefix, kmax)
        lst = toks[0].tolist()
        ranks.append(lst.index(tok) if tok in lst else kmax)
    return ranks


@dataclass(frozen=True)
class TopkSweepOptions(RunOptions):
    drafts: str
    ks: str


def sweep_topk(o: TopkSweepOptions) -> int:
    """Top-k hit ratio of token sources against the target's greedy tokens (Figure 7)."""
    from tqdm import tqdm


    ks = int_list(o.ks, "--ks")
    drafts = [d.strip() for d in o.drafts.split(",") if d.strip()]
    if not drafts:
        raise TreepipeError("--drafts is empty; pass e.g. --drafts layers:4,layers:8,ngram")
    threads = _setup_threads(o.device, o.threads)
    spec = _spec(o, "none")
    base, tok, folder = build_engine(spec)
    ids = prompt_ids(o.prompts, o.chat, tok)
    conts = [base.generate(p, o.max_new_tokens, None, "ar", []).tokens for p in
             tqdm(ids, desc="target greedy", unit="prompt", file=sys.stderr)]
    kmax = max(ks)
    curves = {}
    for d in tqdm(drafts, desc="sweep topk", unit="source", file=sys.stderr):
        vocab = o.draft_vocab if uses_draft_model(d) else ""  # n-gram rows stay full
        src = make_source(dataclasses.replace(spec, draft=d, draft_vocab=vocab), folder,
                          torch_dtype(spec.dtype, spec.device))
        ranks = [r for p, c in zip(ids, conts, strict=True)
                 for r in source_ranks(src, p, c, kmax)]
        curves[d] = {"hit": {str(k): sum(r < k for r in ranks) / len(ranks) for k in ks},
                     "positions": len(ranks)}
    report = {"figure": "7", "config": _config(o, threads), "ks": ks, "curves": curves}
    _write(o.out, "sweep_topk", report)
    plot_topk(report, o.out / "sweep_topk.png")
    sys.stdout.write(topk_markdown(report))
    return 0


def topk_markdown(report: dict[str, Any]) -> str:
    """Table: hit ratio per source (rows) and k (columns)."""
    ks = report["ks"]
    lines = ["| source | " + " | ".join(f"top-{k}" for k in ks) + " |",
             "|---|" + "--:|" * len(ks)]
    for d, c in report["curves"].items():
        lines.append(f"| {d} | " + " | ".join(f"{c['hit'][str(k)]:.3f}" for k in ks) + " |")
    return "\n".join(lines) + "\n"


def plot_topk(report: dict[str, Any], path: Path) -> None:
    """Figure 7 layout: hit ratio against k, one line per source."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = report["ks"]
    for d, c in report["curves"].items():
        ax.plot(ks, [c["hit"][str(k)] for k in ks], marker="o", ms=3, label=d)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="top-k of the source", ylabel="hit ratio", ylim=(0, 1.02),
           title=f"Top-k hit ratio vs {report['config']['model']} greedy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


# ---- sweep layer-time (Figure 9) -------------------------------------------------------------


def device_name(device: str) -> str:
    """The GPU's name for a cuda run, else the CPU's architecture."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def time_layer(shard: Any, n_tokens: int, context: int, repeats: int,
               clock: str = "wall") -> float:
    """Median seconds for ``shard`` to process one tree level of ``n_tokens`` siblings.

    The cache holds ``context`` committed rows; each level attends to them and
    to itself and is dropped again afterwards, so every repeat sees the same
    context.  ``clock`` "cpu" times this thread's CPU time instead of wall time:
    with one torch thread on a shared CPU it leaves out the time the scheduler
    gave to other processes.
    """

    now = time.thread_time if clock == "cpu" else time.perf_counter

    args = shard.args
    dev = next(shard.parameters()).device
    dtype = next(shard.parameters()).dtype
    cache = shard.new_cache(context + n_tokens + 16)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(context, args.dim, generator=gen).to(device=dev, dtype=dtype)
    shard(ctx, torch.arange(context), cache)
    x = torch.randn(n_tokens, args.dim, generator=gen).to(device=dev, dtype=dtype)
    pos = torch.full((n_tokens,), context, dtype=torch.long)
    mask = torch.eye(n_tokens, dtype=torch.bool)
    times = []
    for _ in range(repeats + 1):  # the first repeat warms up
        ids = new_ids(n_tokens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = now()
        shard(x, pos, cache, mask, ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(now() - t)
        cache.keep(torch.zeros(0, dtype=torch.long))
    return statistics.median(times[1:])


@dataclass(frozen=True)
class LayerTimeOptions:
    """``treepipe sweep layer-time``'s options, one field per flag."""

    model: str
    shape: str | None
    dtype: str
    device: str
    tokens: str
    context: int
    repeats: int
    threads: int | None
    clock: str
    out: Path
    layers: int = 1
    execution: str = "eager"
    cuda_graphs: bool = True


BANDWIDTH_BYTES = 1 << 28  # what the probe reads: far beyond any CPU's last-level cache


def memory_bandwidth(device: str, repeats: int = 5, nbytes: int = BANDWIDTH_BYTES) -> float:
    """Bytes per second one read of a large tensor (``nbytes``) takes on ``device`` (best
    of ``repeats``): the rate a step that reads its weights once cannot beat."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first read warms up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def layer_weight_bytes(shard: Any) -> int:
    """Bytes of one decoder layer's weights (what a step must read per layer)."""
    layers = shard.layers
    return sum(p.numel() * p.element_size() for p in layers.parameters()) // len(layers)


def sweep_layer_time(o: LayerTimeOptions) -> int:
    """One decoder layer's time against tokens per step (Figure 9)."""
    from tqdm import tqdm


    tokens = int_list(o.tokens, "--tokens")
    threads = _setup_threads(o.device, o.threads)
    if o.shape:  # one random layer of a known shape, built on the device: no weights needed
        args = shape_args(KNOWN_ARCHITECTURES[o.shape], context=o.context + max(tokens) + 16)
        layer = max(0, min(args.n_layers // 2, args.n_layers - o.layers))
        shard = random_layer(args, layer, torch_dtype(o.dtype, o.device), o.device,
                             n_layers=o.layers)
    else:
        folder = resolve_model(o.model)
        args = load_model_args(folder)
        if o.layers > args.n_layers:
            raise TreepipeError(f"--layers {o.layers} is more than the model's "
                                f"{args.n_layers}; lower --layers")
        layer = max(0, min(args.n_layers // 2, args.n_layers - o.layers))
        if o.context + max(tokens) > args.max_seq_len:
            raise TreepipeError(f"--context {o.context} + {max(tokens)} tokens exceeds the "
                                f"model's context of {args.max_seq_len}; lower --context or "
                                f"--tokens")
        shard = load_shard(folder, layer, layer + o.layers, torch_dtype(o.dtype, o.device),
                           o.device)
    if o.clock == "cpu" and (o.device != "cpu" or threads != 1):
        raise TreepipeError("--clock cpu measures one CPU thread; use it with --device cpu "
                            "--threads 1, or --clock wall")
    compile_s = prepare(shard, o.execution, cache_dir(), cuda_graphs=o.cuda_graphs)
    execution = resolve_execution(o.execution, o.device)
    if execution == "compiled" and o.cuda_graphs and o.device.startswith("cuda"):
        execution += " + CUDA graphs"
    bandwidth = memory_bandwidth(o.device)
    floor_ms = 1e3 * layer_weight_bytes(shard) / bandwidth
    points = []
    for n in tqdm(tokens, desc="layer time", unit="size", file=sys.stderr):
        ms = 1e3 * time_layer(shard, n, o.context, o.repeats, o.clock) / o.layers
        points.append({"tokens": n, "ms": ms, "floor_ratio": ms / floor_ms})
    model = f"{o.shape} (random weights)" if o.shape else o.model
    report = {"figure": "9", "config": {"model": model, "dtype": o.dtype, "device": o.device,
                                        "device_name": device_name(o.device),
                                        "layer": layer, "layers": o.layers,
                                        "execution": execution, "context": o.context,
                                        "clock": o.clock,
                                        "repeats": o.repeats, "threads": threads,
                                        "torch": torch.__version__,
                                        "bandwidth_gb_s": bandwidth / 1e9,
                                        "floor_ms": floor_ms, "compile_s": compile_s},
              "points": points}
    _write(o.out, "sweep_layer_time", report)
    plot_layer_time(report, o.out / "sweep_layer_time.png")
    lines = [f"memory floor {floor_ms:.3f} ms a layer ({bandwidth / 1e9:.1f} GB/s read, "
             f"{execution})",
             "| tokens | " + " | ".join(str(p["tokens"]) for p in points) + " |",
             "|---|" + "--:|" * len(points),
             "| ms | " + " | ".join(f"{p['ms']:.2f}" for p in points) + " |",
             "| × floor | " + " | ".join(f"{p['floor_ratio']:.2f}" for p in points) + " |"]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def plot_layer_time(report: dict[str, Any], path: Path) -> None:
    """Figure 9 layout: layer time against input tokens."""
    plt = pyplot()

    pts = report["points"]
    cfg = report["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["tokens"] for p in pts], [p["ms"] for p in pts], marker="o", ms=3,
            label=f"{cfg['device']} {cfg['dtype']} {cfg.get('execution', 'eager')}, "
                  f"{cfg['threads']} threads, {cfg.get('clock', 'wall')} clock")
    if "floor_ms" in cfg:
        ax.axhline(cfg["floor_ms"], color="grey", ls="--", lw=1,
                   label=f"memory floor ({cfg['bandwidth_gb_s']:.0f} GB/s)")
    ax.set(xlabel="input tokens per step", ylabel="layer time (ms)", ylim=(0, None),
           title=f"One layer of {cfg['model']}, context {cfg['context']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


# ---- parser ---------------------------------------------------------------------------------




__all__ = ["LayerTimeOptions", "TopkSweepOptions", "WidthSweepOptions", "eq1_predict",
           "layer_weight_bytes", "measure_point", "memory_bandwidth", "source_ranks",
           "stage_busy", "sweep_layer_time", "sweep_topk", "sweep_width", "time_layer"]
