"""Token sources that grow the speculative tree: draft model, n-gram lookup, hybrid.

A source sees each tree node once, when the node enters stage 1 (the draft runs
beside stage 1 on the same level), and proposes up to k children for it with
probabilities.  The executor caches those proposals and picks the fixed-width
level from them, so a level that pruning emptied is re-grown from cached
proposals without recomputation.  A source that keeps state per node (the draft
model's KV cache) prunes it exactly like a stage does.

A request with a grammar (``response_format``) passes ``allowed``: one bool row over the
vocabulary per expanded node, the tokens the grammar allows below it (the tree owner
computes them, :meth:`~stages.speculation.step.TreeOwner.allowed`).  A source proposes
only those: a draft model masks its logits before the top-k, so its proposals are its
best allowed tokens; the n-gram lookup skips disallowed continuations.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from stages.model.early_exit import AdaptedNorm
from stages.model.kv_cache import BlockPool, StageCache
from stages.model.model import Segment, StageShard, linear
from stages.speculation.tree import SpecTree

Proposals = tuple[list[Tensor], list[Tensor]]  # per node: tokens [<=k], probs [<=k]


def tree_forward(shard: StageShard, cache: StageCache, tree: SpecTree, idx: Tensor,
                 x: Tensor) -> Tensor:
    """Run ``shard`` on tree nodes ``idx`` with the tree mask over the cache's tree rows."""
    key_idx = torch.cat([tree.index_of(cache.tree_ids), idx])
    mask = tree.attention_mask(idx, key_idx)
    return shard(x, tree.positions(idx), cache, mask, tree.ids[idx])


class DraftClock:
    """Times draft work from its creation: :meth:`seconds` is the wall time less what
    ``sources`` spent meanwhile on benchmark set-up (:attr:`TokenSource.untimed_s`)."""

    def __init__(self, sources: Iterable[TokenSource | None]):
        # once per source: requests may share one
        self.sources = list({id(s): s for s in sources if s is not None}.values())
        self.start, self.untimed = time.perf_counter(), self._untimed()

    def _untimed(self) -> float:
        return sum(s.untimed_s for s in self.sources)

    def seconds(self) -> float:
        """Draft seconds so far."""
        return time.perf_counter() - self.start - (self._untimed() - self.untimed)


def sync_cache(cache: StageCache, tree: SpecTree, committed_ids: list[int]) -> None:
    """Pruning propagation for one cache: promote verified nodes, drop pruned ones.

    ``committed_ids`` are the nodes verified since the last sync, oldest first;
    each must already be in the cache (every participant computed them).
    """
    cache.keep(torch.cat([torch.tensor(committed_ids, dtype=torch.long), tree.ids]))
    for node_id in committed_ids:
        cache.promote(node_id)


class TokenSource(ABC):
    """Proposes children for tree nodes."""

    name: str = "source"
    # seconds spent inside expand on benchmark set-up no deployment pays (replay's
    # continuations), which step records leave out (:class:`DraftClock`)
    untimed_s: float = 0.0

    @abstractmethod
    def reset(self, prompt: list[int]) -> None:
        """Start a new request whose committed tokens are ``prompt``."""

    def prefill(self, prompt: list[int], upto: int) -> None:
        """Start a new request chunk by chunk: called with ``upto`` growing to
        ``len(prompt)`` as its prefill goes (the rows ``prompt[:upto]`` are known).  By
        default the source takes the whole prompt at the last call."""
        if upto >= len(prompt):
            self.reset(prompt)

    @abstractmethod
    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        """Top-k children (tokens, probabilities) for each node in ``idx``.

        ``committed`` ends with the tree's root token.  ``allowed`` (bool [len(idx),
        vocab], None: any token): the only tokens each node may propose.
        """

    def sync(self, tree: SpecTree, committed_ids: list[int]) -> None:  # noqa: B027
        """Follow pruning: ``committed_ids`` left the tree as verified tokens."""
        # optional hook: stateless sources (n-gram) keep nothing per node


