"""The lossless assertion of the tests: ``out`` equals ar's tokens, or first differs
from them at a near-tie that the precision allows.

The rule and its tolerances (``tie_tolerance``, ``first_difference``, ``flip_at_tie``)
live in stages/speculation/near_ties.py, which ``treepipe bench`` judges its rows by too.
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
