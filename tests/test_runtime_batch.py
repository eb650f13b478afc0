"""Many requests at once through real multi-process pipelines (SpecPipe-DB in the runtime).

A mixed load (different prompts, lengths, stop ids, greedy and seeded sampling,
arrivals at different steps, one request cancelled mid-way) runs through real
stage workers and a real draft service over both transports, with an n-gram
source and with a draft model expanding the batch packed; every request gets
exactly its own plain autoregressive tokens, and the workers step the requests
together (fewer barriers than the requests' steps added up).  A stage SIGKILLed
under load comes back and every request still finishes with its own tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.lab.benchmarks.runtime_pipelines import settled_delta, worker_stats
from orchestrator.models.loading import load_draft_model
from orchestrator.serving.runner import SpecStats
from protocol.scheduling.width import AdaptiveWidth
from protocol.sync.heartbeat import StepStats
from stages.model.sampling import SamplingParams
from stages.speculation.batch import BatchRun, Request
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import HybridSource, NgramSource, TokenSource
from tests.runtime_harness import Arrivals, Pipeline, tiny_model_folder
from tests.tiny_models import PROMPT, TARGET, target_shards

SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 11}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@functools.cache
def _engine() -> PipelineEngine:
    return PipelineEngine(target_shards(1))


def ar(prompt: list[int], n: int, params: dict | None = None,
       stop_ids: tuple[int, ...] = ()) -> list[int]:
    sp = SamplingParams(**(params or {}))  # type: ignore[arg-type]
    return _engine().generate(prompt, n, sp, method="ar", stop_ids=stop_ids).tokens


@dataclass
class Req:
    """One request of a mixed load: what to send, and when."""

    name: str
    prompt: list[int]
    max_new: int
    params: dict = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()
    after: tuple[str, int] | None = None  # submit once that request has n tokens
    cancel_at: int = 0  # cancel itself once it has this many tokens (0: never)
    chunk: int = 0  # prompt tokens prefilled per step (0: all in one step)
    # submitted by that request's thread just before its own, so both wait to join at
    # the same barrier, in that order (this one's thread only collects its tokens)
    by: str = ""
    got: list[int] | None = None
    rid: str = ""


def run_load(p: Pipeline, reqs: list[Req], at: tuple[str, int, Callable[[], None]] | None = None,
             timeout_s: float = 120.0) -> None:
    """Run ``reqs`` at once (``after`` staggers arrivals), each in its own thread.

    ``at = (name, n, fn)`` calls ``fn`` once request ``name`` has ``n`` tokens (a kill).
    """
    arrivals = Arrivals(reqs)
    triggers: dict[str, list[tuple[int, Callable[[], None]]]] = {r.name: [] for r in reqs}
    if at is not None:
        triggers[at[0]].append((at[1], at[2]))
    for r in reqs:
        r.rid = f"{r.name}-{time.monotonic_ns() % 10**9}"
    riders = {r.by: r for r in reqs if r.by}
    submitted = {r.name: threading.Event() for r in riders.values()}

    def one(r: Req) -> None:
        sync = p.sync()
        hooks = list(triggers[r.name])
        if r.cancel_at:
            hooks.append((r.cancel_at, lambda: sync.cancel(r.rid, "client")))

        def on(n: int) -> None:
            arrivals.progress(r.name, n)
            for k, fn in hooks:
                if k == n:
                    fn()

        if r.by:
            assert submitted[r.name].wait(timeout_s), f"{r.by} never submitted {r.name}"
            r.got = p.collect(r.rid, timeout_s, on_token=on)
            return
        if r.name in riders:
            o = riders[r.name]
            sync.submit(o.rid, o.prompt, o.params, o.max_new, list(o.stop_ids), len(reqs),
                        o.chunk)
            submitted[o.name].set()
        r.got = p.generate(r.prompt, r.max_new, r.params, r.stop_ids, timeout_s,
                           slots=len(reqs), rid=r.rid, on_token=on, chunk=r.chunk)

    arrivals.run(reqs, one, timeout_s)


def mixed_load() -> list[Req]:
    greedy = ar(PROMPT[2:], 50)
    return [
        Req("a", PROMPT, 40, chunk=6),  # 20 prompt tokens: 4 chunks, 6 prefill steps
        Req("b", [7, 7, 7, 7, 1, 2, 7, 7, 7], 30, SAMPLED),
        # join while the others decode, their prompts in chunks beside their steps: f
        # first (4, 4, 3 rows), then c starts in the row f's last chunk leaves (1, then
        # 4, 4, 4, 4, 1)
        Req("c", PROMPT[2:], 50, stop_ids=(greedy[20],), after=("a", 3), chunk=4),
        Req("f", PROMPT[5:16], 20, {**SAMPLED, "seed": 5}, chunk=4, by="c"),
        Req("d", [3, 1, 4, 1, 5, 9, 2, 6], 300, cancel_at=6),
        # (after f's prefill: its whole prompt in one step must not take c's or f's room)
        Req("e", PROMPT[:5], 24, {**SAMPLED, "seed": 3}, after=("f", 1)),
    ]


# (transport, source, width, topk, adaptive): the n-gram source expands request by
# request, the early-exit draft model every request's level in one packed forward
# (expand_packed), a hybrid request by request with its draft model's KV in the shared
# pool; adaptive: the draft chooses each request's width every step
@pytest.fixture(params=[("zmq", "ngram", 4, 2, False), ("grpc", "layers:2", 8, 4, False),
                        ("zmq", "layers:2", 4, 4, True), ("grpc", "hybrid", 4, 4, False)],
                ids=["zmq-ngram", "grpc-draftmodel", "zmq-draftmodel-adaptive", "grpc-hybrid"])
def pipeline(request: pytest.FixtureRequest, model_folder: Path,
             tmp_path: Path) -> Iterator[Pipeline]:
    transport, source, width, topk, adaptive = request.param
    p = Pipeline(str(model_folder), 3, transport, source, width, topk, log_dir=tmp_path,
                 adaptive=adaptive)
    try:
        yield p.start(TARGET.n_layers)
    finally:
        p.stop()


def test_mixed_load_each_request_gets_its_own_tokens(pipeline: Pipeline) -> None:
    sync = pipeline.sync()
    workers = ["draft", "stage0", "stage1", "stage2"]
    # alone first, on fresh workers: a prompt in 4 chunks takes 6 prefill steps; the
    # workers count as steps only those that advanced the decoding request, and the
    # chunks as prefill
    before = dict.fromkeys(workers, (StepStats(), None))
    solo = Req("solo", PROMPT, 12, chunk=6)
    run_load(pipeline, [solo])
    assert solo.got == ar(PROMPT, 12)
    delta = settled_delta(sync, workers, before)
    own = SpecStats.from_schedule(sync.schedule(solo.rid)).steps
    assert {w: d.steps for w, d in delta.items()} == dict.fromkeys(workers, own), \
        (sync.schedule(solo.rid), delta)
    assert all(d.prefill_s > 0 for d in delta.values()), delta

    reqs = mixed_load()
    before = worker_stats(sync, workers)
    run_load(pipeline, reqs)
    # a request's last token streams as soon as the last stage arrives, but its step's
    # mark enters the schedule when the barrier completes, and then it leaves the batch
    # (on a loaded machine that barrier can wait a while for the slowest participant)
    deadline = time.monotonic() + 30.0
    while sync.in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sync.in_flight() == [], "requests still in the batch 30 s after their last token"
    for r in reqs:
        assert r.got is not None
        if r.cancel_at:
            assert r.cancel_at <= len(r.got) < r.max_new, r.name
            assert r.got == ar(r.prompt, len(r.got), r.params), r.name
            assert sync.request(r.rid).status == "cancelled"
        else:
            assert r.got == ar(r.prompt, r.max_new, r.params, r.stop_ids), r.name
        st = SpecStats.from_schedule(sync.schedule(r.rid))
        assert st.epochs == 1 and (r.cancel_at or st.verified + 1 == len(r.got)), \
            (r.name, sync.schedule(r.rid), sync.in_flight(), sync.request(r.rid))
        # a prompt longer than its chunk was pipelined through the 3 stages, a step per
        # chunk and 2 more ('|' is the last stage's last chunk); a first chunk that took
        # part of the budget adds one
        head = sync.request(r.rid).head
        first = min(len(r.prompt), head if 0 < head < r.chunk else r.chunk)
        chunks = 1 + -(-(len(r.prompt) - first) // r.chunk) if r.chunk else 1
        steps = 1 if chunks == 1 else chunks + 2
        assert sync.schedule(r.rid).startswith(":" * (steps - 1) + "|"), \
            (r.name, sync.schedule(r.rid))
    # c started beside f's last chunk, in the row it left, and every participant cut
    # its prompt there alike (its tokens are ar's)
    assert {r.name: sync.request(r.rid).head for r in reqs if r.name in "cf"} == {
        "c": 1, "f": 4}
    # one barrier per step for the whole batch: the workers arrived fewer times than
    # the requests' own steps add up to (one request at a time would need all of them)
    own = sum(SpecStats.from_schedule(sync.schedule(r.rid)).steps for r in reqs)
    delta = settled_delta(sync, workers, before)
    assert delta["stage0"].steps < 0.8 * own, (delta["stage0"].steps, own)
    # the draft grew a level per request and decode step, as wide as chosen
    drafted = delta["draft"]
    assert drafted.levels > 0 and 0 <= drafted.widths <= pipeline.width * drafted.levels
    if pipeline.adaptive:
        # the front stages measured their forward time and the draft priced levels by it
        curves = sync.curves(["stage0", "stage1", "stage2"])
        assert set(curves) == {"stage0", "stage1"}
        # packed over 1, 2 and 4 requests (the harness's --profile-requests 4)
        assert all(set(loads) == {1, 2, 4} for _, loads in curves.values())
        assert "curves of 2 front stages" in (pipeline.log_dir / "draft.log").read_text()
    else:
        assert drafted.widths == pipeline.width * drafted.levels
    # a draft model's KV (a hybrid's too) lived in the draft service's pool, and every
    # request that left gave its blocks back (a heartbeat a second)
    deadline = time.monotonic() + 5.0
    while True:
        kv = sync.heartbeats(["draft"])["draft"].kv
        if kv is None or kv.used == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if pipeline.source == "ngram":
        assert kv is None
    else:
        assert kv is not None and kv.used == 0 and kv.peak > 0, kv
    assert not pipeline.input_timeouts()
    assert_same_plans_in_process(pipeline, [solo, *reqs])


def in_process_source(p: Pipeline) -> TokenSource:
    """The draft service's token source, built in this process as ``draft serve`` builds it."""
    if p.source == "ngram":
        return NgramSource()
    folder = Path(p.model)
    if p.source == "hybrid":  # the draft service's default --draft-model
        return HybridSource(load_draft_model("layers:4", folder, torch.float64, "cpu"))
    return load_draft_model(p.source, folder, torch.float64, "cpu")


