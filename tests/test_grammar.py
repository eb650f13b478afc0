"""response_format: the verifier's grammar mask keeps every method on ar's tokens under the
same constraint, the text is JSON that validates, and the grammar ends the request; the
draft proposes only tokens the grammar allows on each node's path."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from orchestrator.models.loading import load_draft_model
from protocol.requests.response_format import MAX_FORMAT_BYTES, FormatError, grammar_spec
from protocol.requests.sampling_params import SamplingError
from protocol.scheduling.records import GenerationResult
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.grammar import Constraint, DraftMask, GrammarError, GrammarVocab
from stages.model.planning import even_bounds
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import (
    DraftModelSource,
    HybridSource,
    NgramSource,
    Proposals,
    TokenSource,
)
from stages.speculation.tree import SpecTree
from tests.tiny_models import DEVICE, other_draft

N_NEW = 64  # the schema's JSON ends (the grammar ends it) within 20 tokens
# json_object never ends the request: 32 tokens of JSON (an object, nested, a long string)
OBJECT_NEW = 32
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    args = load_model_args(smollm2_path)
    shards = [load_shard(smollm2_path, a, b, device=DEVICE)
              for a, b in even_bounds(args.n_layers, 2)]
    tok = TextTokenizer.from_folder(smollm2_path)
    prompt = tok.chat_ids([{"role": "user", "content": "Describe Paris as JSON with its "
                                                       "city name, population and whether "
                                                       "it is a capital."}])
    draft = load_draft_model("layers:4", smollm2_path, torch.float32, DEVICE)
    return shards, tok, prompt, draft, GrammarVocab(tok, args.vocab_size)


def test_format_spec_and_wire() -> None:
    assert grammar_spec({"type": "text"}) is None
    spec = grammar_spec(SCHEMA_FORMAT)
    assert spec == grammar_spec({"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                         "name": "x"}})
    p = SamplingParams(temperature=0.5, seed=1, response_format=spec)
    assert SamplingParams.from_wire(json.loads(json.dumps(p.to_wire()))) == p
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, "json", {"type": "json_schema",
                "json_schema": {"schema": {"description": "x" * MAX_FORMAT_BYTES}}}):
        with pytest.raises(FormatError):
            grammar_spec(bad)
    with pytest.raises(SamplingError) as e:
        SamplingParams(min_tokens=2, response_format=spec)
    assert e.value.field == "response_format"
    with pytest.raises(SamplingError):
        SamplingParams.from_wire({"response_format": "{\"type\": 1}"})


def test_bad_schema_does_not_compile(smol) -> None:
    vocab = smol[4]
    with pytest.raises(GrammarError):
        vocab.compile(grammar_spec({"type": "json_schema", "json_schema": {
            "schema": {"type": "no-such-type"}}}))  # type: ignore[arg-type]
    spec = grammar_spec({"type": "json_object"})
    assert vocab.compile(spec) is vocab.compile(spec)  # compiled once


_ar_runs: dict[tuple[str, int, SamplingParams], GenerationResult] = {}


def grammar_ar(smol, fmt: dict, n: int, params: SamplingParams) -> GenerationResult:
    """ar under ``fmt``'s grammar on the module's shards, each run once (several tests
    read the same one)."""
    key = (json.dumps(fmt, sort_keys=True), n, params)
    if key not in _ar_runs:
        shards, tok, prompt, _, vocab = smol
        _ar_runs[key] = PipelineEngine(shards).generate(
            prompt, n, params, "ar", stop_ids=tok.eos_token_ids,
            constraint=vocab.constraint(grammar_spec(fmt)))
    return _ar_runs[key]


class _Recorder(TokenSource):
    """A token source that remembers every node it expanded: (generated tokens and the
    node's path below the root, the tokens it proposed there)."""

    def __init__(self, inner: TokenSource):
        self.inner, self.name = inner, inner.name
        self.seen: list[tuple[list[int], list[int]]] = []
        self.prompt_len = 0

    def reset(self, prompt: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.inner.reset(prompt)

    def expand(self, tree: SpecTree, idx: torch.Tensor, committed: list[int], k: int,
               allowed: torch.Tensor | None = None) -> Proposals:
        toks, probs = self.inner.expand(tree, idx, committed, k, allowed)
        for i, t in zip(idx.tolist(), toks, strict=True):
            self.seen.append((committed[self.prompt_len:] + tree.path_tokens(i)[1:],
                              t.tolist()))
        return toks, probs

    def sync(self, tree: SpecTree, committed_ids: list[int]) -> None:
        self.inner.sync(tree, committed_ids)


@pytest.mark.parametrize("fmt", [SCHEMA_FORMAT, {"type": "json_object"}],
                         ids=["json_schema", "json_object"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_specpipe_equals_ar_under_the_grammar(smol, fmt: dict, sampling: dict) -> None:
    shards, tok, prompt, draft, vocab = smol
    spec = grammar_spec(fmt)
    params = SamplingParams(**sampling, response_format=spec)
    eos = tok.eos_token_ids
    n = N_NEW if fmt is SCHEMA_FORMAT else OBJECT_NEW
    ref = grammar_ar(smol, fmt, n, params)
    for source in (NgramSource(), HybridSource(draft)):
        rec = _Recorder(source)
        out = PipelineEngine(shards, rec, width=8, topk=4).generate(
            prompt, n, params, "specpipe", stop_ids=eos, constraint=vocab.constraint(spec))
        assert out.tokens == ref.tokens, source.name
        # the draft proposed only what the grammar allows on each node's path
        assert rec.seen and _forbidden(rec, vocab.constraint(spec)) == 0, source.name
    if fmt is SCHEMA_FORMAT:
        # the grammar ended it at the closing brace (nothing but EOS could follow)
        assert len(ref.tokens) < N_NEW and tok.decode(ref.tokens).endswith("}")
        jsonschema.validate(json.loads(tok.decode(ref.tokens)), SCHEMA)


def test_max_tokens_still_bounds_it(smol) -> None:
    shards, tok, prompt, _, vocab = smol
    spec = grammar_spec({"type": "json_object"})
    out = PipelineEngine(shards).generate(prompt, 5, SamplingParams(response_format=spec),
                                          "ar", stop_ids=tok.eos_token_ids,
                                          constraint=vocab.constraint(spec))
    assert len(out.tokens) == 5 and tok.decode(out.tokens).lstrip().startswith("{")


def test_constraint_rebuilds_from_a_log(smol) -> None:
    """A resumed request's state is its log replayed: the same masks as one that followed
    the tokens one by one, and a different history restarts the matcher."""
    _, tok, _, _, vocab = smol
    spec = grammar_spec(SCHEMA_FORMAT)
    log = grammar_ar(smol, SCHEMA_FORMAT, N_NEW, SamplingParams(response_format=spec)).tokens
    live = vocab.constraint(spec)
    masks = [live.allowed(log[:i]).clone() for i in range(len(log) + 1)]
    for cut in (0, 3, len(log) // 2):
        resumed = vocab.constraint(spec)
        assert torch.equal(resumed.allowed(log[:cut]), masks[cut])
        assert torch.equal(resumed.allowed(log), masks[-1])
    assert torch.equal(live.allowed(log[:2]), masks[2])  # shorter history: restarted
    with pytest.raises(GrammarError):
        vocab.constraint(spec).allowed([tok.encode("hello")[0]])


def test_no_grammar_state_is_refused_not_ignored() -> None:
    """A caller that does not pass the request's grammar state (the in-process batch
    runner) is refused, never silently unconstrained."""
    from stages.model.sampling import choose_token

    params = SamplingParams(response_format=grammar_spec({"type": "json_object"}))
    with pytest.raises(ValueError, match="grammar state"):
        choose_token(torch.zeros(8), params, [1], [])


def test_vocabulary_bytes_are_the_tokenizers(smol) -> None:
    """The bytes the grammar reads for each token join to the tokenizer's own decoding
    (byte-level pieces mapped back to bytes; special tokens never text)."""
    from stages.model.grammar import _Pieces

    _, tok, _, _, _ = smol
    pieces = _Pieces(tok, 49152)
    text = 'Ünïcode "JSON": {"a": [1, 2.5e-3, null]}\n\tdone — ok'
    ids = tok.encode(text)
    assert b"".join(pieces.tokens[i] for i in ids).decode() == tok.decode(ids) == text
    assert all(pieces.tokens[t].startswith(b"\xff") for t in tok.eos_token_ids)


def _forbidden(rec: _Recorder, check: Constraint) -> int:
    """Proposals the grammar does not allow after their node's path (every proposal below
    a node whose own path it refuses)."""
    bad = 0
    for history, proposed in rec.seen:
        try:
            ok = check.allowed(history)
        except GrammarError:
            bad += len(proposed)
            continue
        bad += sum(not bool(ok[t]) for t in proposed)
    return bad


def test_unmasked_drafts_propose_what_the_grammar_forbids(smol) -> None:
    """The check above can fail: without the draft mask the draft proposes tokens the
    grammar forbids (the verifier could never accept them).  SpecInfer's static tree,
    masked too, keeps the same tokens (ar's, which the masked specpipe above keeps)."""
    shards, tok, prompt, draft, vocab = smol
    spec = grammar_spec(SCHEMA_FORMAT)
    params = SamplingParams(response_format=spec)
    rec = _Recorder(HybridSource(draft))
    eng = PipelineEngine(shards, rec, width=8, topk=4)
    eng.mask_drafts = False
    free = eng.generate(prompt, N_NEW, params, "specpipe", stop_ids=tok.eos_token_ids,
                        constraint=vocab.constraint(spec))
    assert _forbidden(rec, vocab.constraint(spec)) > 0
    static = PipelineEngine(shards, HybridSource(draft), width=8, topk=4).generate(
        prompt, N_NEW, params, "specinfer", stop_ids=tok.eos_token_ids,
        constraint=vocab.constraint(spec))
    assert static.tokens == free.tokens


def test_masked_sources_propose_their_best_allowed_tokens() -> None:
    """A draft model masks its logits before the top-k (with a reduced head too): its
    proposals are its k most likely allowed tokens, probabilities over those; a row that
    allows nothing proposes nothing.  The n-gram lookup skips forbidden continuations
    and falls back to a shorter suffix when none is allowed."""
    draft = DraftModelSource(other_draft())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    root = torch.zeros(1, dtype=torch.long)

    def expand(k: int, allowed: torch.Tensor | None = None) -> Proposals:
        draft.reset(prompt)  # a fresh tree: the draft computes each node once
        return draft.expand(SpecTree(prompt[-1], len(prompt) - 1), root, prompt, k, allowed)

    order = expand(64)[0][0].tolist()  # every token, most likely first
    allowed = torch.zeros(1, 64, dtype=torch.bool)
    allowed[0, order[5::3]] = True  # none of the draft's five favourites
    toks, probs = expand(4, allowed)
    assert toks[0].tolist() == order[5::3][:4]
    assert float(probs[0].sum()) < 1 and bool((probs[0] > 0).all())
    assert expand(64, allowed)[0][0].tolist() == order[5::3]  # fewer than k: only those
    assert expand(4, torch.zeros(1, 64, dtype=torch.bool))[0][0].numel() == 0
    draft.reduce_vocab(torch.tensor(order[::2]))  # the head keeps every other token
    toks, _ = expand(4, allowed)
    assert toks[0].tolist() == [t for t in order[5::3] if t in order[::2]][:4]
    draft.release()

    ngram = NgramSource()
    context = [5, 1, 2, 8, 1, 3, 5, 1]
    assert ngram.lookup(context, 4)[0].tolist() == [2]  # after "5 1"
    only3 = torch.zeros(64, dtype=torch.bool)
    only3[3] = True
    t, p = ngram.lookup(context, 4, only3)  # after "1": 2 or 3
    assert t.tolist() == [3] and p.tolist() == [1.0]
    only9 = torch.zeros(64, dtype=torch.bool)
    only9[9] = True  # no suffix is ever followed by 9
    assert ngram.lookup(context, 4, only9)[0].numel() == 0


def test_draft_mask_rows_follow_each_path(smol) -> None:
    """DraftMask's rows are the verifier's masks after the committed tokens plus each
    path; a path the grammar refuses, or one that ends the text, allows nothing."""
    _, tok, prompt, _, vocab = smol
    spec = grammar_spec(SCHEMA_FORMAT)
    text = tok.encode('{"city": "Paris", "population": 2100000, "capital": true}')
    mask = DraftMask(vocab.constraint(spec), len(prompt))
    verifier = vocab.constraint(spec)
    paths = [text[3:5], [], text[3:4], tok.encode("hello"), text[3:]]
    rows = mask.rows(prompt + text[:3], paths)
    assert rows is not None and rows.shape == (len(paths), vocab.vocab)
    for j in range(3):
        assert torch.equal(rows[j], verifier.allowed(text[:3] + paths[j]))
    assert not rows[3].any() and not rows[4].any()
    # a history the grammar refuses turns the draft's mask off (the verifier fails it)
    assert mask.rows(prompt + tok.encode("hello"), [[]]) is None and mask.off
