"""``treepipe timeline``: a Figure-12-style picture of one recorded request.

One row per device (the draft, then stages 1..m); time runs on the x axis in
*pipelined* milliseconds, i.e. with one device per stage, laid out with the
same per-step cost model as :meth:`protocol.scheduling.records.StepRecord.pipelined_s`:
every participant starts a step together, computes (blue), prunes (orange),
and after the slowest one (plus the verified-token broadcast) sends its
surviving outputs to the next device (green, drawn on the sender's row).  A
miss that flushes nodes in flight is a red line at the end of its step.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.lab.benchmarks.figures import pyplot, save
from orchestrator.lab.benchmarks.options import EngineOptions
from orchestrator.lab.benchmarks.simulator import result_from_dict, result_to_dict
from orchestrator.lab.benchmarks.sweeps import prompt_ids
from orchestrator.models.loading import EngineSpec, build_engine, check_device
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult

COLORS = {"compute": "#3b75af", "prune": "#ef8636", "transfer": "#3a923a", "draft": "#8c6bb1",
          "flush": "#d62728"}


def layout(res: GenerationResult) -> dict[str, Any]:
    """Bars per device row and flush times (ms) for a recorded request.

    Row 0 is the draft, row i the i-th stage.  Each bar is (start, length, kind).
    """
    m, link = res.stages, res.link
    rows: list[list[tuple[float, float, str]]] = [[] for _ in range(m + 1)]
    flushes, verifies = [], []
    t0 = 0.0
    for s in res.steps:
        start = t0
        if s.draft_s:
            rows[0].append((1e3 * t0, 1e3 * s.draft_s, "draft"))
            if s.draft_serial:  # a static tree is drafted before the stages start
                start = t0 + s.draft_s
        busy = [a + b for a, b in zip(s.stage_s, s.prune_s, strict=True)]
        for i in range(m):
            if s.stage_s[i]:
                rows[i + 1].append((1e3 * start, 1e3 * s.stage_s[i], "compute"))
            if s.prune_s[i]:
                rows[i + 1].append((1e3 * (start + s.stage_s[i]), 1e3 * s.prune_s[i], "prune"))
        if s.serial:
            compute_end = t0 + sum(busy) + s.draft_s
        elif s.draft_serial:
            compute_end = start + max(busy, default=0.0)
        else:
            compute_end = t0 + max(max(busy, default=0.0), s.draft_s)
        send = compute_end + (link.latency_s if s.verified and m > 1 else 0.0)
        for i, nbytes in enumerate(s.link_bytes):
            if nbytes:
                # link i leaves the draft (i = 0) or stage i; draw it on the sender's row
                rows[i].append((1e3 * send, 1e3 * link.cost(nbytes), "transfer"))
        end = t0 + s.pipelined_s(link)
        if s.verified:
            verifies.append(1e3 * compute_end)
        if s.flushed:
            flushes.append(1e3 * end)
        t0 = end
    return {"rows": rows, "flushes": flushes, "verifies": verifies, "total_ms": 1e3 * t0}


def plot_timeline(res: GenerationResult, path: Path, zoom: tuple[float, float] | None,
                  title: str) -> dict[str, Any]:
    """Write the picture: the whole request (left) and a zoomed window (right)."""
    plt = pyplot()
    from matplotlib.patches import Patch

    lay = layout(res)
    m = res.stages
    if zoom is None:
        # default window: a few steps either side of the first flush, or the start
        step_ms = lay["total_ms"] / max(len(res.steps), 1)
        centre = lay["flushes"][0] if lay["flushes"] else 6 * step_ms
        zoom = (max(0.0, centre - 6 * step_ms), centre + 6 * step_ms)
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * (m + 1) + 1.8),
                             gridspec_kw={"width_ratios": [3, 2]})
    names = ["draft"] + [f"stage {i + 1}" for i in range(m)]
    for ax, window in zip(axes, (None, zoom), strict=True):
        for r, bars in enumerate(lay["rows"]):
            for kind in ("compute", "prune", "transfer", "draft"):
                segs = [(a, b) for a, b, k in bars if k == kind]
                if segs:
                    ax.broken_barh(segs, (r - 0.38, 0.76), facecolors=COLORS[kind],
                                   linewidth=0)
        for f in lay["flushes"]:
            ax.axvline(f, color=COLORS["flush"], lw=1.2, ls="--")
        ax.set_yticks(range(m + 1), names)
        ax.invert_yaxis()
        ax.set_xlabel("pipelined time (ms)")
        ax.grid(axis="x", alpha=0.3)
        if window is not None:
            ax.set_xlim(*window)
            ax.set_title(f"zoom {window[0]:.0f}–{window[1]:.0f} ms", fontsize=9)
        else:
            ax.set_xlim(0, lay["total_ms"])
            ax.set_title(title, fontsize=9)
    handles = [Patch(color=COLORS[k], label=k) for k in ("draft", "compute", "prune",
                                                          "transfer")]
    handles.append(plt.Line2D([], [], color=COLORS["flush"], ls="--", label="flush (miss)"))
    axes[1].legend(handles=handles, fontsize=7, loc="upper right")
    save(fig, path)
    return {"total_ms": lay["total_ms"], "flushes": len(lay["flushes"]),
            "verified": len(lay["verifies"]), "steps": len(res.steps), "zoom_ms": list(zoom)}


def pick(results: list[tuple[GenerationResult, int]], method: str, source: str | None,
         prompt: int) -> GenerationResult:
    """The recorded run of (method, source) on prompt index ``prompt``."""

    for res, p in results:
        if res.method == method and p == prompt and (source is None or res.source == source):
            return res
    have = sorted({f"{r.method}/{r.source}@{p}" for r, p in results})
    raise TreepipeError(f"no recorded run of {method}/{source or '*'} on prompt {prompt}; the file "
                        f"has {', '.join(have[:12])}")




@dataclass(frozen=True)
class TimelineOptions(EngineOptions):
    records: Path | None
    method: str
    source: str | None
    prompt_index: int
    prompts: str
    max_new_tokens: int
    zoom: str | None
    out: Path


def timeline(o: TimelineOptions) -> int:
    """Draw the timeline of one recorded (or freshly generated) request."""

    zoom = None
    if o.zoom:
        try:
            lo, hi = (float(x) for x in o.zoom.split(":"))
        except ValueError:
            raise TreepipeError(f"--zoom must be START:END in ms, got {o.zoom!r}") from None
        if hi <= lo:
            raise TreepipeError(f"--zoom END must exceed START, got {o.zoom!r}")
        zoom = (lo, hi)
    if o.records is not None:

        if not o.records.is_file():
            raise TreepipeError(f"records file {o.records} not found; write one with treepipe "
                                "bench --records --out DIR")
        data = json.loads(o.records.read_text(encoding="utf-8"))
        runs = [(result_from_dict(d), int(d.get("prompt", 0))) for d in data["results"]]
        res = pick(runs, o.method, o.source, o.prompt_index)
    else:
        check_device(o.device)

        spec = EngineSpec(model=o.model, stages=o.stages, draft=o.draft,
                          draft_model=o.draft_model, width=o.width, topk=o.topk, dtype=o.dtype,
                          device=o.device, link_latency_us=o.link_latency_us,
                          link_gbps=o.link_gbps, draft_vocab=o.draft_vocab,
                          execution=o.execution, recovery=o.recovery,
                          quantize=o.quantize)
        engine, tok, _ = build_engine(spec)
        ids = prompt_ids(o.prompts, False, tok)[0]

        with torch.inference_mode():  # as in the sweeps: caches may grow mid-forward
            engine.generate(ids, 8, None, o.method, [])  # warm-up
            res = engine.generate(ids, o.max_new_tokens, None, o.method, [])
    o.out.mkdir(parents=True, exist_ok=True)
    title = (f"{res.method}/{res.source} m={res.stages} w={res.width} k={res.topk}: "
             f"{len(res.tokens)} tokens")
    info = plot_timeline(res, o.out / "timeline.png", zoom, title)
    (o.out / "timeline.json").write_text(
        json.dumps({**info, "run": result_to_dict(res)}) + "\n", encoding="utf-8")
    sys.stdout.write(f"{title}; {info['steps']} steps, {info['total_ms']:.1f} ms pipelined, "
                     f"{info['flushes']} flushes -> {o.out / 'timeline.png'}\n")
    return 0


__all__ = ["TimelineOptions", "timeline", "layout", "plot_timeline"]
