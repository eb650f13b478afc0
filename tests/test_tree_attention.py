"""Tree-mask attention and KV pruning against running every root-to-leaf path causally."""

import random

import pytest
import torch

from stages.model.linear_tuning import set_upcast_from, untune_shard
from stages.model.model import (
    sdpa_attention,
    upcast_attention,
)
from stages.speculation.token_sources import sync_cache, tree_forward
from stages.speculation.tree import Level, SpecTree
from tests.tiny_models import PROMPT, target_shards

PREFIX = PROMPT[:12]


def causal_hidden(shards, tokens: list[int]) -> torch.Tensor:
    """Last-stage hidden state of the final token, computed plainly and causally."""
    caches = [s.new_cache(64) for s in shards]
    x = torch.tensor(tokens, dtype=torch.long)
    for s, c in zip(shards, caches, strict=True):
        x = s(x, torch.arange(len(tokens)), c)
    return x[-1]


def grow(tree: SpecTree, rng: random.Random) -> torch.Tensor:
    bottom = tree.level(tree.height).tolist()
    par, tok = [], []
    for p in bottom:
        for t in rng.sample(range(64), rng.randint(1, 2)):
            par.append(p)
            tok.append(t)
    return tree.append_level(Level(torch.tensor(par), torch.tensor(tok),
                                   torch.full((len(tok),), 0.5, dtype=torch.float64)))


def prefill(shards, tokens):
    caches = [s.new_cache(64) for s in shards]
    x = torch.tensor(tokens, dtype=torch.long)
    for s, c in zip(shards, caches, strict=True):
        x = s(x, torch.arange(len(tokens)), c)
    return caches


def run_level(shards, caches, tree, idx):
    x = tree.tokens[idx]
    for s, c in zip(shards, caches, strict=True):
        x = tree_forward(s, c, tree, idx, x)
    return x


@pytest.mark.parametrize("upcast", [0, 1])
def test_tree_mask_equals_each_path_causally(upcast):
    shards = target_shards(2)
    for shard in shards:  # the tree levels with this attention, the causal reference fused
        set_upcast_from(shard, upcast)
    rng = random.Random(0)
    tree = SpecTree(PREFIX[-1], len(PREFIX) - 1)
    caches = prefill(shards, PREFIX[:-1])
    outs = {0: run_level(shards, caches, tree, torch.tensor([0]))[0]}
    for _ in range(3):  # levels arrive one at a time, like stage 1 sees them
        idx = grow(tree, rng)
        h = run_level(shards, caches, tree, idx)
        outs.update({int(i): h[j] for j, i in enumerate(idx.tolist())})
    assert len(tree) > 6
    for shard in shards:
        untune_shard(shard)
    for i, h in outs.items():
        ref = causal_hidden(shards, PREFIX[:-1] + tree.path_tokens(i))
        assert torch.allclose(h, ref, atol=1e-10), i


def test_pruned_cache_equals_bruteforce_and_keeps_working():
    shards = target_shards(3)
    rng = random.Random(3)
    tree = SpecTree(PREFIX[-1], len(PREFIX) - 1)
    caches = prefill(shards, PREFIX[:-1])
    run_level(shards, caches, tree, torch.tensor([0]))
    for _ in range(3):
        run_level(shards, caches, tree, grow(tree, rng))
    before = [(c.k.clone(), c.v.clone(), c.n_prefix, c.tree_ids.clone()) for c in caches]
    child = int(tree.children(0)[-1])
    old_root = tree.root_id
    tree.prune_to(child)
    for c in caches:
        sync_cache(c, tree, [old_root])
    for (k, v, n_prefix, ids), c in zip(before, caches, strict=True):
        # brute force: the old root's row joins the prefix, then surviving rows in order
        keep = [n_prefix] + [n_prefix + j for j, i in enumerate(ids.tolist())
                             if i in set(tree.ids.tolist())]
        rows = list(range(n_prefix)) + keep
        assert c.n_prefix == n_prefix + 1
        assert c.tree_ids.tolist() == [i for i in ids.tolist() if i in set(tree.ids.tolist())]
        assert torch.equal(c.k[:, :, : c.length], k[:, :, rows])
        assert torch.equal(c.v[:, :, : c.length], v[:, :, rows])
    # a level computed after pruning (no recomputation) still equals the causal path
    idx = grow(tree, rng)
    h = run_level(shards, caches, tree, idx)
    committed = PREFIX[:-1] + [PREFIX[-1]]
    for j, i in enumerate(idx.tolist()):
        ref = causal_hidden(shards, committed + tree.path_tokens(i))
        assert torch.allclose(h[j], ref, atol=1e-10)


