"""Measure miss recovery from early exits on real prompts (issue 40, the measuring half).

``treepipe draft recovery --prompts docs/drafts/heldout_prompts.jsonl --chat``

For every source and stage count it replays SpecPipe against the target's greedy
tokens (:func:`~orchestrator.lab.recovery.replay.observed_replay`), reads every exit's
top tokens at each verified token's parent from one teacher-forced forward per prompt
(:func:`~stages.model.early_exit.boundary_states`), and projects recovery for each exit
stage j, top-kappa, lag and node budget (:mod:`orchestrator.lab.recovery.accounting`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.lab.benchmarks.prompts import load_prompts
from orchestrator.lab.drafting.draft_eval import target_continuations
from orchestrator.lab.recovery.accounting import Projection, Trace, project
from orchestrator.lab.recovery.replay import observed_replay, replay_from_json, replay_to_json
from orchestrator.models.loading import DEFAULT_HYBRID_DRAFT, EngineSpec, make_source
from orchestrator.models.registry import cache_dir, resolve_model
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.early_exit import boundary_states, cached_adapters, exit_logits
from stages.model.planning import even_bounds
from stages.model.tokenizer import TextTokenizer

TOP = 8  # exit tokens kept per position (the largest kappa)


def exit_tables(shard: Any, prompts: list[list[int]], truths: list[list[int]],
                layers: list[int], adapters: dict[int, Any]) -> list[dict[int, list[list[int]]]]:
    """Per prompt, per exit layer: the exit's top tokens at every position of prompt + truth."""
    tables = []
    for p, t in zip(prompts, truths, strict=True):
        states = boundary_states(shard, p + t[:-1], layers)
        per: dict[int, list[list[int]]] = {}
        for layer in layers:
            ad = adapters.get(layer, (None, None))[0]
            logits = exit_logits(shard, states[layer], layer, ad)
            per[layer] = torch.topk(logits, TOP, dim=-1).indices.tolist()
        tables.append(per)
    return tables


def agreement(prompts: list[list[int]], truths: list[list[int]],
              tables: list[dict[int, list[list[int]]]], layer: int, kappa: int) -> float:
    """Share of the target's tokens (after the first) in the exit's top-kappa at their parent."""
    hit = n = 0
    for p, t, tab in zip(prompts, truths, tables, strict=True):
        for i in range(1, len(t)):
            hit += t[i] in tab[layer][len(p) + i - 1][:kappa]
            n += 1
    return hit / max(1, n)


def row(name: str, m: int, j: int, layer: int, kappa: int, lag: int, budget: str,
        pr: Projection) -> dict[str, Any]:
    return {"source": name, "stages": m, "exit_stage": j, "exit_layer": layer, "kappa": kappa,
            "lag": lag, "budget": budget, "verified": pr.verified,
            "misses_base": pr.misses_base, "exit_holds": pr.exit_share,
            "misses": pr.misses, "caught": pr.caught, "caught_share": pr.caught_share,
            "steps_per_miss_base": pr.steps_per_miss_base,
            "steps_per_miss": pr.steps_per_miss,
            "steps_per_token_base": pr.steps_per_token_base,
            "steps_per_token": pr.steps_per_token, "cut": pr.cut,
            "corrections_per_node": pr.new_per_node / max(1, pr.new_counted),
            "demand_per_step": pr.demand / max(1, pr.steps_base),
            "served_per_step": pr.served / max(1, pr.steps_base),
            "normal_nodes_per_step": pr.entering / max(1, pr.steps_base)}


@dataclass(frozen=True)
class RecoveryOptions:
    """``treepipe draft recovery``'s settings (orchestrator/cli/draft_commands.py)."""

    target: str = "smollm2-135m"
    prompts: str = "docs/drafts/heldout_prompts.jsonl"
    chat: bool = False
    max_new_tokens: int = 64
    sources: str = "ngram,hybrid"
    draft_model: str = DEFAULT_HYBRID_DRAFT
    stages: str = "4,8"
    width: int = 16
    topk: int = 8
    kappas: str = "1,2,4,8"
    lags: str = "0,1"
    threads: int | None = None
    normal_widths: str = ""
    traces: Path | None = None
    json: Path | None = None
    print_json: Path | None = None