def _named(plan: dict[str, Any], names: dict[Any, str]) -> dict[str, Any]:
    """A plan (as JSON) with its request ids replaced by the requests' names."""
    plan = json.loads(json.dumps(plan))
    plan["leave"] = [names[r] for r in plan["leave"]]
    for part in ("admit", "chunks", "next"):
        for item in plan[part]:
            item["rid"] = names[item["rid"]]
    plan["widths"] = [[names[r], w] for r, w in plan["widths"]]
    return plan


def assert_same_plans_in_process(p: Pipeline, reqs: list[Req]) -> None:
    """The scheduling core made the same plans in the draft service as in-process: each
    epoch of the trace that ran to its end, replayed through a BatchRun fed the same
    arrivals and cancels (the steps at which the draft service first saw each request in
    line, and applied each cancel), gives the same plans and tokens (a cancel keeps the
    token its step verified in both).

    The adaptive width too: its choices follow step times, measured and so unlike in
    the two executors, so the replay prices each choice as the draft service did (the
    trace's prices, :class:`TracedPrices`); its rates learn the same ranks in both (not
    a token that ended its request, Scheduler.update), and each choice reads the same
    estimates as the draft service's did (a cancelled request's own among them: the
    barrier that ends it comes before the choice that still counts it; not the level
    the engine grows it after that choice, which never runs)."""
    rows = [json.loads(line) for line in p.plan_trace.read_text().splitlines()]
    by_rid = {r.rid: r for r in reqs}
    epochs: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        epochs.setdefault(row["epoch"], []).append(row)
    # an epoch a later one superseded (a participant joined late) saw its requests again
    seen = {e: {rid for row in rs for rid in row["seen"]} for e, rs in epochs.items()}
    done = [e for e in epochs if not any(seen[e] & seen[f] for f in epochs if f > e)]
    assert sorted(rid for e in done for rid in seen[e]) == sorted(by_rid)
    eng = PipelineEngine(target_shards(p.stages), in_process_source(p), width=p.width,
                         topk=p.topk)
    width: int | AdaptiveWidth = p.width
    if p.adaptive:
        # the runtime's policy lives on across epochs: so does the replay's
        assert not any(row["prices"] for e in epochs if e not in done for row in epochs[e])
        width = TracedPrices(p.width, p.stages,
                             [t for e in sorted(done) for row in epochs[e] for t in row["prices"]],
                             [t for e in sorted(done) for row in epochs[e]
                              for t in row["estimates"]])
    for e in sorted(done):
        _replay_epoch(eng, width, epochs[e], by_rid)
    if isinstance(width, TracedPrices):
        assert not width.tables, f"{len(width.tables)} traced choices were not made"


