"""When a method's tokens may differ from ar's: only at a near-tie, never elsewhere.

Tree attention and single-token decoding sum in different orders, so in float32 and
bf16 a near-tie can flip an argmax (or a sampled draw that sits on a CDF boundary).
A difference is accepted only if it STARTS at such a position; the tolerance depends
on the precision (docs/engine.md, "Lossless"):

* float64: none (exact: any difference is refused, even at an exact tie);
* float32: ar's top-two logits within 1e-4 (or, sampling, the draw within 1e-4 of a
  boundary);
* bfloat16: within 2^-6 of the top logit's magnitude (at least 2^-6): a few bf16 units
  in the last place, since bf16 keeps 8 significant bits.

The tests (tests/lossless_rule.py) and ``treepipe bench`` both judge by this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stages.model.sampling import SamplingParams, filtered_probs, uniform_for

_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bf16",
          torch.float16: "float16"}


def tie_tolerance(dtype: torch.dtype, top: float) -> float:
    """How close ar's two best logits (or a draw and a boundary) must be for a flip."""
    if dtype == torch.float64:
        return 0.0
    if dtype == torch.bfloat16:
        return 2.0 ** -6 * max(1.0, abs(top))
    return 1e-4


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or None (one may still be longer)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


@dataclass(frozen=True)
class TieFlip:
    """Where ``out`` first differs from ar's ``ref``, and how close ar's choice was there.

    ``margin``: greedy, ar's top-two logit gap; sampling, the draw's distance to the
    nearest CDF boundary; None where nothing was measured, and then ``unmeasured`` says
    why (float64 refuses any flip; a run merely longer than the other; no logits).
    """

    index: int
    margin: float | None
    tolerance: float
    greedy: bool
    dtype: torch.dtype
    unmeasured: str = ""

    @property
    def allowed(self) -> bool:
        """True when the difference starts at a near-tie within the dtype's tolerance."""
        # tolerance 0 is float64: exact, so not even an exact tie may flip
        return self.margin is not None and self.tolerance > 0 and self.margin <= self.tolerance

    def describe(self) -> str:
        """``from token I, at a near-tie of ... : allowed``, or why it is a real difference."""
        if self.margin is None:
            return f"from token {self.index} ({self.unmeasured})"
        name = _NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))
        where = (f"ar's top two logits (gap {self.margin:.3g}" if self.greedy
                 else f"a CDF boundary (draw {self.margin:.3g} from it")
        where += f", {name} tolerance {self.tolerance:.3g})"
        if self.allowed:
            return f"from token {self.index}, at a near-tie of {where}: allowed"
        return f"from token {self.index}, not at a near-tie of {where}"


def tie_margin(logits: Tensor, sampling: SamplingParams, index: int) -> tuple[float, float]:
    """(margin, top logit) of ar's choice at generated position ``index`` from its 1-D
    logits: greedy, the top-two gap; sampling, the seeded draw's distance to the nearest
    boundary of the filtered CDF."""
    top2 = torch.topk(logits, 2).values
    top = float(top2[0])
    if sampling.greedy:
        return float(top2[0] - top2[1]), top
    _, probs = filtered_probs(logits, sampling)
    return float((torch.cumsum(probs, 0) - uniform_for(sampling.seed, index)).abs().min()), top


def flip_at_tie(ref_tokens: Sequence[int], ref_logits: Sequence[Tensor] | Mapping[int, Tensor],
                out_tokens: Sequence[int], sampling: SamplingParams,
                dtype: torch.dtype) -> TieFlip | None:
    """None when ``out_tokens`` equals ar's ``ref_tokens``; else the :class:`TieFlip` at
    the first difference, whose ``allowed`` says whether it starts at a near-tie.

    ``ref_logits[i]``: the logits ar chose its token ``i`` from (``keep_logits``); only
    the row at the first difference is read, and none in float64.
    """
    i = first_difference(ref_tokens, out_tokens)
    if i is None:
        if len(ref_tokens) == len(out_tokens):
            return None
        # one run stopped earlier with every shared token equal: no tie explains that
        return TieFlip(min(len(ref_tokens), len(out_tokens)), None, 0.0, sampling.greedy,
                       dtype, f"{len(out_tokens)} tokens, ar {len(ref_tokens)}")
    if dtype == torch.float64:
        return TieFlip(i, None, 0.0, sampling.greedy, dtype, "float64 is exact")
    margin, top = tie_margin(ref_logits[i], sampling, i)
    return TieFlip(i, margin, tie_tolerance(dtype, top), sampling.greedy, dtype)
