"""``treepipe tune``: pick the tree width w (and top-k k) by minimising Eq. (1).

For every candidate (w, k) the command runs SpecPipe on the calibration
prompts with this hardware, this target split and this token source, and
measures t_i(w) (each stage's busy time per step, stage 1's at least the
draft's, plus the step's communication) and P(w, k) (the level hit rate).
Eq. (1), with a miss costing m-1 refill steps as in our schedule and the
pipeline fill spread over a request, predicts the TBT; the smallest
prediction wins.  With ``--verify`` every candidate also runs on held-out
prompts, interleaved with the calibration prompts (so both see the same machine
speed), and the chosen candidate's measured held-out TBT is printed beside its
prediction.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.lab.benchmarks.figures import pyplot, save
from orchestrator.lab.benchmarks.options import RunOptions
from orchestrator.lab.benchmarks.sweeps import (
    _config,
    _setup_threads,
    _spec,
    _write,
    eq1_predict,
    int_list,
    prompt_ids,
    stage_busy,
    summarise,
)
from orchestrator.models.loading import build_engine
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult
from stages.speculation.engine import PipelineEngine

DEFAULT_WIDTHS = "1,2,4,8,16,32,48,64"
DEFAULT_TOPKS = "4,8,16"




def choose(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The candidate with the smallest Eq. (1) prediction (smaller w on a tie)."""
    return min(points, key=lambda p: (p["eq1_ms"], p["w"], p["k"]))


@dataclass(frozen=True)
class TuneOptions(RunOptions):
    widths: str
    topks: str
    verify: bool
    verify_prompts: str


def tune(o: TuneOptions) -> int:
    """Measure, predict, choose and (optionally) verify."""
    from tqdm import tqdm


    widths, topks = int_list(o.widths, "--widths"), int_list(o.topks, "--topks")
    threads = _setup_threads(o.device, o.threads)
    base, tok, _ = build_engine(_spec(o))
    if base.source is None:
        raise TreepipeError("tune needs a token source; pass --draft ngram|hybrid|layers:N|MODEL")
    ids = prompt_ids(o.prompts, o.chat, tok)
    verify_ids = None
    if o.verify:
        verify_ids = prompt_ids(o.verify_prompts, o.chat, tok)
    base.generate(ids[0], min(o.max_new_tokens, 16), None, "specpipe", [])  # warm-up
    grid = [(w, k) for k in topks for w in widths]
    engines = [PipelineEngine(base.shards, base.source, w, k, base.link,
                              recovery=base.recovery) for w, k in grid]
    runs: list[list[GenerationResult]] = [[] for _ in grid]
    held: list[list[GenerationResult]] = [[] for _ in grid]
    vids = verify_ids or []
    # inference mode: a KV cache that grows during a forward pass (a wide tree
    # outgrowing the draft's cache) holds inference tensors, which pruning outside
    # inference mode may not update in place
    with torch.inference_mode(), tqdm(total=len(grid) * (len(ids) + len(vids)), desc="tune",
                                      unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        # Interleaved: every candidate runs on a prompt before the next prompt, and the
        # held-out prompts run between the calibration prompts, so a drift in machine
        # speed during the tune hits every candidate and both prompt sets alike.
        for i in range(max(len(ids), len(vids))):
            for j, eng in enumerate(engines):
                if i < len(ids):
                    runs[j].append(eng.generate(ids[i], o.max_new_tokens, None, "specpipe", []))
                    bar.update()
                if i < len(vids):
                    held[j].append(eng.generate(vids[i], o.max_new_tokens, None, "specpipe",
                                                []))
                    bar.update()
    points = [summarise(r, eng) for r, eng in zip(runs, engines, strict=True)]
    for j, p in enumerate(points):
        if held[j]:
            h = summarise(held[j], engines[j])
            p["heldout"] = {k: h[k] for k in ("prompts", "decode_tokens", "hit_rate",
                                              "tbt_pipelined_ms", "eq1_ms")}
            p["heldout"]["rel_err"] = (p["eq1_ms"] - h["tbt_pipelined_ms"]) / h["tbt_pipelined_ms"]
    best = choose(points)
    report: dict[str, Any] = {
        "config": {**_config(o, threads), "widths": widths, "topks": topks,
                   "verify_prompts": o.verify_prompts if o.verify else None},
        "source": base.source.name,
        "choice": {"w": best["w"], "k": best["k"], "predicted_ms": best["eq1_ms"],
                   "hit_rate": best["hit_rate"]},
        "points": points,
    }
    if "heldout" in best:
        h = best["heldout"]
        # the prediction's step costs with the held-out prompts' own hit rate: how much
        # of the held-out error is P differing between the prompt sets
        j = points.index(best)
        p_ho = 1e3 * eq1_predict(stage_busy(runs[j]), h["hit_rate"], engines[j].m,
                                 h["decode_tokens"] / h["prompts"])
        report["verify"] = {**h, "heldout_p_predicted_ms": p_ho,
                            "heldout_p_rel_err": (p_ho - h["tbt_pipelined_ms"])
                            / h["tbt_pipelined_ms"]}
    _write(o.out, "tune", report)
    plot_tune(report, o.out / "tune.png")
    sys.stdout.write(tune_markdown(report))
    return 0


def tune_markdown(report: dict[str, Any]) -> str:
    """The candidates table and the choice line."""
    ho = all("heldout" in p for p in report["points"])
    lines = ["| w | k | hit rate P | max t_i (ms) | draft (ms) | Eq.(1) TBT (ms) | "
             "measured TBT pipelined (ms) |" + (" held-out P | held-out TBT (ms) |" if ho else ""),
             "|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|" if ho else "")]
    for p in sorted(report["points"], key=lambda p: (p["k"], p["w"])):
        lines.append(f"| {p['w']} | {p['k']} | {p['hit_rate']:.2f} | {max(p['t_i_ms']):.2f} | "
                     f"{p['draft_ms']:.2f} | {p['eq1_ms']:.2f} | {p['tbt_pipelined_ms']:.2f} |"
                     + (f" {p['heldout']['hit_rate']:.2f} | "
                        f"{p['heldout']['tbt_pipelined_ms']:.2f} |" if ho else ""))
    c = report["choice"]
    lines += ["", f"Choice: w = {c['w']}, k = {c['k']} (source {report['source']}), predicted "
              f"TBT {c['predicted_ms']:.2f} ms."]
    v = report.get("verify")
    if v:
        cfg = report["config"]
        lines += [
            "",
            "| check at the chosen (w, k) | prompts | hit rate | measured TBT pipelined (ms) | "
            "predicted (ms) | error |", "|---|---|--:|--:|--:|--:|",
            f"| calibration prompts (the tune's own runs) | {cfg['prompts']} | "
            f"{c['hit_rate']:.2f} | {_measured(report, c):.2f} | {c['predicted_ms']:.2f} | "
            f"{100 * (c['predicted_ms'] / _measured(report, c) - 1):+.1f}% |",
            f"| held-out prompts, interleaved with the tune | {cfg['verify_prompts']} | "
            f"{v['hit_rate']:.2f} | {v['tbt_pipelined_ms']:.2f} | {c['predicted_ms']:.2f} | "
            f"{100 * v['rel_err']:+.1f}% |",
            f"| held-out, Eq.(1) with their own P | {cfg['verify_prompts']} | "
            f"{v['hit_rate']:.2f} | {v['tbt_pipelined_ms']:.2f} | "
            f"{v['heldout_p_predicted_ms']:.2f} | {100 * v['heldout_p_rel_err']:+.1f}% |",
        ]
    return "\n".join(lines) + "\n"