def test_cache_grown_in_inference_mode_can_be_pruned_outside() -> None:
    """A cache that outgrows its capacity mid-forward stays prunable afterwards."""
    import torch as _t

    from stages.model.kv_cache import StageCache

    cache = StageCache(1, 1, 2, 16, _t.float32)
    with _t.inference_mode():
        cache.write(0, _t.ones(40, 1, 2), _t.ones(40, 1, 2))
        cache.commit_write(_t.arange(1, 41))
    assert cache.capacity >= 40
    cache.keep(_t.arange(1, 41, 2))  # raised "Inplace update to inference tensor" before
    assert cache.n_tree == 20


def test_skinny_linear_matches_linear_for_every_row_count():
    """The CPU few-rows path (w @ x.T, padded to an even count) is x @ w.T, row for row."""
    from stages.model.model import SKINNY_ROWS, linear

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        w = torch.randn(37, 16, generator=gen, dtype=dtype)
        for n in range(1, SKINNY_ROWS + 3):
            x = torch.randn(n, 16, generator=gen, dtype=dtype)
            for inp in (x, x.t().contiguous().t()):  # row-major and column-major input
                out = linear(inp, w)
                assert out.shape == (n, 37) and out.is_contiguous()
                torch.testing.assert_close(out, inp @ w.t())


def test_one_vector_takes_the_kernel_chosen_for_one_row(monkeypatch):
    """ar's last hidden state reaches the LM head as one vector: it must take the kernel
    measured for one row (it took F.linear's, 2.3x slower for SmolLM2's float32 head)."""
    import stages.model.model as model

    calls = []

    def spy(x, w):
        calls.append(tuple(x.shape))
        return x @ w.t()

    monkeypatch.setitem(model.CPU_KERNELS, "packed", spy)
    w = torch.randn(24, 16)
    w._treepipe_kernels = ("packed",) * len(model.ROW_BUCKETS)
    v = torch.randn(16)
    with torch.inference_mode():
        out = model.linear(v, w)
    assert calls == [(1, 16)] and out.shape == (24,)
    torch.testing.assert_close(out, w @ v)


