"""Choosing the next token from target logits: greedy, or seeded sampling.

Sampling draws its uniform number from (seed, index of the generated token), not
from a stream, so the token at position i depends only on the logits there and
the seed.  That is what makes every decoding method (and a restarted worker)
produce the same tokens as plain autoregressive sampling with the same seed.

Every token choice goes through :func:`choose_token`, which first applies the request's
penalties, logit bias and min_tokens (:func:`adjust_logits`) to the target's logits,
given the prompt and the tokens committed before that position.  A verifier chooses a
position's token from the logits of its committed context, so with the same committed
tokens every method makes ar's adjustment and keeps ar's tokens; a draft's proposals
are not adjusted (that changes only how often they hit).  A request's ``response_format``
masks the adjusted logits the same way (:mod:`stages.model.grammar`), from its committed
tokens only; the draft's proposals are masked apart, from a copy of the grammar state
(:class:`~stages.model.grammar.DraftMask`), which changes only how often they hit.

:func:`token_logprobs` reports what a request asks with ``logprobs``, from the same
logits row but unadjusted (vLLM's ``raw_logprobs``); it reads the row, never changes it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import Tensor

from protocol.requests.logprobs import TokenLogprobs
from protocol.requests.sampling_params import SamplingParams
from stages.model.grammar import Constraint


def uniform_for(seed: int, index: int) -> float:
    """The uniform draw in [0, 1) used for generated token number ``index``."""
    return random.Random(f"treepipe:{seed}:{index}").random()


def filtered_probs(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Sorted candidate token ids and their renormalised probabilities (float64): the
    temperature's distribution, then min_p, top-k and top-p."""
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    # stable sort: equal probabilities keep token-id order, so the result is reproducible
    p_sorted, ids = torch.sort(probs, descending=True, stable=True)
    if params.min_p > 0:  # vLLM's order: min_p first, top-k and top-p on what it leaves
        kept = int((p_sorted >= params.min_p * p_sorted[0]).sum())
        p_sorted, ids = p_sorted[:kept] / p_sorted[:kept].sum(), ids[:kept]
    keep = p_sorted.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1.0:
        csum = torch.cumsum(p_sorted, 0)
        keep = min(keep, int(torch.searchsorted(csum, torch.tensor(params.top_p,
                                                                   dtype=torch.float64))) + 1)
    p_sorted, ids = p_sorted[:keep], ids[:keep]
    return ids, p_sorted / p_sorted.sum()


def adjust_logits(logits: Tensor, params: SamplingParams, prompt: Sequence[int],
                  generated: Sequence[int], stop_ids: Sequence[int] = ()) -> Tensor:
    """1-D logits for the next generated token after ``prompt`` + ``generated`` (the
    committed tokens only), with vLLM's semantics: ``logit_bias`` added; repetition
    penalty over the prompt and generated tokens (positive logits divided by it, negative
    ones multiplied); frequency (times the count) and presence penalties subtracted over
    the generated tokens; with fewer than ``min_tokens`` generated, ``stop_ids`` (EOS
    among them) at -inf.  Unchanged logits (the same tensor) when nothing applies."""
    if not params.adjusts:
        return logits
    out = logits.detach().to("cpu", torch.float64).clone()
    vocab = out.numel()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)  # type: ignore[misc]
        out[torch.tensor(ids, dtype=torch.long)] += torch.tensor(bias, dtype=torch.float64)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt, *generated], dtype=torch.long)] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if (params.frequency_penalty or params.presence_penalty) and len(generated):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long),
                                minlength=vocab).to(torch.float64)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if len(generated) < params.min_tokens and len(stop_ids):
        out[torch.tensor([t for t in stop_ids if 0 <= t < vocab], dtype=torch.long)] = \
            -torch.inf
    return out


def choose_token(logits: Tensor, params: SamplingParams, prompt: Sequence[int],
                 generated: Sequence[int], stop_ids: Sequence[int] = (),
                 constraint: Constraint | None = None) -> int:
    """The next token after ``prompt`` + ``generated`` (committed tokens) from its 1-D
    target logits: :func:`constrained_logits`, then greedy or the seeded draw for
    generated position ``len(generated)``."""
    return pick_token(constrained_logits(logits, params, prompt, generated, stop_ids,
                                         constraint), params, len(generated))


def constrained_logits(logits: Tensor, params: SamplingParams, prompt: Sequence[int],
                       generated: Sequence[int], stop_ids: Sequence[int] = (),
                       constraint: Constraint | None = None) -> Tensor:
    """:func:`adjust_logits`, then the request's grammar mask (``constraint``, built from
    ``params.response_format``) after the committed ``generated`` tokens."""
    if constraint is None and params.response_format is not None:
        # a caller that never built the grammar state would decode free text silently
        raise ValueError("this request has a response_format but no grammar state: pass "
                         "the constraint (stages.model.grammar.GrammarVocab.constraint)")
    out = adjust_logits(logits.detach().to("cpu"), params, prompt, generated, stop_ids)
    return out if constraint is None else constraint.mask(out, generated)


def pick_token(logits: Tensor, params: SamplingParams, index: int) -> int:
    """Greedy, or the seeded draw for generated position ``index``, from 1-D logits that
    :func:`adjust_logits` already adjusted."""
    logits = logits.detach().to("cpu")
    if params.greedy:
        # argmax over 16-bit values runs a slow path on a CPU (SmolLM2's 49152 bf16 logits:
        # 180 against 62 us on CPU-2 with the exact float32 copy); the first maximum wins
        # in both, so the token is the same
        return int(torch.argmax(logits.to(torch.promote_types(logits.dtype, torch.float32))))
    ids, probs = filtered_probs(logits, params)
    u = uniform_for(params.seed, index)
    pos = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(u, dtype=torch.float64),
                                 right=True))
    return int(ids[min(pos, ids.numel() - 1)])


def token_logprobs(logits: Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s logprob under the raw distribution of the 1-D target ``logits`` (float32
    ``log_softmax``, before temperature, penalties and top-k/top-p: vLLM's default
    ``raw_logprobs``) and the ``k`` most likely tokens with theirs, ties by lower id."""
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float32), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        # topk, not a sort of the whole vocabulary; ties then ordered by id
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple(sorted(zip(ids.tolist(), vals.tolist(), strict=True),
                           key=lambda p: (-p[1], p[0])))
    return TokenLogprobs(float(lp[token]), top)
