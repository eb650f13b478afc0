"""The decoding parameters of one request, checked at construction.

Torch-free, so the CLI client (``treepipe generate --endpoint``) checks its flags
without importing torch; :mod:`stages.model.sampling` chooses tokens with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.errors import TreepipeError

# The same bounds as the gateway (orchestrator/serving/runner.py) and the wire format
# (treepipe.proto: int32 top_k, uint64 seed), so every way into the engine agrees.
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1
SEED_LIMIT = 2**64


class SamplingError(TreepipeError, ValueError):
    """A sampling parameter out of range; ``field`` names it (temperature, top_p, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _number(x: object) -> bool:
    # bool is an int to Python, but True as a temperature is a caller's bug
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request; temperature 0 means greedy.

    Construction refuses NaN, infinities and out-of-range values (:class:`SamplingError`):
    NaN compares false with every bound, and a NaN or infinite temperature turns the
    softmax into NaN or uniform noise while the request still "succeeds".
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if not _number(t) or not math.isfinite(t):
            raise SamplingError("temperature", f"temperature must be a finite number in "
                                f"[0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}")
        if t < 0:
            raise SamplingError("temperature", f"temperature must be >= 0 (0 = greedy), got {t}")
        if t > MAX_TEMPERATURE:
            raise SamplingError("temperature", f"temperature must be at most "
                                f"{MAX_TEMPERATURE:g}, got {t}")
        if not _number(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise SamplingError("top_p", f"top-p must be a finite number in (0, 1], got {p!r}")
        if not _integer(k) or not 0 <= k <= MAX_TOP_K:
            raise SamplingError("top_k", f"top-k must be an integer in [0, {MAX_TOP_K}] "
                                f"(0 = off), got {k!r}")
        if not _integer(s) or not 0 <= s < SEED_LIMIT:
            raise SamplingError("seed", f"seed must be an integer in [0, 2^64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
