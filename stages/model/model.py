"""Llama-architecture decoder in plain PyTorch, split into stage shards.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (minus the ``model.``
prefix) so a safetensors folder loads without renaming.  A :class:`StageShard`
holds layers ``[start, end)`` plus the embedding on the first stage and the
final norm and LM head on the last; the whole model is the shard ``[0, n)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE
from stages.model.config import ModelArgs
from stages.model.kv_cache import BlockPool, StageCache


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse RoPE frequencies, with Llama-3 frequency scaling when configured."""
    hd = args.head_dim
    inv = 1.0 / (args.rope_base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = args.rope_scaling or {}
    if sc.get("rope_type", sc.get("type")) != "llama3":
        return inv
    factor = sc["factor"]
    low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_ctx = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [n, head_dim] for absolute positions (computed in float32 like HF)."""
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [n, heads, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def fuse_linears(*linears: nn.Linear) -> Tensor:
    """Concatenate bias-free linear weights (rows) and re-point each weight at its slice.

    Fewer, larger matmuls per token cost less call overhead on CPU; since the
    original parameters become views, loading a state dict still fills the fused
    tensor and no memory is duplicated.
    """
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row:row + rows], requires_grad=False)
        row += rows
    return fused


SKINNY_ROWS = 2  # untuned, products with at most this many rows go as w @ x.T (see linear)
# oneDNN's packed float32/bf16 linear (torch.ops.mkldnn, as torch.compile's CPU backend uses it)
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN packs bf16 weights only with AVX-512 (bw, vl, dq) or AVX-NE-CONVERT; elsewhere it
# refuses, and bf16 products stay on F.linear
ONEDNN_BF16 = ONEDNN and bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported",
                                      lambda: False)())
# row counts a CPU kernel choice is made for: a product takes the choice of the largest
# bucket not above its rows (64 and more: the last)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def row_bucket(n: int) -> int:
    """Index into :data:`ROW_BUCKETS` of the bucket ``n`` rows take."""
    return min(max(n, 1).bit_length() - 1, len(ROW_BUCKETS) - 1)


def plain_kernel(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear``: BLAS's own small-n kernel."""
    return F.linear(x, w)


def skinny_kernel(x: Tensor, w: Tensor) -> Tensor:
    """``w @ x.T`` padded to an even row count: oneDNN's kernel for the transposed, tall
    product, which on some CPUs reads the weights faster than its small-n ``linear``."""
    n = x.shape[0]
    xs = torch.cat([x, x[-1:]]) if n % 2 else x.contiguous()
    return (w @ xs.t())[:, :n].t().contiguous()


def packed_kernel(x: Tensor, w: Tensor) -> Tensor:
    """oneDNN's linear on the weight packed once into its blocked layout
    (:func:`packed_weight`); ``F.linear`` where packing does not apply."""
    packed = packed_weight(w)
    if packed is None:
        return F.linear(x, w)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def native_kernel(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear`` through ATen's own BLAS, oneDNN switched off for the call.

    Why: for a bf16 row ATen's float32-accumulating GEMV read SmolLM2's weights 1.3-1.8x
    faster than oneDNN's packed product (CPU-2, AVX-512 BF16, 2 threads, weights from
    DRAM: 576x1536 in 50 against 88 us, the 49152x576 head 1.76 against 2.29 ms), and with
    oneDNN on, bf16 ``F.linear`` takes oneDNN's unpacked path. The switch is process-wide
    and flipped back at once: a stage's products run on one thread (no stage process
    computes on two), so no other product runs meanwhile."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, w)
    finally:
        torch._C._set_mkldnn_enabled(was)


CPU_KERNELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "plain": plain_kernel, "skinny": skinny_kernel, "packed": packed_kernel}
if hasattr(torch._C, "_set_mkldnn_enabled"):  # private: a torch without it has no native
    CPU_KERNELS["native"] = native_kernel
# before a weight is tuned (stages.model.linear_tuning): one or two rows as w @ x.T, more
# on the packed weight, the rule measured on the first development machine
UNTUNED = tuple("skinny" if b <= SKINNY_ROWS else "packed" for b in ROW_BUCKETS)