class NgramSource(TokenSource):
    """Prompt lookup: continuations of the longest suffix that occurred before.

    Probabilities are the continuation frequencies among the matches.
    """

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def reset(self, prompt: list[int]) -> None:
        pass

    def lookup(self, context: list[int], k: int,
               allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k next tokens after ``context`` by n-gram match frequency (only tokens
        ``allowed`` holds, when given: a suffix with none falls back to a shorter one)."""
        n_ctx = len(context)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            suffix = context[n_ctx - n:]
            counts: Counter[int] = Counter()
            first = suffix[0]
            for i in range(n_ctx - n):
                if context[i] == first and context[i:i + n] == suffix:
                    counts[context[i + n]] += 1
            if allowed is not None:
                counts = Counter({t: c for t, c in counts.items()
                                  if t < allowed.numel() and bool(allowed[t])})
            if counts:
                total = sum(counts.values())
                # most_common is stable for equal counts (first occurrence first)
                top = counts.most_common(k)
                return (torch.tensor([t for t, _ in top], dtype=torch.long),
                        torch.tensor([c / total for _, c in top], dtype=torch.float64))
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        toks, probs = [], []
        for j, i in enumerate(idx.tolist()):
            t, p = self.lookup(committed + tree.path_tokens(i)[1:], k,
                               None if allowed is None else allowed[j])
            toks.append(t)
            probs.append(p)
        return toks, probs


class ReducedHead(nn.Module):
    """The LM head over a subset of the vocabulary (FR-Spec / EAGLE-3 style).

    The rows of ``lm_head.weight`` for ``ids`` are copied once into a [K, dim]
    matrix, so a draft step costs K instead of V dot products per node.  Its
    probabilities are a softmax over the subset only (renormalised: they sum to 1
    over the K ids), and a token outside the subset is never proposed.  Output
    stays lossless because the target verifies every token anyway.
    """

    def __init__(self, lm_head: nn.Linear, ids: Tensor):
        super().__init__()
        ids = ids.to(dtype=torch.long, device=lm_head.weight.device)
        self.register_buffer("ids", ids, persistent=False)
        self.register_buffer("weight", lm_head.weight.detach()[ids].clone(), persistent=False)

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def forward(self, h: Tensor) -> Tensor:
        """Logits [n, K] for hidden states [n, dim]; column j is token ``ids[j]``."""
        with torch.inference_mode():
            return linear(h, self.weight)


class DraftModelSource(TokenSource):
    """A smaller Llama sharing the target's tokenizer; its KV cache is pruned like a stage's.

    With ``head`` (a :class:`ReducedHead`) proposals come from a subset of the
    vocabulary and their probabilities are renormalised over that subset.
    """

    name = "draft"

    def __init__(self, shard: StageShard, label: str = "draft", pool: BlockPool | None = None,
                 head: ReducedHead | None = None):
        if not (shard.is_first and shard.is_last):
            raise ValueError("a draft model must be a whole model (one shard)")
        self.shard, self.name = shard, label
        # a shared pool lets several requests' drafts run as one packed forward
        self.pool = pool
        self.cache: StageCache | None = None
        self.filled = 0  # rows of the request's prompt in the cache (prefill)
        self.head = head

    def reduce_vocab(self, ids: Tensor) -> None:
        """Propose only tokens ``ids`` from now on (a :class:`ReducedHead` over them)."""
        assert self.shard.lm_head is not None
        self.head = ReducedHead(self.shard.lm_head, ids)

    def top_proposals(self, h: Tensor, k: int,
                      allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k (token ids, probabilities) [n, k] for final hidden states ``h`` [n, dim].

        ``allowed`` (bool [n, vocab]): the logits of other tokens are -inf before the
        softmax, so the probabilities are over the allowed tokens and an entry of
        probability 0 is no proposal (a row allowing fewer than k, or none)."""
        # the tree lives on the CPU (it is small and indexed per node); only the top-k
        # leave the device
        logits = self.shard.logits(h) if self.head is None else self.head(h)
        if allowed is not None:
            cols = allowed if self.head is None else allowed[:, self.head.ids.cpu()]
            logits = logits.masked_fill(~cols.to(logits.device), -torch.inf)
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        if allowed is not None:  # a row with nothing allowed is NaN: probability 0 each
            probs = probs.nan_to_num(0.0)
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        if self.head is None:
            return top.indices.cpu(), top.values.cpu()
        # subset column -> real token id
        return self.head.ids[top.indices].cpu(), top.values.cpu()

    @property
    def vocab_size(self) -> int:
        return self.shard.args.vocab_size

    def reset(self, prompt: list[int]) -> None:
        self.release()
        self.prefill(prompt, len(prompt))

    def prefill(self, prompt: list[int], upto: int) -> None:
        """The draft model's forward over ``prompt[filled:upto]``: a long prompt's rows
        enter its cache a chunk at a time, beside the stages' chunks, not all at once."""
        if self.cache is None:
            self.cache = StageCache.in_pool(self.pool) if self.pool is not None else \
                self.shard.new_cache(len(prompt) + 256)
            self.filled = 0
        if upto > self.filled:
            ids = torch.tensor(prompt[self.filled:upto], dtype=torch.long)
            self.shard(ids, torch.arange(self.filled, upto), self.cache)
            self.filled = upto

    def release(self) -> None:
        """Give the request's KV blocks back (they matter when the pool is shared)."""
        if self.cache is not None:
            self.cache.release()
            self.cache = None

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        return expand_packed([self], [tree], [idx], k, [allowed])[0]

    def sync(self, tree: SpecTree, committed_ids: list[int]) -> None:
        assert self.cache is not None
        sync_cache(self.cache, tree, committed_ids)


def expand_packed(drafts: list[DraftModelSource], trees: list[SpecTree], idxs: list[Tensor],
                  k: int, allowed: Sequence[Tensor | None] | None = None) -> list[Proposals]:
    """Top-k proposals of several requests' drafts (one shard, one pool) in one forward;
    ``allowed``: per request, its nodes' grammar rows (None: that request's are free)."""
    shard, head = drafts[0].shard, drafts[0].head
    segs, xs, pos = [], [], []
    for d, tree, idx in zip(drafts, trees, idxs, strict=True):
        assert d.cache is not None, "reset() first"
        if d.shard is not shard or d.head is not head:
            raise ValueError("packed drafts must share one draft model and LM head")
        key_idx = torch.cat([tree.index_of(d.cache.tree_ids), idx])
        segs.append(Segment(d.cache, int(idx.numel()), tree.attention_mask(idx, key_idx),
                            tree.ids[idx]))
        xs.append(tree.tokens[idx])
        pos.append(tree.positions(idx))
    h = shard.forward_packed(torch.cat(xs), torch.cat(pos), segs)
    rows = _packed_rows(allowed, [s.n for s in segs], drafts[0].vocab_size)
    tok, prob = drafts[0].top_proposals(h, k, rows)
    out: list[Proposals] = []
    for ti, tv in zip(tok.split([s.n for s in segs]), prob.split([s.n for s in segs]),
                      strict=True):
        if rows is None:
            out.append((list(ti), list(tv)))
        else:  # masked: probability 0 is a token the grammar forbids, no proposal
            out.append(([t[p > 0] for t, p in zip(ti, tv, strict=True)],
                        [p[p > 0] for p in tv]))
    return out


def _packed_rows(allowed: Sequence[Tensor | None] | None, sizes: list[int],
                 vocab: int) -> Tensor | None:
    """The packed forward's grammar rows (every token for a request without any), or None
    when no request has a grammar."""
    if allowed is None or all(a is None for a in allowed):
        return None
    return torch.cat([a if a is not None else torch.ones(n, vocab, dtype=torch.bool)
                      for a, n in zip(allowed, sizes, strict=True)])


class HybridSource(TokenSource):
    """Draft model and n-gram together: union of proposals, noisy-or of probabilities."""

    name = "hybrid"

    def __init__(self, draft: DraftModelSource, ngram: NgramSource | None = None):
        self.draft, self.ngram = draft, ngram or NgramSource()

    @property
    def vocab_size(self) -> int:
        return self.draft.vocab_size

    def reset(self, prompt: list[int]) -> None:
        self.draft.reset(prompt)
        self.ngram.reset(prompt)

    def prefill(self, prompt: list[int], upto: int) -> None:
        self.draft.prefill(prompt, upto)
        if upto >= len(prompt):
            self.ngram.reset(prompt)

    def expand(self, tree: SpecTree, idx: Tensor, committed: list[int], k: int,
               allowed: Tensor | None = None) -> Proposals:
        d_tok, d_p = self.draft.expand(tree, idx, committed, k, allowed)
        n_tok, n_p = self.ngram.expand(tree, idx, committed, k, allowed)
        toks, probs = [], []
        for dt, dp, nt, np_ in zip(d_tok, d_p, n_tok, n_p, strict=True):
            miss: dict[int, float] = {}
            for t, p in zip(dt.tolist() + nt.tolist(), dp.tolist() + np_.tolist(), strict=True):
                miss[t] = miss.get(t, 1.0) * (1.0 - p)
            ranked = sorted(miss.items(), key=lambda kv: kv[1])[:k]  # stable: draft first
            toks.append(torch.tensor([t for t, _ in ranked], dtype=torch.long))
            probs.append(torch.tensor([1.0 - m for _, m in ranked], dtype=torch.float64))
        return toks, probs

    def sync(self, tree: SpecTree, committed_ids: list[int]) -> None:
        self.draft.sync(tree, committed_ids)


class EarlyExitSource(DraftModelSource):
    """Token source: target layers ``[0, l_e)`` + adapter + final norm + shared LM head."""

    name = "early-exit"

    def __init__(self, adapted: StageShard, label: str = "early-exit"):
        if not isinstance(adapted.norm, AdaptedNorm):
            raise ValueError("an early-exit source needs a cut shard with an attached adapter")
        super().__init__(adapted, label)

    @property
    def exit_layer(self) -> int:
        return self.shard.args.n_layers


def draft_model(source: TokenSource | None) -> DraftModelSource | None:
    """The draft model a source runs (itself, or a hybrid's), whose KV cache can live in a
    shared pool; None for a source without one (n-gram, replay, none)."""
    if isinstance(source, HybridSource):
        return source.draft
    return source if isinstance(source, DraftModelSource) else None
