"""response_format: the verifier's grammar mask keeps every method on ar's tokens under the
same constraint, the text is JSON that validates, and the grammar ends the request."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from orchestrator.models.loading import load_draft_model
from protocol.requests.response_format import MAX_FORMAT_BYTES, FormatError, grammar_spec
from protocol.requests.sampling_params import SamplingError
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.grammar import GrammarError, GrammarVocab
from stages.model.planning import even_bounds
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import HybridSource, NgramSource
from tests.tiny_models import DEVICE

N_NEW = 64
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


@pytest.mark.parametrize("fmt", [SCHEMA_FORMAT, {"type": "json_object"}],
                         ids=["json_schema", "json_object"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_specpipe_equals_ar_under_the_grammar(smol, fmt: dict, sampling: dict) -> None:
    shards, tok, prompt, draft, vocab = smol
    spec = grammar_spec(fmt)
    params = SamplingParams(**sampling, response_format=spec)
    eos = tok.eos_token_ids
    ref = PipelineEngine(shards).generate(prompt, N_NEW, params, "ar", stop_ids=eos,
                                          constraint=vocab.constraint(spec))
    for source in (NgramSource(), HybridSource(draft)):
        out = PipelineEngine(shards, source, width=8, topk=4).generate(
            prompt, N_NEW, params, "specpipe", stop_ids=eos, constraint=vocab.constraint(spec))
        assert out.tokens == ref.tokens, source.name
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
    shards, tok, prompt, _, vocab = smol
    spec = grammar_spec(SCHEMA_FORMAT)
    out = PipelineEngine(shards).generate(prompt, N_NEW, SamplingParams(response_format=spec),
                                          "ar", stop_ids=tok.eos_token_ids,
                                          constraint=vocab.constraint(spec))
    log = out.tokens
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
