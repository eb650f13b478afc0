"""Weight-only int8 (``--quantize int8``, stages/model/quantization.py): the quantized product
against the float one within int8's error, what a quantized shard holds, and the flag's and
the manifest's refusals (tests/test_lossless_tiny.py and test_batch_lossless.py run the
decoding methods against ar with the same int8 weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.cli.main import main
from orchestrator.models.loading import check_quantize
from stages.model.linear_tuning import weight_groups
from stages.model.model import linear
from stages.model.quantization import QMAX, Int8Linear, quantize_shard
from stages.speculation.engine import ConfigError
from tests.tiny_models import PROMPT, target_whole


def weight_error_bound(x: torch.Tensor, q: Int8Linear) -> torch.Tensor:
    """The most rounding each weight to its row's int8 grid can move each output:
    half a step (scale / 2) per weight, times |x|."""
    return x.abs().double() @ (q.scales.double()[:, None] / 2).expand(
        q.out_features, q.in_features).T


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_int8_product_matches_the_float_one_within_int8_error(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    q = Int8Linear.from_weight(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() == QMAX
    exact = x.double() @ w.double().T
    # float64 activations: the dequantized matmul, off only by the weights' rounding
    deq = q(x.double())
    assert ((deq - exact).abs() <= weight_error_bound(x, q) + 1e-9).all()
    # float32 activations: torch's int8 kernel with bfloat16 activations (the CPU's fast
    # path), its output in float32; bf16 rounds x and the output (2^-8 relative each)
    y = q(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    bf16 = 2 * 2.0 ** -8 * (x.abs().double() @ w.abs().double().T)
    assert ((y.double() - exact).abs() <= weight_error_bound(x, q) + bf16).all()
    rel = (y.double() - exact).norm() / exact.norm()
    assert 0 < rel < 0.02, rel  # quantized (not the float weight), and close
    # linear() hands an int8 weight its own product; bfloat16 activations stay bfloat16
    assert torch.equal(linear(x, q), y)
    assert q(x.bfloat16()).dtype == torch.bfloat16


def test_the_kernel_and_the_dequantized_matmul_multiply_by_the_same_weights() -> None:
    """The scales are rounded to bfloat16 before the weights are: the kernel's weights are
    exactly ``qweight * scales`` (the float64 tests' path), only the arithmetic differs."""
    w = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    q = Int8Linear.from_weight(w)
    assert torch.equal(q.scales.bfloat16().float(), q.scales)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    kernel = torch.ops.aten._weight_int8pack_mm(x, q.qweight, q.kernel_scales).double()
    ref = x.double() @ q.dequantized(torch.float64).T
    assert ((kernel - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-6).all()


def test_a_width_the_kernel_does_not_take_multiplies_dequantized() -> None:
    """The kernel takes in_features in multiples of 16 only (24 gave garbage in torch 2.13,
    17 crashed): other widths take the dequantized matmul, the same weights."""
    w = torch.randn(12, 24, generator=torch.Generator().manual_seed(3))
    q = Int8Linear.from_weight(w)
    assert q.kernel_dtype is None and q.kernel_scales is None
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(q(x), x @ q.dequantized().T)
    assert ((q(x.double()) - x.double() @ w.double().T).abs()
            <= weight_error_bound(x, q) + 1e-9).all()


def test_a_quantized_shard_holds_int8_projections_and_head_only() -> None:
    whole = target_whole()
    ids = torch.tensor(PROMPT)
    ref = whole.logits(whole(ids, torch.arange(len(PROMPT)), whole.new_cache(64)))
    q = quantize_shard(target_whole())
    att, mlp = q.layers[0].self_attn, q.layers[0].mlp
    for m in (att.wqkv, att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.w13,
              mlp.gate_proj, mlp.up_proj, mlp.down_proj, q.lm_head):
        assert isinstance(m, Int8Linear)
    assert not any(isinstance(m, nn.Linear) for m in q.modules())  # float weights dropped
    # the fused weight's parts are views of its rows, not copies
    assert att.k_proj.qweight.data_ptr() == att.wqkv.qweight[att.q_proj.out_features:].data_ptr()
    assert weight_groups(q) == {}  # nothing left for the kernel tuning to measure
    assert quantize_shard(q) is q  # a second call changes nothing
    out = q.logits(q(ids, torch.arange(len(PROMPT)), q.new_cache(64)))
    assert out.dtype == torch.float64 and not torch.equal(out, ref)
    assert torch.allclose(out, ref, atol=0.05 * ref.abs().max().item())


def test_a_bad_quantize_value_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench", "--quantize", "int4"], ["serve", "m", "--quantize", "fp8"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert "--quantize" in err[0] and "choose from 'none', 'int8'" in err[0], err
    with pytest.raises(ConfigError, match=r"unknown quantization 'int4'; use --quantize none "
                                          r"or int8"):
        check_quantize("int4")
    with pytest.raises(ValueError, match="use --quantize none or int8"):
        quantize_shard(target_whole(), "int4")
