"""A benchmark token source with a controlled hit rate: ``--draft replay:P``.

It knows the target's own greedy continuation of the prompt (a plain ``ar`` run,
computed once per request when the request starts, so it never counts as draft
time) and, for a tree node whose path follows that continuation, proposes the
token the target really emits next with probability P, ranked first among
deterministic wrong tokens.  Off the continuation it proposes only wrong tokens,
with lower probabilities, so the fixed-width level always keeps the true path
first: the level holds the target's token with probability P, whatever the width.

It measures the *system* (pipeline, synchroniser, links) at the hit rates of a
good draft (SpecPipe's 0.9-0.99) on any model, random-weight ones included.  It
is not a way to decode faster: it needs the answer first.  Output stays lossless
like every source's, since the target still verifies every token.  Under
sampling the replayed continuation is the greedy one, so hits are rarer.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from stages.speculation.token_sources import Proposals, TokenSource
from stages.speculation.tree import SpecTree

DEFAULT_HORIZON = 256  # tokens of continuation computed per request (replay:P:H for more)
HIT_PROB = 0.9  # what the true token is proposed with; wrong ones share the rest
OFF_PATH_PROB = 0.01  # proposals under nodes that left the continuation


def parse_replay(spec: str) -> tuple[float, int] | None:
    """``replay:P`` or ``replay:P:H`` -> (P, horizon H); None for another source name.

    Raises ValueError naming the fix for a malformed spec.
    """
    if not spec.startswith("replay:"):
        return None
    parts = spec.split(":")[1:]
    try:
        p = float(parts[0])
        horizon = int(parts[1]) if len(parts) > 1 else DEFAULT_HORIZON
    except (ValueError, IndexError):
        raise ValueError(f"bad token source {spec!r}; write replay:P (0 <= P <= 1) or "
                         "replay:P:H with H tokens of continuation") from None
    if len(parts) > 2 or not 0.0 <= p <= 1.0 or horizon < 1:
        raise ValueError(f"bad token source {spec!r}; write replay:P with 0 <= P <= 1 "
                         "(and optionally :H, H >= 1)")
    return p, horizon


class ReplaySource(TokenSource):
    """Proposes the target's own next token with probability ``p`` (benchmarks only)."""

    def __init__(self, continuation: Callable[[list[int], int], list[int]], p: float,
                 vocab_size: int, horizon: int = DEFAULT_HORIZON, seed: int = 0):
        self.continuation, self.p, self.horizon = continuation, p, horizon
        self._vocab, self.seed = vocab_size, seed
        self.name = f"replay:{p:g}"
        self.truth: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def reset(self, prompt: list[int]) -> None:
        self.truth = list(prompt) + self.continuation(list(prompt), self.horizon)

    def _hit(self, pos: int) -> bool:
        # one coin per sequence position, the same in every process and run
        return random.Random(self.seed * 1_000_003 + pos).random() < self.p

    def _wrong(self, pos: int, avoid: int, n: int) -> list[int]:
        rng = random.Random(~(self.seed * 1_000_003 + pos))
        out: list[int] = []
        while len(out) < min(n, self._vocab - 1):
            t = rng.randrange(self._vocab)
            if t != avoid and t not in out:
                out.append(t)
        return out

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int) -> Proposals:
        toks, probs = [], []
        for i in idx.tolist():
            seq = committed + tree.path_tokens(i)[1:]  # committed ends with the root
            pos = len(seq)
            on_path = pos < len(self.truth) and seq == self.truth[:pos]
            true = self.truth[pos] if on_path else -1
            if on_path and self._hit(pos):
                cand = [true, *self._wrong(pos, true, k - 1)]
                p = [HIT_PROB] + [(1 - HIT_PROB) / max(k - 1, 1)] * (len(cand) - 1)
            else:
                cand = self._wrong(pos, true, k)
                top = (1 - HIT_PROB) if on_path else OFF_PATH_PROB
                p = [top / len(cand)] * len(cand)
            toks.append(torch.tensor(cand, dtype=torch.long))
            probs.append(torch.tensor(p, dtype=torch.float64))
        return toks, probs
