"""Paged FlexAttention (stages/model/tree_attention.py) against the dense paged_attention."""

import random

import pytest
import torch

from stages.model import tree_attention as ta
from stages.model.kv_cache import BlockPool, StageCache
from stages.model.model import PagedRows, Segment, paged_attention

pytestmark = pytest.mark.skipif(not ta.flex_available("cpu"),
                                reason="compiled FlexAttention needs an AVX2 CPU")

POOL_BLOCKS = 48  # one pool size for every test
# five requests in one packed batch (8 after bucketing): every test that needs a batch
# uses these shapes, so the few compiled graphs (one per bucket) are shared
MIXED = [(40, 0, 1, False),  # a decode step
         (17, 3, 4, True),  # a tree level over cached tree rows
         (0, 0, 9, False),  # a first prefill chunk
         (64, 7, 2, True),  # prefix ending on a block edge
         (3, 0, 5, True)]  # a level with no cached tree rows


def ancestor_mask(rng: random.Random, t: int, n: int) -> torch.Tensor:
    """Rows of the n new nodes of a random tree over t cached + n new nodes (BFS order):
    each node sees itself and its ancestors."""
    anc = torch.zeros(t + n, t + n, dtype=torch.bool)
    for i in range(t + n):
        anc[i, i] = True
        if i:  # node 0 is a root; later nodes hang under an earlier one (or start a root)
            parent = rng.randrange(-1, i)
            if parent >= 0:
                anc[i] |= anc[parent]
    return anc[t:]


def packed_batch(specs: list[tuple[int, int, int, bool]], n_heads: int, n_kv: int,
                 dtype: torch.dtype, seed: int = 0):
    """A shared pool with one request per (n_prefix, n_tree, n_new, is_tree) spec, block
    tables scattered over the pool, random K/V everywhere (free slots included), and
    random new rows; returns (pool, segments, q, k, v)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = BlockPool(1, n_kv, 64, POOL_BLOCKS, dtype)
    rng.shuffle(pool.free)  # physical blocks out of logical order
    with torch.inference_mode(False):
        pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
        pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    segments = []
    for p, t, n, tree in specs:
        c = StageCache.in_pool(pool)
        if p:
            c.reserve(p)
            c.commit_write(None)
        if t:
            c.reserve(t)
            c.commit_write(torch.arange(t))
        mask = ancestor_mask(rng, t, n) if tree else None
        segments.append(Segment(c, n, mask, torch.arange(t, t + n) if tree else None))
    total = sum(s.n for s in segments)
    q = torch.randn(total, n_heads, 64, generator=gen).to(dtype)
    k = torch.randn(total, n_kv, 64, generator=gen).to(dtype)
    v = torch.randn(total, n_kv, 64, generator=gen).to(dtype)
    return pool, segments, q, k, v


def both(specs, n_heads=9, n_kv=3, dtype=torch.float32, seed=0):
    """(paged_attention, flex attend) on the same batch; the former writes the new rows."""
    pool, segments, q, k, v = packed_batch(specs, n_heads, n_kv, dtype, seed)
    rows = PagedRows.pack(segments, torch.device("cpu")).rows
    ref = paged_attention(q, k, v, pool.k[0], pool.v[0], rows)
    plan = ta.plan_for(segments)
    return ref, ta.attend(plan, q, pool.k[0], pool.v[0]), (pool, segments, q)


def test_lone_decode_step():
    ref, out, _ = both([(300, 0, 1, False)])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_causal_prefill_chunk():
    ref, out, _ = both([(37, 0, 13, False)])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_prefill_longer_than_a_query_tile():
    ref, out, _ = both([(5, 0, ta.Q_BLOCK + 40, False)])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_tree_level_with_random_ancestor_mask():
    ref, out, _ = both([(29, 4, 12, True)], seed=1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_packed_requests_of_different_lengths_and_shapes():
    ref, out, _ = both(MIXED, seed=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_without_gqa():
    ref, out, _ = both(MIXED, n_heads=3, n_kv=3, seed=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_bfloat16():
    ref, out, _ = both(MIXED, dtype=torch.bfloat16, seed=4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_a_wrong_tree_mask_changes_exactly_its_row():
    ref, good, (pool, segments, q) = both(MIXED, seed=5)
    seg = segments[1]
    seg.tree_mask = seg.tree_mask.clone()
    seg.tree_mask[2, 0] = ~seg.tree_mask[2, 0]  # its row 2 now (un)sees tree row 0
    bad = ta.attend(ta.plan_for(segments), q, pool.k[0], pool.v[0])
    differs = (bad - good).abs().amax(dim=(1, 2)) > 1e-4
    assert differs.tolist() == [False, False, False, True] + [False] * 17
    assert ((bad - ref).abs().amax(dim=(1, 2)) > 1e-4).tolist() == differs.tolist()


def test_reads_only_its_own_blocks():
    pool, segments, q = both(MIXED, seed=6)[2]
    plan = ta.plan_for(segments)
    before = ta.attend(plan, q, pool.k[0], pool.v[0])
    with torch.inference_mode(False):
        for b in pool.free:  # garbage in every slot no request owns
            rows = slice(b * pool.block_size, (b + 1) * pool.block_size)
            pool.k[:, :, rows] = 1e4
            pool.v[:, :, rows] = float("nan")
    torch.testing.assert_close(ta.attend(plan, q, pool.k[0], pool.v[0]), before)
    first = segments[0].cache.blocks[0] * pool.block_size
    with torch.inference_mode(False):
        pool.v[:, :, first] += 1.0  # the first request's row 0: only its rows move
    after = ta.attend(plan, q, pool.k[0], pool.v[0])
    moved = (after - before).abs().amax(dim=(1, 2)) > 1e-4
    assert moved.tolist() == [True] + [False] * 20


def test_bad_tree_mask_shape_is_refused():
    pool, segments, _, _, _ = packed_batch([(4, 2, 3, True)], 9, 3, torch.float32)
    segments[0].tree_mask = segments[0].tree_mask[:, 1:]
    PagedRows.pack(segments, torch.device("cpu"))  # PagedRows reserves the rows first
    with pytest.raises(ValueError, match="tree mask"):
        ta.plan_for(segments)


def test_buckets():
    assert [ta.bucket(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    assert ta.bucket(9, ta.MIN_WIDTH) == 16
