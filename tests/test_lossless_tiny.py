"""Lossless: every method, stage count, width, top-k and token source equals plain ar
(eager ar: every configuration also runs with compiled layers, which must not change a
token)."""

import pytest

from protocol.scheduling.records import GenerationResult
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, HybridSource, NgramSource
from tests.tiny_models import EXECUTIONS, PROMPT, other_draft, target_shards, target_whole

N_NEW = 32
SAMPLINGS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11),
}


@pytest.fixture(scope="module")
def reference():
    eng = PipelineEngine([target_whole()])
    return {name: eng.generate(PROMPT, N_NEW, sp, "ar").tokens for name, sp in SAMPLINGS.items()}


def sources(execution: str = "eager"):
    """Every token source: the target as its own draft (many hits), a foreign draft
    (mostly misses), n-gram lookup, and the hybrid."""
    return {
        "self-draft": DraftModelSource(target_whole(execution=execution)),
        "draft": DraftModelSource(other_draft(execution=execution)),
        "ngram": NgramSource(),
        "hybrid": HybridSource(DraftModelSource(other_draft(execution=execution))),
    }


STAGES = [1, 2, 3, 4, 5]
# compiled layers run every configuration at two stage counts (one stage and a pipeline
# whose stages hold different layer counts): the graphs do not depend on the stage count,
# and all five would add minutes to `make test`
COMPILED_STAGES = (1, 3)
RUNS = [(m, e) for m in STAGES for e in EXECUTIONS if e == "eager" or m in COMPILED_STAGES]
SOURCES = ("self-draft", "draft", "ngram", "hybrid")
# (width, top-k, source, method) of every speculative configuration.  SpecInfer's tree
# is the engine's static branching whatever w and k are, so it runs once per source
# (six (w, k) pairs would repeat the same computation).
SPECULATIVE = [(w, k, name, "specpipe") for w in (1, 2, 8) for k in (1, 4)
               for name in SOURCES] + [(8, 4, name, "specinfer") for name in SOURCES]
_runs: dict[tuple, GenerationResult] = {}


def speculative_run(m: int, sampling: str, w: int, k: int, name: str, method: str,
                    execution: str = "eager") -> GenerationResult:
    """One speculative generation, computed once per configuration (several tests read it)."""
    key = (m, sampling, w, k, name, method, execution)
    if key not in _runs:
        _runs[key] = PipelineEngine(target_shards(m, execution=execution),
                                    sources(execution)[name], width=w, topk=k).generate(
            PROMPT, N_NEW, SAMPLINGS[sampling], method)
    return _runs[key]


@pytest.mark.parametrize("m,execution", RUNS)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["ar", "pp"])
def test_baseline_matches_ar(m, sampling, method, execution, reference):
    out = PipelineEngine(target_shards(m, execution=execution)).generate(
        PROMPT, N_NEW, SAMPLINGS[sampling], method)
    assert out.tokens == reference[sampling], (method, m, execution)


@pytest.mark.parametrize("m,execution", RUNS)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("w,k,name,method", SPECULATIVE,
                         ids=[f"w{w}-k{k}-{n}-{me}" for w, k, n, me in SPECULATIVE])
def test_every_method_matches_ar(m, sampling, w, k, name, method, execution, reference):
    out = speculative_run(m, sampling, w, k, name, method, execution)
    assert out.tokens == reference[sampling], (method, m, w, k, name, execution)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("m", STAGES)
def test_hit_path_is_exercised(m, sampling):
    hits = sum(sum(s.hits for s in speculative_run(m, sampling, *c).steps) for c in SPECULATIVE)
    assert hits > 0  # the hit path (pruning to a subtree) was exercised, not only refills


def test_pipeline_schedule_counts():
    """pp takes m steps per token; specpipe with a perfect draft ~1 step per token."""
    m = 4
    shards = target_shards(m)
    pp = PipelineEngine(shards).generate(PROMPT, 16, SamplingParams(), "pp")
    assert len(pp.steps) == m * (len(pp.tokens) - 1)
    sp = PipelineEngine(shards, DraftModelSource(target_whole()), width=8, topk=4).generate(
        PROMPT, 16, SamplingParams(), "specpipe")
    st = sp.stats()
    assert st["hit_rate"] == 1.0 and st["flushes"] == 0
    # refill of the first root (m - 1 steps) plus at most a few bubbles from width pruning
    assert len(sp.steps) < (m - 1) + 2 * (len(sp.tokens) - 1)
    assert all(n <= 8 for s in sp.steps for n in s.stage_tokens)


def test_stop_token_ends_generation(reference):
    ref = reference["greedy"]
    stop = ref[5]
    out = PipelineEngine(target_shards(3), NgramSource()).generate(
        PROMPT, N_NEW, SamplingParams(), "specpipe", stop_ids=[stop])
    assert out.tokens == ref[: ref.index(stop) + 1]
