"""Lossless in float32 and bfloat16, and with int8 weights on torch's int8 kernel (a
float32 model whose products run in bf16): every method equals ar of the same precision
and weights, up to the near-tie rule of tests/lossless_rule.py at the products' precision
(float64 is exact: test_lossless_tiny.py).

With TREEPIPE_TEST_DEVICE=cuda the same cases run on a GPU, where the kernels sum in
other orders than on the CPU (docs/benchmarks.md, "GPU runs").
"""

import pytest
import torch

from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, NgramSource
from tests.lossless_rule import assert_lossless
from tests.tiny_models import PROMPT, target_shards, target_whole

N_NEW = 32
# name -> (the model's dtype, its weights (--quantize), the precision its near-ties are
# judged at: the int8 kernel's bf16 products)
DTYPES = {"float32": (torch.float32, "none", torch.float32),
          "bfloat16": (torch.bfloat16, "none", torch.bfloat16),
          "int8": (torch.float32, "int8", torch.bfloat16)}
SAMPLINGS = {"greedy": SamplingParams(),
             "sampled": SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11)}
# specinfer's tree is the engine's static branching whatever w and k: once per source
CASES = [("pp", 1, 1, None)] + [("specpipe", w, k, src) for w, k in ((1, 1), (4, 2))
                                 for src in ("self", "ngram")] + \
    [("specinfer", 4, 2, src) for src in ("self", "ngram")]


@pytest.fixture(scope="module")
def references():
    return {(d, s): PipelineEngine([target_whole(dt, quantize=q)]).generate(
        PROMPT, N_NEW, sp, "ar", keep_logits=True)
            for d, (dt, q, _) in DTYPES.items() for s, sp in SAMPLINGS.items()}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", [3])
def test_methods_match_ar_in_dtype(m, dtype, sampling, references):
    (dt, quantize, rule), sp = DTYPES[dtype], SAMPLINGS[sampling]
    ref = references[(dtype, sampling)]
    hits = 0
    for method, w, k, src in CASES:
        source = (DraftModelSource(target_whole(dt)) if src == "self"
                  else NgramSource() if src == "ngram" else None)
        out = PipelineEngine(target_shards(m, dt, quantize=quantize), source, width=w,
                             topk=k).generate(PROMPT, N_NEW, sp, method)
        assert_lossless(ref, out, sp, rule, f"{method} w={w} k={k} {src} m={m} {dtype}")
        hits += sum(s.hits for s in out.steps)
    assert hits > 0  # the self-draft must verify levels, or the tree path went untested
