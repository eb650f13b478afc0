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
from collections.abc import Sequence
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
from protocol.config.recovery import Recovery
from protocol.errors import TreepipeError
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.early_exit import (
    boundary_states,
    cached_adapters,
    exit_head,
    exit_logits,
)
from stages.model.planning import even_bounds
from stages.model.tokenizer import TextTokenizer

TOP = 8  # exit tokens kept per position (the largest kappa)
HELDOUT = "docs/drafts/heldout_prompts.jsonl"  # the default --prompts, in the source tree
ROOT = Path(__file__).resolve().parents[3]  # the source tree this module runs from


def heldout_prompts() -> str:
    """The held-out prompts file (the default ``--prompts``) of the source tree this runs
    from, wherever the command is started; one line naming --prompts without one."""
    path = ROOT / HELDOUT
    if not path.is_file():
        raise TreepipeError(f"the default prompts {HELDOUT} are not under {ROOT} (they ship "
                            "with a treepipe source checkout); pass --prompts humaneval:N or "
                            "a JSONL file")
    return str(path)


def read_report(path: Path) -> dict[str, Any]:
    """A ``--json`` report of this command, for ``--print``; one line naming the fix for a
    file that is missing, not JSON, or not such a report."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TreepipeError(f"--print {path}: cannot read it ({e.strerror}); pass a report "
                            "that `treepipe draft recovery --json FILE` wrote") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise TreepipeError(f"--print {path} is not JSON ({e}); pass a report that "
                            "`treepipe draft recovery --json FILE` wrote") from None
    # the keys print_tables reads before any row
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list) or \
            not isinstance(report.get("agreement"), dict) or "width" not in report:
        raise TreepipeError(f"--print {path} is not a `treepipe draft recovery --json` report "
                            "(no \"rows\", \"agreement\" and \"width\"); pass one that "
                            "--json wrote")
    return report


def exit_tables(shard: Any, prompts: list[list[int]], truths: list[list[int]],
                layers: list[int], adapters: dict[int, Any], head: Recovery | None = None,
                top: int = TOP) -> list[dict[int, list[list[int]]]]:
    """Per prompt, per exit layer: the exit's top tokens at every position of prompt + truth;
    with ``head`` (an ``early-exit`` setting) the exit recovery runs
    (:func:`~stages.model.early_exit.exit_head`: its vocabulary, its adapter) instead of
    the plain exit with ``adapters``."""
    tables = []
    for p, t in zip(prompts, truths, strict=True):
        states = boundary_states(shard, p + t[:-1], layers)
        per: dict[int, list[list[int]]] = {}
        for layer in layers:
            if head is not None:
                toks, probs = exit_head(shard, layer, head).top(states[layer], top)
                per[layer] = toks.masked_fill(probs <= 0, -1).tolist()
                continue
            ad = adapters.get(layer, (None, None))[0]
            logits = exit_logits(shard, states[layer], layer, ad)
            per[layer] = torch.topk(logits, top, dim=-1).indices.tolist()
        tables.append(per)
    return tables


def head_label(head: Recovery) -> str:
    """A head setting in a table: ``full``, ``vocab=FILE:N``, ``... + adapter``."""
    name = f"vocab={Path(head.vocab).name}" if head.vocab else head.head
    return name + (f" + adapter={head.adapter}" if head.adapter else "")


def head_layers(head: Recovery, layers: list[int]) -> list[int]:
    """The layers ``head`` can run at: all, but an explicit adapter only at its own."""
    if head.adapter and head.adapter != "auto":
        return [layer for layer in layers if layer in dict(head.adapters)]
    return layers


def head_costs(shard: Any, heads: list[Recovery], layers: list[int],
               nodes: tuple[int, ...] = (1, 16), rounds: int = 5,
               seconds: float = 0.4) -> list[dict[str, Any]]:
    """ms per call of each head's top-8 on ``n`` nodes' states (random: the cost does not
    depend on them) at each layer; ``+draft`` scores 8 candidates per node.  The heads
    take turns for ``rounds`` rounds of ``seconds`` each, and each call is timed: on a
    shared machine the minimum is the head's own cost, the median what a step saw."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for head in heads:
        for layer in head_layers(head, layers):
            ex = exit_head(shard, layer, head)
            for n in nodes:
                h = torch.randn(n, shard.args.dim, generator=gen)
                cands = [torch.randint(0, shard.args.vocab_size, (8,), generator=gen)
                         for _ in range(n)] if ex.by_candidates else None
                ex.top(h, 8, None, cands)  # warm: kernels, caches
                cases.append((head, layer, n, ex, h, cands, []))
    for _ in range(rounds):
        for _, _, _, ex, h, cands, times in cases:
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end or not times:
                t = time.perf_counter()
                ex.top(h, 8, None, cands)
                times.append(time.perf_counter() - t)
    out = []
    for head, layer, n, ex, _, _, times in cases:
        times.sort()
        lo, med = 1e3 * times[0], 1e3 * times[len(times) // 2]
        out.append({"head": head_label(head), "layer": layer, "nodes": n, "calls": len(times),
                    "ms_min": lo, "ms_median": med, "ms_per_node_min": lo / n,
                    "ms_per_node_median": med / n, "exit": ex.describe()})
    return out


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
    prompts: str | None = None  # None: the held-out set (HELDOUT)
    chat: bool = False
    max_new_tokens: int = 64
    sources: str = "ngram,hybrid"
    draft_model: str = DEFAULT_HYBRID_DRAFT
    stages: Sequence[int] = (4, 8)
    width: int = 16
    topk: int = 8
    kappas: Sequence[int] = (1, 2, 4, 8)
    lags: Sequence[int] = (0, 1)
    threads: int | None = None
    normal_widths: Sequence[int] = ()
    traces: Path | None = None
    json: Path | None = None
    print_json: Path | None = None
    # early-exit heads to compare (recovery settings, their names resolved); () = the plain
    # exit with any cached adapter, as before
    heads: tuple[Recovery, ...] = ()
    exit_layers: Sequence[int] = ()  # more layers for the agreement table (e.g. 8,15,23)
    no_replay: bool = False  # agreement (and costs) only
    cost_layers: Sequence[int] = ()  # time each head at these layers, 1 and 16 nodes


def measure_recovery(o: RecoveryOptions) -> int:
    """Replay, read the exits, project recovery and print the tables (0: done)."""
    if o.print_json:
        print_tables(read_report(o.print_json))
        return 0
    if o.threads:
        torch.set_num_threads(o.threads)
    t0 = time.time()
    # the default's name, not its path, keys the caches and the report (as before)
    spec = o.prompts or HELDOUT
    prompts = load_prompts(o.prompts or heldout_prompts())
    folder = resolve_model(o.target)
    args = load_model_args(folder)
    stage_counts, kappas, lags = list(o.stages), list(o.kappas), list(o.lags)
    bounds = check_settings(o, args.n_layers, args.vocab_size)  # before the model runs
    tok = TextTokenizer.from_folder(folder)
    ids = [p.ids(tok, o.chat) for p in prompts]
    name = hashlib.sha256(json.dumps([spec, o.chat]).encode()).hexdigest()[:16]
    cache = cache_dir() / "draft_eval" / f"{folder.name}-{name}-{o.max_new_tokens}.json"
    truths = target_continuations(folder, ids, o.max_new_tokens, "cpu", cache, progress=False)
    layers = sorted({b for m in stage_counts for _, b in bounds[m][:-1]} | {args.n_layers})
    whole = load_shard(folder, 0, args.n_layers, torch.float32, "cpu")
    heads: list[Recovery | None] = list(o.heads) or [None]
    adapters = {} if o.heads else cached_adapters(cache_dir() / "drafts", o.target)
    top = max([TOP, *kappas])
    every = sorted(set(layers) | set(o.exit_layers))
    by_head: dict[str, tuple[Recovery | None, list[dict[int, list[list[int]]]]]] = {}
    for head in heads:
        if head is not None and head.draft_only:
            continue  # it re-ranks a draft's proposals: no agreement without a draft
        label = "plain" if head is None else head_label(head)
        at = every if head is None else head_layers(head, every)
        by_head[label] = (head, exit_tables(whole, ids, truths, at, adapters, head, top))
    print(f"# {len(ids)} prompts ({spec}, chat={o.chat}), {o.max_new_tokens} new tokens; "
          f"heads: {list(by_head)}, adapters: {sorted(adapters) or 'none'} "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    agree = {label: {str(layer): {str(k): agreement(ids, truths, tabs, layer, k)
                                  for k in kappas} for layer in tabs[0]}
             for label, (_, tabs) in by_head.items()}
    report: dict[str, Any] = {
        "target": o.target, "prompts": spec, "chat": o.chat, "n_prompts": len(ids),
        "max_new_tokens": o.max_new_tokens, "width": o.width, "topk": o.topk,
        "adapters": {str(k): str(v[1]) for k, v in adapters.items()},
        "agreement": next(iter(agree.values())), "rows": []}
    if o.heads:
        report["heads"] = {label: {"setting": h.name if h else "", "agreement": agree[label],
                                   "exits": {str(layer): exit_head(whole, layer, h).describe()
                                             for layer in tabs[0]} if h else {}}
                           for label, (h, tabs) in by_head.items()}
    if o.cost_layers:
        report["costs"] = head_costs(whole, list(o.heads) or [Recovery(8, 1)],
                                     list(o.cost_layers))
    if o.no_replay:
        _finish(o, report, t0)
        return 0
    store = o.traces
    saved: dict[str, Any] = {}
    if store is not None and store.is_file():
        saved = json.loads(store.read_text(encoding="utf-8"))
        if saved.get("key") != name + str(o.max_new_tokens):
            saved = {}
    saved["key"] = name + str(o.max_new_tokens)
    widths = sorted({o.width, *o.normal_widths}, reverse=True)
    for src_name in o.sources.split(","):
        source = None
        for m in stage_counts:
            runs: dict[int, list[Any]] = {}
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
                runs[w] = saved[label]
            for hlabel, (_, tables) in by_head.items():
                _project_rows(report, o, src_name, m, bounds[m], widths, kappas, lags,
                              ids, tables, runs, hlabel)
    _finish(o, report, t0)
    return 0


def check_settings(o: RecoveryOptions, n_layers: int, vocab: int
                   ) -> dict[int, list[tuple[int, int]]]:
    """Each ``--stages`` count's layer bounds; ``--exit-layers`` / ``--cost-layers``
    within the model's layers and ``--kappas`` within its vocabulary; one line naming the
    fix otherwise."""
    try:
        bounds = {m: even_bounds(n_layers, m) for m in o.stages}
    except ValueError as e:
        raise TreepipeError(f"--stages: {e}") from None
    for flag, given in (("--exit-layers", o.exit_layers), ("--cost-layers", o.cost_layers)):
        if given and max(given) > n_layers:
            raise TreepipeError(f"{flag}: the model {o.target} has {n_layers} layers; give "
                                f"exit layers in [1, {n_layers}]")
    if max(o.kappas) > vocab:
        raise TreepipeError(f"--kappas: the model {o.target} has {vocab} tokens; give "
                            f"top-kappa values in [1, {vocab}]")
    return bounds


def _project_rows(report: dict[str, Any], o: RecoveryOptions, src_name: str, m: int,
                  bounds: list[tuple[int, int]], widths: list[int], kappas: list[int],
                  lags: list[int], ids: list[list[int]], tables: list[dict[int, list[list[int]]]],
                  saved: dict[int, list[Any]], hlabel: str) -> None:
    """The projection's rows for one exit head over the saved replays (every exit stage
    whose layer the head has, every width, kappa, lag and budget)."""
    runs: dict[int, list[Trace]] = {}
    for w in widths:
        traces = []
        for p, tab, d in zip(ids, tables, saved[w], strict=True):
            rp = replay_from_json(d)
            exits = {j: [tab[b][len(p) + v.index - 1] for v in rp.verifications]
                     for j, (_, b) in enumerate(bounds[:-1], start=1) if b in tab}
            traces.append(Trace(rp, exits))
        runs[w] = traces
    base_steps = sum(tr.replay.steps for tr in runs[o.width])
    for w in widths:
        for j, (_, layer) in enumerate(bounds[:-1], start=1):
            if layer not in tables[0]:
                continue
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
                        r["head"] = hlabel
                        report["rows"].append(r)


def _finish(o: RecoveryOptions, report: dict[str, Any], t0: float) -> None:
    """Write ``--json`` and print the tables."""
    report["seconds"] = time.time() - t0
    if o.json:
        o.json.parent.mkdir(parents=True, exist_ok=True)
        o.json.write_text(json.dumps(report) + "\n", encoding="utf-8")
    print_tables(report)


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
    if "heads" in report or "costs" in report:
        print_head_tables(report)
    if not report["rows"]:
        return
    first = report["rows"][0].get("head")
    rows = [r for r in report["rows"] if r.get("head") == first]
    if "heads" in report:
        print(f"\nThe projection with the first head ({first}):\n")
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


def print_head_tables(report: dict[str, Any]) -> None:
    """Markdown: each head's cost per node; its agreement with the final head per layer and
    kappa; the share of the baseline's misses its top-kappa holds per source, m and exit."""
    if report.get("costs"):
        print("| head | layer | nodes | ms per call, min | median | ms per node, min | "
              "median |\n|---|--:|--:|--:|--:|--:|--:|")
        for c in report["costs"]:
            print(f"| {c['head']} | {c['layer']} | {c['nodes']} | {c['ms_min']:.3f} | "
                  f"{c['ms_median']:.3f} | {c['ms_per_node_min']:.3f} | "
                  f"{c['ms_per_node_median']:.3f} |")
    heads = report.get("heads", {})
    if heads:
        kappas = sorted({int(k) for h in heads.values() for by in h["agreement"].values()
                         for k in by})
        print("\nAgreement with the final head's greedy token (top-κ holds it):\n")
        print("| head | layer | " + " | ".join(f"κ = {k}" for k in kappas) + " |")
        print("|---|--:|" + "--:|" * len(kappas))
        for label, h in heads.items():
            for layer, by in h["agreement"].items():
                print(f"| {label} | {layer} | " +
                      " | ".join(f"{by[str(k)]:.3f}" for k in kappas) + " |")
    rows = [r for r in report["rows"] if r.get("head") and r["lag"] == 1 and
            r["budget"] == "free" and r["normal_width"] == report["width"]]
    if rows:
        print("\nShare of the baseline's misses in the exit's top-κ, and the projected cut "
              "(lag 1, no limit / cap):\n")
        print("| head | source | m | exit stage (layer) | κ | misses | holds | caught | cut | "
              "cut, cap |\n|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        spare = {(r["head"], r["source"], r["stages"], r["exit_stage"], r["kappa"]): r
                 for r in report["rows"] if r.get("head") and r["lag"] == 1 and
                 r["budget"] == "spare" and r["normal_width"] == report["width"]}
        for r in rows:
            sp = spare.get((r["head"], r["source"], r["stages"], r["exit_stage"], r["kappa"]))
            print(f"| {r['head']} | {r['source']} | {r['stages']} | {r['exit_stage']} "
                  f"({r['exit_layer']}) | {r['kappa']} | {r['misses_base']} | "
                  f"{r['exit_holds']:.3f} | {r['caught_share']:.3f} | "
                  f"{100 * r['cut_vs_w']:.1f}% | "
                  + (f"{100 * sp['cut_vs_w']:.1f}% |" if sp else "— |"))


__all__ = ["RecoveryOptions", "measure_recovery", "exit_tables", "agreement", "print_tables",
           "print_head_tables", "head_costs", "head_label"]
