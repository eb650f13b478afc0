"""Lockstep probe: an earlier ``AdaptiveWidth.choose`` ("old", from the file OLD_WIDTH,
e.g. ``git show 4d779b9:stages/speculation/width.py > old.py``) beside the current one,
in the bench's groups; every row goes to PROBE_OUT as a JSON line. A measurement
script, not part of treepipe: run it as the bench, e.g.
OLD_WIDTH=old.py PROBE_OUT=rows.jsonl python probe_old_policy.py bench ... --widths
2,4,8,adaptive
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import orchestrator.benchmarks.bench as bench
import stages.speculation.batch as batch
import stages.speculation.width as width_module

_spec = importlib.util.spec_from_file_location("old_width", os.environ["OLD_WIDTH"])
assert _spec is not None and _spec.loader is not None
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)
old.StepCost = width_module.StepCost  # its isinstance checks see the runs' cost model


class Old(width_module.AdaptiveWidth):
    choose = old.AdaptiveWidth.choose


OUT = os.environ["PROBE_OUT"]
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
    extra = [bench.BatchConfig(ada[0].engine, "specpipe", "adaptive")] if ada else []
    QUEUE[:] = [width_module.AdaptiveWidth] * len(ada) + [Old] if ada else []
    rows = orig(configs + extra, b, prompts, n_new, stop, *args, **kw)
    labels = [str(c.width) for c in configs] + (["old"] if ada else [])
    with open(OUT, "a") as f:
        for label, r in zip(labels, rows, strict=True):
            f.write(json.dumps({"B": b, "policy": label, **{k: r[k] for k in (
                "throughput_tok_s", "tbt_mean_ms", "mean_width", "steps", "tokens")}}) + "\n")
    return rows[:len(configs)]


bench.concurrency_rows = probe_rows

if __name__ == "__main__":
    from orchestrator.cli.main import main
    sys.exit(main(sys.argv[1:]))
