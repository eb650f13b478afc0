"""Real multi-process pipelines for ``treepipe bench --runtime``.

For every ``pp`` and ``specpipe`` row of a benchmark, one local pipeline
(``treepipe up`` machinery: Redis, the draft service, one process per stage,
the gateway) runs the same model, stage count, width and token source as the
in-process engine.  All of them are started before the first prompt, so the
benchmark can interleave the runtime and the engine per prompt; each request
goes through the gateway's gRPC API, and its wall-clock TBT is what the client
saw.  The workers' heartbeat ``stats`` (protocol/sync/heartbeat.py), read before
and after each request, say where each worker's wall time went.

``ar`` and ``specinfer`` have no runtime mode: the runtime's non-speculative
schedule is ``pp`` (each token through every stage in turn), and SpecInfer's
whole-tree passes have no draft-service protocol.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.deploy.launcher import down_detached, running_state, state_sync, up_detached
from orchestrator.deploy.manifest import API_VERSION, KIND
from orchestrator.serving.client import Client
from protocol.errors import TreepipeError
from protocol.sync.heartbeat import StepStats
from protocol.sync.synchroniser import Synchroniser

RUNTIME_METHODS = ("pp", "specpipe")
# a worker writes its heartbeat once it has handled a request's final verdict
SETTLE_S = 10.0


@dataclass
class RuntimeRun:
    """One request through a real pipeline."""

    tokens: list[int]
    ttft_ms: float
    tbt_ms: float  # mean client-side time between tokens after the first
    stats: dict[str, StepStats]  # per worker: what this request added

    @property
    def decode_s(self) -> float:
        """Wall time from the prefill step's verdict to the last one.

        Every moment of a worker in that span is compute, barrier, input wait or
        sending, so the sum is its wall clock; the workers step together, so they
        agree to within a verdict's delivery (the largest is taken).  The client's
        first gap also holds step 0's barrier, which waits for every worker's
        prefill (a replay source computes its continuation there): that is TTFT-like
        time, which the engine's TBT leaves out too.
        """
        return max((s.compute_s + s.barrier_s + s.input_s + s.send_s
                    for s in self.stats.values()), default=0.0)


@dataclass
class _Pipeline:
    name: str
    manifest: Path
    endpoint: str
    sync: Synchroniser
    workers: list[str] = field(default_factory=list)


def pipeline_manifest(name: str, model: str, dtype: str, stages: int, source: str | None,
                      width: int, topk: int, transport: str, max_new: int,
                      recovery: str = "none", quantize: str = "none") -> dict[str, Any]:
    """The manifest of one benchmarked row: free ports, one thread per worker; the
    row's miss recovery (a pipeline without a source has no tree to recover) and the
    stages' weights (``quantize``, model.quantize)."""
    draft: dict[str, Any] = {"source": source or "none", "width": width, "topk": topk}
    if source and recovery != "none":
        draft["recovery"] = recovery
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
            "spec": {"backend": "local",
                     "model": {"source": model, "dtype": dtype, "quantize": quantize},
                     "stages": {"count": stages, "device": {"type": "cpu"}},
                     "draft": draft,
                     "transport": transport, "synchronizer": {"mode": "embedded"},
                     "gateway": {"port": 0, "httpPort": 0},
                     "limits": {"contextLength": 2048, "maxNewTokens": max(max_new, 16)}}}


def worker_stats(sync: Synchroniser, workers: list[str]) -> dict[str, tuple[StepStats, Any]]:
    """Each worker's cumulative step stats and the request it is on (None: idle), from
    its last heartbeat."""
    beats = sync.heartbeats(workers)
    out = {}
    for w in workers:
        s = beats[w].stats if w in beats else None
        if s is None:
            raise TreepipeError(f"worker {w} reports no step stats; is it an older treepipe?")
        out[w] = (s, beats[w].req)
    return out


def settled_delta(sync: Synchroniser, workers: list[str],
                  before: dict[str, tuple[StepStats, Any]]) -> dict[str, StepStats]:
    """What each worker did since ``before``, once the heartbeats have caught up (every
    worker at the same step count, above ``before``'s, and idle; at most SETTLE_S).

    Above: heartbeats written before the measured requests reached a worker look idle
    too, with no steps since ``before``; every caller measures requests that decode.
    """
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = worker_stats(sync, workers)
        steps = {after[w][0].steps - before[w][0].steps for w in workers}
        if (len(steps) == 1 and min(steps) > 0 and all(after[w][1] is None for w in workers)) \
                or time.monotonic() > deadline:
            return {w: after[w][0].minus(before[w][0]) for w in workers}
        time.sleep(0.05)


