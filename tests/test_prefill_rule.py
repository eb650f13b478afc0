"""protocol/scheduling/prefill.py: the prefill layout the engine and the runtime share."""

from __future__ import annotations

import pytest

from protocol.scheduling.prefill import PrefillLayout, room


def stage1_rows(lay: PrefillLayout, step: int) -> int:
    """Rows stage 1 computes in prefill step ``step``: the width of that chunk."""
    a, b = lay.bounds(step)
    return b - a


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 40])
@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("head", [0, 1, 2, 3, 99])
def test_the_chunks_cover_the_rows_once_in_order(rows, chunk, head):
    lay = PrefillLayout(rows, chunk, head)
    spans = [lay.bounds(j) for j in range(lay.chunks())]
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a < b for a, b in spans)  # no empty chunk
    assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    # the first takes the room it joined into (a whole chunk for 0 or more than one),
    # every later but the last a whole chunk
    assert spans[0][1] == min(rows, head if 0 < head < chunk else chunk)
    assert all(b - a == chunk for a, b in spans[1:-1])
    assert lay.bounds(lay.chunks()) == (rows, rows) and lay.bounds(-1) == (0, 0)
    assert [stage1_rows(lay, t) for t in range(-1, lay.chunks() + 1)] == (
        [0] + [b - a for a, b in spans] + [0])
    # pipelined: stage i has chunk j in step j + i, the last stage's last chunk ends it
    assert lay.steps(3) == lay.chunks() + 2
    assert [lay.chunk_at(t, 2) for t in range(lay.steps(3))] == (
        [None, None] + list(range(lay.chunks())))


def test_a_head_adds_a_chunk_only_when_the_rest_needs_one():
    assert PrefillLayout(6, 3).chunks() == 2
    assert PrefillLayout(6, 3, 2).chunks() == 3  # 2, 3, 1
    assert PrefillLayout(5, 3, 2).chunks() == 2  # 2, 3
    assert PrefillLayout(2, 3, 2).chunks() == 1
    assert (PrefillLayout(7, 3).chunks(), PrefillLayout(7, 3).steps(2)) == (3, 4)


def test_no_chunk_means_the_whole_sequence_through_every_stage_in_one_step():
    lay = PrefillLayout(9, 0, 4)
    assert (lay.chunks(), lay.steps(4), lay.bounds(0), stage1_rows(lay, 0)) == (1, 1, (0, 9), 9)
    assert stage1_rows(lay, 1) == 0
    assert [lay.chunk_at(0, i) for i in range(4)] == [0, 0, 0, 0]


@pytest.mark.parametrize(("chunk", "load", "want"), [
    (8, 0, 8), (8, 3, 5), (8, 7, 1), (8, 8, 0), (8, 12, 0), (0, 5, 0), (0, 0, 0)])
def test_room_is_the_budget_left(chunk, load, want):
    assert room(chunk, load) == want
