"""A benchmark token source with a controlled hit rate: ``--draft replay:P`` (or
``replay:P-Q``, a hit rate that grows with the tree's width).

It knows the target's own greedy continuation of the prompt (a plain ``ar`` run,
computed once per request when the request starts, so it never counts as draft
time) and, for a tree node whose path follows that continuation, proposes the
token the target really emits next with probability P, ranked first among
deterministic wrong tokens.  Off the continuation it proposes only wrong tokens,
with lower probabilities, so the fixed-width level always keeps the true path
first: the level holds the target's token with probability P, whatever the width.

``replay:P-Q`` (Q > P) ranks the target's token lower instead of dropping it: first
with probability P, r-th (r >= 1) with probability (Q - P) 2^-r, so a level of
width w holds it with probability P + (Q - P)(1 - 2^-(w-1)), rising toward Q like
the top-k curves of a real draft (the paper's Figure 7).  It lets a benchmark show
what width buys, which ``replay:P`` by design does not.

In a batch (and with another kernel, thread count or dtype) the target can emit
another token than the plain ``ar`` run at a near-tie of its top two logits; from
there the committed tokens have left the continuation, and until the source computes
the continuation of what was committed (once, at the first expansion after the
divergence) it would propose only wrong tokens for the rest of the request, so a
batch would be measured at a lower hit rate than one request. It does so up to
:data:`MAX_FOLLOWS` times a request (a sampled request, which leaves the greedy
continuation at most tokens, then misses as before), and not for a grammar's request.
The time those continuations take is benchmark set-up, as at the start:
:attr:`untimed_s` counts it and the engines' step records leave it out
(:class:`~stages.speculation.token_sources.DraftClock`). A draft service
of the distributed runtime computes them in its step, so runtime wall-clock rows
include them, as they include the first continuation.

It measures the *system* (pipeline, synchroniser, links) at the hit rates of a
good draft (SpecPipe's 0.9-0.99) on any model, random-weight ones included.  It
is not a way to decode faster: it needs the answer first.  Output stays lossless
like every source's, since the target still verifies every token.  Under
sampling the replayed continuation is the greedy one, so hits are rarer.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from stages.speculation.token_sources import Proposals, TokenSource
from stages.speculation.tree import SpecTree

DEFAULT_HORIZON = 256  # tokens of continuation computed per request (replay:P:H for more)
HIT_PROB = 0.9  # what the true token is proposed with; wrong ones share the rest
# re-anchorings a request gets: a greedy one leaves the continuation at a few near-ties,
# a sampled one at most tokens, where following would run ar again at every step
MAX_FOLLOWS = 4
OFF_PATH_PROB = 0.01  # proposals under nodes that left the continuation


class ReplaySpec(NamedTuple):
    """A parsed ``replay:P[-Q][:H]``: top-1 hit rate, the limit width approaches, horizon."""

    p: float
    horizon: int = DEFAULT_HORIZON
    limit: float | None = None  # None: replay:P, the same hit rate at every width


def parse_replay(spec: str) -> ReplaySpec | None:
    """``replay:P``, ``replay:P-Q`` or either with ``:H`` -> ReplaySpec; None for another
    source name.

    Raises ValueError naming the fix for a malformed spec.
    """
    if not spec.startswith("replay:"):
        return None
    parts = spec.split(":")[1:]
    fix = ("write replay:P (0 <= P <= 1), replay:P-Q (P < Q <= 1: the hit rate grows with "
           "the width from P toward Q), optionally :H for H >= 1 tokens of continuation")
    try:
        # P-Q, where a minus after an exponent (1e-3) belongs to the number
        rates = [float(x) for x in re.split(r"(?<![eE])-", parts[0])]
        horizon = int(parts[1]) if len(parts) > 1 else DEFAULT_HORIZON
    except (ValueError, IndexError):
        raise ValueError(f"bad token source {spec!r}; {fix}") from None
    if len(parts) > 2 or len(rates) > 2 or horizon < 1 \
            or not all(0.0 <= r <= 1.0 for r in rates) \
            or (len(rates) == 2 and not rates[0] < rates[1]):
        raise ValueError(f"bad token source {spec!r}; {fix}")
    return ReplaySpec(rates[0], horizon, rates[1] if len(rates) == 2 else None)


def coin_rank(u: float, p: float, limit: float | None, k: int) -> int | None:
    """The rank a coin ``u`` in [0, 1) gives the target's token: 0 below p, then r >= 1
    with probability (limit - p) 2^-r; None past ``limit`` or k proposals."""
    if u < p:
        return 0
    if limit is None or u >= limit:
        return None
    x = (u - p) / (limit - p)
    if x >= 1.0:  # u a rounding step below limit: the far tail, past any k
        return None
    r = 1 + math.floor(-math.log2(1.0 - x))
    return r if r < k else None


class ReplaySource(TokenSource):
    """Proposes the target's own next token with probability ``p`` (benchmarks only)."""

    def __init__(self, continuation: Callable[[list[int], int], list[int]], p: float,
                 vocab_size: int, horizon: int = DEFAULT_HORIZON, seed: int = 0,
                 limit: float | None = None):
        self.continuation, self.p, self.horizon = continuation, p, horizon
        self._vocab, self.seed, self.limit = vocab_size, seed, limit
        self.name = f"replay:{p:g}" + (f"-{limit:g}" if limit is not None else "")
        self.truth: list[int] = []
        self.follows = 0  # re-anchorings of the current request

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def reset(self, prompt: list[int]) -> None:
        self.truth = list(prompt) + self.continuation(list(prompt), self.horizon)
        self.follows = 0

    def _follow(self, committed: list[int]) -> None:
        """Re-anchor on ``committed`` where the target left the continuation within its
        horizon: the target's continuation of what it committed, to the same end (up to
        :data:`MAX_FOLLOWS` times a request)."""
        n = len(committed)
        if n >= len(self.truth) or self.follows >= MAX_FOLLOWS or self.truth[:n] == committed:
            return
        self.follows += 1
        t = time.perf_counter()
        self.truth = committed + self.continuation(list(committed), len(self.truth) - n)
        self.untimed_s += time.perf_counter() - t

    def _rank(self, pos: int, k: int) -> int | None:
        """Where the target's token stands among a node's k proposals (None: absent)."""
        # one coin per sequence position, the same in every process and run
        return coin_rank(random.Random(self.seed * 1_000_003 + pos).random(), self.p,
                         self.limit, k)

    def _wrong(self, pos: int, avoid: int, n: int) -> list[int]:
        rng = random.Random(~(self.seed * 1_000_003 + pos))
        out: list[int] = []
        while len(out) < min(n, self._vocab - 1):
            t = rng.randrange(self._vocab)
            if t != avoid and t not in out:
                out.append(t)
        return out

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        if allowed is None:  # a grammar's request leaves the free continuation by design
            self._follow(committed)
        toks, probs = [], []
        for j, i in enumerate(idx.tolist()):
            seq = committed + tree.path_tokens(i)[1:]  # committed ends with the root
            pos = len(seq)
            on_path = pos < len(self.truth) and seq == self.truth[:pos]
            true = self.truth[pos] if on_path else -1
            rank = self._rank(pos, k) if on_path else None
            if on_path and self.limit is not None:
                # strictly falling probabilities, the target's token at its rank (if any)
                cand = self._wrong(pos, true, k - (rank is not None))
                if rank is not None:
                    cand.insert(rank, true)
                p = [HIT_PROB] + [(1 - HIT_PROB) * 0.5 ** j for j in range(1, len(cand))]
            elif rank is not None:
                cand = [true, *self._wrong(pos, true, k - 1)]
                p = [HIT_PROB] + [(1 - HIT_PROB) / max(k - 1, 1)] * (len(cand) - 1)
            else:
                cand = self._wrong(pos, true, k)
                top = (1 - HIT_PROB) if on_path else OFF_PATH_PROB
                p = [top / len(cand)] * len(cand)
            t, pr = torch.tensor(cand, dtype=torch.long), torch.tensor(p, dtype=torch.float64)
            if allowed is not None:  # a grammar's request: only the tokens it allows
                ok = allowed[j][t]
                t, pr = t[ok], pr[ok]
            toks.append(t)
            probs.append(pr)
        return toks, probs
