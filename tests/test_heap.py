"""settle_heap: garbage is collected before the survivors are frozen, and the lockstep
benchmark settles the heap before its runs step."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from stages.runtime.heap import settle_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (the frozen count is per process)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_settle_heap_frees_garbage_and_freezes_survivors(thawed: None) -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = _Node()
    assert settle_heap() > 0
    assert dead() is None  # collected first: a frozen cycle would never be freed
    # the survivor is out of every generation a collection walks
    assert not any(o is kept for o in gc.get_objects())
    assert gc.get_freeze_count() > 0


def test_concurrency_rows_settle_the_heap_before_stepping(
        thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.lab.benchmarks.bench import BatchConfig, concurrency_rows
    from stages.speculation.batch import BatchRun
    from stages.speculation.engine import PipelineEngine
    from stages.speculation.token_sources import NgramSource
    from tests.tiny_models import PROMPT, target_shards

    engine = PipelineEngine(target_shards(2), NgramSource(), width=2, topk=2)
    frozen: list[int] = []
    real_step = BatchRun.step

    def step(run: BatchRun) -> None:
        frozen.append(gc.get_freeze_count())
        real_step(run)

    monkeypatch.setattr(BatchRun, "step", step)
    assert gc.get_freeze_count() == 0
    rows = concurrency_rows([BatchConfig(engine, "specpipe", "adaptive")], 2,
                            [PROMPT, PROMPT[:5]], 4, ())
    assert rows[0]["steps"] > 0 and frozen and frozen[0] > 0
