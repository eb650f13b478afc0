"""Constrained decoding: a request's ``response_format`` as a token mask (llguidance).

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

The same grammar restricts a draft's proposals (:class:`DraftMask`): each tree node's
children are drawn only from the tokens allowed after the committed tokens and the node's
path, so the draft spends its top-k on tokens the verifier can accept.  That changes only
the hit rate, never the tokens (the verifier masks its own rows).

llguidance was chosen by mask cost per token on SmolLM2-135M's tokenizer (docs/serving.md);
it needs no other package, where xgrammar pulls triton (1 GB).  Its numpy helpers, not
its torch ones: ``llguidance.torch`` compiles a kernel at import, which pulls in
torch._dynamo and sympy and doubled every worker's start-up.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch
from torch import Tensor

from protocol.errors import TreepipeError
from stages.model.tokenizer import TextTokenizer

COMPILED_CACHE = 32  # distinct formats kept compiled per process (least recently used out)
# OpenAI's JSON mode asks for an object; whitespace is fixed (", " and ": "), not the
# model's free choice, so it cannot pad the text with blank lines up to max_tokens
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(TreepipeError, ValueError):
    """A format that does not compile, or a token the grammar does not allow."""


class GrammarVocab:
    """A model's vocabulary as the grammar library sees it, and the formats compiled for it
    (each distinct format compiled once, a small LRU cache of fresh matchers to copy)."""

    def __init__(self, tok: TextTokenizer, vocab_size: int):
        """``vocab_size``: the model's logits row length (may exceed the tokenizer's)."""
        self.vocab = vocab_size
        # one phantom stop id past the vocabulary: where only it is allowed, the JSON is
        # complete and the request ends, with EOS or (a model without one) none
        pieces = _Pieces(tok, vocab_size)
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(pieces),
                                          n_vocab=vocab_size + 1, eos_token=pieces.stops)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def compile(self, spec: str) -> llguidance.LLMatcher:
        """A fresh matcher of a canonical format text (protocol/requests/response_format.py)
        to copy; GrammarError when the schema cannot be compiled."""
        hit = self._compiled.get(spec)
        if hit is not None:
            self._compiled.move_to_end(spec)
            return hit
        d = json.loads(spec)
        schema = {"type": "object"} if d["type"] == "json_object" else d["schema"]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                    defaults=_JSON_OPTIONS)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        self._compiled[spec] = matcher
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return matcher

    def constraint(self, spec: str) -> Constraint:
        """A fresh per-request grammar state for ``spec``; GrammarError when no token of
        the vocabulary can start it (a JSON object of a vocabulary without "{")."""
        out = Constraint(self.compile(spec), self.vocab)
        first = out.allowed(()).nonzero()
        # the mask assumes bytes the grammar forces (an object's "{") are tokens; a
        # vocabulary without them gets a mask whose tokens the grammar then refuses
        if not first.numel() or not out.fresh().consume_token(int(first[0])):
            raise GrammarError("no token of this model's vocabulary can start text that "
                               "matches the response_format")
        return out


class _Pieces:
    """The vocabulary's bytes as llguidance's TokenizerWrapper reads them, plus the phantom
    stop id; it reads any ``tokenizers`` model (its own Hugging Face loader refuses
    decoders other than byte-level and SentencePiece ones)."""

    def __init__(self, tok: TextTokenizer, vocab: int):
        inner = tok.tokenizer
        kinds = _decoders(inner)
        added = inner.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        self.tokens: list[bytes] = []
        for i in range(vocab):
            piece = inner.id_to_token(i)
            if piece is None or i in special:
                # not text: never allowed inside JSON (the 0xff prefix marks a special)
                self.tokens.append(b"\xff" + (piece or f"<{i}>").encode())
            elif i in added:
                self.tokens.append(added[i].content.encode())  # added text is stored raw
            elif "ByteLevel" in kinds:
                self.tokens.append(bytes(_BYTE_OF.get(c, 0) for c in piece))
            elif "Metaspace" in kinds or "ByteFallback" in kinds:
                self.tokens.append(_metaspace(piece))
            else:
                self.tokens.append(piece.encode())
        self.tokens.append(b"\xff<|grammar-end|>")  # the phantom stop id: never chosen
        # EOS is allowed where the JSON may end, and the phantom with it
        self.stops = [t for t in tok.eos_token_ids if 0 <= t < vocab] + [vocab]
        self.eos_token_id = vocab
        self.special_token_ids = sorted({*special, *self.stops})
        self.bos_token_id = tok.bos_token_id
        self._encode = inner

    def __call__(self, text: str) -> list[int]:
        """Token ids of ``text`` (llguidance tokenizes grammar literals with it)."""
        return list(self._encode.encode(text, add_special_tokens=False).ids)


def _decoders(inner: object) -> set[str]:
    """The types of a ``tokenizers.Tokenizer``'s decoder and, for a Sequence, its parts."""
    dec = json.loads(inner.to_str()).get("decoder")  # type: ignore[attr-defined]
    if not isinstance(dec, dict):
        return set()
    return {dec.get("type", ""), *(d.get("type", "") for d in dec.get("decoders") or [])}


