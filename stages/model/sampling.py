"""Choosing the next token from target logits: greedy, or seeded sampling.

Sampling draws its uniform number from (seed, index of the generated token), not
from a stream, so the token at position i depends only on the logits there and
the seed.  That is what makes every decoding method (and a restarted worker)
produce the same tokens as plain autoregressive sampling with the same seed.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from stages.model.sampling_params import SamplingParams


def uniform_for(seed: int, index: int) -> float:
    """The uniform draw in [0, 1) used for generated token number ``index``."""
    return random.Random(f"treepipe:{seed}:{index}").random()


def filtered_probs(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Sorted candidate token ids and their renormalised probabilities (float64)."""
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    # stable sort: equal probabilities keep token-id order, so the result is reproducible
    p_sorted, ids = torch.sort(probs, descending=True, stable=True)
    keep = p_sorted.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1.0:
        csum = torch.cumsum(p_sorted, 0)
        keep = min(keep, int(torch.searchsorted(csum, torch.tensor(params.top_p,
                                                                   dtype=torch.float64))) + 1)
    p_sorted, ids = p_sorted[:keep], ids[:keep]
    return ids, p_sorted / p_sorted.sum()


def choose_token(logits: Tensor, params: SamplingParams, index: int) -> int:
    """Next token for generated position ``index`` from 1-D logits."""
    logits = logits.detach().to("cpu")
    if params.greedy:
        return int(torch.argmax(logits))
    ids, probs = filtered_probs(logits, params)
    u = uniform_for(params.seed, index)
    pos = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(u, dtype=torch.float64),
                                 right=True))
    return int(ids[min(pos, ids.numel() - 1)])
