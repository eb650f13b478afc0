"""protocol/scheduling/scheduler.py: the one module that decides what a step holds.

Admission (slots, the KV budget, first in line waits), the prefill budget, cancels and
widths, on the scheduler alone; then the in-process executor (BatchRun) running its
plans on a seeded workload: the same plans every time, and every request's tokens
those of plain autoregressive decoding.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

from protocol.scheduling.kv_blocks import kv_limit
from protocol.scheduling.plan import Admission, Chunk, Ticket
from protocol.scheduling.records import StepRecord
from protocol.scheduling.scheduler import Scheduler, StepOutputs, decide_joins
from protocol.scheduling.width import AdaptiveWidth
from protocol.sync.control import Verdict
from stages.model.sampling import SamplingParams
from stages.speculation.batch import BatchRun, Request
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import NgramSource
from tests.tiny_models import PROMPT, target_shards

if TYPE_CHECKING:
    from stages.runtime.admission import LineScheduler


def ids(admitted: tuple[Admission, ...]) -> tuple[object, ...]:
    return tuple(a.rid for a in admitted)


def test_the_core_imports_no_torch() -> None:
    code = ("import sys, protocol.scheduling.scheduler, protocol.scheduling.plan, "
            "protocol.scheduling.kv_blocks; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_fills_the_slots_in_order() -> None:
    s = Scheduler(2, 4, pipelined=False)
    for rid in "abc":
        s.add(Ticket(rid, 5))
    plan = s.schedule()
    assert ids(plan.admit) == ("a", "b") and [t.rid for t in s.queue] == ["c"]
    assert s.schedule().admit == ()  # no slot until one finishes
    s.close([], done=["a"])
    assert ids(s.schedule().admit) == ("c",)


def test_the_kv_budget_holds_the_line() -> None:
    """The first that does not fit waits, and the ones behind it wait with it."""
    s = Scheduler(8, 4, kv_budget=10, pipelined=False)
    for rid, blocks in (("a", 6), ("b", 5), ("c", 3)):
        s.add(Ticket(rid, 5, blocks))
    assert ids(s.schedule().admit) == ("a",) and s.reserved == 6
    assert s.schedule().admit == ()  # c would fit, but b is first in line
    s.close([], done=["a"])
    assert ids(s.schedule().admit) == ("b", "c") and s.reserved == 8
    assert not s.fits_alone(Ticket("d", 5, 11)) and s.fits_alone(Ticket("d", 5, 10))


def test_no_budget_admits_regardless_of_blocks() -> None:
    s = Scheduler(8, 4, pipelined=False)
    for rid in "ab":
        s.add(Ticket(rid, 5, 10**9))
    assert ids(s.schedule().admit) == ("a", "b") and s.reserved == 0


def test_the_prefill_budget_decides_joiners_a_step_ahead() -> None:
    s = Scheduler(4, 4, prefill_chunk=4)
    s.add(Ticket("a", 10))
    s.add(Ticket("b", 3))
    plans = [s.schedule() for _ in range(6)]
    assert [p.chunks for p in plans] == [
        (),  # an idle pipeline's first step only decides who joins at the next
        (Chunk("a", 0, 0, 4),),
        (Chunk("a", 1, 4, 8),),
        (Chunk("a", 2, 8, 10), Chunk("b", 0, 0, 2)),  # b's head takes the 2 rows left
        (Chunk("b", 1, 2, 3),),
        (),
    ]
    assert [ids(p.admit) for p in plans] == [(), ("a",), (), ("b",), (), ()]
    # b found no room beside a's first or second chunk, then was decided beside its last
    assert [p.next for p in plans[:3]] == [(Admission("a", 4),), (), (Admission("b", 2),)]


def test_a_decided_joiner_that_is_cancelled_gives_its_blocks_back() -> None:
    s = Scheduler(4, 4, kv_budget=10, prefill_chunk=0)
    s.add(Ticket("a", 5, 4))
    s.add(Ticket("b", 5, 4))
    assert s.schedule().next == (Admission("a"), Admission("b")) and s.reserved == 8
    assert s.cancel("b") is False
    plan = s.schedule()
    assert plan.leave == ("b",) and ids(plan.admit) == ("a",) and s.reserved == 4
    assert not s.cancelled and s.schedule().next == ()


def test_a_cancel_drops_a_queued_request_and_retires_a_running_one() -> None:
    s = Scheduler(1, 4, kv_budget=10, pipelined=False)
    s.add(Ticket("a", 5, 4))
    s.add(Ticket("b", 5, 4))
    s.add(Ticket("c", 5, 4))
    assert ids(s.schedule().admit) == ("a",)
    assert s.cancel("b") is True and [t.rid for t in s.queue] == ["c"]
    assert s.cancel("a") is False  # running: it leaves at the next plan
    plan = s.schedule()
    assert plan.leave == ("a",) and ids(plan.admit) == ("c",) and s.reserved == 4
    assert s.cancel("zz") is False and not s.cancelled


def test_prefilled_requests_decode_with_the_fixed_width() -> None:
    s = Scheduler(4, 3, prefill_chunk=0)
    s.add(Ticket("a", 2))
    s.schedule()
    assert ids(s.schedule().admit) == ("a",)
    s.close([], started=["a"])
    assert s.update(StepOutputs((("a", 0),), ("a",))) == {"a": 3}
    assert s.schedule().widths == (("a", 3),)


def cost(n: float, requests: int | None = None) -> float:
    """A step whose time is mostly its nodes: a policy priced by it is deterministic."""
    return 1.0 + 0.5 * n


def test_the_adaptive_policy_chooses_every_going_width() -> None:
    policy = AdaptiveWidth(4, 2, cost)
    s = Scheduler(4, 4, pipelined=False, policy=policy)
    s.add(Ticket("a", 2))
    s.add(Ticket("b", 2))
    assert s.schedule().widths == (("a", 1), ("b", 1))  # adaptive trees start one wide
    for _ in range(20):  # a draft that is always right: wider trees pay off
        widths = s.update(StepOutputs((("a", 0), ("b", 0)), ("a", "b")))
        s.close([StepRecord([2, 2], [1.0, 1.0], [0.0, 0.0], [0, 0])])
    assert set(widths) == {"a", "b"} and all(0 <= w <= 4 for w in widths.values())
    assert dict(s.schedule().widths) == widths
    s.close([], done=["a", "b"])
    assert s.idle and not policy.hit  # the policy forgot them


def _workload(run: BatchRun, cancel: bool = True) -> dict[int, list[int]]:
    """Four requests of different lengths (two seeded), one joining mid-batch, one
    cancelled (unless not ``cancel``): each request's tokens by id."""
    specs = [(PROMPT, 14, SamplingParams()), (PROMPT[4:], 9, SamplingParams(0.9, 0.95, 40, 11)),
             ([7, 7, 1, 2], 12, SamplingParams()), (PROMPT[::-1], 16, SamplingParams(0.8, seed=3))]
    reqs = [Request(p, n, sp, rid=100 + j) for j, (p, n, sp) in enumerate(specs)]
    run.run(arrivals={0: reqs[:3], 4: reqs[3:]}, cancels={12: [102]} if cancel else None)
    return {rid: res.tokens for rid, res in run.results.items()}


