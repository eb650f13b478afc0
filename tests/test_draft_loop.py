"""The draft service's side of the one schedule loop (stages/runtime/draft_service.py).

The service follows what waits at each remote stage's input with the loop of
stages/speculation/loop.py and decides each verdict itself; the stages prune by the
barrier's verdict.  Where the two disagree, the service must stop at that step, not
grow a tree the stages no longer hold.  The whole path through real processes is
tests/test_runtime.py and tests/test_runtime_batch.py; this pins the checks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protocol.sync.control import Verdict
from protocol.sync.heartbeat import StepStats
from stages.runtime.draft_service import _RemoteStages
from stages.speculation.loop import TreeLane, begin_step, end_step
from stages.speculation.step import TreeOwner


def _service(stages: int) -> tuple[SimpleNamespace, TreeLane]:
    """A service holding one pp request ("r", no token source) over ``stages`` stages,
    its root just sent to stage 1: only what _RemoteStages reads of a DraftService."""
    owner = TreeOwner(None, 0, 0, [1, 2, 3])
    owner.start(4)
    lane = TreeLane(owner, stages)
    lane.new_root = 777  # the id the service reserved for a miss at this barrier
    svc = SimpleNamespace(name="draft", owners={"r": owner}, lanes={"r": lane},
                          draft_pool=None, stats=StepStats(), epoch=1,
                          _ranked=lambda verdicts: [], local_step=lambda rid: 2,
                          scheduler=SimpleNamespace(update=lambda ranks, going: {}))
    return svc, lane


def _step(svc: SimpleNamespace, lane: TreeLane, verdict: Verdict) -> _RemoteStages:
    """One step of the loop, split by the barrier that brings ``verdict``."""
    stages = _RemoteStages(svc, {"r": verdict})  # type: ignore[arg-type]
    out = begin_step([lane], stages, len(lane.inbox))
    end_step([lane], stages, out)
    stages.check_verified()
    return stages


def test_the_loop_follows_the_barriers_verdict_and_sends_the_new_root() -> None:
    svc, lane = _service(1)
    stages = _step(svc, lane, Verdict(token=9, child=-1, root=777))
    owner = svc.owners["r"]
    assert owner.committed[-1] == 9  # the miss committed the verified token
    assert owner.tree.root_id == 777  # under the id the barrier told every stage
    level = stages.levels["r"]
    assert level.ids.tolist() == [777] and level.tokens.tolist() == [9]


def test_a_verdict_other_than_the_loops_stops_the_service() -> None:
    svc, lane = _service(1)
    with pytest.raises(RuntimeError, match="differs from the barrier's"):
        _step(svc, lane, Verdict(token=9, child=-1, root=778))


def test_a_token_the_loop_has_no_root_for_stops_the_service() -> None:
    svc, lane = _service(2)  # the root reaches the last stage one step later
    with pytest.raises(RuntimeError, match="had not at the last stage"):
        _step(svc, lane, Verdict(token=9, child=-1, root=777))


def test_a_root_at_the_last_stage_needs_a_verified_token() -> None:
    svc, lane = _service(1)
    with pytest.raises(RuntimeError, match="verified no token"):
        _step(svc, lane, Verdict(token=-1, root=777))