def _metaspace(piece: str) -> bytes:
    """A SentencePiece piece's bytes: ▁ is a space, <0xAB> one byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in, reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_OF = _bytes_to_unicode()


class Constraint:
    """One request's grammar state, following its committed tokens."""

    def __init__(self, fresh: llguidance.LLMatcher, vocab: int):
        """``fresh``: the compiled format's matcher before any token (copied, never
        advanced)."""
        self._fresh, self.vocab = fresh, vocab
        self._matcher = self.fresh()
        self._seen = 0  # committed tokens the matcher has accepted
        self._last = -1  # the last of them: a different history restarts the matcher
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab + 1)
        self._allowed: Tensor | None = None  # the mask after the accepted tokens
        self._paths = llguidance.numpy.allocate_token_bitmask(1, vocab + 1)  # allowed_after's

    def copy(self) -> Constraint:
        """A fresh state of the same format (a second follower, such as the draft's)."""
        return Constraint(self._fresh, self.vocab)

    def fresh(self) -> llguidance.LLMatcher:
        """A copy of the matcher before any token."""
        return self._fresh.deep_copy()

    def _follow(self, committed: Sequence[int]) -> None:
        """Advance the matcher over the committed tokens it has not seen."""
        n = self._seen
        if len(committed) < n or (n and int(committed[n - 1]) != self._last):
            self._matcher, self._seen, n = self.fresh(), 0, 0
        for t in committed[n:]:
            if not self._matcher.consume_token(int(t)):
                raise GrammarError(f"token {int(t)} after {self._seen} committed tokens is not "
                                   "allowed by the request's response_format")
            self._seen, self._last, self._allowed = self._seen + 1, int(t), None

    def allowed(self, committed: Sequence[int]) -> Tensor:
        """Bool mask over the vocabulary: the tokens the grammar allows next."""
        self._follow(committed)
        if self._allowed is None:
            if self._matcher.is_stopped():
                self._allowed = torch.zeros(self.vocab, dtype=torch.bool)
            else:
                llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
                self._allowed = _unpack(self._bitmask, self.vocab)[0]
        return self._allowed

    def allowed_after(self, committed: Sequence[int],
                      paths: Sequence[Sequence[int]]) -> Tensor:
        """Bool rows [len(paths), vocab]: the tokens the grammar allows after ``committed``
        and then each path (a draft tree node's tokens below the committed root); a path
        the grammar refuses, or one that completes the text, allows nothing."""
        self._follow(committed)
        if self._paths.shape[0] < len(paths):
            self._paths = llguidance.numpy.allocate_token_bitmask(len(paths), self.vocab + 1)
        rows = self._paths[:len(paths)]
        rows.fill(0)
        m = self._matcher
        for j, path in enumerate(paths):
            # each path from the committed state and back: a few tokens per node, no copy
            got = m.try_consume_tokens([int(t) for t in path])
            if got == len(path) and not m.is_stopped():
                llguidance.numpy.fill_next_token_bitmask(m, self._paths, j)
            if got:
                m.rollback(got)
        return _unpack(rows, self.vocab)

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


class DraftMask:
    """A request's grammar over its draft's proposals: the rows of tokens allowed below
    tree nodes, from its own copy of the grammar state (the verifier's is never moved).

    ``committed`` as the tree owner holds it: the prompt (``prompt_len`` tokens), then the
    generated tokens, which alone the grammar reads.  Drafting must never fail a request,
    so a history the grammar refuses (the verifier fails that request itself) turns the
    mask off: the proposals go unmasked, which only costs hits."""

    def __init__(self, constraint: Constraint, prompt_len: int):
        """``constraint``: the request's grammar state (copied fresh, not shared)."""
        self._state, self._skip = constraint.copy(), prompt_len
        self.off = False

    def rows(self, committed: Sequence[int], paths: Sequence[Sequence[int]]) -> Tensor | None:
        """Bool rows [len(paths), vocab] of the tokens allowed after ``committed`` and each
        path (None: the mask is off)."""
        if self.off:
            return None
        try:
            return self._state.allowed_after(committed[self._skip:], paths)
        except GrammarError:
            self.off = True
            return None


def _unpack(bitmask: np.ndarray, vocab: int) -> Tensor:
    """Bool rows [n, vocab] of llguidance's packed int32 bitmask [n, words] (token i is bit
    i % 32 of word i // 32: little-endian bytes, as on x86 and ARM); numpy's unpackbits
    takes ~20 µs a row of 49152 tokens where torch's shifts took ~0.3 ms."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].view(np.bool_))
