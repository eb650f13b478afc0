"""``treepipe chaos``: requests while random processes of a local pipeline are killed.

A bounded, seeded series of requests (greedy and seeded sampling in turn) runs
through ``treepipe up``'s real processes.  During each request, with probability
``kill_prob``, one process chosen at random (a stage, the draft, the gateway or
``redis-server``) gets SIGKILL at a random step (once the client holds a random
number of the request's tokens).  Every request must either
finish with exactly the tokens of plain ``ar`` decoding or fail with a clear
gRPC error within its deadline; the tokens a failed request streamed must still
be a prefix of ``ar``'s (never silently wrong).  Afterwards the pipeline must
serve an exact request again.  The figures (requests, kills by kind, exact,
failed cleanly, wrong) are printed and returned.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import torch

from orchestrator.deploy.launcher import (
    RESTART_LIMIT,
    RESTART_WINDOW_S,
    down_detached,
    load_planned,
    read_state,
    up_detached,
)
from orchestrator.models.loading import torch_dtype
from orchestrator.models.registry import resolve_model
from orchestrator.serving.client import Client
from protocol.errors import TreepipeError
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine

KINDS = ("stage", "draft", "gateway", "redis")
SERVING_WAIT_S = 180.0  # a killed Redis or gateway comes back within seconds


@dataclass
class Outcome:
    """One request of the series."""

    index: int
    sampled: bool
    killed: str | None  # the process killed during it, if any
    result: str  # exact, failed, wrong
    tokens: int
    seconds: float
    error: str = ""


@dataclass
class ChaosReport:
    """What ``treepipe chaos`` measured."""

    seed: int
    requests: int
    kills: dict[str, int] = field(default_factory=dict)
    exact: int = 0
    failed_cleanly: int = 0
    wrong: int = 0
    serves_after: bool = False
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No request was silently wrong and the pipeline serves again."""
        return self.wrong == 0 and self.serves_after


def _victims(name: str) -> dict[str, list[tuple[str, int]]]:
    """(process name, pid) of every process of a kind, as the supervisor last wrote them."""
    st = read_state(name)
    if not st:
        raise TreepipeError(f"pipeline {name!r} stopped during the chaos run; see its "
                            "supervisor.log")
    procs = st.procs
    return {"stage": [(k, p) for k, p in procs.items() if k.startswith("stage")],
            "draft": [("draft", procs["draft"])], "gateway": [("gateway", procs["gateway"])],
            "redis": [("redis", st.redis_pid)] if st.redis_pid else []}


def _within_budget(history: list[float], now: float) -> bool:
    """Whether one more kill keeps the process under the supervisor's restart budget.

    More than RESTART_LIMIT deaths in RESTART_WINDOW_S is a crash loop, which the
    supervisor stops on purpose (docs/reliability.md); the chaos run tests recovery,
    so it stays one kill under that rate.
    """
    recent = [t for t in history if now - t < RESTART_WINDOW_S]
    return len(recent) < RESTART_LIMIT - 1