def test_the_in_process_executor_runs_the_same_plans_and_ar_tokens() -> None:
    m = 2
    ar_eng = PipelineEngine(target_shards(m), None, width=1, topk=1)
    ar = _workload(BatchRun(ar_eng, "ar", max_batch=4), cancel=False)
    runs = []
    for _ in range(2):
        eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=2)
        run = BatchRun(eng, "specpipe", max_batch=3, kv_blocks=64,
                       width=AdaptiveWidth(4, m, cost), prefill_chunk=8)
        runs.append((_workload(run), run.plans))
    (tokens, plans), (tokens2, plans2) = runs
    assert plans == plans2 and any(w != 1 for p in plans for _, w in p.widths)
    assert plans[0].admit == () and ids(plans[1].admit) == (100,)  # a step ahead
    assert any(103 in [a.rid for a in p.admit] for p in plans)
    assert any(p.leave == (102,) for p in plans)
    for rid in (100, 101, 103):  # the cancelled one stopped early
        assert tokens[rid] == tokens2[rid] == ar[rid], rid
    assert tokens[102] == ar[102][:len(tokens[102])]


def test_decide_joins_takes_each_tickets_own_budget_and_chunk() -> None:
    """The distributed scheduler's tickets carry their gateway's budget and chunk; a
    request alone always fits (one a re-plan priced above a whole pool runs by itself)."""
    line = [Ticket("a", 7, 30, chunk=3, budget=20), Ticket("b", 2, 5, chunk=0, budget=40)]
    assert decide_joins(line, held=0, load=0, slots=9, budget=None, chunk=64) == [
        Admission("a", 3), Admission("b", 0)]  # a alone; b: 30 + 5 <= 40, no prefill budget
    assert decide_joins(line, held=1, load=0, slots=9, budget=None, chunk=64) == []
    assert decide_joins(line[1:], held=1, load=5, slots=9, budget=None, chunk=64) == [
        Admission("b", 0)]
    assert decide_joins(line, held=0, load=3, slots=9, budget=None, chunk=64) == []
    assert decide_joins(line, held=0, load=0, slots=1, budget=None, chunk=64) == [
        Admission("a", 3)]


