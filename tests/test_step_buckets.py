"""Steps padded to their bucket (stages.model.step_buckets) compute what unpadded steps do.

A padded step is what a captured CUDA graph replays (stages.model.cuda_graphs). These
tests run the padding on the device the tiny models are on: on a CPU it runs as it is,
with TREEPIPE_TEST_DEVICE=cuda it is recorded and replayed as graphs.
"""

from __future__ import annotations

import torch

from stages.model.cuda_graphs import StepGraphs
from stages.model.kv_cache import StageCache
from stages.model.model import Segment, StageShard
from stages.model.step_buckets import MIN_KEYS, BucketKey, bucket, bucket_key, pad_step
from tests.tiny_models import DEVICE, target_whole

CAPTURE = DEVICE == "cuda"


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 256)] == [1, 1, 2, 4, 4, 8, 32, 256]
    assert bucket(3, MIN_KEYS) == MIN_KEYS and bucket(65, MIN_KEYS) == 128


def _steps(shard: StageShard, seed: int) -> list[tuple[list[Segment], torch.Tensor]]:
    """A batch of requests with prefixes, then tree levels and committed rows of mixed sizes."""
    gen = torch.Generator().manual_seed(seed)
    pool = shard.new_pool(4, growable=True)
    caches = [StageCache.in_pool(pool) for _ in range(3)]
    steps = []
    for c, n in zip(caches, (5, 9, 2), strict=True):  # prompts, one at a time
        steps.append(([Segment(c, n)], torch.randint(0, 64, (n,), generator=gen)))
    tree = [Segment(caches[0], 3, torch.ones(3, 3, dtype=torch.bool).tril(), torch.arange(3)),
            Segment(caches[1], 1, torch.ones(1, 1, dtype=torch.bool), torch.arange(1)),
            Segment(caches[2], 2, torch.eye(2, dtype=torch.bool), torch.arange(2))]
    steps.append((tree, torch.randint(0, 64, (6,), generator=gen)))
    return steps


def _positions(segments: list[Segment]) -> torch.Tensor:
    return torch.cat([torch.arange(s.cache.length, s.cache.length + s.n) for s in segments])