class LocalPipelines:
    """One running local pipeline per (method, source) row; stopped on exit."""

    def __init__(self, model: str, dtype: str, stages: int, width: int, topk: int,
                 transport: str, max_new: int, recovery: str = "none", quantize: str = "none"):
        self.cfg = dict(model=model, dtype=dtype, stages=stages, width=width, topk=topk,
                        transport=transport, max_new=max_new, recovery=recovery,
                        quantize=quantize)
        self.dir = Path(tempfile.mkdtemp(prefix="treepipe-bench-"))
        self.pipes: dict[str | None, _Pipeline] = {}

    def start(self, sources: list[str | None], log: Any = sys.stderr) -> None:
        """Bring up one pipeline per source (None: ``pp``), all before the first request."""
        for i, src in enumerate(sources):
            name = f"bench-rt-{i}"
            path = self.dir / f"{name}.yaml"
            path.write_text(yaml.safe_dump(pipeline_manifest(name, source=src, **self.cfg)))
            print(f"starting pipeline {name} ({src or 'pp'})", file=log, flush=True)
            pipe = _Pipeline(name, path, up_detached(str(path)),
                             state_sync(running_state(name), name))
            pipe.workers = pipe.sync.participants()
            self.pipes[src] = pipe

    def run(self, source: str | None, ids: list[int], max_new: int,
            ignore_eos: bool) -> RuntimeRun:
        """One greedy request on the row's pipeline, with what each worker spent on it."""
        pipe = self.pipes[source]
        before = worker_stats(pipe.sync, pipe.workers)
        with Client(pipe.endpoint) as c:
            out = c.generate(prompt_ids=ids, max_tokens=max_new, temperature=0.0,
                             ignore_eos=ignore_eos)
        return RuntimeRun(out.tokens, out.ttft_ms, out.tbt_ms,
                          settled_delta(pipe.sync, pipe.workers, before))

    def close(self) -> None:
        """Stop every pipeline started."""
        for pipe in self.pipes.values():
            pipe.sync.close()
            down_detached(str(pipe.manifest))

    def __enter__(self) -> LocalPipelines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def breakdown(runs: list[RuntimeRun]) -> dict[str, Any]:
    """Per-step means of each worker's time over ``runs``, and the critical path.

    The workers step in lockstep, so each one's compute + barrier + input + send
    per step is about the wall time of a step; the slowest worker's compute is what
    the modelled (pipelined) time counts, and the rest of a step is overhead.
    """
    total: dict[str, StepStats] = {}
    for r in runs:
        for w, s in r.stats.items():
            total[w] = total.get(w, StepStats()).plus(s)
    return per_step(total)


def per_step(total: dict[str, StepStats]) -> dict[str, Any]:
    """Per-step means of each worker's time in ``total``, and the critical path."""
    per_worker = {}
    for w, s in total.items():
        n = max(s.steps, 1)
        per_worker[w] = {"steps": s.steps, "compute_ms": 1e3 * s.compute_s / n,
                         "barrier_ms": 1e3 * s.barrier_s / n, "input_ms": 1e3 * s.input_s / n,
                         "send_ms": 1e3 * s.send_s / n, "bytes_per_step": s.sent_bytes / n,
                         "nodes_per_step": s.nodes / n}
    if not per_worker:
        return {"workers": {}}
    crit = max(per_worker, key=lambda w: per_worker[w]["compute_ms"])
    c = per_worker[crit]
    step_ms = c["compute_ms"] + c["barrier_ms"] + c["input_ms"] + c["send_ms"]
    # the draft service's levels: how wide they were, on average (fixed or adaptive)
    levels = sum(s.levels for s in total.values())
    mean_width = sum(s.widths for s in total.values()) / levels if levels else None
    return {"workers": per_worker, "critical": crit, "step_ms": step_ms,
            "compute_ms": c["compute_ms"], "overhead_ms": step_ms - c["compute_ms"],
            "mean_width": mean_width}