def test_kv_limit_holds_a_request_to_the_pools_now() -> None:
    assert kv_limit(50, 0, None) == 50  # pools unknown: what its gateway read
    assert kv_limit(50, 0, 80) == 80 and kv_limit(50, 60, 80) == 60  # within its cap
    assert kv_limit(50, 0, 0) == 50 and kv_limit(50, 30, 0) == 30  # no fixed pool
    assert kv_limit(50, None, 80) == 50  # an earlier gateway: its reading stands as the cap


def test_a_distributed_line_drives_the_queue_and_the_barrier_confirms_joins() -> None:
    """The draft service's use (stages/runtime/admission.py): the line in Redis is the
    queue, a decided joiner the barrier did not take frees its blocks and is decided
    again from the line, and a request an epoch's start restarts joins at the next plan."""
    s = Scheduler(100, 4, kv_budget=0)
    a, b = Ticket("a", 8, 5, chunk=4, budget=10), Ticket("b", 8, 5, chunk=4, budget=10)
    s.line_is([a, b])
    plan = s.schedule()
    # a's first chunk fills stage 1's prefill room of the next step: b waits
    assert ids(plan.next) == ("a",) and s.reserved == 5 and list(s.queue) == [b]
    s.joined(set())  # a was cancelled in line before the barrier let it in
    assert s.reserved == 0 and not s.decided
    s.line_is([b])
    assert ids(s.schedule().next) == ("b",)
    s.joined({"b"})
    s.resume(Admission("r", 0), Ticket("r", 3, 2, chunk=0))
    s.line_is([])
    plan = s.schedule()
    assert ids(plan.admit) == ("b", "r") and s.reserved == 7
    assert s.holds("r") and not s.holds("a")