class TracedPrices(AdaptiveWidth):
    """The adaptive width, each choice priced as the draft service priced its own (the
    plan trace's prices, in order; a price it never asked for is a KeyError), from the
    estimates the draft service's choice read (the trace's, checked first: where the
    two learnt differently, the first choice that read different ones fails, whatever
    prices the step times gave)."""

    def __init__(self, cap: int, m: int, prices: list[list[list[float]]],
                 estimates: list[dict[str, list]]):
        self.tables = deque({nodes: s for nodes, s in t} for t in prices)
        self.estimated = deque(estimates)
        self.choices = 0
        self.now: dict[float, float] = {}
        super().__init__(cap, m, lambda nodes: self.now[nodes])

    def choose(self, rids: Sequence[Hashable]) -> dict[Hashable, int]:
        """The next traced choice's prices, then the policy's choice."""
        assert self.tables, "the replay made more width choices than the draft service"
        self.now = self.tables.popleft()
        want, have = self.estimated.popleft(), json.loads(json.dumps(self.estimates(rids)))
        assert have == want, (f"choice {self.choices} read other estimates than the draft "
                              f"service's (replay, draft): "
                              f"{[(have[k], want[k]) for k in want if have[k] != want[k]]}")
        self.choices += 1
        return super().choose(rids)


