"""Mask cost per token of xgrammar, llguidance and outlines-core on SmolLM2-135M's tokenizer.

Each library replays the same schema-valid JSON (compact, as SmolLM2 tokenizes it) and
computes the allowed-token mask before every token; prints the compile time and the
median and mean mask time per token.  Not a test (pytest collects only test_*.py):

    PYTHONPATH=. .venv/bin/python tests/grammar_mask_bench.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerFast

from orchestrator.models.registry import fetch_model

VOCAB, EOS = 49152, 2
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 12}},
                         "ok": {"type": "boolean"}}}
DOC = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36,
       "tags": ["mathematics", "poetry", "engines"], "ok": True}
ROUNDS = 20


def replay(new: Callable[[], object], mask: Callable[[object], None],
           accept: Callable[[object, int], None], ids: list[int]) -> list[float]:
    """Seconds per mask over ``ids`` (every token accepted after its mask), ROUNDS times."""
    out = []
    for _ in range(ROUNDS):
        m = new()
        for t in ids:
            t0 = time.perf_counter()
            mask(m)
            out.append(time.perf_counter() - t0)
            accept(m, t)
    return out


def xgrammar(hf: PreTrainedTokenizerFast, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    g = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    c = time.perf_counter() - t
    bm = xgr.allocate_token_bitmask(1, VOCAB)

    def accept(m: object, tok: int) -> None:
        assert m.accept_token(tok)  # type: ignore[attr-defined]

    return c, replay(lambda: xgr.GrammarMatcher(g),
                     lambda m: m.fill_next_token_bitmask(bm),  # type: ignore[attr-defined]
                     accept, ids)


def llguidance(hf: PreTrainedTokenizerFast, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB, eos_token=EOS)
    grm = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                 defaults={"whitespace_flexible": False})
    c = time.perf_counter() - t
    bm = llguidance.torch.allocate_token_bitmask(1, VOCAB)

    def accept(m: object, tok_id: int) -> None:
        assert m.consume_token(tok_id), m.get_error()  # type: ignore[attr-defined]

    return c, replay(lambda: llg.LLMatcher(tok, grm),
                     lambda m: llguidance.torch.fill_next_token_bitmask(m, bm, 0),  # type: ignore[arg-type]
                     accept, ids)


def outlines(hf: PreTrainedTokenizerFast, ids: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for s, i in hf.get_vocab().items():
        if i != EOS:
            vocab.setdefault(s, []).append(i)
    idx = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(EOS, vocab))
    c = time.perf_counter() - t
    # a mask as the others give it: a bool row over the vocabulary
    return c, replay(lambda: Guide(idx),
                     lambda g: torch.zeros(VOCAB, dtype=torch.bool).index_fill_(
                         0, torch.tensor(g.get_tokens()), True),  # type: ignore[attr-defined]
                     lambda g, tok: g.advance(tok), ids)  # type: ignore[attr-defined]


def main() -> None:
    """Print each library's compile time and mask time per token."""
    hf = PreTrainedTokenizerFast(tokenizer_file=str(fetch_model("smollm2-135m") /
                                                    "tokenizer.json"))
    ids = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    for lib in (xgrammar, llguidance, outlines):
        c, secs = lib(hf, ids)
        print(f"{lib.__name__:11s} compile {c:5.2f} s  mask per token: median "
              f"{statistics.median(secs) * 1e6:6.0f} us, mean {statistics.fmean(secs) * 1e6:6.0f}"
              f" us ({len(ids)} tokens x {ROUNDS})", flush=True)


if __name__ == "__main__":
    main()
