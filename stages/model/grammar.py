"""Constrained decoding: a request's ``response_format`` as a token mask (xgrammar).

The verifier masks the logits it chooses a token from (:func:`stages.model.sampling.
choose_token`) to the tokens the grammar allows after the committed ones, so every
decoding method masks the same rows the same way and keeps ar's tokens under the same
constraint.  A :class:`Constraint` follows a request's committed tokens: it advances its
matcher over the tokens committed since its last call, so a request resumed from its token
log rebuilds the grammar state by replaying the log.

The grammar also ends the request: EOS is allowed only where the JSON is complete, and
where nothing but the end can follow (:meth:`Constraint.finished`) the request stops even
if it has no EOS (a model without one, or ``ignore_eos``).  For that, the grammar's stop
tokens are the model's EOS ids plus one id past the vocabulary that is never chosen.

xgrammar was chosen by mask cost per token on SmolLM2-135M's tokenizer (docs/serving.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr
from torch import Tensor

from protocol.errors import TreepipeError
from stages.model.tokenizer import TextTokenizer

COMPILED_CACHE = 32  # distinct formats kept compiled per process (least recently used out)
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(TreepipeError, ValueError):
    """A format that does not compile, or a token the grammar does not allow."""


class GrammarVocab:
    """A model's vocabulary as the grammar library sees it, and the formats compiled for it
    (each distinct format compiled once, a small LRU cache)."""

    def __init__(self, tok: TextTokenizer, vocab_size: int):
        """``vocab_size``: the model's logits row length (may exceed the tokenizer's)."""
        # imported here: transformers is slow to import and only grammars need it
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)
        self.vocab = vocab_size
        # one phantom stop id past the vocabulary: where only it is allowed, the JSON is
        # complete and the request ends, EOS or none
        stops = [t for t in tok.eos_token_ids if 0 <= t < vocab_size] + [vocab_size]
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size + 1,
                                                       stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()

    def compile(self, spec: str) -> xgr.CompiledGrammar:
        """The grammar of a canonical format text (protocol/requests/response_format.py);
        GrammarError when the schema cannot be compiled."""
        hit = self._compiled.get(spec)
        if hit is not None:
            self._compiled.move_to_end(spec)
            return hit
        d = json.loads(spec)
        try:
            # json_object is OpenAI's JSON mode: an object, any properties.  Whitespace is
            # xgrammar's fixed ", " and ": ", not the model's free choice: it cannot pad
            # the text with blank lines up to max_tokens
            schema = {"type": "object"} if d["type"] == "json_object" else d["schema"]
            grammar = self.compiler.compile_json_schema(json.dumps(schema),
                                                        any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
        self._compiled[spec] = grammar
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return grammar

    def constraint(self, spec: str) -> Constraint:
        """A fresh per-request grammar state for ``spec``; GrammarError when no token of
        the vocabulary can start it (a JSON object of a vocabulary without "{")."""
        out = Constraint(self.compile(spec), self.vocab)
        if out.finished(()):
            raise GrammarError("no token of this model's vocabulary can start text that "
                               "matches the response_format")
        return out


class Constraint:
    """One request's grammar state, following its committed tokens."""

    def __init__(self, grammar: xgr.CompiledGrammar, vocab: int):
        self._grammar, self.vocab = grammar, vocab
        self._matcher = xgr.GrammarMatcher(grammar)
        self._seen = 0  # committed tokens the matcher has accepted
        self._last = -1  # the last of them: a different history restarts the matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab + 1)
        self._allowed: Tensor | None = None  # the mask after the accepted tokens

    def _follow(self, committed: Sequence[int]) -> None:
        """Advance the matcher over the committed tokens it has not seen."""
        n = self._seen
        if len(committed) < n or (n and int(committed[n - 1]) != self._last):
            self._matcher, self._seen, n = xgr.GrammarMatcher(self._grammar), 0, 0
        for t in committed[n:]:
            if not self._matcher.accept_token(int(t)):
                raise GrammarError(f"token {int(t)} after {self._seen} committed tokens is not "
                                   "allowed by the request's response_format")
            self._seen, self._last, self._allowed = self._seen + 1, int(t), None

    def allowed(self, committed: Sequence[int]) -> Tensor:
        """Bool mask over the vocabulary: the tokens the grammar allows next."""
        self._follow(committed)
        if self._allowed is None:
            if self._matcher.is_terminated():
                self._allowed = torch.zeros(self.vocab, dtype=torch.bool)
            else:
                self._matcher.fill_next_token_bitmask(self._bitmask)
                bits = (self._bitmask[0, :, None] >> _BITS) & 1
                self._allowed = bits.flatten()[:self.vocab].bool()
        return self._allowed

    def finished(self, committed: Sequence[int]) -> bool:
        """Whether nothing may follow ``committed``: the text is complete (or, in a
        vocabulary that lacks a needed character, cannot go on), so the request ends."""
        return not bool(self.allowed(committed).any())

    def mask(self, logits: Tensor, committed: Sequence[int]) -> Tensor:
        """1-D ``logits`` with every token the grammar does not allow next at -inf."""
        ok = self.allowed(committed)
        if not bool(ok.any()):
            raise GrammarError(f"the response_format allows no token after {len(committed)} "
                               "committed tokens (the request should have ended)")
        return torch.where(ok.to(logits.device), logits, -torch.inf)