def _replay_epoch(eng: PipelineEngine, width: int | AdaptiveWidth,
                  rows: list[dict[str, Any]], by_rid: dict[str, Req]) -> None:
    """One epoch's plans and tokens, replayed in process (see above)."""
    assert [row["plan"]["step"] for row in rows] == list(range(len(rows)))
    arrivals: dict[int, list[Request]] = {}
    cancels: dict[int, list[int]] = {}
    names: dict[Any, str] = {r.rid: r.name for r in by_rid.values()}
    ids: dict[str, int] = {}
    for k, row in enumerate(rows):
        for rid in row["seen"]:
            r = by_rid[rid]
            req = Request(list(r.prompt), r.max_new, SamplingParams(**r.params),
                          r.stop_ids, chunk=r.chunk)
            names[req.rid], ids[rid] = r.name, req.rid
            arrivals.setdefault(k, []).append(req)
        for rid in row["cancelled"]:
            cancels.setdefault(k, []).append(ids[rid])
    run = BatchRun(eng, "specpipe", max_batch=len(ids), width=width)
    results = run.run(arrivals, cancels)
    got = [_named(dataclasses.asdict(plan), names) for plan in run.plans]
    assert got == [_named(row["plan"], names) for row in rows]
    for rid, i in ids.items():
        r = by_rid[rid]
        tokens = results[i].tokens
        # a cancel keeps the token verified in the step it lands in, in both executors
        assert tokens == r.got, r.name


