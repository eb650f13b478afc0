"""``treepipe bench``: every decoding method on the same shards, prompts and token budget.

Rows are (method, token source) pairs; ``ar`` and ``pp`` have no source.  The
target's stage shards are loaded once and shared by every row, each token
source is built once, and the rows run interleaved per prompt so that a change
in machine speed during the run hits every row alike.  Optionally Hugging Face
``transformers`` greedy ``generate`` runs on the same folder as a reference for
``ar``'s speed and tokens, and ``--runtime`` runs the ``pp`` and ``specpipe`` rows
through real multi-process pipelines too (orchestrator/lab/benchmarks/runtime_pipelines.py),
interleaved with the engine, for wall-clock TBT beside the modelled pipelined TBT.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orchestrator.lab.benchmarks.figures import pyplot, save
from orchestrator.lab.benchmarks.options import EngineOptions
from orchestrator.lab.benchmarks.prompts import BenchPrompt, load_prompts
from orchestrator.lab.benchmarks.runtime_pipelines import (
    RUNTIME_METHODS,
    LocalPipelines,
    RuntimeRun,
    breakdown,
)
from orchestrator.lab.benchmarks.simulator import result_to_dict
from orchestrator.lab.benchmarks.sweeps import device_name, eq1_predict, stage_busy
from orchestrator.lab.benchmarks.tune import load_tune
from orchestrator.models.loading import (
    EngineSpec,
    build_engine,
    check_device,
    make_source,
    torch_dtype,
    uses_draft_model,
)
from orchestrator.models.registry import KNOWN_MODELS
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult
from protocol.scheduling.width import parse_width
from stages.model.quantization import KERNEL_DTYPES
from stages.model.sampling import SamplingParams
from stages.runtime.heap import settle_heap
from stages.speculation.batch import BATCH_METHODS, DEFAULT_PREFILL_CHUNK, BatchRun, Request
from stages.speculation.engine import METHODS, PipelineEngine
from stages.speculation.near_ties import TieFlip, first_difference, flip_at_tie
from stages.speculation.replay import parse_replay

SPEC_METHODS = ("specinfer", "specpipe")
DEFAULT_METHODS = "ar,pp,specinfer,specpipe"
DEFAULT_SOURCES = "ngram,hybrid"
WARMUP_TOKENS = 16  # enough to touch every code path (tree growth, pruning, flushes)
HF_LABEL = "transformers"


@dataclass(frozen=True)
class Row:
    """One benchmarked configuration."""

    method: str
    source: str | None  # None for ar and pp

    @property
    def label(self) -> str:
        return self.method if self.source is None else f"{self.method}/{self.source}"


@dataclass
class Run:
    """One generation of one row on one prompt."""

    prompt: int
    tokens: list[int]
    wall_s: float
    prefill_s: float
    result: GenerationResult | None = None  # None for the transformers reference
    matches_ar: bool | None = None  # exactly ar's tokens
    first_diff: int | None = None  # first index where the tokens differ from ar's
    flip: TieFlip | None = None  # where they differ: at an allowed near-tie or not

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_s(self) -> float:
        return max(self.wall_s - self.prefill_s, 0.0)


@dataclass
class RowRuns:
    """All runs of one row, in prompt order."""

    row: Row
    runs: list[Run] = field(default_factory=list)
    runtime: list[RuntimeRun] = field(default_factory=list)  # bench --runtime
    # with an ar row: each runtime run's first difference from ar's tokens, by prompt
    # (absent where equal); None without an ar row to judge by
    runtime_flips: dict[int, TieFlip] | None = None


# ---- argument parsing ----------------------------------------------------------------




def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), math.ceil(q * len(ordered))) - 1)]


@dataclass(frozen=True)
class BatchConfig:
    """One row of the multi-request benchmark at one B: a method on an engine, its width
    policy and how many requests it keeps in flight (default B)."""

    engine: PipelineEngine
    method: str
    width: int | str | None = None
    in_flight: int | None = None


def request_lengths(n: int, low: int, high: int) -> list[int]:
    """``n`` requests' new-token counts for ``--lengths LOW-HIGH``: evenly spread over
    LOW..HIGH, in an order shuffled with a fixed seed (every row and repeat alike)."""
    lengths = [low + round((high - low) * i / max(n - 1, 1)) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def concurrency_rows(configs: Sequence[BatchConfig], batch: int, prompts: list[list[int]],
                     n_new: int | Sequence[int], stop: Sequence[int],
                     prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                     on_finish: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """``configs`` at one B, side by side, in modelled pipelined time.

    Every prompt is queued at once in each configuration's :class:`BatchRun`, which
    starts the next whenever fewer than ``in_flight`` run (the paper's scheduler). The
    runs advance in lockstep, one step of each in turn, so that a change in machine
    speed (another tenant on the host) lands on all of them alike: on this machine the
    same run's throughput drifts by 25 % from one minute to the next, while rows stepped
    together keep their order. TBT is the gap between a request's consecutive tokens;
    throughput counts every token over the whole run. ``on_finish`` hears how many
    requests each step finished (a progress bar). ``n_new``: new tokens per request, one
    count for all or one per prompt.
    """
    # a full collection walking the loaded model took 169-209 ms and landed in whichever
    # run's timed forward allocated when it tripped (stages/runtime/heap.py)
    settle_heap()
    runs = [BatchRun(c.engine, c.method, c.in_flight or batch, width=c.width,
                     prefill_chunk=prefill_chunk) for c in configs]
    lengths = [n_new] * len(prompts) if isinstance(n_new, int) else list(n_new)
    reqs = [[Request(p, n, SamplingParams(), tuple(stop))
             for p, n in zip(prompts, lengths, strict=True)] for _ in runs]
    for run, rs in zip(runs, reqs, strict=True):
        for r in rs:
            run.add(r)
        run.presize()  # pools that grow mid-run make a compiled GPU stage record again
    walls = [0.0] * len(runs)
    while not all(run.idle for run in runs):
        for k, run in enumerate(runs):
            if not run.idle:
                before = len(run.results)
                t0 = time.perf_counter()
                run.step()
                walls[k] += time.perf_counter() - t0
                if on_finish is not None and len(run.results) > before:
                    on_finish(len(run.results) - before)
    return [_batch_row(c, batch, run, rs, wall)
            for c, run, rs, wall in zip(configs, runs, reqs, walls, strict=True)]


def concurrency_row(engine: PipelineEngine, method: str, batch: int, prompts: list[list[int]],
                    n_new: int | Sequence[int], stop: Sequence[int], width: int | str | None = None,
                    in_flight: int | None = None,
                    prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """One (method, B) point of the multi-request benchmark, run alone
    (:func:`concurrency_rows`); ``width`` is the specpipe width policy (default the
    engine's)."""
    return concurrency_rows([BatchConfig(engine, method, width, in_flight)], batch, prompts,
                            n_new, stop, prefill_chunk)[0]


def _batch_row(c: BatchConfig, batch: int, run: BatchRun, reqs: list[Request],
               wall: float) -> dict[str, Any]:
    """A finished run's row: throughput, TBT, hit rate, widths, KV and the tokens."""
    results = run.results
    gaps = [b - a for r in reqs for a, b in zip(run.token_times[r.rid],
                                                 run.token_times[r.rid][1:], strict=False)]
    tokens = sum(len(results[r.rid].tokens) for r in reqs)
    steps = [s for s in run.steps if not s.serial]
    verified = sum(s.verified for s in steps)
    spec = c.method == "specpipe"  # the only method with a tree width
    chosen = run.adaptive.chosen if run.adaptive is not None else []
    return {
        "method": c.method, "source": results[reqs[0].rid].source, "concurrency": batch,
        "in_flight": c.in_flight or batch,
        "width": (str(c.width) if isinstance(c.width, str) else run.width) if spec else None,
        "mean_width": (sum(chosen) / len(chosen) if chosen else run.width) if spec else None,
        "requests": len(reqs), "tokens": tokens, "steps": len(run.steps),
        "pipelined_s": run.clock, "wall_s": wall,
        "throughput_tok_s": tokens / run.clock if run.clock else 0.0,
        "tbt_mean_ms": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
        "tbt_p99_ms": 1e3 * percentile(gaps, 0.99),
        "hit_rate": sum(s.hits for s in steps) / verified if verified else 0.0,
        "kv": run.kv_report(),
        "outputs": [results[r.rid].tokens for r in reqs],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput among repeats of one row (the lower middle of an
    even count), with every repeat's throughput and the tokens of all: a repeat whose
    tokens differ counts against losslessness."""
    ranked = sorted(runs, key=lambda r: r["throughput_tok_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["throughput_runs"] = [r["throughput_tok_s"] for r in runs]
    if any(r["outputs"] != mid["outputs"] for r in runs):
        mid["outputs"] = None  # never equal to ar's: the row reports lossless false
    return mid


SERIAL = "specpipe-serial"  # one request in the pipeline at a time, the others queued


def concurrency_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the multi-request benchmark, and adaptive against fixed widths."""
    out = ["| method | source | w | B | tokens | throughput tok/s | mean TBT ms | p99 TBT ms "
           "| hit rate | mean w | lossless |", "|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['source']} | {r.get('width') or '—'} "
                   f"| {r['concurrency']} | {r['tokens']} "
                   f"| {_fmt(r['throughput_tok_s'], 1)}{_spread(r)} | {_fmt(r['tbt_mean_ms'])} "
                   f"| {_fmt(r['tbt_p99_ms'])} | {_fmt(r['hit_rate'])} "
                   f"| {_fmt(r.get('mean_width'))} | {_fmt(r.get('lossless'))}"
                   + (f" ({r['near_tie_flips']} near-tie)" if r.get("near_tie_flips") else "")
                   + " |")
    if any(r.get("near_tie_flips") for r in rows):
        out += ["", "lossless: every output equals ar's, or first differs from it at a near-tie "
                "of ar's top two logits within the dtype's tolerance (float32 and bf16 sum a "
                "tree in another order than one token; docs/engine.md, \"Lossless\"); "
                "(n near-tie): how many outputs did."]
    md = "# treepipe bench --concurrency (pipelined, modelled time)\n\n" + "\n".join(out) + "\n"
    return md + adaptive_markdown(rows) + range_markdown(rows) + kv_markdown(rows)


def _spread(row: dict[str, Any]) -> str:
    """" (lowest–highest)" of a row's repeated throughputs; "" for a single run."""
    runs = row.get("throughput_runs") or []
    return f" ({min(runs):.1f}–{max(runs):.1f})" if len(runs) > 1 else ""


def kv_markdown(rows: list[dict[str, Any]]) -> str:
    """Paged KV at the largest B: bytes per held token and peak pool use per stage."""
    big = max((r["concurrency"] for r in rows if r.get("kv")), default=None)
    at = [r for r in rows if r.get("kv") and r["concurrency"] == big]
    if not at:
        return ""
    out = ["", f"KV pools at B = {big} (blocks are taken as tokens arrive and given back when "
               "a request ends; nothing is sized by max_new_tokens):", "",
           "| method | w | stage | bytes per token | peak blocks (rows each) | peak MiB "
           "| peak tokens held |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in at:
        kv = r["kv"]
        for i, (b, bs, pk) in enumerate(zip(kv["bytes_per_token"], kv["block_size"],
                                            kv["peak_blocks"], strict=True)):
            out.append(f"| {r['method']} | {r.get('width') or '—'} | {i} | {b} | {pk} ({bs}) "
                       f"| {pk * bs * b / 2**20:.2f} | {pk * bs} |")
    return "\n".join(out) + "\n"


def _rounds(row: dict[str, Any]) -> list[float]:
    """A row's throughput in each lockstep round (its one run when not repeated)."""
    return row.get("throughput_runs") or [row["throughput_tok_s"]]


def round_ratios(policy: dict[str, Any], fixed: list[dict[str, Any]]) -> list[float]:
    """``policy``'s throughput over the best fixed width's, lockstep round by round (run
    k of every row ran in one group): the comparison the medians of each row blur."""
    runs, mine = [_rounds(r) for r in fixed], _rounds(policy)
    return [mine[k] / best for k, best in enumerate(map(max, zip(*runs, strict=False)))
            if k < len(mine) and best > 0]


def adaptive_markdown(rows: list[dict[str, Any]]) -> str:
    """Per (source, B): the best fixed width's throughput and mean TBT beside adaptive's,
    and adaptive over the best fixed width round by round (median, lowest-highest)."""
    ada = [r for r in rows if r["method"] == "specpipe" and str(r.get("width")).startswith("a")]
    if not ada:
        return ""
    out = ["", "| source | B | adaptive tok/s | best fixed tok/s (w) | ratio | adaptive TBT ms "
           "| best fixed TBT ms (w) | ratio | per round: median (range) |",
           "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for a in ada:
        fixed = [r for r in rows if r["method"] == "specpipe" and r["source"] == a["source"]
                 and r["concurrency"] == a["concurrency"]
                 and isinstance(r.get("width"), int)]
        if not fixed:
            continue
        bt = max(fixed, key=lambda r: r["throughput_tok_s"])
        bl = min(fixed, key=lambda r: r["tbt_mean_ms"])
        ratios = round_ratios(a, fixed)
        out.append(f"| {a['source']} | {a['concurrency']} | {_fmt(a['throughput_tok_s'], 1)} "
                   f"| {_fmt(bt['throughput_tok_s'], 1)} ({bt['width']}) "
                   f"| {_fmt(a['throughput_tok_s'] / bt['throughput_tok_s'])} "
                   f"| {_fmt(a['tbt_mean_ms'])} | {_fmt(bl['tbt_mean_ms'])} ({bl['width']}) "
                   f"| {_fmt(a['tbt_mean_ms'] / bl['tbt_mean_ms'])} | {_spread_of(ratios)} |")
    return "\n".join(out) + "\n"


def _spread_of(ratios: list[float]) -> str:
    """``median (lowest-highest)`` of per-round ratios; '—' for fewer than two rounds."""
    if len(ratios) < 2:
        return "—"
    # nearest rank: the lower middle one, as for the rows' median runs
    return f"{percentile(ratios, 0.5):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"


def range_markdown(rows: list[dict[str, Any]]) -> str:
    """Per source, each specpipe width policy across the whole B range: throughput summed
    over every B (the reported run, and each lockstep round: repeat k at every B), mean
    TBT averaged over B, and in how many rounds its sum was the highest. A policy is
    better across the range than a fixed width only if it beats that width's sum; at
    each B a different width may be best."""
    spec = [r for r in rows if r["method"] == "specpipe" and r.get("width") is not None]
    bs = sorted({r["concurrency"] for r in spec})
    if len(bs) < 2:
        return ""
    body = []
    for source in dict.fromkeys(r["source"] for r in spec):
        sums: dict[str, tuple[float, list[float], float]] = {}
        for w in dict.fromkeys(str(r["width"]) for r in spec if r["source"] == source):
            pts = [r for r in spec if r["source"] == source and str(r["width"]) == w]
            if sorted(r["concurrency"] for r in pts) != bs:
                continue
            runs = [_rounds(r) for r in pts]
            sums[w] = (sum(r["throughput_tok_s"] for r in pts),
                       [sum(col) for col in zip(*runs, strict=False)],  # repeat k at every B
                       sum(r["tbt_mean_ms"] for r in pts) / len(pts))
        if len(sums) < 2:
            continue
        n = min(len(rounds) for _, rounds, _ in sums.values())
        tops = [max(rounds[k] for _, rounds, _ in sums.values()) for k in range(n)]
        for w, (total, rounds, tbt) in sums.items():
            firsts = sum(1 for k in range(n) if rounds[k] == tops[k])
            body.append(f"| {source} | {w} | {total:.1f} | {', '.join(f'{x:.1f}' for x in rounds)} "
                        f"| {tbt:.2f} | {firsts} of {n} |")
    if not body:
        return ""
    return "\n".join(["", f"Across B = {', '.join(map(str, bs))} (throughput summed over B; "
                           "each round is one lockstep repeat at every B):", "",
                       "| source | w | tok/s summed over B | per round | mean TBT ms (mean over "
                       "B) | highest sum in rounds |", "|---|---|--:|---|--:|--:|", *body]) + "\n"


def parse_rows(methods: str, sources: str) -> list[Row]:
    """Rows for ``--methods`` x ``--sources``: one per method, times sources for spec methods."""

    ms = [m.strip() for m in methods.split(",") if m.strip()]
    if not ms:
        raise TreepipeError(f"--methods is empty; pass a comma list of {', '.join(METHODS)}")
    bad = [m for m in ms if m not in METHODS]
    if bad:
        raise TreepipeError(f"unknown method {bad[0]!r} in --methods; choose from "
                            f"{', '.join(METHODS)}")
    ss = [s.strip() for s in sources.split(",") if s.strip()]
    if any(m in SPEC_METHODS for m in ms):
        if not ss:
            raise TreepipeError("--sources is empty but specinfer/specpipe need a token source; "
                                "pass e.g. --sources ngram,hybrid")
        for s in ss:
            check_source(s)
    rows: list[Row] = []
    for m in dict.fromkeys(ms):
        if m in SPEC_METHODS:
            rows.extend(Row(m, s) for s in dict.fromkeys(ss))
        else:
            rows.append(Row(m, None))
    return rows


def check_source(source: str) -> None:
    """Reject a --sources entry that is not ngram, hybrid, layers:N, replay:P or a model."""
    if source.startswith("replay:"):
        try:
            parse_replay(source)
        except ValueError as e:
            raise TreepipeError(f"{e} (in --sources)") from None
        return
    if source in ("ngram", "hybrid") or source in KNOWN_MODELS:
        return
    if source.startswith("layers:"):
        if source.split(":", 1)[1].isdigit():
            return
        raise TreepipeError(f"bad source {source!r} in --sources; write layers:N with N a "
                            "layer count")
    path = Path(source).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    raise TreepipeError(f"unknown source {source!r} in --sources; use ngram, hybrid, layers:N, "
                        "or a draft model folder / .gguf file")


# ---- running ---------------------------------------------------------------------------


def _result_run(prompt: int, res: GenerationResult) -> Run:
    return Run(prompt, list(res.tokens), res.wall_s, res.prefill_s, res)


def _make_hf_clock() -> Any:
    """A transformers streamer that timestamps each generated token (not the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: Any) -> None:
            # generate() first puts the prompt ids, then one tensor per new token
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return TokenClock()


def load_hf_model(folder: Path, dtype: torch.dtype, device: str, ignore_eos: bool) -> Any:
    """transformers' Llama on our model folder, for the reference timings."""

    try:
        import transformers
    except ImportError:
        raise TreepipeError("--hf needs the transformers package; pip install transformers, or "
                            "drop --hf") from None
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as e:  # transformers raises many types for unreadable folders
        raise TreepipeError(f"transformers cannot load {folder} ({type(e).__name__}: {e}); "
                            "drop --hf") from None
    model = model.to(device).eval()
    if ignore_eos:
        # Unset here, not via min_new_tokens: that masks EOS in the logits and so
        # changes greedy choices where EOS would win, unlike our ar which keeps going.
        model.generation_config.eos_token_id = None
    return model


def hf_generate(model: Any, prompt: list[int], max_new_tokens: int, stop_ids: Sequence[int],
                device: str) -> tuple[list[int], float, float]:
    """Greedy transformers generate: (new tokens, wall seconds, prefill seconds)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    clock = _make_hf_clock()
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False,
                              "streamer": clock, "attention_mask": torch.ones_like(ids)}
    if stop_ids:
        kwargs["eos_token_id"] = list(stop_ids)
        kwargs["pad_token_id"] = stop_ids[0]
    else:
        kwargs["min_new_tokens"] = max_new_tokens
        kwargs["pad_token_id"] = 0  # batch of one: never used, but silences a warning
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        wall = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    # prefill ends when the first new token appears, as in our GenerationResult
    prefill = clock.times[0] - t0 if clock.times else wall
    return tokens, wall, prefill


def _compare(run: Run, ar_tokens: list[int] | None) -> None:
    if ar_tokens is None:
        return
    run.matches_ar = run.tokens == ar_tokens
    if not run.matches_ar:
        n = min(len(run.tokens), len(ar_tokens))
        run.first_diff = next((i for i in range(n) if run.tokens[i] != ar_tokens[i]), n)


def ar_logit_rows(engine: PipelineEngine, prompt: list[int], ref: list[int], need: set[int],
                  stop: Sequence[int]) -> dict[int, torch.Tensor]:
    """ar's (greedy) logits at generated positions ``need`` of its tokens ``ref``, from a
    re-run of ar with ``keep_logits`` up to the last of them; {} when the re-run does not
    reproduce ``ref`` there (its logits would then not be the reference's)."""
    n = max(need) + 1
    # keep_logits holds a float32 vocab row per token (0.5 MiB at a 128k vocab), so the
    # timed runs never keep them: only this re-run does, up to the last position asked,
    # and only the asked rows outlive it
    res = engine.generate(prompt, n, SamplingParams(), "ar", stop, keep_logits=True)
    if res.tokens != ref[:n]:
        return {}
    return {i: res.logits[i] for i in need}


def judge_against_ar(engine: PipelineEngine, ids: list[list[int]], stop: Sequence[int],
                     refs: list[list[int]], outs: list[tuple[int, list[int]]],
                     dtype: torch.dtype) -> list[TieFlip | None]:
    """For each (prompt index, greedy tokens) in ``outs``: None when equal to ar's
    ``refs[prompt]``, else where it first differs and whether that is a near-tie flip the
    dtype allows (stages/speculation/near_ties.py). ar re-runs at most once per prompt."""
    firsts = [first_difference(refs[j], tokens) for j, tokens in outs]
    need: dict[int, set[int]] = {}
    if dtype != torch.float64:  # float64 is exact: no logits needed to refuse a flip
        for (j, _), i in zip(outs, firsts, strict=True):
            if i is not None:
                need.setdefault(j, set()).add(i)
    rows = {j: ar_logit_rows(engine, ids[j], refs[j], n, stop) for j, n in need.items()}
    flips: list[TieFlip | None] = []
    for (j, tokens), i in zip(outs, firsts, strict=True):
        if i is not None and j in rows and i not in rows[j]:
            flips.append(TieFlip(i, None, 0.0, True, dtype, "ar's re-run with logits did not "
                                 "reproduce its tokens"))
        else:
            flips.append(flip_at_tie(refs[j], rows.get(j, {}), tokens, SamplingParams(), dtype))
    return flips


# ---- aggregation ---------------------------------------------------------------------


def step_breakdown(res: GenerationResult) -> dict[str, int]:
    """Where a pipelined (pp / specpipe) request's steps went.

    ``verify``: steps that committed a token; ``fill``: the m-1 steps before the
    first token reaches the last stage; ``miss``: the m-1 steps after each miss
    (but the last token's) while the new root crosses the pipeline; ``bubble``:
    the rest, steps where the last stage had nothing to verify because width
    pruning or a missing proposal left the verified node's next level empty.
    """
    m = res.stages
    verify = [s for s in res.steps if s.verified]
    fill = m - 1 if verify else len(res.steps)
    miss = (m - 1) * sum(1 for s in verify[:-1] if not s.hits)
    return {"verify": len(verify), "fill": fill, "miss": miss,
            "bubble": len(res.steps) - len(verify) - fill - miss}


def eq2_steps_per_token(hit_rate: float, m: int) -> float:
    """Eq. (2): expected pipeline steps per committed token, 1 + (1 - P)(m - 1)."""
    return 1.0 + (1.0 - hit_rate) * (m - 1)


def aggregate(rr: RowRuns, m: int, width: int, topk: int) -> dict[str, Any]:
    """Totals over the prompts of one row (ratios of sums, not means of ratios)."""
    row, runs = rr.row, rr.runs
    results = [r.result for r in runs if r.result is not None]
    dec = sum(r.decode_tokens for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    agg: dict[str, Any] = {
        "method": row.method, "source": row.source, "label": row.label,
        "m": m if row.method != HF_LABEL else None,
        "w": width if row.source else None, "k": topk if row.source else None,
        "prompts": len(runs), "new_tokens": sum(len(r.tokens) for r in runs),
        "decode_tokens": dec, "decode_s": decode_s,
        "prefill_s": sum(r.prefill_s for r in runs),
        "tok_s_wall": dec / decode_s if decode_s else None,
        "tbt_wall_ms": 1e3 * decode_s / dec if dec else None,
        "matches_ar": (None if any(r.matches_ar is None for r in runs)
                       else sum(bool(r.matches_ar) for r in runs)),
        "mismatched_prompts": [r.prompt for r in runs if r.matches_ar is False],
        # of those, the ones that differ first at a near-tie the dtype allows
        "near_tie_prompts": [r.prompt for r in runs if r.flip is not None and r.flip.allowed],
    }
    if not results:  # the transformers reference has no step records
        return agg
    steps = sum(len(res.steps) for res in results)
    verified = sum(s.verified for res in results for s in res.steps)
    hits = sum(s.hits for res in results for s in res.steps)
    pipelined = sum(res.pipelined_s for res in results)
    hit_rate = hits / verified if verified else 0.0
    agg.update({
        "steps": steps, "verified": verified, "hits": hits,
        "tokens_per_step": dec / steps if steps else None,
        "steps_per_token": steps / dec if dec else None,
        "hit_rate": hit_rate if row.source else None,
        "flushes": sum(1 for res in results for s in res.steps if s.flushed),
        "re_roots": sum(s.recovered for res in results for s in res.steps),
        "pipelined_s": pipelined,
        "tbt_pipelined_ms": 1e3 * pipelined / dec if dec else None,
        "eq2_steps_per_token": None, "eq2_rel_diff": None, "step_breakdown": None,
    })
    # Eq. (2) models the SpecPipe schedule (pp is its P = 0 case); ar is not
    # pipelined and specinfer records one step per stage per tree pass.
    if row.method in ("pp", "specpipe") and dec:
        pred = eq2_steps_per_token(hit_rate, m)
        agg["eq2_steps_per_token"] = pred
        agg["eq2_rel_diff"] = (steps / dec - pred) / pred
        parts = [step_breakdown(res) for res in results]
        agg["step_breakdown"] = {k: sum(p[k] for p in parts) for k in parts[0]}
    agg.update(runtime_figures(rr, agg))
    if row.method == "specpipe" and dec:
        # Eq. (1) from this row's own measured t_i(w) and P(w): what `treepipe tune`
        # would predict for this (w, k), beside the measured pipelined TBT

        agg["eq1_tbt_ms"] = 1e3 * eq1_predict(stage_busy(results), hit_rate, m,
                                              dec / len(results))
    return agg


def runtime_lossless(rr: RowRuns) -> int | None:
    """How many of ``rr``'s runtime runs equal ar's tokens or first differ from them at a
    near-tie the dtype allows; None without an ar row to judge by."""
    if rr.runtime_flips is None:
        return None
    return len(rr.runtime) - sum(not flip.allowed for flip in rr.runtime_flips.values())


def runtime_figures(rr: RowRuns, agg: dict[str, Any]) -> dict[str, Any]:
    """``wall_tbt_ms`` beside ``pipelined_tbt_ms``, and the runtime's breakdown.

    A row run through real pipelines (``--runtime``) takes its wall TBT from them;
    any other row's wall TBT is the in-process one (one process computing every
    stage in turn, which is how ``ar`` and SpecInfer's passes run anyway).
    """
    out: dict[str, Any] = {"pipelined_tbt_ms": agg.get("tbt_pipelined_ms"),
                           "wall_tbt_ms": agg["tbt_wall_ms"], "wall_from": "in-process"}
    if not rr.runtime:
        return out
    gaps = sum(max(len(r.tokens) - 1, 0) for r in rr.runtime)
    same = sum(rt.tokens == run.tokens for rt, run in zip(rr.runtime, rr.runs, strict=True))
    bd = breakdown(rr.runtime)
    steps = bd["workers"][bd["critical"]]["steps"] if bd["workers"] else 0
    # the engine's compute per step for the same stage: the model's input, measured with
    # one stage computing at a time (the runtime's stages compute at once)
    results = [r.result for r in rr.runs if r.result is not None]
    n = sum(len(res.steps) for res in results)
    for w, fig in bd["workers"].items():
        if w.startswith("stage") and n:
            i = int(w.removeprefix("stage"))
            fig["engine_compute_ms"] = 1e3 * sum(s.stage_s[i] + s.prune_s[i]
                                                 for res in results for s in res.steps) / n
    out.update({
        "wall_from": "runtime",
        "wall_tbt_ms": 1e3 * sum(r.decode_s for r in rr.runtime) / gaps if gaps else None,
        "runtime_client_tbt_ms": sum(r.tbt_ms * max(len(r.tokens) - 1, 0)
                                     for r in rr.runtime) / gaps if gaps else None,
        "runtime_ttft_ms": sum(r.ttft_ms for r in rr.runtime) / len(rr.runtime),
        "runtime_matches_engine": same, "runtime_lossless": runtime_lossless(rr),
        "runtime_steps": steps,
        "runtime_breakdown": bd,
    })
    return out


def load_tune_prediction(path: Path, width: int, topk: int) -> dict[str, Any]:
    """The Eq. (1) prediction that ``treepipe tune`` made for this (w, k)."""

    data = load_tune(path)
    for p in data["points"]:
        if p["w"] == width and p["k"] == topk:
            return {"predicted_ms": p["eq1_ms"], "source": data["config"].get("draft")}
    raise TreepipeError(f"{path} has no prediction for w={width}, k={topk}; pass the --width and "
                        f"--topk it chose (w={data['choice']['w']}, k={data['choice']['k']})")


# ---- output ----------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown_report(report: dict[str, Any]) -> str:
    """The two Markdown tables (methods; ar vs transformers) with a config line."""
    cfg = report["config"]
    tuned = any("tune_predicted_ms" in r for r in report["rows"])
    lines = [
        "| method | source | m | w | k | tokens/step | hit rate | flushes | TBT wall (ms) | "
        "TBT pipelined (ms) | TBT Eq.(1) (ms) | " + ("TBT tune (ms) | " if tuned else "")
        + "steps/token measured | Eq.(2) steps/token | tok/s (wall) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if tuned else "")
        + "--:|--:|--:|",
    ]
    for r in report["rows"]:
        if r["method"] == HF_LABEL:
            continue
        eq2 = _fmt(r["eq2_steps_per_token"])
        if r["eq2_rel_diff"] is not None:
            eq2 += f" ({100 * r['eq2_rel_diff']:+.1f}%)"
        lines.append(
            f"| {r['method']} | {r['source'] or '—'} | {r['m']} | {r['w'] or '—'} | "
            f"{r['k'] or '—'} | {_fmt(r['tokens_per_step'])} | {_fmt(r['hit_rate'])} | "
            f"{r['flushes']} | {_fmt(r['tbt_wall_ms'])} | {_fmt(r['tbt_pipelined_ms'])} | "
            f"{_fmt(r.get('eq1_tbt_ms'))} | "
            + (f"{_fmt(r.get('tune_predicted_ms'))} | " if tuned else "")
            + f"{_fmt(r['steps_per_token'])} | {eq2} | {_fmt(r['tok_s_wall'], 1)} |")
    link = f"{cfg['link_latency_us']:g} µs, {cfg['link_gbps']:g} Gbit/s"
    lines += [
        "",
        f"{cfg['model']} ({cfg['dtype']}"
        f"{', int8 weights' if cfg.get('quantize') == 'int8' else ''}, {cfg['device']}, "
        f"{cfg['threads']} threads), "
        f"{cfg['n_prompts']} prompts ({cfg['prompts']}), {cfg['max_new_tokens']} new tokens "
        f"each{', EOS ignored' if cfg['ignore_eos'] else ''}; modelled link {link}. "
        "Eq.(2) column: 1 + (1 - P)(m - 1) with P the row's hit rate, and in brackets the "
        "measured steps/token relative to it. TBT Eq.(1): the paper's Eq. (1) with this row's "
        "measured t_i(w) and P(w) (m - 1 refill steps per miss, pipeline fill included)"
        + (f"; TBT tune: the prediction in {cfg['tune']}." if tuned else "."),
    ]
    if any(r["matches_ar"] is not None for r in report["rows"] if r["method"] != HF_LABEL):
        lines += _difference_lines(report)
    if any(r.get("wall_from") == "runtime" for r in report["rows"]):
        lines += ["", runtime_markdown(report["rows"])]
    hf = next((r for r in report["rows"] if r["method"] == HF_LABEL), None)
    ar = next((r for r in report["rows"] if r["method"] == "ar"), None)
    if hf is not None:
        lines += ["", "| engine | threads | decode tok/s | TBT (ms) | tokens equal ar |",
                  "|---|--:|--:|--:|--:|"]
        if ar is not None:
            lines.append(f"| treepipe ar | {cfg['threads']} | {_fmt(ar['tok_s_wall'], 1)} | "
                         f"{_fmt(ar['tbt_wall_ms'])} | — |")
        same = ("— (ar not run)" if hf["matches_ar"] is None
                else f"{hf['matches_ar']}/{hf['prompts']} prompts")
        lines.append(f"| transformers generate | {cfg['threads']} | "
                     f"{_fmt(hf['tok_s_wall'], 1)} | {_fmt(hf['tbt_wall_ms'])} | {same} |")
        diffs = [r for r in report["results"]
                 if r["method"] == HF_LABEL and r["matches_ar"] is False]
        for d in diffs:
            where = d.get("difference") or f"from token {d['first_diff']}"
            lines.append(f"transformers differs from ar on prompt {d['prompt']} "
                         f"({d['name']}) {where}.")
    return "\n".join(lines) + "\n"


def _difference_lines(report: dict[str, Any]) -> list[str]:
    """The rows' tokens against ar's: a note per near-tie flip (allowed), and, as before,
    a line per row whose tokens really differ; or that every row matched exactly."""
    rows = [r for r in report["rows"] if r["method"] not in ("ar", HF_LABEL)]
    ties = [r for r in report["results"]
            if r["method"] not in ("ar", HF_LABEL) and r.get("near_tie")]
    lines = [f"{Row(r['method'], r['source']).label} differs from ar on prompt {r['prompt']} "
             f"{r['difference']}." for r in ties]
    lossy = [(r, [p for p in r["mismatched_prompts"] if p not in r.get("near_tie_prompts", [])])
             for r in rows]
    for r, prompts in lossy:
        if prompts:
            lines.append(f"Tokens differ from ar: {r['label']} on prompts "
                         f"{', '.join(map(str, prompts))}.")
    if any(prompts for _, prompts in lossy):
        return lines
    if ties:
        return lines + ["Apart from those near-tie flips (float32 and bf16 sum a tree in "
                        "another order than one token; docs/engine.md, \"Lossless\"), every "
                        "row produced exactly ar's tokens on every prompt."]
    return ["Every row produced exactly ar's tokens on every prompt."]


def runtime_markdown(rows: list[dict[str, Any]]) -> str:
    """The wall-clock table of ``bench --runtime``: runtime wall vs modelled pipelined TBT."""
    pp = next((r for r in rows if r["method"] == "pp"), None)

    def speedup(r: dict[str, Any], key: str) -> str:
        if pp is None or not pp.get(key) or not r.get(key):
            return "—"
        return f"{pp[key] / r[key]:.2f}x"

    lines = ["| method | source | TBT wall (ms) | wall from | TBT pipelined (ms) | "
             "wall / pipelined | speedup over pp (wall) | speedup over pp (pipelined) | "
             "critical worker | its compute ms/step (runtime / engine) | barrier | input wait | "
             "send | steps (runtime / engine) |",
             "|---|---|--:|---|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        if r["method"] == HF_LABEL:
            continue
        ratio = (f"{r['wall_tbt_ms'] / r['pipelined_tbt_ms']:.2f}"
                 if r.get("wall_tbt_ms") and r.get("pipelined_tbt_ms") else "—")
        bd = r.get("runtime_breakdown") or {}
        c = bd.get("workers", {}).get(bd.get("critical"), {})
        parts = (f"{bd['critical']} | {c['compute_ms']:.2f} / "
                 f"{_fmt(c.get('engine_compute_ms'))} | {c['barrier_ms']:.2f} | "
                 f"{c['input_ms']:.2f} | {c['send_ms']:.2f} | {r['runtime_steps']} / "
                 f"{r['steps']}") if c else "— | — | — | — | — | —"
        lines.append(f"| {r['method']} | {r['source'] or '—'} | {_fmt(r['wall_tbt_ms'])} | "
                     f"{r['wall_from']} | {_fmt(r['pipelined_tbt_ms'])} | {ratio} | "
                     f"{speedup(r, 'wall_tbt_ms')} | {speedup(r, 'pipelined_tbt_ms')} | "
                     f"{parts} |")
    # judged against ar where the bench ran it (near-tie flips allowed), else exactly
    # against the engine's tokens
    lossy = [r["label"] for r in rows if r.get("wall_from") == "runtime"
             and (r["runtime_matches_engine"] if r.get("runtime_lossless") is None
                  else r["runtime_lossless"]) != r["prompts"]]
    lines += ["", "Wall TBT: through real processes for rows run by `--runtime` (the workers' "
              "wall time from the prefill step's verdict to the last verdict, per token after "
              "the first, as the engine's wall TBT counts; the gRPC client's mean gap, which "
              "also holds the prefill barrier, is `runtime_client_tbt_ms` in the JSON), else "
              "in one process. Breakdown: "
              "per decode step of the worker with the most compute (barrier = arrive to "
              "verdict, input wait = waiting for the link message, send = encoding and "
              "queueing link messages; prefill excluded); its engine compute is the same "
              "stage's in the in-process run, where one stage computes at a time. "
              + (f"Runtime tokens differ from ar's (without an ar row: the engine's), not at "
                 f"a near-tie: {', '.join(lossy)}." if lossy
                 else "The runtime's tokens equal ar's on every prompt, or first differ from "
                 "them at a near-tie the dtype allows (without an ar row: equal the engine's)."
                 )]
    return "\n".join(lines)


def _run_record(row: Row, run: Run, prompts: list[BenchPrompt]) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "prompt": run.prompt, "name": prompts[run.prompt].name, "method": row.method,
        "source": row.source, "tokens": run.tokens, "wall_s": run.wall_s,
        "prefill_s": run.prefill_s, "decode_tokens": run.decode_tokens,
        "matches_ar": run.matches_ar, "first_diff": run.first_diff,
        # where the tokens differ from ar's: True at a near-tie the dtype allows
        "near_tie": None if run.flip is None else run.flip.allowed,
        "difference": None if run.flip is None else run.flip.describe(),
    }
    if run.result is not None:
        rec["stats"] = run.result.stats()
        if row.method in ("pp", "specpipe"):
            rec["step_breakdown"] = step_breakdown(run.result)
    return rec


# ---- command ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchOptions(EngineOptions):
    """``treepipe bench``'s options, one field per flag."""

    methods: str
    sources: str
    prompts: str
    max_new_tokens: int
    chat: bool
    ignore_eos: bool
    threads: int | None
    hf: bool
    warmup: bool
    out: Path | None
    json: bool
    records: bool
    tune: Path | None
    concurrency: list[int] | None
    widths: str | None
    repeats: int
    lengths: tuple[int, int] | None
    prefill_chunk: int
    runtime: bool
    transport: str


def bench(a: BenchOptions) -> int:
    """Run the benchmark described by the parsed ``bench`` arguments."""
    rows = parse_rows(a.methods, a.sources)
    prompts = load_prompts(a.prompts)  # before loading the model: fail fast on bad input
    check_device(a.device)
    if a.records and a.out is None:
        raise TreepipeError("--records needs --out DIR to write DIR/records.json")
    if a.lengths is not None and a.concurrency is None:
        raise TreepipeError("--lengths sets each request's length under load; add "
                            "--concurrency B1,B2,...")
    if a.widths is not None:
        if a.concurrency is None:
            raise TreepipeError("--widths compares width policies under load; add "
                                "--concurrency B1,B2,...")
        _width_policies(a)  # a bad entry fails before the model loads
    tuned = load_tune_prediction(a.tune, a.width, a.topk) if a.tune is not None else None
    if a.threads is not None:  # the parser already refused values below 1
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()

    spec = EngineSpec(model=a.model, stages=a.stages, draft="none", draft_model=a.draft_model,
                      width=a.width, topk=a.topk, dtype=a.dtype, device=a.device,
                      link_latency_us=a.link_latency_us, link_gbps=a.link_gbps,
                      draft_vocab=a.draft_vocab, execution=a.execution, recovery=a.recovery,
                      quantize=a.quantize)
    base, tok, folder = build_engine(spec)
    dtype = torch_dtype(spec.dtype, spec.device)
    # int8 products round their activations to the kernel's dtype (bfloat16 for a float32
    # model): a near-tie is judged at that precision
    ties = KERNEL_DTYPES.get(dtype, dtype) if spec.quantize == "int8" else dtype
    # One set of target shards for every row; one engine per token source around them.
    engines: dict[str | None, PipelineEngine] = {None: base}
    for src in dict.fromkeys(r.source for r in rows if r.source is not None):
        vocab = spec.draft_vocab if uses_draft_model(src) else ""  # n-gram rows stay full
        source = make_source(dataclasses.replace(spec, draft=src, draft_vocab=vocab), folder,
                             dtype, base.shards)
        engines[src] = PipelineEngine(base.shards, source, spec.width, spec.topk, base.link,
                                      recovery=spec.recovery)

    ids = [p.ids(tok, a.chat) for p in prompts]
    stop: list[int] = [] if a.ignore_eos else list(tok.eos_token_ids)
    if a.concurrency is not None:
        return _bench_concurrency(a, rows, engines, ids, stop, ties)
    sampling = SamplingParams()
    hf_model = load_hf_model(folder, dtype, spec.device, a.ignore_eos) if a.hf else None

    def run_one(row: Row, i: int, n_new: int) -> Run:
        if row.method == HF_LABEL:
            toks, wall, prefill = hf_generate(hf_model, ids[i], n_new, stop, spec.device)
            return Run(i, toks, wall, prefill)
        res = engines[row.source].generate(ids[i], n_new, sampling, row.method, stop)
        return _result_run(i, res)

    all_rows = rows + ([Row(HF_LABEL, None)] if hf_model is not None else [])
    pipes = None
    if a.runtime:
        if spec.device != "cpu":
            raise TreepipeError("--runtime starts local CPU pipelines; drop --device or "
                                "--runtime")
        pipes = LocalPipelines(a.model, spec.dtype, spec.stages, spec.width, spec.topk,
                               a.transport, a.max_new_tokens, spec.recovery.name,
                               spec.quantize)
    try:
        if pipes is not None:
            pipes.start([r.source for r in rows if r.method in RUNTIME_METHODS])
        table = _bench_rows(a, all_rows, run_one, pipes, ids, prompts)
    finally:
        if pipes is not None:
            pipes.close()
    ar_index = next((j for j, r in enumerate(all_rows) if r.method == "ar"), None)
    if ar_index is not None:
        for rr in table:
            if rr.row.method != "ar":
                for run in rr.runs:
                    _compare(run, table[ar_index].runs[run.prompt].tokens)
        # a differing run: at a near-tie of ar's top two logits, or a real difference
        differ = [run for rr in table if rr.row.method != "ar" for run in rr.runs
                  if run.matches_ar is False]
        refs = [run.tokens for run in table[ar_index].runs]
        # the real pipelines' tokens by the same rule: they may flip a near-tie too
        rt_differ = [(rr, i, rt.tokens) for rr in table for i, rt in enumerate(rr.runtime)
                     if rt.tokens != refs[i]]
        flips = judge_against_ar(base, ids, stop, refs,
                                 [(run.prompt, run.tokens) for run in differ]
                                 + [(i, tokens) for _, i, tokens in rt_differ], ties)
        for run, flip in zip(differ, flips[:len(differ)], strict=True):
            run.flip = flip
        for rr in table:
            rr.runtime_flips = {}
        for (rr, i, _), flip in zip(rt_differ, flips[len(differ):], strict=True):
            assert rr.runtime_flips is not None and flip is not None
            rr.runtime_flips[i] = flip

    report: dict[str, Any] = {
        "config": {
            "model": a.model, "folder": str(folder), "stages": spec.stages,
            "width": spec.width, "topk": spec.topk, "draft_model": spec.draft_model,
            "recovery": spec.recovery.name,
            "draft_vocab": spec.draft_vocab,
            "dtype": spec.dtype, "quantize": spec.quantize, "device": spec.device,
            "threads": threads, "prompts": a.prompts, "n_prompts": len(prompts), "chat": a.chat,
            "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos,
            "warmup": a.warmup, "link_latency_us": spec.link_latency_us,
            "link_gbps": spec.link_gbps, "torch": torch.__version__,
            "transformers": _transformers_version() if hf_model is not None else None,
            "methods": [r.label for r in all_rows],
            "runtime": a.runtime, "runtime_transport": a.transport if a.runtime else None,
        },
        "rows": [aggregate(rr, spec.stages, spec.width, spec.topk) for rr in table],
        "results": [_run_record(rr.row, run, prompts) for rr in table for run in rr.runs],
    }
    if tuned is not None:
        report["config"]["tune"] = str(a.tune)
        for r in report["rows"]:
            if r["method"] == "specpipe" and r["source"] in (tuned["source"], None):
                r["tune_predicted_ms"] = tuned["predicted_ms"]
    md = markdown_report(report)
    if a.out is not None and a.records:
        a.out.mkdir(parents=True, exist_ok=True)
        recs = [{**result_to_dict(run.result), "prompt": run.prompt}
                for rr in table for run in rr.runs if run.result is not None]
        (a.out / "records.json").write_text(
            json.dumps({"config": report["config"], "results": recs}) + "\n", encoding="utf-8")
    return _emit(a, report, md)


def _bench_rows(a: BenchOptions, rows: list[Row], run_one: Any,
                pipes: LocalPipelines | None, ids: list[list[int]],
                prompts: list[BenchPrompt]) -> list[RowRuns]:
    """Every row on every prompt, interleaved per prompt (so machine-speed drifts are
    shared); with ``pipes``, each runtime row's real pipeline right after its engine run."""
    from tqdm import tqdm

    def on_runtime(row: Row) -> bool:
        return pipes is not None and row.method in RUNTIME_METHODS

    if a.warmup:
        for row in rows:
            run_one(row, 0, min(a.max_new_tokens, WARMUP_TOKENS))
            if on_runtime(row):
                assert pipes is not None
                pipes.run(row.source, ids[0], min(a.max_new_tokens, WARMUP_TOKENS),
                          a.ignore_eos)
    settle_heap()  # loaded and warm: collections walk only what the runs make
    table = [RowRuns(r) for r in rows]
    total = len(prompts) * sum(1 + on_runtime(r) for r in rows)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for i in range(len(prompts)):
            for rr in table:
                bar.set_postfix_str(f"{prompts[i].name} {rr.row.label}", refresh=False)
                rr.runs.append(run_one(rr.row, i, a.max_new_tokens))
                bar.update()
                if on_runtime(rr.row):
                    assert pipes is not None
                    bar.set_postfix_str(f"{prompts[i].name} {rr.row.label} runtime",
                                        refresh=False)
                    rr.runtime.append(pipes.run(rr.row.source, ids[i], a.max_new_tokens,
                                                a.ignore_eos))
                    bar.update()
    return table


def _bench_concurrency(a: BenchOptions, rows: list[Row],
                       engines: dict[str | None, PipelineEngine], ids: list[list[int]],
                       stop: list[int], dtype: torch.dtype) -> int:
    """``bench --concurrency``: each batched row at each B (specpipe at each width policy,
    plus specpipe-serial); tokens checked against ar at B=1, a difference that starts at
    a near-tie the dtype allows counted as lossless (``near_tie_flips``)."""
    from tqdm import tqdm

    batched = [r for r in rows if r.method in BATCH_METHODS]
    if not batched:
        raise TreepipeError(f"--concurrency runs only {', '.join(BATCH_METHODS)}; "
                            "add one of them to --methods")
    widths = _width_policies(a)
    n_new = request_lengths(len(ids), *a.lengths) if a.lengths else a.max_new_tokens
    configs = [(r, w) for r in batched for w in (widths if r.method == "specpipe" else [None])]
    # every configuration at one B runs in lockstep with the others (concurrency_rows),
    # and each repeat is a fresh lockstep group; the specpipe-serial row (one request in
    # flight whatever B, so one run reused at every B) joins the first B's groups
    serial = next(((r, w) for r, w in configs if r.method == "specpipe" and w == widths[-1]),
                  None)
    tries: dict[tuple[Row, str, int], list[dict[str, Any]]] = {}
    serial_runs: list[dict[str, Any]] = []
    total = len(ids) * a.repeats * (len(configs) * len(a.concurrency) + (serial is not None))
    with tqdm(total=total, desc="bench --concurrency", unit="request", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for k, b in enumerate(a.concurrency):
            group = [BatchConfig(engines[r.source], r.method, w) for r, w in configs]
            if serial is not None and k == 0:
                group.append(BatchConfig(engines[serial[0].source], "specpipe", None,
                                         in_flight=1))
            for rep in range(a.repeats):
                bar.set_postfix_str(f"B={b} repeat {rep + 1}/{a.repeats}")
                # each repeat builds and steps the group one configuration further on:
                # a run's place in the group is worth up to 1.5 % (docs/benchmarks.md),
                # so over len(group) repeats every configuration is first once
                shift = rep % len(group)
                done = concurrency_rows(group[shift:] + group[:shift], b, ids, n_new, stop,
                                        a.prefill_chunk, bar.update)
                done = done[len(group) - shift:] + done[:len(group) - shift]
                for (r, w), row in zip(configs, done, strict=False):
                    # the rotation undone: each row back with its configuration
                    assert row["method"] == r.method and (
                        w is None or str(row["width"]) == str(w)), (r.method, w, row)
                    tries.setdefault((r, str(w), b), []).append(row)
                serial_runs += done[len(configs):]
    runs = {key: median_run(t) for key, t in tries.items()}
    points: list[dict[str, Any]] = []
    for r, w in configs:
        points += [runs[r, str(w), b] for b in a.concurrency]
        if (r, w) == serial:
            one = median_run(serial_runs)
            points += [{**one, "method": SERIAL, "concurrency": b} for b in a.concurrency]
    ref = concurrency_row(engines[None], "ar", 1, ids, n_new, stop)["outputs"]
    outs = [(j, out) for p in points if p["outputs"] is not None
            for j, out in enumerate(p["outputs"]) if out != ref[j]]
    judged = judge_against_ar(engines[None], ids, stop, ref, outs, dtype)
    flip_of = {(j, tuple(out)): f for (j, out), f in zip(outs, judged, strict=True)}
    for p in points:
        outputs = p.pop("outputs")
        flips = [] if outputs is None else [flip_of.get((j, tuple(o))) for j, o in
                                            enumerate(outputs)]
        # repeats with other tokens (outputs None) stay lossy, as before
        p["lossless"] = outputs is not None and all(f is None or f.allowed for f in flips)
        # requests whose output differs from ar's, first at an allowed near-tie
        p["near_tie_flips"] = sum(f is not None and f.allowed for f in flips)
    report = {"config": {"model": a.model, "stages": a.stages, "width": a.width,
                         "widths": [str(w) for w in widths], "topk": a.topk,
                         "max_new_tokens": a.max_new_tokens, "n_prompts": len(ids),
                         "lengths": None if isinstance(n_new, int) else n_new,
                         "concurrency": a.concurrency, "prefill_chunk": a.prefill_chunk,
                         "repeats": a.repeats, "dtype": a.dtype, "quantize": a.quantize,
                         "device": a.device,
                         "device_name": device_name(a.device), "torch": torch.__version__},
              "concurrency": points}
    code = _emit(a, report, concurrency_markdown(points))
    if a.out is not None:
        plot_concurrency(report, a.out / "bench.png")
    return code


def plot_concurrency(report: dict[str, Any], path: Path) -> None:
    """Figures 16/17 layout: throughput (left) and mean TBT (right) against B, one line per
    method and width policy, in modelled pipelined time."""
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[str, list[dict[str, Any]]] = {}
    for p in report["concurrency"]:
        name = p["method"] + (f" w={p['width']}" if p["method"] == "specpipe" else "")
        lines.setdefault(name, []).append(p)
    for name, pts in lines.items():
        pts = sorted(pts, key=lambda p: p["concurrency"])
        bs = [p["concurrency"] for p in pts]
        style = {"ls": "--"} if name == SERIAL else {}
        ax1.plot(bs, [p["throughput_tok_s"] for p in pts], marker="o", ms=3, label=name, **style)
        ax2.plot(bs, [p["tbt_mean_ms"] for p in pts], marker="o", ms=3, label=name, **style)
    ax1.set(xlabel="requests in flight B", ylabel="throughput (tokens/s)", title="Throughput")
    ax2.set(xlabel="requests in flight B", ylabel="mean TBT (ms)", title="Time between tokens")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    cfg = report["config"]
    fig.suptitle(f"SpecPipe-DB on {cfg['model']}, m={cfg['stages']}, {cfg['n_prompts']} "
                 f"prompts x {cfg['max_new_tokens']} tokens (pipelined time)", fontsize=10)
    save(fig, path)


def _width_policies(a: BenchOptions) -> list[int | str]:
    """``--widths`` parsed (default: just ``--width``, which also caps ``adaptive``)."""
    if a.widths is None:
        return [a.width]
    widths = [parse_width(w) for w in a.widths.split(",") if w.strip()]
    if not widths:
        raise TreepipeError("--widths is empty; pass e.g. --widths 1,4,adaptive")
    return list(dict.fromkeys(widths))


def _emit(a: BenchOptions, report: dict[str, Any], md: str) -> int:
    """Write bench.json and bench.md under --out (if given); print JSON or the table."""
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (a.out / "bench.md").write_text(md, encoding="utf-8")
    if a.json:
        print(json.dumps(report))
    else:
        sys.stdout.write(md)
    return 0


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


__all__ = ["BenchOptions", "bench", "eq2_steps_per_token", "load_prompts",
           "parse_rows", "step_breakdown"]
