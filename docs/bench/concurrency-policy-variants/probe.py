"""Lockstep probe: extra AdaptiveWidth variants in the same groups as the bench's rows.

A measurement script, not part of treepipe: run it as the bench, e.g.
PROBE_VARIANTS=pooled,uniform PROBE_OUT=rows.jsonl python probe.py bench ... --widths
1,2,4,8,adaptive; each group at a B gets one extra adaptive run per variant, stepped
in lockstep with the others, and every row goes to PROBE_OUT as a JSON line.  The
variant ``old`` is an earlier ``AdaptiveWidth``'s methods from the file OLD_WIDTH,
e.g.
``git show 4d779b9:stages/speculation/width.py > old.py`` (the scan before the best
admissible move).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import orchestrator.benchmarks.bench as bench
import stages.speculation.batch as batch
import stages.speculation.width as width_module
from stages.speculation.width import AdaptiveWidth

OUT = os.environ.get("PROBE_OUT", "/work/scratch/probe/rows.jsonl")
VARIANTS = os.environ.get("PROBE_VARIANTS", "pooled,uniform").split(",")


def make_setting(name: str, value: float):
    """AdaptiveWidth with the width module's constant ``name`` (e.g. PRIOR, the
    verifications the pooled rate weighs in a request's own, or RECOVERY_PRIOR, the
    misses the prior share of recovered ones weighs) set to ``value`` while it chooses."""
    class Setting(AdaptiveWidth):
        def choose(self, rids):
            saved = getattr(width_module, name)
            setattr(width_module, name, value)
            try:
                return super().choose(rids)
            finally:
                setattr(width_module, name, saved)
    return Setting


class Pooled(AdaptiveWidth):
    def rate(self, rid, w):
        return self.pooled[w]


class Uniform(AdaptiveWidth):
    """One width for every request: the best uniform choice by the same score."""

    def choose(self, rids):
        g = {r: {x: self.goodput(self.rate(r, x)) for x in self.widths} for r in rids}
        lv = {r: {x: self.level_nodes(r, x) for x in self.widths} for r in rids}
        cur = self.current.get("__u", 1)

        def sc(x):
            n = self.nodes_of(sum(lv[r][x] for r in rids), 0 if x else len(rids))
            t = self.cost(n, len(rids))
            return sum(g[r][x] for r in rids) / t, n
        best, here = sc(cur)
        for x in self.widths:
            s, n = sc(x)
            if s > best * (1 + (self.widen_margin if n > here else 1e-9)):
                cur, best, here = x, s, n
        self.current["__u"] = cur
        w = dict.fromkeys(rids, cur)
        self.chosen.extend(w.values())
        return w


class AlikePooled(AdaptiveWidth):
    """Alike requests priced at the pooled rates (the alike test cannot tell them apart,
    and the pooled estimate has the longer memory); unlike ones at their own."""

    def choose(self, rids):
        if len(rids) > 1 and self.alike(rids):
            self.rate = lambda rid, w: self.pooled[w]  # type: ignore[method-assign]
        try:
            return super().choose(rids)
        finally:
            self.__dict__.pop("rate", None)


def make_hybrid(h: float):
    class Hybrid(AdaptiveWidth):
        """Per-request widths only when they beat the best common width by ``h``."""

        def choose(self, rids):
            w = super().choose(rids)
            self.chosen[-len(rids):] = []
            g = {r: {x: self.goodput(self.rate(r, x)) for x in self.widths} for r in rids}
            lv = {r: {x: self.level_nodes(r, x) for x in self.widths} for r in rids}

            def sc(ws):
                level = sum(lv[r][x] for r, x in ws.items())
                idle = sum(1 for x in ws.values() if not x)
                t = self.cost(self.nodes_of(level, idle), len(rids))
                good = sum(g[r][x] for r, x in ws.items())
                return good / t if t > 0 else good
            if len(set(w.values())) > 1:
                s = sc(w)
                best_u = max(self.widths, key=lambda x: sc(dict.fromkeys(rids, x)))
                u = dict.fromkeys(rids, best_u)
                if s < sc(u) * (1 + h):
                    w = u
            self.current.update(w)
            self.chosen.extend(w.values())
            return w
    return Hybrid


def load_old(path: str) -> type:
    """AdaptiveWidth with the methods of the width module in ``path``."""
    spec = importlib.util.spec_from_file_location("old_width", path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    old.StepCost = width_module.StepCost  # its isinstance checks see the runs' cost model

    # every method but __init__ (the instance is made by the current class, then
    # swapped): its choice, its pricing of the hit rates and of a level's nodes
    methods = {k: v for k, v in vars(old.AdaptiveWidth).items()
               if callable(v) and k != "__init__"}
    return type("Old", (AdaptiveWidth,), methods)


CLASSES = {"base": AdaptiveWidth, "pooled": Pooled, "uniform": Uniform,
           "alikepooled": AlikePooled}
if "old" in VARIANTS:
    CLASSES["old"] = load_old(os.environ["OLD_WIDTH"])
for v in VARIANTS:
    if v.startswith("prior"):
        CLASSES[v] = make_setting("PRIOR", float(v[5:]))
    if v.startswith("recovery"):
        CLASSES[v] = make_setting("RECOVERY_PRIOR", float(v[8:]))
    if v.startswith("hybrid"):
        CLASSES[v] = make_hybrid(float(v[6:]))
QUEUE: list[type] = []


_init = batch.BatchRun.__init__


def _patched(self, *a, **k):
    _init(self, *a, **k)
    if self.adaptive is not None and QUEUE:
        self.adaptive.__class__ = QUEUE.pop(0)


batch.BatchRun.__init__ = _patched
orig = bench.concurrency_rows


def probe_rows(configs, b, prompts, n_new, stop, *args, **kw):
    configs = list(configs)
    ada = [c for c in configs if c.width == "adaptive"]
    extra = ([bench.BatchConfig(ada[0].engine, "specpipe", "adaptive") for _ in VARIANTS]
             if ada else [])
    QUEUE[:] = ([AdaptiveWidth] * len(ada)) + [CLASSES[v] for v in VARIANTS] if ada else []
    rows = orig(configs + extra, b, prompts, n_new, stop, *args, **kw)
    with open(OUT, "a") as f:
        labels = [str(c.width) for c in configs] + (VARIANTS if ada else [])
        for label, r in zip(labels, rows, strict=True):
            f.write(json.dumps({"B": b, "policy": label, **{k: r[k] for k in (
                "throughput_tok_s", "tbt_mean_ms", "tbt_p99_ms", "mean_width", "steps", "tokens",
                "hit_rate")}}) + "\n")
    return rows[:len(configs)]


bench.concurrency_rows = probe_rows

if __name__ == "__main__":
    from orchestrator.cli.main import main
    sys.exit(main(sys.argv[1:]))
