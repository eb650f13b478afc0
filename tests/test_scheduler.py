"""protocol/scheduling/scheduler.py: the one module that decides what a step holds.

Admission (slots, the KV budget, first in line waits), the prefill budget, cancels and
widths, on the scheduler alone; then the in-process executor (BatchRun) running its
plans on a seeded workload: the same plans every time, and every request's tokens
those of plain autoregressive decoding.
"""

from __future__ import annotations

import subprocess
import sys

from protocol.scheduling.plan import Chunk, Ticket
from protocol.scheduling.records import StepRecord
from protocol.scheduling.scheduler import Scheduler, StepOutputs
from protocol.scheduling.width import AdaptiveWidth
from stages.model.sampling import SamplingParams
from stages.speculation.batch import BatchRun, Request
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import NgramSource
from tests.tiny_models import PROMPT, target_shards


def test_the_core_imports_no_torch() -> None:
    code = ("import sys, protocol.scheduling.scheduler, protocol.scheduling.plan, "
            "protocol.scheduling.kv_blocks; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_fills_the_slots_in_order() -> None:
    s = Scheduler(2, 4, pipelined=False)
    for rid in "abc":
        s.add(Ticket(rid, 5))
    plan = s.schedule()
    assert plan.admit == ("a", "b") and [t.rid for t in s.queue] == ["c"]
    assert s.schedule().admit == ()  # no slot until one finishes
    s.close([], done=["a"])
    assert s.schedule().admit == ("c",)


def test_the_kv_budget_holds_the_line() -> None:
    """The first that does not fit waits, and the ones behind it wait with it."""
    s = Scheduler(8, 4, kv_budget=10, pipelined=False)
    for rid, blocks in (("a", 6), ("b", 5), ("c", 3)):
        s.add(Ticket(rid, 5, blocks))
    assert s.schedule().admit == ("a",) and s.reserved == 6
    assert s.schedule().admit == ()  # c would fit, but b is first in line
    s.close([], done=["a"])
    assert s.schedule().admit == ("b", "c") and s.reserved == 8
    assert not s.fits_alone(Ticket("d", 5, 11)) and s.fits_alone(Ticket("d", 5, 10))


def test_no_budget_admits_regardless_of_blocks() -> None:
    s = Scheduler(8, 4, pipelined=False)
    for rid in "ab":
        s.add(Ticket(rid, 5, 10**9))
    assert s.schedule().admit == ("a", "b") and s.reserved == 0


def test_the_prefill_budget_feeds_joiners_in_order() -> None:
    s = Scheduler(4, 4, prefill_chunk=4)
    s.add(Ticket("a", 10))
    s.add(Ticket("b", 3))
    chunks = [s.schedule().chunks for _ in range(5)]
    assert chunks == [
        (Chunk("a", 0, 0, 4),),  # b finds no room beside a's whole chunk
        (Chunk("a", 1, 4, 8),),
        (Chunk("a", 2, 8, 10), Chunk("b", 0, 0, 2)),  # b's head takes the 2 rows left
        (Chunk("b", 1, 2, 3),),
        (),
    ]
    assert s.schedule().admit == ()  # both admitted at the first plan, as slots allowed


def test_a_cancel_drops_a_queued_request_and_retires_a_running_one() -> None:
    s = Scheduler(1, 4, kv_budget=10, pipelined=False)
    s.add(Ticket("a", 5, 4))
    s.add(Ticket("b", 5, 4))
    s.add(Ticket("c", 5, 4))
    assert s.schedule().admit == ("a",)
    assert s.cancel("b") is True and [t.rid for t in s.queue] == ["c"]
    assert s.cancel("a") is False  # running: it leaves at the next plan
    plan = s.schedule()
    assert plan.leave == ("a",) and plan.admit == ("c",) and s.reserved == 4
    assert s.cancel("zz") is False and not s.cancelled


def test_prefilled_requests_decode_with_the_fixed_width() -> None:
    s = Scheduler(4, 3, prefill_chunk=0)
    s.add(Ticket("a", 2))
    assert s.schedule().widths == ()  # still prefilling: no level yet
    s.close([], started=["a"])
    assert s.update(StepOutputs((("a", 0),), ("a",))) == {"a": 3}
    assert s.schedule().widths == (("a", 3),)


def test_the_adaptive_policy_chooses_every_going_width() -> None:
    def cost(n: float, requests: int | None = None) -> float:
        return 1.0 + 0.5 * n

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
    run.run(arrivals={0: reqs[:3], 4: reqs[3:]}, cancels={9: [102]} if cancel else None)
    return {rid: res.tokens for rid, res in run.results.items()}


def test_the_in_process_executor_runs_the_same_plans_and_ar_tokens() -> None:
    m = 2
    ar_eng = PipelineEngine(target_shards(m), None, width=1, topk=1)
    ar = _workload(BatchRun(ar_eng, "ar", max_batch=4), cancel=False)
    runs = []
    for _ in range(2):
        eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=2)
        run = BatchRun(eng, "specpipe", max_batch=3, kv_blocks=64, width="adaptive",
                       prefill_chunk=3)
        runs.append((_workload(run), run.plans))
    (tokens, plans), (tokens2, plans2) = runs
    # the adaptive widths follow measured step times, so only the rest must repeat
    assert [(p.step, p.leave, p.admit, p.chunks) for p in plans] == \
        [(p.step, p.leave, p.admit, p.chunks) for p in plans2]
    assert plans[0].admit == (100, 101, 102)  # three slots
    assert any(103 in p.admit for p in plans) and any(p.leave == (102,) for p in plans)
    for rid in (100, 101, 103):  # the cancelled one stopped early
        assert tokens[rid] == tokens2[rid] == ar[rid], rid
    assert tokens[102] == ar[102][:len(tokens[102])]
