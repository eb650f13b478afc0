"""The decoding parameters of one request, checked at construction.

Torch-free, so the CLI client (``treepipe generate --endpoint``) checks its flags
without importing torch; :mod:`stages.model.sampling` chooses tokens with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.errors import TreepipeError
from protocol.requests.logprobs import MAX_TOP_LOGPROBS
from protocol.requests.response_format import FormatError, check_spec

# The same bounds as the gateway (orchestrator/serving/runner.py) and the wire format
# (treepipe.proto: int32 top_k, uint64 seed), so every way into the engine agrees.
MAX_TEMPERATURE = 100.0
# what a request that leaves temperature out samples at, over HTTP and gRPC alike
# (OpenAI's and vLLM's default; 0 is greedy)
API_TEMPERATURE = 1.0
MAX_TOP_K = 2**31 - 1
SEED_LIMIT = 2**64
# OpenAI's bounds for the penalties and logit_bias (vLLM's too)
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_BIASED_TOKENS = 1024  # logit_bias entries one request may send
MAX_MIN_TOKENS = 2**31 - 1


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
    # vLLM's penalties: presence and frequency over the generated tokens, repetition over
    # the prompt and the generated tokens (1 = off); see stages.model.sampling.adjust_logits
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit; any mapping is kept as sorted (id, bias) pairs,
    # so the parameters stay frozen and hashable
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # stop ids (EOS included) cannot be chosen before this many tokens
    # None: no logprobs; K in [0, 20]: each committed token's logprob under the target's
    # raw distribution and its K most likely alternatives (protocol/requests/logprobs.py).
    # Reported only: it never changes a token
    logprobs: int | None = None
    # None: free text; else the canonical grammar text of OpenAI's response_format
    # (protocol/requests/response_format.py): the verifier masks every token it chooses
    # to the grammar (stages/model/grammar.py), which also ends the request
    response_format: str | None = None
    # vLLM's min_p: after temperature, tokens less likely than min_p times the most likely
    # one are dropped before top-k and top-p (0 = off); greedy keeps its argmax anyway
    min_p: float = 0.0

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
        mp = self.min_p
        if not _number(mp) or not math.isfinite(mp) or not 0 <= mp <= 1:
            raise SamplingError("min_p", f"min_p must be a finite number in [0, 1] (0 = off), "
                                f"got {mp!r}")
        if not _integer(k) or not 0 <= k <= MAX_TOP_K:
            raise SamplingError("top_k", f"top-k must be an integer in [0, {MAX_TOP_K}] "
                                f"(0 = off), got {k!r}")
        if not _integer(s) or not 0 <= s < SEED_LIMIT:
            raise SamplingError("seed", f"seed must be an integer in [0, 2^64), got {s!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not math.isfinite(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingError(name, f"{name} must be a finite number in "
                                    f"[{-MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v!r}")
        r = self.repetition_penalty
        if not _number(r) or not math.isfinite(r) or not r > 0:
            raise SamplingError("repetition_penalty", "repetition_penalty must be a finite "
                                f"number > 0 (1 = off), got {r!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        m = self.min_tokens
        if not _integer(m) or not 0 <= m <= MAX_MIN_TOKENS:
            raise SamplingError("min_tokens", f"min_tokens must be an integer in "
                                f"[0, {MAX_MIN_TOKENS}] (0 = off), got {m!r}")
        lp = self.logprobs
        if lp is not None and (not _integer(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise SamplingError("logprobs", f"logprobs must be an integer in "
                                f"[0, {MAX_TOP_LOGPROBS}] (top alternatives per token) or "
                                f"absent, got {lp!r}")
        if self.response_format is not None:
            try:
                check_spec(self.response_format)
            except FormatError as e:
                raise SamplingError("response_format", str(e)) from None
            if self.min_tokens:
                # min_tokens bars EOS where the grammar may allow nothing else
                raise SamplingError("response_format", "response_format cannot be combined "
                                    "with min_tokens (the grammar decides where the JSON "
                                    "ends); leave min_tokens out")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether any penalty, bias or min_tokens changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    def to_wire(self) -> dict[str, float | int | str | list[list[float]]]:
        """The JSON object a request's hash stores: the fields that differ from off
        (logit_bias as [id, bias] pairs: JSON has no integer keys)."""
        out: dict[str, float | int | str | list[list[float]]] = {
            "temperature": float(self.temperature), "top_p": float(self.top_p),
            "top_k": int(self.top_k), "seed": int(self.seed)}
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_tokens", 0), ("min_p", 0.0)):
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = [[t, b] for t, b in self.logit_bias]  # type: ignore[misc]
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.response_format is not None:
            out["response_format"] = self.response_format
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, object]) -> SamplingParams:
        """The parameters :meth:`to_wire` wrote, checked (SamplingError names a field
        out of range; TypeError or ValueError: a value of the wrong kind)."""
        def num(name: str, default: float) -> float:
            v = d.get(name, default)
            if not _number(v):
                raise SamplingError(name, f"{name} must be a number, got {v!r}")
            return float(v)  # type: ignore[arg-type]

        def whole(name: str) -> int:
            v = d.get(name, 0)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if not _integer(v):
                raise SamplingError(name, f"{name} must be an integer, got {v!r}")
            return v  # type: ignore[return-value]

        bias = d.get("logit_bias", ())
        lp = d.get("logprobs")
        return cls(num("temperature", 0.0), num("top_p", 1.0), whole("top_k"),
                   whole("seed"), num("presence_penalty", 0.0),
                   num("frequency_penalty", 0.0), num("repetition_penalty", 1.0),
                   tuple((int(t), float(b)) for t, b in bias),  # type: ignore[union-attr]
                   whole("min_tokens"), None if lp is None else whole("logprobs"),
                   d.get("response_format"), num("min_p", 0.0))  # type: ignore[arg-type]

    def check_vocab(self, vocab: int) -> None:
        """Refuse logit_bias token ids outside a model's vocabulary of ``vocab`` tokens."""
        for t, _ in self.logit_bias:  # type: ignore[misc]
            if t >= vocab:
                raise SamplingError("logit_bias", f"logit_bias token id {t} is outside the "
                                    f"vocabulary [0, {vocab})")


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, every one checked."""
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, tuple | list):
        items = list(bias)
    else:
        raise SamplingError("logit_bias", f"logit_bias must map token ids to biases, got "
                            f"{bias!r}")
    if len(items) > MAX_BIASED_TOKENS:
        raise SamplingError("logit_bias", f"logit_bias has {len(items)} entries; send at most "
                            f"{MAX_BIASED_TOKENS}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise SamplingError("logit_bias", f"logit_bias must map token ids to biases, got "
                                f"{item!r}")
        t, b = item
        if not _integer(t) or t < 0:
            raise SamplingError("logit_bias", f"logit_bias keys must be token ids >= 0, "
                                f"got {t!r}")
        if not _number(b) or not math.isfinite(b) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise SamplingError("logit_bias", f"logit_bias of token {t} must be a finite "
                                f"number in [{-MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}")
        if t in out:
            raise SamplingError("logit_bias", f"logit_bias lists token {t} twice")
        out[t] = float(b)
    return tuple(sorted(out.items()))
