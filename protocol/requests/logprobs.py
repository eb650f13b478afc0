"""The logprobs of one committed token, as the last stage sends them to the gateway.

The verifying stage computes them from the target's raw distribution at the verified
position (``log_softmax`` of its logits in float32, before temperature, penalties and
top-k/top-p: vLLM's default ``raw_logprobs``) for the requests that ask; the barrier
(arrive.lua) passes the encoded form through, unread, as the ``lp`` field of the
token's commit event, and the gateway decodes it here, checked.  Torch-free: the
gateway does not import torch for this.

Wire form: a JSON list ``[logprob, id1, logprob1, id2, logprob2, ...]``, the chosen
token's logprob then the top alternatives, most likely first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's chat bound)
# vLLM writes -inf as this (JSON has no infinity); a raw logit of -inf is the only source
LOGPROB_FLOOR = -9999.0
# the longest wire form the barrier passes on: 21 numbers of at most ~25 characters
MAX_WIRE_CHARS = 1024


class LogprobsError(ValueError):
    """A malformed logprobs entry on the wire."""


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the ``top`` alternatives as (token id, logprob),
    most likely first (ties: lower id first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> str:
        """The compact JSON form the barrier carries (floats at float32 precision)."""
        flat: list[float | int] = [_short(self.logprob)]
        for t, lp in self.top:
            flat += [int(t), _short(lp)]
        return json.dumps(flat, separators=(",", ":"))

    @classmethod
    def from_wire(cls, raw: str, want: int, vocab: int) -> TokenLogprobs:
        """Decode and check an entry for a request that asked for ``want`` alternatives
        of a ``vocab``-token model; :class:`LogprobsError` says what is wrong."""
        if len(raw) > MAX_WIRE_CHARS:
            raise LogprobsError(f"entry of {len(raw)} characters (at most {MAX_WIRE_CHARS})")
        try:
            flat = json.loads(raw)
        except ValueError:
            raise LogprobsError(f"not JSON: {raw[:60]!r}") from None
        if not isinstance(flat, list) or len(flat) % 2 != 1:
            raise LogprobsError(f"not [logprob, id, logprob, ...]: {raw[:60]!r}")
        if len(flat) // 2 != want:
            raise LogprobsError(f"{len(flat) // 2} alternatives, the request asked for {want}")
        top = tuple((flat[i], flat[i + 1]) for i in range(1, len(flat), 2))
        for t, _ in top:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise LogprobsError(f"token id {t!r} outside [0, {vocab})")
        values = [flat[0], *(lp for _, lp in top)]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or \
                    not LOGPROB_FLOOR <= v <= 0:
                raise LogprobsError(f"logprob {v!r} outside [{LOGPROB_FLOOR:g}, 0]")
        if any(a < b for a, b in zip(values[1:], values[2:], strict=False)):
            raise LogprobsError("alternatives not sorted, most likely first")
        return cls(float(flat[0]), tuple((t, float(lp)) for t, lp in top))


def _short(x: float) -> float:
    """``x`` at float32 precision (9 significant digits round-trip a float32), and
    -inf or NaN as the floor, so the JSON stays standard."""
    if not math.isfinite(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(f"{min(x, 0.0):.9g}")
