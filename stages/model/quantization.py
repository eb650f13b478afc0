"""Weight-only int8 (``--quantize int8``): every stage Linear as int8 weights and one scale
per output row, quantized once at load.

Symmetric per output channel: row ``i`` of a weight ``W`` becomes ``q[i] = round(W[i] /
s[i])`` in [-127, 127] with ``s[i] = max|W[i]| / 127``, so ``W ~ q * s[:, None]``. The
projections of attention (the fused QKV and the output) and of the MLP (the fused gate/up
and the down projection) and the LM head are quantized; embeddings and norms stay in the
model's dtype, and so do the KV cache and attention. The product on a CPU is torch's own
``torch.ops.aten._weight_int8pack_mm`` (int8 weights times 16- or 32-bit activations, the
per-row scale applied to the output); for activations it does not take (float64, the
tiny test models) and off the CPU it is a matmul on the dequantized weight, the same math.

Lossless stays what it is: every method runs the same quantized weights, so ``ar`` in
int8 mode is the reference of every method in int8 mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stages.model.execution_modes import QUANTIZE_MODES

# the activation dtype of each model dtype's int8 products on a CPU (absent: dequantized).
# float32 activations go in as bfloat16: _weight_int8pack_mm is vectorised for 16-bit
# activations only. SmolLM2's [3072, 576] gate/up weight, 1 thread, an AMD EPYC
# (docs/bench/execution/int8_matmul.py): bf16 activations 525 / 716 / 1944 us at
# 1 / 4 / 16 rows against the float32 weight's 1112 / 1857 / 2480 us; float32 activations
# 2-14x slower than the float32 weight. Whole-model ar, SmolLM2, 1 thread, process CPU
# time per token (docs/bench/execution/int8_activations.py, the better of two runs on a
# shared 2-core EPYC with avx512_bf16): float32 47.2 ms, int8 in a float32 model (bf16
# products only) 29.7, int8 in a bfloat16 model (norms, attention and KV in bf16 too)
# 31.1, bfloat16 46.3. The whole model in bf16 buys nothing over the cast, so a float32
# model stays float32 (--dtype auto on a CPU) and only its products' inputs are cast.
KERNEL_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
QMAX = 127  # symmetric: -128 is never used, so q and -q are both int8
# the kernel takes in_features in multiples of this only: in torch 2.13 on CPU, 24 and 40
# gave garbage (1e27) and 8 (at 5 rows), 17 and 33 crashed the process; 16, 32, 48 ... 8192
# matched the dequantized product at 1 to 130 rows. Other widths multiply dequantized.
KERNEL_IN_MULTIPLE = 16


class Int8Linear(nn.Module):
    """A bias-free Linear as int8 weights ``qweight`` [out, in] and per-row ``scales``
    [out]; it computes its own product (:func:`stages.model.model.linear` calls it).

    ``scales`` hold values the kernel's activation dtype represents exactly (bfloat16 for
    a float32 or bfloat16 model), rounded before the weights are, so the kernel and the
    dequantized matmul multiply by the same weights."""

    def __init__(self, qweight: Tensor, scales: Tensor, kernel_dtype: torch.dtype | None):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != qweight.shape[:1]:
            raise ValueError(f"Int8Linear needs int8 weights [out, in] and [out] scales, got "
                             f"{qweight.dtype} {list(qweight.shape)} and {list(scales.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.kernel_dtype = kernel_dtype
        # the scales in the kernel's dtype, as its op wants them (made once, not per call)
        self.register_buffer("kernel_scales", None if kernel_dtype is None
                             else scales.to(kernel_dtype), persistent=False)

    @classmethod
    def from_weight(cls, w: Tensor) -> Int8Linear:
        """``w`` [out, in] (any float dtype) quantized per output row."""
        kernel = KERNEL_DTYPES.get(w.dtype) if w.shape[-1] % KERNEL_IN_MULTIPLE == 0 else None
        exact = torch.promote_types(w.dtype, torch.float32)  # float64 stays float64
        wf = w.detach().to(exact)
        scales = wf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / QMAX
        if kernel is not None:  # the scale the kernel will multiply by
            scales = scales.to(kernel).to(exact).clamp_min(torch.finfo(kernel).tiny)
        q = torch.round(wf / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return cls(q.contiguous(), scales, kernel)

    def rows(self, start: int, end: int) -> Int8Linear:
        """Output rows [start, end) as a view of this one (a fused weight's parts)."""
        return Int8Linear(self.qweight[start:end], self.scales[start:end], self.kernel_dtype)

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight ``qweight * scales`` [out, in] these products multiply by."""
        dtype = dtype or self.scales.dtype
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        """``x @ W.T`` for x [..., in], in x's dtype."""
        if self.kernel_scales is not None and x.device.type == "cpu" \
                and x.dtype in KERNEL_DTYPES:
            x2 = x.reshape(-1, x.shape[-1]).to(self.kernel_dtype).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.kernel_scales)
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel_dtype}")


def _quantized_parts(fused: Tensor, *linears: nn.Linear) -> tuple[Int8Linear, list[Int8Linear]]:
    """The fused weight quantized, and each of ``linears`` (whose weights are its row
    slices, :func:`stages.model.model.fuse_linears`) as a view of its rows: per-row
    scales make the fused quantization the parts' quantizations stacked."""
    q = Int8Linear.from_weight(fused)
    parts, row = [], 0
    for lin in linears:
        n = lin.weight.shape[0]
        parts.append(q.rows(row, row + n))
        row += n
    return q, parts


def check_mode(mode: str) -> str:
    """``mode`` if it names one of :data:`QUANTIZE_MODES`; ValueError naming the fix."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {mode!r}; use --quantize "
                         f"{' or '.join(QUANTIZE_MODES)}")
    return mode


def quantize_shard(shard: nn.Module, mode: str = "int8") -> nn.Module:
    """Replace ``shard``'s (a :class:`~stages.model.model.StageShard`, fused) projections
    and LM head by :class:`Int8Linear` in place (``mode`` none: nothing); the float
    weights are dropped. Returns the shard."""
    if check_mode(mode) == "none":
        return shard
    with torch.no_grad():
        for layer in shard.layers:
            att, mlp = layer.self_attn, layer.mlp
            if isinstance(att.wqkv, Int8Linear):
                continue  # quantized already
            if att.wqkv is None or mlp.w13 is None:
                raise ValueError("quantize a shard after StageShard.fuse()")
            att.wqkv, (att.q_proj, att.k_proj, att.v_proj) = _quantized_parts(
                att.wqkv, att.q_proj, att.k_proj, att.v_proj)
            mlp.w13, (mlp.gate_proj, mlp.up_proj) = _quantized_parts(
                mlp.w13, mlp.gate_proj, mlp.up_proj)
            att.o_proj = Int8Linear.from_weight(att.o_proj.weight)
            mlp.down_proj = Int8Linear.from_weight(mlp.down_proj.weight)
        if isinstance(shard.lm_head, nn.Linear):
            shard.lm_head = Int8Linear.from_weight(shard.lm_head.weight)
    return shard


def is_quantized(shard: nn.Module) -> bool:
    """Whether ``shard``'s weights are int8 (:func:`quantize_shard` ran on it)."""
    return any(isinstance(m, Int8Linear) for m in shard.modules())


__all__ = ["Int8Linear", "KERNEL_DTYPES", "is_quantized", "quantize_shard"]