def _wait_serving(endpoint: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with Client(endpoint) as c:
                if c.health("treepipe.v1.Inference") == "SERVING":
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TreepipeError(f"the pipeline at {endpoint} did not serve again within "
                        f"{deadline_s:.0f} s")


def _request(endpoint: str, ids: list[int], n: int, sp: SamplingParams, deadline_s: float,
             out: dict[str, Any]) -> None:
    got: list[int] = out.setdefault("tokens", [])  # the killer watches it grow
    try:
        with Client(endpoint) as c:
            for chunk in c.stream(deadline_s, prompt_ids=ids, max_tokens=n, ignore_eos=True,
                                  temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed):
                got += list(chunk.token_ids)
    except grpc.RpcError as e:
        out["error"] = f"{e.code().name}: {e.details()}"


def run_chaos(name: str, endpoint: str, engine: PipelineEngine, prompts: list[list[int]],
              max_new: int, seed: int, kill_prob: float, deadline_s: float,
              kinds: Sequence[str] = KINDS, log: Any = sys.stderr) -> ChaosReport:
    """Run the series against the running local pipeline ``name`` at ``endpoint``,
    killing processes of ``kinds``."""
    rng = random.Random(seed)
    rep = ChaosReport(seed, len(prompts), {k: 0 for k in KINDS})
    history: dict[str, list[float]] = {}  # kill times per process name
    for i, ids in enumerate(prompts):
        sampled = i % 2 == 1
        sp = SamplingParams(0.8, 0.95, 0, seed + i) if sampled else SamplingParams()
        want = engine.generate(ids, max_new, sp, method="ar").tokens
        _wait_serving(endpoint, SERVING_WAIT_S)
        out: dict[str, Any] = {}
        t0 = time.monotonic()
        th = threading.Thread(target=_request, args=(endpoint, ids, max_new, sp, deadline_s, out))
        th.start()
        killed = None
        if rng.random() < kill_prob:
            kind = rng.choice(list(kinds))
            # at a random step (in the first half, which a fast request cannot outrun):
            # once the client holds that many tokens
            at = rng.randint(1, max(1, max_new // 2))
            while th.is_alive() and len(out.get("tokens", [])) < at:
                time.sleep(0.002)
            now = time.monotonic()
            procs = [(n, p) for n, p in _victims(name)[kind]
                     if _within_budget(history.get(n, []), now)]
            if th.is_alive() and procs:
                who, pid = rng.choice(procs)
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed = kind
                    rep.kills[kind] += 1
                    history.setdefault(who, []).append(now)
                except ProcessLookupError:
                    pass
        th.join(deadline_s + 30)
        secs = time.monotonic() - t0
        got, err = out.get("tokens", []), out.get("error", "")
        if th.is_alive():
            result, err = "wrong", "the client did not return within its deadline"
        elif not err and got == want:
            result = "exact"
        elif err and got == want[:len(got)] and secs <= deadline_s + 30:
            result = "failed"
        else:
            result = "wrong"
        rep.exact += result == "exact"
        rep.failed_cleanly += result == "failed"
        rep.wrong += result == "wrong"
        rep.outcomes.append(Outcome(i, sampled, killed, result, len(got), round(secs, 2), err))
        print(f"request {i + 1}/{len(prompts)} {'sampled' if sampled else 'greedy'}: "
              f"{result}{f' (killed {killed})' if killed else ''}{f' [{err}]' if err else ''}",
              file=log, flush=True)
    # the pipeline serves again: one more request with no kill must be exact
    _wait_serving(endpoint, SERVING_WAIT_S)
    out = {}
    _request(endpoint, prompts[0], max_new, SamplingParams(), deadline_s, out)
    rep.serves_after = not out.get("error") and out.get("tokens") == engine.generate(
        prompts[0], max_new, SamplingParams(), method="ar").tokens
    return rep


@dataclass(frozen=True)
class ChaosOptions:
    """``treepipe chaos``'s options, one field per flag."""

    file: str
    requests: int
    seed: int
    kill_prob: float
    kinds: str
    max_new_tokens: int
    deadline: float
    json: bool


def chaos_series(o: ChaosOptions) -> int:
    """``treepipe chaos -f MANIFEST``: up, the seeded series with kills, down."""
    if not 0.0 <= o.kill_prob <= 1.0:
        raise TreepipeError(f"--kill-prob {o.kill_prob} is not a probability; use 0..1")
    kinds = [k.strip() for k in o.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise TreepipeError(f"--kinds {o.kinds!r}: use a comma list of {', '.join(KINDS)}")
    if not (math.isfinite(o.deadline) and o.deadline > 0):  # inf would overflow a join
        raise TreepipeError(f"--deadline {o.deadline}: give a finite positive number of "
                            f"seconds")
    planned = load_planned(o.file)
    m = planned.manifest  # load_planned refused anything but backend: local
    folder = resolve_model(m.spec.model.source)
    args = load_model_args(folder)
    rng = random.Random(o.seed)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(rng.randint(4, 24))]
               for _ in range(o.requests)]
    torch.set_num_threads(1)
    engine = PipelineEngine([load_shard(folder, 0, args.n_layers,
                                        torch_dtype(m.spec.model.dtype))])
    endpoint = up_detached(o.file)
    try:
        rep = run_chaos(m.metadata.name, endpoint, engine, prompts, o.max_new_tokens, o.seed,
                        o.kill_prob, o.deadline, kinds)
    finally:
        down_detached(o.file)
    summary = {k: v for k, v in asdict(rep).items() if k != "outcomes"}
    if o.json:
        print(json.dumps({**summary, "ok": rep.ok, "outcomes": [asdict(o)
                                                                for o in rep.outcomes]}))
    else:
        kills = ", ".join(f"{k} {v}" for k, v in rep.kills.items())
        print(f"chaos seed {rep.seed}: {rep.requests} requests, kills: {kills}; exact "
              f"{rep.exact}, failed cleanly {rep.failed_cleanly}, wrong {rep.wrong}; serves "
              f"again afterwards: {'yes' if rep.serves_after else 'NO'}")
    return 0 if rep.ok else 1