def linear(x: Tensor, w: Tensor | nn.Module) -> Tensor:
    """``x @ w.T`` for x [n, in]; ``w`` a weight, an ``nn.Linear`` (its weight), or a module
    that computes its own product (an int8 weight, :mod:`stages.model.quantization`).

    On CPU the kernel is the one measured fastest for this weight at this many rows
    (:mod:`stages.model.linear_tuning` stores the choice on the weight, per
    :data:`ROW_BUCKETS`); which one wins differs by CPU, shape and rows (SmolLM2's
    [3072, 576] gate/up weight, 1 thread, from DRAM: on one AMD EPYC 1 row took 791 us
    plain against 1001 skinny, 2 rows 1741 plain against 940 skinny, 16 rows 1659 packed
    against 2203 plain). An untuned weight follows :data:`UNTUNED`.
    """
    if isinstance(w, nn.Module):
        if not isinstance(w, nn.Linear):
            return w(x)
        w = w.weight
    if x.dim() == 1:  # one vector (ar's last row): the same kernels as a row
        return linear(x[None], w)[0]
    if x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, w)
    if torch.compiler.is_compiling():  # the kernels are Python: an opaque op in a graph
        return cpu_linear(x, w)
    choice = getattr(w, "_treepipe_kernels", UNTUNED)[row_bucket(x.shape[0])]
    return CPU_KERNELS[choice](x, w)


@torch.library.custom_op("treepipe::cpu_linear", mutates_args=())
def cpu_linear(x: Tensor, w: Tensor) -> Tensor:
    """:func:`linear` as one operation a compiled graph calls without tracing into it."""
    return linear(x, w)


