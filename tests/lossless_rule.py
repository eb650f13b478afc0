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

The rule (``tie_tolerance``, ``first_difference``, ``flip_at_tie``) lives in
stages/speculation/near_ties.py, which ``treepipe bench`` judges its rows by too.
"""

from __future__ import annotations

import torch

from protocol.scheduling.records import GenerationResult
from stages.model.sampling import SamplingParams
from stages.speculation.near_ties import first_difference, flip_at_tie


def assert_lossless(ref: GenerationResult, out: GenerationResult, sampling: SamplingParams,
                    dtype: torch.dtype, label: str) -> None:
    """``out`` equals ``ref`` (an ar run with ``keep_logits``) up to a near-tie flip."""
    i = first_difference(ref.tokens, out.tokens)
    if i is None:
        assert len(out.tokens) == len(ref.tokens), f"{label}: {len(out.tokens)} tokens"
        return
    flip = flip_at_tie(ref.tokens, ref.logits, out.tokens, sampling, dtype)
    assert flip is not None and flip.index == i
    tol = flip.tolerance
    # float64 measures nothing (any flip is refused): say so instead of a number
    margin = f"{flip.margin:.3g}" if flip.margin is not None else flip.unmeasured
    if sampling.greedy:
        assert flip.allowed, f"{label}: differs from ar at token {i} where ar's top-2 gap is " \
                             f"{margin} (tolerance {tol:.3g})"
        return
    assert flip.allowed, f"{label}: differs from ar at token {i}, draw {margin} from a " \
                         f"boundary (tolerance {tol:.3g})"