def test_packed_linear_matches_linear_and_follows_the_weight():
    """From SKINNY_ROWS + 1 rows on, an inference-mode float32 product on CPU uses the
    oneDNN-packed weight: x @ w.T for row- and column-major input, packed once, packed
    again after an in-place update of the weight; with gradients on it stays F.linear
    (draft training must reach the weight)."""
    from stages.model.model import (
        ONEDNN,
        ONEDNN_BF16,
        SKINNY_ROWS,
        linear,
        packed_kernel,
        packed_weight,
    )

    assert ONEDNN, "this torch has no oneDNN: the CPU path under test cannot run"
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(37, 16, generator=gen))
    with torch.inference_mode():
        for n in (SKINNY_ROWS + 1, 8, 33, 70):
            x = torch.randn(n, 16, generator=gen)
            for inp in (x, x.t().contiguous().t()):
                out = linear(inp, w)
                assert out.shape == (n, 37)
                torch.testing.assert_close(out, inp @ w.detach().t())
        first = packed_weight(w)
        assert first is not None and packed_weight(w) is first  # packed once
    with torch.no_grad():
        w.mul_(2.0)
    with torch.inference_mode():
        x = torch.randn(8, 16, generator=gen)
        assert packed_weight(w) is not first
        torch.testing.assert_close(linear(x, w), x @ w.detach().t())
        assert packed_weight(w.detach().double()) is None  # float32 and bf16 only
        half = w.detach().bfloat16()
        # bf16 packs where oneDNN has a bf16 path (AVX-512); elsewhere F.linear serves it
        assert (packed_weight(half) is not None) == ONEDNN_BF16
        xh = x.bfloat16()
        torch.testing.assert_close(packed_kernel(xh, half), xh @ half.t())

    x = torch.randn(8, 16, generator=gen)
    assert packed_weight(w) is None
    linear(x, w).sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(0).expand(37, 16))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5),
                                       (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_upcast_attention_is_the_fused_kernels_attention(dtype, tol, heads, kv_heads):
    """Attention upcast to float32 (the CPU alternative the tuner may pick) against
    torch's fused kernel in the inputs' dtype: padded requests, random visibility,
    grouped and plain heads."""
    gen = torch.Generator().manual_seed(3)
    for b, n, t, masked in ((1, 1, 300, False), (3, 5, 40, True), (2, 64, 70, True)):
        q = torch.randn(b, heads, n, 32, generator=gen).to(dtype)
        k, v = (torch.randn(b, kv_heads, t, 32, generator=gen).to(dtype) for _ in range(2))
        mask = None
        if masked:
            mask = torch.rand(b, 1, n, t, generator=gen) < 0.6
            mask[..., 0] = True  # every row sees a key, as PagedRows guarantees
        ref = sdpa_attention(q, k, v, mask)
        out = upcast_attention(q, k, v, mask)
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_query_heads_are_torchs_grouped_attention(dtype):
    """16-bit CPU attention folds the query heads that share a key head into its rows:
    against torch's own grouped call, one row and many, padded requests, masks."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(5)
    for b, n, t, masked in ((1, 1, 150, False), (8, 1, 40, True), (8, 2, 150, True),
                            (3, 5, 40, True), (1, 64, 70, True)):
        q = torch.randn(b, 9, n, 64, generator=gen).to(dtype)
        k, v = (torch.randn(b, 3, t, 64, generator=gen).to(dtype) for _ in range(2))
        mask = None
        if masked:
            mask = torch.rand(b, 1, n, t, generator=gen) < 0.6
            mask[..., 0] = True
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = sdpa_attention(q, k, v, mask)
        assert out.shape == ref.shape and out.dtype == dtype
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_only_one_row_steps_upcast_and_from_their_threshold(monkeypatch):
    """paged_attention attends a request's lone row in float32 once it has
    ``upcast_from`` keys, and with torch's fused kernel in the model's dtype otherwise."""
    import stages.model.model as model

    used = []

    def upcast(*a):
        n = len(used)
        out = upcast_attention(*a)
        del used[n:]  # its own call of the fused kernel, in float32
        used.append("upcast")
        return out

    monkeypatch.setattr(model, "upcast_attention", upcast)
    monkeypatch.setattr(model, "sdpa_attention",
                        lambda *a: used.append("sdpa") or sdpa_attention(*a))
    shard = target_shards(1)[0]
    n_layers = len(shard.layers)
    for upcast in (16, 0):
        set_upcast_from(shard, upcast)
        cache = shard.new_cache(64)
        used.clear()
        shard(torch.tensor(PROMPT[:14]), torch.arange(14), cache)  # 14 rows: fused
        assert used == ["sdpa"] * n_layers
        for pos, expect in ((14, "sdpa"), (15, "upcast"), (16, "upcast")):  # 15, 16, 17 keys
            used.clear()
            shard(torch.tensor(PROMPT[pos:pos + 1]), torch.tensor([pos]), cache)
            assert used == [expect if upcast else "sdpa"] * n_layers, (upcast, pos)