@cpu_linear.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def packed_weight(w: Tensor) -> Tensor | None:
    """``w`` in oneDNN's blocked layout for :func:`linear`, packed once (at load, by
    :meth:`StageShard.fuse`, else on first use) and kept on the tensor itself, so it goes
    when the weight goes; None where the packed kernel does not apply: not a CPU float32 or
    bfloat16 weight (bfloat16 needs :data:`ONEDNN_BF16`), gradients wanted (draft
    training), or a torch without oneDNN. An in-place update that bumps the version
    counter (``copy_``, an optimiser step) repacks; one that does not (through ``.data``,
    or to an inference tensor) would leave the copy stale, and no code here updates
    weights that way. Costs one more copy of the weight."""
    # bf16 as well: on CPU-2 (AVX-512 BF16) SmolLM2's packed bf16 weights read 1.3-1.7x
    # faster than F.linear's at one row, and whole-model ar went 38.5 -> 29.4 ms a token
    if (w.device.type != "cpu" or torch.is_grad_enabled() or not ONEDNN or w.dim() != 2
            or not (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and ONEDNN_BF16))):
        return None
    version = -1 if w.is_inference() else w._version
    hit = getattr(w, "_treepipe_packed", None)
    if hit is None or hit[0] != version:
        hit = (version, torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None))
        w._treepipe_packed = hit  # type: ignore[attr-defined]
    return hit[1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # 16-bit inputs normalise in float32, as Hugging Face's Llama does: in bf16 the
        # mean square's rounding changed SmolLM2's greedy answers (to "the capital of
        # France?" it no longer said Paris, which transformers' bf16 model does)
        h = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass
class Segment:
    """One request's share of a packed (ragged) forward: ``n`` consecutive entries.

    ``ids``/``tree_mask`` as in :meth:`StageShard.forward`.
    """

    cache: StageCache
    n: int
    tree_mask: Tensor | None = None
    ids: Tensor | None = None

    def rows_mask(self) -> Tensor:
        """Which of the cache's tree rows and the new rows each new entry sees (before
        :meth:`StageCache.reserve`): the tree mask, or for committed rows a causal one."""
        if self.tree_mask is not None:
            return self.tree_mask
        c = self.cache
        return torch.ones(self.n, c.n_tree + self.n, dtype=torch.bool).tril(c.n_tree)


class RowIndex(NamedTuple):
    """Where a packed forward's rows go in the paged pool, as tensors only (what every
    layer, eager or compiled, reads; see :class:`PagedRows`)."""

    write: Tensor  # [N] slots of the new entries, in packed order
    read: Tensor  # [B, T_max] slots of each request's keys (cached, then new), padded
    pad: Tensor  # [B, n_max] packed entry each padded query row takes (padding: any)
    unpad: Tensor  # [N] padded row of each packed entry
    mask: Tensor | None  # [B, 1, n_max, T_max] keys each padded row sees; None: all


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """torch's fused attention, q [B, heads, n, hd] over k, v [B, kv_heads, T, hd].

    On a CPU in 16 bits the query heads that share a key head go in as rows of that
    head: torch's kernel pays per (request, head) and takes a slow path at one query
    row, so the folded call ran 3-7x faster at one row (CPU-2, bf16, 9 heads over 3,
    one thread: 30 against 137 us over 150 keys, 276 against 1929 over 2048; 8 requests
    of one row 208 against 1099; of two rows 232 against 428) and level from 4 rows a
    request on, with the same values (each row's sums run over the same key blocks)."""
    b, h, n, hd = q.shape
    kv = k.shape[1]
    if h != kv and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        g = h // kv  # q's heads are kv-major, so head kv * g + j is row j * n + i of kv
        m = None if mask is None else mask.repeat(1, 1, g, 1)
        out = F.scaled_dot_product_attention(q.reshape(b, kv, g * n, hd), k, v, attn_mask=m)
        return out.reshape(b, h, n, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)


def upcast_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """:func:`sdpa_attention` on q, k, v upcast to at least float32, back in q's dtype.

    Why: torch's 16-bit fused kernel on a CPU costs about 1 us per key at one query row
    called with grouped heads (CPU-2, bf16, 9 heads over 3, one thread: 539 us over 512
    keys), where its float32 kernel on the values upcast took 94, the copies included.
    Since :func:`sdpa_attention` folds the grouped heads into rows (76 us there) it won
    on CPU-2 no more; whether and from how many keys it wins at one row is measured per
    machine (:mod:`stages.model.linear_tuning`)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = sdpa_attention(q.to(acc), k.to(acc), v.to(acc), mask)
    return out.to(q.dtype)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, pk: Tensor, pv: Tensor,
                    rows: RowIndex, upcast_from: int = 0) -> Tensor:
    """Store the new k, v [N, kv_heads, hd] in one layer's pool ``pk``/``pv``
    [kv_heads, slots, hd], then attend the packed queries q [N, heads, hd] to their own
    request's keys; returns [N, heads, hd]. Steps of one row a request attend with
    :func:`upcast_attention` from ``upcast_from`` keys on (measured on a CPU; 0: never),
    the rest with torch's fused kernel. One row only: a compiled step specialises on it
    anyway, where a choice by row count would split its graphs by ranges of rows."""
    pk.index_copy_(1, rows.write, k.transpose(0, 1))
    pv.index_copy_(1, rows.write, v.transpose(0, 1))
    n_kv, hd = pk.shape[0], pk.shape[2]
    b, t = rows.read.shape
    keys, values = (p.index_select(1, rows.read.view(-1)).view(n_kv, b, t, hd).transpose(0, 1)
                    for p in (pk, pv))
    one_row = rows.pad.shape[1] == 1
    attend = upcast_attention if upcast_from and one_row and t >= upcast_from else sdpa_attention
    if b == 1:  # one request: its rows are the padded batch as they stand (pad, unpad: 0..n)
        return attend(q[None].transpose(1, 2), keys, values, rows.mask)[0].transpose(0, 1)
    qb = q.index_select(0, rows.pad.view(-1)).view(b, rows.pad.shape[1], *q.shape[1:])
    out = attend(qb.transpose(1, 2), keys, values, rows.mask)
    return out.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, rows.unpad)


@dataclass
class PagedRows:
    """A packed forward's paged K/V and how its ragged entries map onto a padded batch.

    Attention runs as one batched call over ``B`` requests padded to ``n_max`` entries
    and ``T_max`` keys each, so its cost grows with each request's own rows, not with
    every request's rows times every other's (a block-diagonal mask over the packed
    entries costs ``N x T`` and takes SDPA's slow math path on CPU).
    """

    pool: BlockPool
    rows: RowIndex

    @classmethod
    def pack(cls, segments: list[Segment], device: torch.device) -> PagedRows:
        """Reserve each segment's new rows in its cache and lay the batch out."""
        if len(segments) == 1:
            return cls._pack_one(segments[0], device)
        return cls._pack_many(segments, device)

    @classmethod
    def _pack_many(cls, segments: list[Segment], device: torch.device) -> PagedRows:
        """:meth:`pack` for any number of requests."""
        pool = segments[0].cache.pool
        n_max = max(seg.n for seg in segments)
        writes, reads, masks = [], [], []
        for seg in segments:
            c, n = seg.cache, seg.n
            if c.pool is not pool:
                raise ValueError("a packed forward needs every request's cache in one pool")
            masks.append(torch.cat([torch.ones(n, c.n_prefix, dtype=torch.bool),
                                    seg.rows_mask()], dim=1))
            new, every = c.reserve(n)
            writes.append(new)
            reads.append(every)
        t_max = max(r.numel() for r in reads)
        # a lone committed entry sees every row it has: no mask (SDPA's fast path)
        plain = len(segments) == 1 and segments[0].ids is None and segments[0].n == 1
        mask = None if plain else torch.zeros(len(segments), 1, n_max, t_max, dtype=torch.bool)
        pad, unpad, start = [], [], 0
        for b, (seg, m) in enumerate(zip(segments, masks, strict=True)):
            if mask is not None:
                mask[b, 0, :seg.n, :m.shape[1]] = m
                mask[b, 0, seg.n:, 0] = True  # padding rows see one real key, not none
            pad += list(range(start, start + seg.n)) + [start] * (n_max - seg.n)
            unpad += range(b * n_max, b * n_max + seg.n)
            start += seg.n
        # padding keys read slot 0 of the pool; the mask hides them
        read = torch.zeros(len(segments), t_max, dtype=torch.long, device=pool.k.device)
        for b, r in enumerate(reads):
            read[b, :r.numel()] = r
        return cls(pool, RowIndex(torch.cat(writes), read,
                                  torch.tensor(pad, device=device).view(len(segments), n_max),
                                  torch.tensor(unpad, device=device),
                                  None if mask is None else mask.to(device)))


    @classmethod
    def _pack_one(cls, seg: Segment, device: torch.device) -> PagedRows:
        """:meth:`pack` for one request, in a handful of operations: on a GPU each is a
        launch or a copy the step waits on, and most steps of one request are this."""
        c, n = seg.cache, seg.n
        # a lone committed row (ar, pp) sees every key: no mask, and none built; building
        # it took 1.3 ms of an 8-stage H200 ar token's 6.4 (tril, 8 calls a token, each
        # waking the process's CPU threads)
        tm = seg.rows_mask() if seg.ids is not None or n > 1 else None
        n_prefix = c.n_prefix
        new, every = c.reserve(n)
        mask = None
        if tm is not None:
            full = torch.zeros(1, 1, n, every.numel(), dtype=torch.bool)
            full[0, 0, :, :n_prefix] = True
            full[0, 0, :, n_prefix:n_prefix + tm.shape[1]] = tm
            mask = full.to(device)
        rows = torch.arange(n, device=device)
        return cls(c.pool, RowIndex(new, every.view(1, -1), rows.view(1, n), rows, mask))


class Attention(nn.Module):
    """Grouped-query attention over a stage cache with an explicit (tree) mask."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * self.hd, args.dim, bias=False)
        self.wqkv: Tensor | nn.Module | None = None  # nn.Module: int8
        self.upcast_from = 0  # keys from which one-row steps upcast (linear_tuning)

    def fuse(self) -> None:
        """One QKV matmul instead of three; the HF-named weights become views into it."""
        self.wqkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pk: Tensor, pv: Tensor,
                rows: RowIndex) -> Tensor:
        n, h, kv, hd = x.shape[0], self.n_heads, self.n_kv, self.hd
        if self.wqkv is not None:
            # one rotation over the query and key heads side by side: half the small
            # operations of two, which on a CPU cost more than their arithmetic
            qkv = linear(x, self.wqkv).reshape(n, h + 2 * kv, hd)
            qk = apply_rope(qkv[:, :h + kv], cos, sin)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv:]
        else:
            q, k, v = (linear(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
            q = apply_rope(q.reshape(n, h, hd), cos, sin)
            k = apply_rope(k.reshape(n, kv, hd), cos, sin)
            v = v.reshape(n, kv, hd)
        out = paged_attention(q, k, v, pk, pv, rows, self.upcast_from)
        return linear(out.reshape(n, self.n_heads * self.hd), self.o_proj)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.w13: Tensor | nn.Module | None = None  # nn.Module: int8

    def fuse(self) -> None:
        """One gate+up matmul instead of two; the HF-named weights become views into it."""
        self.w13 = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is not None:
            gate, up = linear(x, self.w13).chunk(2, dim=-1)
        else:
            gate, up = linear(x, self.gate_proj), linear(x, self.up_proj)
        return linear(F.silu(gate) * up, self.down_proj)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = FeedForward(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pk: Tensor, pv: Tensor,
                rows: RowIndex) -> Tensor:
        """One decoder layer on the packed rows; ``pk``/``pv`` are this layer's pool."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pk, pv, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


def layer_call(layer: TransformerBlock, h: Tensor, cos: Tensor, sin: Tensor, pk: Tensor,
               pv: Tensor, rows: RowIndex) -> Tensor:
    """One layer's step, as a free function: the unit :mod:`stages.model.compiled`
    compiles once and every layer of every shard of one shape reuses."""
    return layer(h, cos, sin, pk, pv, rows)


class StageShard(nn.Module):
    """Layers [start, end) of the model; embedding if first, norm + LM head if last."""

    def __init__(self, args: ModelArgs, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= args.n_layers:
            raise ValueError(f"shard [{start}, {end}) is outside the model's "
                             f"{args.n_layers} layers")
        self.args, self.start, self.end = args, start, end
        self.is_first, self.is_last = start == 0, end == args.n_layers
        # on the meta device (load_shard: the checkpoint sets every weight) nothing is
        # computed: there the embedding's normal_ and RoPE's division would run torch's
        # Python references, whose first call imports torch._dynamo (~2 s of CPU in every
        # worker's start)
        meta = torch.get_default_device().type == "meta"
        vd = (args.vocab_size, args.dim)
        self.embed_tokens = ((nn.Embedding(*vd, _weight=torch.empty(vd)) if meta
                              else nn.Embedding(*vd)) if self.is_first else None)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(end - start))
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False) if self.is_last else None
        self.register_buffer("inv_freq", torch.empty((args.head_dim + 1) // 2) if meta
                             else rope_inv_freq(args), persistent=False)
        # how each layer runs: eager, or compiled (stages.model.compiled.compile_shard)
        self.layer_fn: Callable[..., Tensor] = layer_call
        # what runs the layers of a step: layer_loop, or its captured CUDA graphs
        # (stages.model.cuda_graphs.StepGraphs, which pads the step to a bucket)
        self.step_fn: Callable[..., Tensor] = self.layer_loop

    def fuse(self) -> StageShard:
        """Fuse QKV and gate/up matmuls and pack them for the CPU kernel (:func:`linear`);
        call after the final ``.to(dtype/device)``."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        # packing at load, not in the first request with 3+ rows: SmolLM2's weights take
        # about 0.6 s to pack, a stall that request (and a benchmark's first row) would pay
        with torch.no_grad():
            for layer in self.layers:
                att, mlp = layer.self_attn, layer.mlp
                assert att.wqkv is not None and mlp.w13 is not None
                for w in (att.wqkv, att.o_proj.weight, mlp.w13, mlp.down_proj.weight):
                    packed_weight(w)
            if self.lm_head is not None:
                packed_weight(self.lm_head.weight)
        return self

    @property
    def n_local_layers(self) -> int:
        return self.end - self.start

    def checkpoint_keys(self) -> dict[str, str]:
        """Map from Hugging Face checkpoint key to this shard's parameter name."""
        keys: dict[str, str] = {}
        for name, _ in self.named_parameters():
            if name.startswith("layers."):
                _, j, rest = name.split(".", 2)
                keys[f"model.layers.{self.start + int(j)}.{rest}"] = name
            elif name == "lm_head.weight":
                keys["lm_head.weight"] = name
            else:
                keys[f"model.{name}"] = name
        return keys

    def new_cache(self, capacity: int) -> StageCache:
        """An empty KV cache for this shard's layers (its own pool, grown on demand)."""
        p = next(self.parameters())
        return StageCache(self.n_local_layers, self.args.n_kv_heads, self.args.head_dim,
                          capacity, p.dtype, p.device)

    def new_pool(self, n_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 growable: bool = False) -> BlockPool:
        """A pool of KV blocks that many requests' caches share (SpecPipe-DB): fixed, or
        (``growable``) doubling when full."""
        p = next(self.parameters())
        return BlockPool(self.n_local_layers, self.args.n_kv_heads, self.args.head_dim,
                         n_blocks, p.dtype, p.device, block_size, growable)

    def forward(self, x: Tensor, positions: Tensor, cache: StageCache,
                tree_mask: Tensor | None = None, ids: Tensor | None = None) -> Tensor:
        """Run the shard on n new entries and append their K/V to ``cache``.

        ``x`` is token ids [n] on the first stage, hidden states [n, dim] otherwise.
        With ``ids`` the entries are tree nodes and ``tree_mask`` [n, n_tree + n]
        says which tree rows (those already cached, then the new ones) each new
        entry sees; the committed prefix is always visible.  Without ``ids`` the
        entries extend the committed prefix, causally.
        Returns hidden states [n, dim] (normed on the last stage, before the head).
        """
        return self.forward_packed(x, positions, [Segment(cache, int(x.shape[0]), tree_mask, ids)])

    @torch.inference_mode()
    def forward_packed(self, x: Tensor, positions: Tensor, segments: list[Segment]) -> Tensor:
        """One forward over the packed entries of several requests (a ragged batch).

        ``x``/``positions`` hold every segment's entries one segment after another;
        all caches share one pool.  An entry sees only its own request's committed
        prefix and (tree mask or causal) rows: attention runs per request, batched.
        """
        dev = self.inv_freq.device
        h = self.embed_tokens(x.to(dev)) if self.embed_tokens is not None else x.to(dev)
        if self.layer_fn is not layer_call and not h.is_inference():
            # hidden states made outside inference mode carry autograd's dispatch keys,
            # which a compiled layer guards on: one graph would become two
            h = h.clone()
        if sum(s.n for s in segments) != h.shape[0]:
            raise ValueError("segment sizes do not add up to the packed entries")
        kv = PagedRows.pack(segments, h.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions.to(h.device), h.dtype)
        h = self.run_layers(h, cos, sin, kv.pool.k, kv.pool.v, kv.rows)
        for seg in segments:
            seg.cache.commit_write(seg.ids)
        return self.norm(h) if self.norm is not None else h

    def logits(self, h: Tensor) -> Tensor:
        """LM-head logits for final-stage hidden states."""
        assert self.lm_head is not None, "only the last stage has the LM head"
        with torch.inference_mode():
            return linear(h, self.lm_head)

    def run_layers(self, h: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                   rows: RowIndex) -> Tensor:
        """The shard's layers over packed rows, as :attr:`step_fn` runs them."""
        return self.step_fn(h, cos, sin, k_pool, v_pool, rows)

    def layer_loop(self, h: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor,
                   rows: RowIndex) -> Tensor:
        """The shard's layers over packed rows, one after another."""
        for j, layer in enumerate(self.layers):
            h = self.layer_fn(layer, h, cos, sin, k_pool[j], v_pool[j], rows)
        return h


def randomise(shard: StageShard, gen: torch.Generator) -> StageShard:
    """Fill ``shard``'s parameters in place: norms near 1, weights scaled by 1/sqrt(fan-in)."""
    with torch.no_grad():
        for name, p in shard.named_parameters():
            r = torch.randn(p.shape, generator=gen, device=gen.device)
            p.copy_(1.0 + 0.1 * r if "norm" in name else r * (1.0 / math.sqrt(p.shape[-1])))
        if shard.is_first and shard.is_last and shard.args.tie_embeddings:
            shard.lm_head.weight.copy_(shard.embed_tokens.weight)
    return shard


def random_shards(args: ModelArgs, bounds: list[tuple[int, int]], seed: int = 0,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> list[StageShard]:
    """Shards of one randomly initialised model (fixed seed), for tests and benchmarks."""
    full = randomise(StageShard(args, 0, args.n_layers), torch.Generator().manual_seed(seed))
    state = {hf: full.state_dict()[name] for hf, name in full.checkpoint_keys().items()}
    return [shard_from_state(args, a, b, state, dtype, device) for a, b in bounds]


def random_layer(args: ModelArgs, layer: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", seed: int = 0,
                 n_layers: int = 1) -> StageShard:
    """``n_layers`` random decoder layers from ``layer`` on, built directly on ``device``
    (a 70B layer without the 70B)."""
    with torch.device(device):
        shard = StageShard(args, layer, layer + n_layers).to(dtype)
    return randomise(shard, torch.Generator(device).manual_seed(seed)).eval().fuse()


def shard_from_state(args: ModelArgs, start: int, end: int, state: dict[str, Tensor],
                     dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> StageShard:
    """A shard whose parameters come from a Hugging Face-keyed state dict."""
    shard = StageShard(args, start, end)
    own = {}
    for hf, name in shard.checkpoint_keys().items():
        if hf not in state and hf == "lm_head.weight" and args.tie_embeddings:
            hf = "model.embed_tokens.weight"
        own[name] = state[hf]
    shard.load_state_dict(own, strict=True)
    # fuse after the move: the fused QKV / gate-up tensors are plain attributes
    return shard.to(dtype=dtype, device=device).eval().fuse()