def test_kill_and_replan_under_load_every_request_finishes_with_its_own_tokens(
        model_folder: Path, tmp_path: Path) -> None:
    """Workers with --plan rejoin alone: the SIGKILLed stage's restart, then a re-plan to
    2 stages, each start a new epoch in which every running request resumes from its
    token log."""
    p = Pipeline(str(model_folder), 3, "grpc", "ngram", 4, 2, log_dir=tmp_path, plan="three")
    try:
        p.start(TARGET.n_layers)
        deadline = time.monotonic() + 120
        while not p.sync().ready():
            p.check_alive()
            assert time.monotonic() < deadline, "workers did not join"
            time.sleep(0.2)

        # a and c prefill in chunks, and again (prompt and log) when they resume; each
        # runs well past the kill (a's 12th token) and resumes for 18+ tokens after it
        reqs = [Req("a", PROMPT, 40, chunk=6),
                Req("b", [7, 7, 7, 7, 1, 2, 7, 7, 7], 36, SAMPLED),
                Req("c", PROMPT[3:], 44, after=("a", 2), chunk=5), Req("d", [5, 4, 3, 2, 1], 30)]
        run_load(p, reqs, at=("a", 12, lambda: p.restart("stage1")))
        sync = p.sync()
        for r in reqs:
            assert r.got == ar(r.prompt, r.max_new, r.params), f"request {r.name} differs"
        # the kill landed mid-load: the requests running then restarted in a new epoch
        assert sum(SpecStats.from_schedule(sync.schedule(r.rid)).epochs > 1 for r in reqs) >= 2
        assert "joined: epoch" in (tmp_path / "stage1.log").read_text()
        # a re-plan under load (every worker replaced by a 2-stage layout): the same
        reqs = [Req("f", PROMPT, 32), Req("g", [7, 7, 7, 7, 1, 2, 7, 7, 7], 28, SAMPLED),
                Req("h", PROMPT[1:], 36, after=("f", 2))]
        run_load(p, reqs, at=("f", 10, lambda: p.replan(2, "two")))
        for r in reqs:
            assert r.got == ar(r.prompt, r.max_new, r.params), f"request {r.name} differs"
        assert sync.layout_id() == "two" and sync.participants() == ["draft", "stage0", "stage1"]
        assert sum(SpecStats.from_schedule(sync.schedule(r.rid)).epochs > 1 for r in reqs) >= 2
    finally:
        p.stop()


def test_kv_budget_holds_requests_back_and_each_gets_its_own_tokens(
        model_folder: Path, tmp_path: Path) -> None:
    """Stages (and the draft model) with fixed KV pools of two requests' worst cases, a
    gateway runner with four slots: the four requests run at most two at a time (the
    others wait for blocks, not for slots), every one gets its own ar tokens, and the
    pools stayed the size they were given: the admission that bounds a stage's rows
    bounds the draft model's too."""
    from orchestrator.serving.runner import GatewayLimits, RequestRunner
    from protocol import treepipe_pb2
    from protocol.scheduling.kv_blocks import request_blocks
    from tests.test_gateway_admission import Conn

    need = request_blocks(len(PROMPT) + 40, 2, 4)  # the longest request's worst case
    p = Pipeline(str(model_folder), 2, "zmq", "layers:2", 4, 2, log_dir=tmp_path,
                 kv_tokens=2 * need * 16)
    try:
        p.start(TARGET.n_layers)
        sync = p.sync()
        runner = RequestRunner(sync, "m", None, TARGET.vocab_size, [], GatewayLimits(
            512, max_new_tokens=64, concurrency=4, kv_tokens=2 * need * 16, tree_width=4))
        sends = [(PROMPT, 40, SAMPLED), (PROMPT[3:], 36, {}), ([7, 7, 7, 7, 1, 2, 7], 40, {}),
                 (PROMPT[1:], 40, {**SAMPLED, "seed": 4})]
        got: dict[int, list[int]] = {}
        sent: dict[int, dict] = {}  # the sampling the gateway sends (float32 from the proto)
        most = [0]
        done = threading.Event()

        def one(i: int) -> None:
            prompt, n, params = sends[i]
            req = treepipe_pb2.GenerateRequest(prompt_ids=prompt, max_tokens=n)
            for k, v in params.items():
                setattr(req.sampling, k, v)
            adm = runner.validate(req)
            sent[i] = adm.params
            got[i] = [t for c in runner.generate(adm, Conn()) for t in c.token_ids]

        def watch() -> None:
            while not done.is_set():
                most[0] = max(most[0], sum(sync.request(r).status == "running"
                                           for r in sync.in_flight()))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        done.set()
        watcher.join(5)
        for i, (prompt, n, _) in enumerate(sends):
            assert got.get(i) == ar(prompt, n, sent[i]), f"request {i} differs"
        assert most[0] == 2, f"{most[0]} requests ran at once within two requests' blocks"
        names = ["draft", "stage0", "stage1"]
        pools = [sync.heartbeats(names)[w].kv for w in names]
        assert all(k is not None and k.blocks == 2 * need and k.fixed
                   and 0 < k.peak <= 2 * need for k in pools), pools
        assert not p.input_timeouts()
    finally:
        p.stop()