def test_padded_steps_match_unpadded_and_touch_no_other_slot():
    plain, padded = target_whole(), target_whole()
    padded.step_fn = StepGraphs(padded.layer_loop, capture=CAPTURE)
    runs = {}
    for name, shard in (("plain", plain), ("padded", padded)):
        outs = []
        for segments, ids in _steps(shard, seed=1):
            outs.append(shard.forward_packed(ids, _positions(segments), segments))
        runs[name] = (outs, segments[0].cache.pool)
    for a, b in zip(runs["plain"][0], runs["padded"][0], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    pool_a, pool_b = runs["plain"][1], runs["padded"][1]
    real = pool_a.scratch_slot  # every slot a block holds: written alike
    torch.testing.assert_close(pool_a.k[:, :, :real], pool_b.k[:, :, :real], rtol=1e-10,
                               atol=1e-10)


def test_pad_step_shapes_and_masks():
    shard = target_whole()
    segments, ids = _steps(shard, seed=2)[-1]
    from stages.model.model import PagedRows

    for s, n in zip((segments[0].cache, segments[1].cache, segments[2].cache), (5, 9, 2),
                    strict=True):  # give each cache its prompt rows
        s.reserve(n)
        s.commit_write(None)
    rows = PagedRows.pack(segments, torch.device("cpu")).rows
    n = ids.numel()
    h = torch.randn(n, shard.args.dim, dtype=torch.float64)
    cs = torch.randn(n, shard.args.head_dim, dtype=torch.float64)
    step = pad_step(h, cs, cs, rows, scratch_slot=999)
    assert step is not None
    assert step.key == bucket_key(n, rows) == BucketKey(8, 4, 4, MIN_KEYS)
    assert step.rows.write[n:].eq(999).all() and step.h[n:].eq(0).all()
    mask = step.rows.mask
    assert mask is not None and mask.shape == (4, 1, 4, MIN_KEYS)
    assert mask.any(-1).all()  # every row, padding too, sees some key
    assert not mask[3, 0, :, 1:].any()  # the padded request sees key 0 alone
    # each real row's padded output place holds the same query as before
    flat_pad = step.rows.pad.view(-1)
    assert torch.equal(flat_pad[step.rows.unpad[:n]], torch.arange(n))


def test_steps_past_the_largest_bucket_run_unpadded():
    shard = target_whole()
    calls = []

    def layers(h, *rest):
        calls.append(h.shape[0])
        return shard.layer_loop(h, *rest)

    shard.step_fn = StepGraphs(layers, capture=CAPTURE)
    cache = shard.new_cache(300)
    shard(torch.randint(0, 64, (257,)), torch.arange(257), cache)
    shard(torch.randint(0, 64, (3,)), torch.arange(257, 260), cache)
    # the long step once, unpadded; the short one padded to 4 rows (recorded as a graph,
    # it runs once outside the recording and once inside)
    assert calls[0] == 257 and calls[1:] == [4] * (1 + CAPTURE)


def test_a_grown_pool_keeps_steps_right():
    plain, padded = target_whole(), target_whole()
    graphs = StepGraphs(padded.layer_loop, capture=CAPTURE)
    padded.step_fn = graphs
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(3))
    outs = []
    for shard in (plain, padded):
        cache = shard.new_cache(16)
        shard(ids[:4], torch.arange(4), cache)
        first = {id(g) for gs in graphs.store.graphs.values() for g in gs.values()}
        shard(ids[4:], torch.arange(4, 200), cache)  # the pool grows: new addresses
        outs.append(shard(ids[:1], torch.arange(200, 201), cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    if CAPTURE:  # recorded again over the grown pool, not replayed over the old one
        latest = list(graphs.store.graphs.values())[-1]
        assert latest and all(id(g) not in first for g in latest.values())


def test_graphs_stay_recorded_for_the_pools_used_last():
    """Steps that alternate between pools (the engine's requests each have one) replay
    their graphs instead of recording them again each step; a pool at a known address but
    of another shape is another pool; the graphs of the pools used longest ago go."""
    from stages.model.cuda_graphs import POOLS_KEPT, GraphStore
    from stages.model.step_buckets import BucketKey

    store = GraphStore()
    key = BucketKey(4, 1, 4, 64)
    a, b = (1, 2, (2, 64, 8)), (3, 4, (2, 64, 8))
    recorded = 0
    for pool in (a, b) * 5:
        if store.get(pool, key) is None:
            store.put(pool, key, object())
            recorded += 1
    assert recorded == 2
    grown = (1, 2, (2, 128, 8))  # a's address, another layout
    assert store.get(grown, key) is None
    store.put(grown, key, object())
    for i in range(POOLS_KEPT):  # newer pools push a, b and grown out, oldest first
        store.get((10 + i, 20 + i, (2, 64, 8)), key)
    assert a not in store.graphs and b not in store.graphs and grown not in store.graphs
    assert len(store.graphs) == POOLS_KEPT and len(store) == 0


def test_one_request_packs_as_a_batch_of_one_would():
    """PagedRows' few-operation path for one request lays out what the general one does."""
    from stages.model.model import PagedRows

    shard = target_whole()
    for n, tree in ((1, False), (5, False), (1, True), (3, True)):
        rows = []
        for pack in (PagedRows._pack_one, lambda seg, dev: PagedRows._pack_many([seg], dev)):
            cache = shard.new_cache(64)
            cache.reserve(7)
            cache.commit_write(None)  # a committed prefix of 7
            if tree:  # two tree rows cached already
                cache.reserve(2)
                cache.commit_write(torch.tensor([100, 101]))
            # a tree mask narrower than every tree row: the rows past it stay hidden
            tm = torch.ones(n, n, dtype=torch.bool).tril() if tree else None
            seg = Segment(cache, n, tm, torch.arange(n) if tree else None)
            rows.append(pack(seg, torch.device("cpu")).rows)
        one, many = rows
        for a, b in zip(one, many, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b), (n, tree)