def _measured(report: dict[str, Any], c: dict[str, Any]) -> float:
    p = next(p for p in report["points"] if (p["w"], p["k"]) == (c["w"], c["k"]))
    return float(p["tbt_pipelined_ms"])


def plot_tune(report: dict[str, Any], path: Path) -> None:
    """Predicted (Eq. 1) and measured TBT against w, one colour per k."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k in sorted({p["k"] for p in report["points"]}):
        pts = sorted((p for p in report["points"] if p["k"] == k), key=lambda p: p["w"])
        line, = ax.plot([p["w"] for p in pts], [p["eq1_ms"] for p in pts], ls="--",
                        label=f"Eq.(1) k={k}")
        ax.plot([p["w"] for p in pts], [p["tbt_pipelined_ms"] for p in pts], marker="o",
                ms=3, color=line.get_color(), label=f"measured k={k}")
    c = report["choice"]
    ax.plot([c["w"]], [c["predicted_ms"]], marker="*", ms=14, color="k", ls="",
            label=f"choice w={c['w']} k={c['k']}")
    if report.get("verify"):
        ax.plot([c["w"]], [report["verify"]["tbt_pipelined_ms"]], marker="x", ms=10,
                color="red", ls="", label="held-out measured")
    ax.set(xlabel="tree width w", ylabel="TBT pipelined (ms)", ylim=(0, None),
           title=f"treepipe tune, draft {report['source']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def load_tune(path: Path) -> dict[str, Any]:
    """A tune.json written by ``treepipe tune``."""

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["points"], data["source"]  # noqa: B018 - shape check
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TreepipeError(f"cannot read tune results from {path} ({e}); run treepipe tune "
                            "--out DIR first") from None
    return data


__all__ = ["TuneOptions", "choose", "tune", "load_tune", "tune_markdown"]