class _Line:
    """The synchroniser as a draft service's barrier reads it: each ended request's status."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}

    def requests(self, rids: list[str]) -> list[SimpleNamespace]:
        return [SimpleNamespace(status=self.status.get(r, "running")) for r in rids]


def _both_executors() -> tuple[_Line, LineScheduler, Scheduler]:
    """The runtime's scheduler (as a draft service runs it) and the engine's, adaptive,
    each with requests a and b decoding."""
    from stages.runtime.admission import LineScheduler

    line = _Line()
    runtime = LineScheduler(line, 4, adaptive=True)  # type: ignore[arg-type]
    runtime.start(1, AdaptiveWidth(4, 2, cost))
    engine = Scheduler(4, 4, policy=AdaptiveWidth(4, 2, cost))
    for core in (runtime.core, engine):
        for rid in ("a", "b"):
            core.resume(Admission(rid, 0), Ticket(rid, 2))
    runtime.plan(False, [], "", 2, ["a", "b"])
    engine.schedule()
    engine.close([], started=["a", "b"])
    return line, runtime, engine


def test_a_cancel_leaves_both_executors_with_the_same_width_estimates() -> None:
    """The draft service's barrier ends a cancelled request (and the service finishes
    it) before the width step that still counts it (Scheduler.update); the engine's
    cancel lands after that step, and the engine then grows the request's last level,
    which never runs.  The choice reads the cancelled request's own estimates in both
    (the service's finish used to forget them first, so the runtime chose as if it were
    new: width 1, the pooled rates and levels), and neither learns that last level (the
    engine did): a replay of the runtime's plans then asked for step prices it never
    priced, a flaky KeyError under load.  The scheduler forgets the request when it
    leaves the plan, and a new epoch the rest."""
    from stages.runtime.draft_service import DraftService

    line, runtime, engine = _both_executors()
    # a few steps alike in both: both requests go on, each level drawing on its proposals
    for ranks in ([("a", 0), ("b", 1)], [("a", 2), ("b", 0)], [("a", None), ("b", 3)]):
        assert runtime.update(ranks, ["a", "b"]) == engine.update(StepOutputs(
            tuple(ranks), ("a", "b")))
        runtime.observe_levels([("a", 3), ("b", 1)])
        for rid, n in (("a", 3), ("b", 1)):
            engine.observe_level(rid, n)
        runtime.plan(False, [], "", 2, [])
        engine.schedule()
    # b's cancel lands: the service's barrier ends it, its finish runs, then a goes on
    line.status["b"] = "cancelled"
    runtime.barrier(["b"], [], [("b", 1)])
    service = SimpleNamespace(owners={}, lanes={}, _out={}, policy=runtime.core.policy,
                              scheduler=runtime)
    DraftService.finish(service, "b")  # type: ignore[arg-type]
    widths = runtime.update([("a", 0)], ["a"])
    read = runtime.core.policy.read if runtime.core.policy is not None else None
    # the engine learns both ranks and chooses for both, then the cancel lands
    expected = engine.update(StepOutputs((("a", 0), ("b", 1)), ("a", "b")))
    engine.cancel("b")
    assert engine.policy is not None and read == engine.policy.read
    assert read["requests"][1][0] is not None  # b's own width, not a new request's
    assert widths == {"a": expected["a"]}
    # the levels that grow after it: a's in both, b's in the engine only
    runtime.observe_levels([("a", 2)])
    engine.observe_level("a", 2)
    engine.observe_level("b", 4)
    # b leaves at the next plan in both, and the policies forget it there
    assert runtime.plan(False, [], "", 2, []) == [] and engine.schedule().leave == ("b",)
    policy = runtime.core.policy
    assert policy is not None and "b" not in policy.hit and "b" not in engine.policy.hit
    assert policy.estimates(["a"]) == engine.policy.estimates(["a"])
    # a new epoch restarts a from its log: a new request to the policy (pooled rates stay)
    runtime.start(2, policy)
    assert policy.estimates(["a"])["requests"] == [[None, None, None, None]]
    assert policy.estimates([])["pooled"] == engine.policy.estimates([])["pooled"]


def test_a_cancel_in_a_step_that_verified_nothing_counts_in_that_steps_choice() -> None:
    """A cancel may land while its request's pipeline refills after a miss: the step
    verified no token of it.  The engine's cancel lands after that step's width choice,
    which still holds the request; the draft service's barrier ended it first, so the
    service must keep it for the choice without a rank (it kept only ranked ones, and the
    runtime then chose for fewer requests than the engine: a flaky estimates mismatch in
    tests/test_runtime_batch.py's adaptive replay)."""
    from stages.runtime.draft_service import DraftService

    line, runtime, engine = _both_executors()
    for ranks in ([("a", 0), ("b", 3)], [("a", 1), ("b", 2)]):
        assert runtime.update(ranks, ["a", "b"]) == engine.update(StepOutputs(
            tuple(ranks), ("a", "b")))
        runtime.plan(False, [], "", 2, [])
        engine.schedule()
    # b's cancel lands in a step that verified a's token only: the service's barrier
    # ranks what the ended b verified, nothing
    service = SimpleNamespace(owners={"b": None}, joined={"b": 0}, policy=runtime.core.policy,
                              local_step=lambda rid: 5, _ranked=lambda verdicts: [])
    kept = DraftService._ranks(service, [("b", Verdict(-1, -1, 9, True))])  # type: ignore[arg-type]
    assert kept == [("b", None)]
    line.status["b"] = "cancelled"
    runtime.barrier(["b"], [], kept)
    widths = runtime.update([("a", 0)], ["a"])
    read = runtime.core.policy.read if runtime.core.policy is not None else None
    expected = engine.update(StepOutputs((("a", 0),), ("a", "b")))  # b is chosen for too
    engine.cancel("b")
    assert engine.policy is not None and read == engine.policy.read
    assert len(read["requests"]) == 2  # both requests' estimates were read
    assert widths == {"a": expected["a"]}