@pytest.mark.parametrize(("stages", "plan", "pool"), [(3, "three", 12), (2, "small", 7)])
def test_a_replan_waits_for_kv_blocks_and_each_gets_its_own_tokens(
        model_folder: Path, tmp_path: Path, stages: int, plan: str, pool: int) -> None:
    """Two requests fit fixed pools of 12 blocks at their two-stage worst cases (6 each).
    A re-plan under load to three stages prices each at 7, or one to two stages whose
    workers hold pools of 7 blocks (a smaller memory.kvTokens) holds one of them, though
    the requests were admitted against 12: the new layout's epoch resumes one of them
    and the other waits for its blocks beside it (not counted as a stall), joins when
    the first ends, resumes from its token log, and both get their own ar tokens: a
    re-plan cannot run a fixed pool out of blocks."""
    from protocol.scheduling.kv_blocks import request_blocks

    a, b = (PROMPT, 45, {}), ([7, 7, 7, 7, 1, 2, 7, 7, 7], 56, SAMPLED)
    assert [request_blocks(len(x[0]) + x[1], m, 4) for x in (a, b) for m in (2, 3)] == [
        6, 7, 6, 7]
    p = Pipeline(str(model_folder), 2, "zmq", "ngram", 4, 2, log_dir=tmp_path, plan="two",
                 kv_tokens=12 * 16)
    try:
        p.start(TARGET.n_layers)
        sync = p.sync()
        deadline = time.monotonic() + 120
        while not sync.ready():
            p.check_alive()
            assert time.monotonic() < deadline, "workers did not join"
            time.sleep(0.2)
        rids = {"a": "a-" + uuid.uuid4().hex[:8], "b": "b-" + uuid.uuid4().hex[:8]}
        for name, (prompt, n, params) in zip(rids, (a, b), strict=True):
            sync.submit(rids[name], prompt, params, n, [], slots=2, kv_width=4, kv_budget=12)
        got: dict[str, list[int]] = {}
        seen = {"waited": False, "most": 0}
        done = threading.Event()

        def watch() -> None:
            mine = p.sync()
            while not done.is_set():
                # the new layout's epoch runs (while it is pending, the fenced batch
                # still names what ran before it)
                if mine.layout_id() == plan and not mine.r.exists(mine.key("pending")):
                    batch = mine.r.smembers(mine.key("batch"))
                    seen["most"] = max(seen["most"], sum(
                        mine.r.hget(mine.req_key(r.decode()), "status") == b"running"
                        for r in batch))
                    seen["waited"] |= any(mine.waits_beside_a_batch(r) for r in rids.values())
                time.sleep(0.01)

        def one(name: str, at: tuple[int, Callable[[], None]] | None) -> None:
            got[name] = p.collect(rids[name], 180, at)

        watcher = threading.Thread(target=watch, daemon=True)
        def replan() -> None:
            p.kv_tokens = pool * 16
            p.replan(stages, plan)

        threads = [threading.Thread(target=one, args=("a", (8, replan)), daemon=True),
                   threading.Thread(target=one, args=("b", None), daemon=True)]
        for t in [watcher, *threads]:
            t.start()
        for t in threads:
            t.join(200)
        done.set()
        watcher.join(5)
        assert got.get("a") == ar(a[0], a[1]) and got.get("b") == ar(b[0], b[1], b[2])
        assert sync.layout_id() == plan
        assert seen == {"waited": True, "most": 1}, seen
    finally:
        p.stop()


def test_a_kv_pool_the_device_cannot_hold_fails_at_start_in_one_line() -> None:
    from protocol.errors import TreepipeError
    from stages.runtime.kv_pool import kv_pool

    shard = target_shards(2)[0]
    pool = kv_pool(shard, 5, "stage0")
    assert (pool.n_blocks, pool.growable) == (5, False)  # all of it now, fixed
    with pytest.raises(TreepipeError) as e:  # tens of terabytes
        kv_pool(shard, 10**10, "stage0")
    assert "\n" not in str(e.value) and "cannot allocate its KV pool" in str(e.value)
    assert str(e.value).endswith("lower memory.kvTokens (or --kv-tokens)")