def measure_recovery(o: RecoveryOptions) -> int:
    """Replay, read the exits, project recovery and print the tables (0: done)."""
    if o.print_json:
        print_tables(json.loads(o.print_json.read_text(encoding="utf-8")))
        return 0
    if o.threads:
        torch.set_num_threads(o.threads)
    t0 = time.time()
    folder = resolve_model(o.target)
    args = load_model_args(folder)
    tok = TextTokenizer.from_folder(folder)
    ids = [p.ids(tok, o.chat) for p in load_prompts(o.prompts)]
    name = hashlib.sha256(json.dumps([o.prompts, o.chat]).encode()).hexdigest()[:16]
    cache = cache_dir() / "draft_eval" / f"{folder.name}-{name}-{o.max_new_tokens}.json"
    truths = target_continuations(folder, ids, o.max_new_tokens, "cpu", cache, progress=False)
    stage_counts = [int(x) for x in o.stages.split(",")]
    kappas = [int(x) for x in o.kappas.split(",")]
    lags = [int(x) for x in o.lags.split(",")]
    bounds = {m: even_bounds(args.n_layers, m) for m in stage_counts}
    layers = sorted({b for m in stage_counts for _, b in bounds[m][:-1]} | {args.n_layers})
    whole = load_shard(folder, 0, args.n_layers, torch.float32, "cpu")
    adapters = cached_adapters(cache_dir() / "drafts", o.target)
    tables = exit_tables(whole, ids, truths, layers, adapters)
    print(f"# {len(ids)} prompts ({o.prompts}, chat={o.chat}), {o.max_new_tokens} new tokens; "
          f"adapters: {sorted(adapters) or 'none'} ({time.time() - t0:.0f} s)", file=sys.stderr)
    report: dict[str, Any] = {
        "target": o.target, "prompts": o.prompts, "chat": o.chat, "n_prompts": len(ids),
        "max_new_tokens": o.max_new_tokens, "width": o.width, "topk": o.topk,
        "adapters": {str(k): str(v[1]) for k, v in adapters.items()},
        "agreement": {str(layer): {str(k): agreement(ids, truths, tables, layer, k)
                                   for k in kappas} for layer in layers},
        "rows": []}
    store = o.traces
    saved: dict[str, Any] = {}
    if store is not None and store.is_file():
        saved = json.loads(store.read_text(encoding="utf-8"))
        if saved.get("key") != name + str(o.max_new_tokens):
            saved = {}
    saved["key"] = name + str(o.max_new_tokens)
    widths = sorted({o.width, *(int(x) for x in o.normal_widths.split(",") if x)}, reverse=True)
    for src_name in o.sources.split(","):
        source = None
        for m in stage_counts:
            runs: dict[int, list[Trace]] = {}
            for w in widths:
                label = f"{src_name}/{o.draft_model}/m={m}/w={w}/k={o.topk}"
                if label not in saved:
                    if source is None:
                        spec = EngineSpec(model=o.target, draft=src_name,
                                          draft_model=o.draft_model)
                        source = make_source(spec, folder, torch.float32)
                    assert source is not None
                    saved[label] = [replay_to_json(observed_replay(source, p, t, m, w, o.topk))
                                    for p, t in zip(ids, truths, strict=True)]
                    if store is not None:
                        store.parent.mkdir(parents=True, exist_ok=True)
                        store.write_text(json.dumps(saved) + "\n", encoding="utf-8")
                    print(f"# {label}: replayed ({time.time() - t0:.0f} s)", file=sys.stderr)
                traces = []
                for p, tab, d in zip(ids, tables, saved[label], strict=True):
                    rp = replay_from_json(d)
                    exits = {j: [tab[b][len(p) + v.index - 1] for v in rp.verifications]
                             for j, (_, b) in enumerate(bounds[m][:-1], start=1)}
                    traces.append(Trace(rp, exits))
                runs[w] = traces
            base_steps = sum(tr.replay.steps for tr in runs[o.width])
            for w in widths:
                for j, (_, layer) in enumerate(bounds[m][:-1], start=1):
                    for kappa in kappas:
                        for lag in lags:
                            for budget in ("free", "spare"):
                                tot = Projection()
                                for tr in runs[w]:
                                    tot.add(project(tr, j, kappa, lag, budget, cap=o.width))
                                r = row(src_name, m, j, layer, kappa, lag, budget, tot)
                                r["normal_width"] = w
                                r["steps_per_token_w"] = base_steps / max(1, tot.verified)
                                r["cut_vs_w"] = 1 - tot.steps / max(1, base_steps)
                                report["rows"].append(r)
    report["seconds"] = time.time() - t0
    if o.json:
        o.json.parent.mkdir(parents=True, exist_ok=True)
        o.json.write_text(json.dumps(report) + "\n", encoding="utf-8")
    print_tables(report)
    return 0


