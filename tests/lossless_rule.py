"""When a method's tokens may differ from ar's: only at a near-tie, never elsewhere.

Tree attention and single-token decoding sum in different orders, so in float32 and
bf16 a near-tie can flip an argmax (or a sampled draw that sits on a CDF boundary).
A difference is accepted only if it STARTS at such a position; the tolerance depends
on the precision (docs/engine.md, "Lossless"):

* float64: none (exact);
* float32: ar's top-two logits within 1e-4 (or, sampling, the draw within 1e-4 of a
  boundary);
* bfloat16: within 2^-6 of the top logit's magnitude (at least 2^-6): a few bf16 units
  in the last place, since bf16 keeps 8 significant bits.
"""

from __future__ import annotations

import torch

from protocol.scheduling.records import GenerationResult
from stages.model.sampling import SamplingParams, filtered_probs, uniform_for


def tie_tolerance(dtype: torch.dtype, top: float) -> float:
    """How close ar's two best logits (or a draw and a boundary) must be for a flip."""
    if dtype == torch.float64:
        return 0.0
    if dtype == torch.bfloat16:
        return 2.0 ** -6 * max(1.0, abs(top))
    return 1e-4


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def assert_lossless(ref: GenerationResult, out: GenerationResult, sampling: SamplingParams,
                    dtype: torch.dtype, label: str) -> None:
    """``out`` equals ``ref`` (an ar run with ``keep_logits``) up to a near-tie flip."""
    i = first_difference(ref.tokens, out.tokens)
    if i is None:
        assert len(out.tokens) == len(ref.tokens), f"{label}: {len(out.tokens)} tokens"
        return
    logits = ref.logits[i]
    top2 = torch.topk(logits, 2).values
    tol = tie_tolerance(dtype, float(top2[0]))
    if sampling.greedy:
        gap = float(top2[0] - top2[1])
        assert gap <= tol, f"{label}: differs from ar at token {i} where ar's top-2 gap is " \
                           f"{gap:.3g} (tolerance {tol:.3g})"
        return
    _, probs = filtered_probs(logits, sampling)
    dist = float((torch.cumsum(probs, 0) - uniform_for(sampling.seed, i)).abs().min())
    assert dist <= tol, f"{label}: differs from ar at token {i}, draw {dist:.3g} from a " \
                        f"boundary (tolerance {tol:.3g})"
