"""What masking the draft's proposals with the grammar buys: SpecPipe's hit rate and tokens
per step on json_schema requests, SmolLM2-135M over 4 in-process stages, greedy, with the
draft mask on and off (stages.model.grammar.DraftMask; PipelineEngine.mask_drafts).  The
tokens are checked equal to ar's under the same grammar both ways.  Not a test (pytest
collects only test_*.py):

    PYTHONPATH=. .venv/bin/python docs/bench/draft_mask.py
"""

from __future__ import annotations

import torch

from orchestrator.models.loading import load_draft_model
from orchestrator.models.registry import fetch_model
from protocol.requests.response_format import grammar_spec
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.grammar import GrammarVocab
from stages.model.planning import even_bounds
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import HybridSource, NgramSource

STAGES, WIDTH, TOPK, MAX_NEW = 4, 8, 4, 128
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["city", "country", "population", "capital", "landmarks"],
          "properties": {"city": {"type": "string", "maxLength": 30},
                         "country": {"type": "string", "maxLength": 30},
                         "population": {"type": "integer", "minimum": 0},
                         "capital": {"type": "boolean"},
                         "landmarks": {"type": "array", "maxItems": 4,
                                       "items": {"type": "string", "maxLength": 30}}}}
CITIES = ("Paris", "Tokyo", "Cairo")


def main() -> None:
    """Print one line per token source: hit rate and tokens per step, mask off -> on."""
    torch.set_num_threads(1)
    path = fetch_model("smollm2-135m")
    args = load_model_args(path)
    shards = [load_shard(path, a, b) for a, b in even_bounds(args.n_layers, STAGES)]
    tok = TextTokenizer.from_folder(path)
    vocab = GrammarVocab(tok, args.vocab_size)
    spec = grammar_spec({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    params = SamplingParams(response_format=spec)
    prompts = [tok.chat_ids([{"role": "user", "content": f"Describe {c} as JSON: city, "
                                                         "country, population, whether it "
                                                         "is a capital, landmarks."}])
               for c in CITIES]
    ar = [PipelineEngine(shards).generate(p, MAX_NEW, params, "ar", stop_ids=tok.eos_token_ids,
                                          constraint=vocab.constraint(spec)).tokens
          for p in prompts]
    draft = load_draft_model("layers:4", path, torch.float32, "cpu")
    sources = {"draft layers:4": lambda: draft,
               "ngram": NgramSource, "hybrid": lambda: HybridSource(draft)}
    for name, make in sources.items():
        line = []
        for masked in (False, True):
            eng = PipelineEngine(shards, make(), width=WIDTH, topk=TOPK)
            eng.mask_drafts = masked
            hits = verified = steps = dec = 0
            for p, ref in zip(prompts, ar, strict=True):
                out = eng.generate(p, MAX_NEW, params, "specpipe", stop_ids=tok.eos_token_ids,
                                   constraint=vocab.constraint(spec))
                assert out.tokens == ref, (name, masked)
                hits += sum(s.hits for s in out.steps)
                verified += sum(s.verified for s in out.steps)
                steps += len(out.steps)
                dec += out.decode_tokens
            line.append(f"hit rate {hits / verified:.2f}, {dec / steps:.2f} tokens/step")
        print(f"{name}: mask off {line[0]}; on {line[1]} ({sum(map(len, ar))} tokens)",
              flush=True)


if __name__ == "__main__":
    main()