def _line(r: dict[str, Any]) -> str:
    return (f"| {r['source']} | {r['stages']} | {r['normal_width']} | {r['exit_stage']} "
            f"({r['exit_layer']}) | {r['kappa']} | {r['lag']} | {r['budget']} | "
            f"{r['misses_base']} | {r['exit_holds']:.2f} | "
            f"{r['caught']}/{r['misses']} ({r['caught_share']:.2f}) | "
            f"{r['steps_per_miss_base']:.2f} → {r['steps_per_miss']:.2f} | "
            f"{r['steps_per_token_w']:.2f} → {r['steps_per_token']:.2f} | "
            f"{100 * r['cut_vs_w']:.1f}% | {r['corrections_per_node']:.2f} | "
            f"{r['demand_per_step']:.1f} | {r['served_per_step']:.1f} | "
            f"{r['normal_nodes_per_step']:.1f} |")


HEADER = ("| source | m | w' | exit stage j (layer) | κ | lag | budget | misses (base) | "
          "exit top-κ holds | caught / misses | steps per miss base → rec | "
          "steps/token (w) → rec | cut | corrections/node | wanted/step | served/step | "
          "normal nodes/step |\n"
          "|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")


def print_tables(report: dict[str, Any]) -> None:
    """Markdown: exit agreement; the best setting per (source, m, w', lag, budget); every
    exit depth and κ at the replay's own width, lag 1."""
    rows = report["rows"]
    kappas = sorted({r["kappa"] for r in rows})
    print("| exit layer | " + " | ".join(f"top-{k}" for k in kappas) + " |")
    print("|--:|" + "--:|" * len(kappas))
    for layer, by_k in report["agreement"].items():
        print(f"| {layer} | " + " | ".join(f"{by_k[str(k)]:.3f}" for k in kappas) + " |")
    print("\nBest (j, κ) per setting:\n")
    print(HEADER)
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["source"], r["stages"], -r["normal_width"], r["lag"], r["budget"])
        if key not in groups or r["cut_vs_w"] > groups[key]["cut_vs_w"]:
            groups[key] = r
    for key in sorted(groups):
        print(_line(groups[key]))
    print("\nWhat a 25 % cut would take (w' = w, no node limit): the share of misses a "
          "correction must catch, against what the exit's top-κ holds:\n")
    print("| source | m | lag | exit stage j (layer) | steps per miss base | needed catch share "
          "| exit holds at κ = " + ", ".join(str(k) for k in kappas) + " |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        if r["normal_width"] != report["width"] or r["budget"] != "free" or \
                r["kappa"] != kappas[0]:
            continue
        save = r["steps_per_miss_base"] - r["exit_stage"] - r["lag"]
        need = 0.25 * r["steps_per_token_w"] * r["verified"] / max(1e-9, r["misses_base"] * save)
        need_s = f"{need:.2f}" if save > 0 else "—"
        holds = [x["exit_holds"] for x in rows if x["source"] == r["source"] and
                 x["stages"] == r["stages"] and x["exit_stage"] == r["exit_stage"] and
                 x["lag"] == r["lag"] and x["budget"] == "free" and
                 x["normal_width"] == r["normal_width"]]
        print(f"| {r['source']} | {r['stages']} | {r['lag']} | {r['exit_stage']} "
              f"({r['exit_layer']}) | {r['steps_per_miss_base']:.2f} | "
              f"{need_s} | " + " / ".join(f"{h:.2f}" for h in holds) + " |")
    print(f"\nEvery exit depth and κ (w' = {report['width']}, lag 1):\n")
    print(HEADER)
    for r in rows:
        if r["normal_width"] == report["width"] and r["lag"] == 1:
            print(_line(r))


__all__ = ["RecoveryOptions", "measure_recovery", "exit_tables", "agreement", "print_tables"]
