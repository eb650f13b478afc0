"""Lossless: every method, stage count, width, top-k and token source equals plain ar
(eager ar: every method and token source also runs with compiled layers and with padded
steps, at the widest and the narrowest tree, which must not change a token; with int8
weights, a few configurations equal ar with the same int8 weights)."""

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


_refs: dict[tuple[str, str], list[int]] = {}


def ar_reference(sampling: str, quantize: str = "none") -> list[int]:
    """Plain ar's tokens with the target's weights as ``quantize`` names: each mode is
    its own lossless reference (int8 weights make another model, not a worse run)."""
    if (sampling, quantize) not in _refs:
        eng = PipelineEngine([target_whole(quantize=quantize)])
        _refs[sampling, quantize] = eng.generate(PROMPT, N_NEW, SAMPLINGS[sampling], "ar").tokens
    return _refs[sampling, quantize]


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
# (width, top-k, method) of every tree shape.  SpecInfer's tree is the engine's static
# branching whatever w and k are, so it runs once (six (w, k) pairs would repeat the same
# computation).
TREE_SHAPES = [(w, k, "specpipe") for w in (1, 2, 8) for k in (1, 4)] + [(8, 4, "specinfer")]
# (width, top-k, source, method) of every speculative configuration
SPECULATIVE = [(w, k, name, method) for w, k, method in TREE_SHAPES for name in SOURCES]
_runs: dict[tuple, GenerationResult] = {}


def speculative_run(m: int, sampling: str, w: int, k: int, name: str, method: str,
                    execution: str = "eager", quantize: str = "none") -> GenerationResult:
    """One speculative generation, computed once per configuration (several tests read it);
    the token sources' draft models keep float weights whatever ``quantize`` is, as in
    treepipe (only the stages' weights are quantized)."""
    key = (m, sampling, w, k, name, method, execution, quantize)
    if key not in _runs:
        _runs[key] = PipelineEngine(target_shards(m, execution=execution, quantize=quantize),
                                    sources(execution)[name], width=w, topk=k).generate(
            PROMPT, N_NEW, SAMPLINGS[sampling], method)
    return _runs[key]


# int8 weights (--quantize int8) at a pipeline of three stages, eager: the product of an
# int8 weight is the same code in every execution mode and at every stage count
INT8_STAGES = 3
BASELINE_RUNS = [(m, e, "none") for m, e in RUNS] + [(INT8_STAGES, "eager", "int8")]


@pytest.mark.parametrize("m,execution,quantize", BASELINE_RUNS)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["ar", "pp"])
def test_baseline_matches_ar(m, sampling, method, execution, quantize):
    out = PipelineEngine(target_shards(m, execution=execution, quantize=quantize)).generate(
        PROMPT, N_NEW, SAMPLINGS[sampling], method)
    assert out.tokens == ar_reference(sampling, quantize), (method, m, execution, quantize)


# Compiled layers and padded steps run every method, token source and sampling at
# w=8, k=4 and w=1, k=1 (the widest and the narrowest tree), not at all six (w, k)
# pairs: the pairs change which nodes the tree holds (the engine's code, the same in
# every execution mode, all of it run eager above at every stage count) and how many
# rows each step has, and what an execution mode changes is how a step of those rows
# runs (compiled: graphs specialised on sizes of one, dynamic otherwise; graphs: rows,
# requests and keys padded to power-of-two buckets).  Recording every step's shape
# signature (its bucket, which of rows/requests/rows-per-request/keys are one or were
# padded, whether it has a mask) over all 28 configurations at 1 and 3 stages found
# 7 (1 stage) and 11 (3 stages) signatures, and the w=8, k=4 configurations of both
# methods with ar and pp already meet every one of them.
EXECUTION_SHAPES = ((8, 4), (1, 1))
# Eager, `make test` runs every stage count with every tree shape (w, k, method), both
# samplings, and the token source rotating so that every stage count meets every source
# and every tree shape meets every source: 70 runs that cover each pair of the four
# factors.  The whole cross product (280 runs, minutes on 2 cores) is `make test-grid`.
def covering(m: int, shape: int) -> str:
    """The token source a stage count and tree shape run with in the pairwise subset."""
    return SOURCES[(m + shape) % len(SOURCES)]


PAIRWISE = {(m, (w, k, covering(m, i), method)) for m in STAGES
            for i, (w, k, method) in enumerate(TREE_SHAPES)}
METHOD_RUNS = [pytest.param(m, execution, c, "none",
                            id=f"w{c[0]}-k{c[1]}-{c[2]}-{c[3]}-{m}-{execution}",
                            marks=[] if execution != "eager" or (m, c) in PAIRWISE
                            else [pytest.mark.grid])
               for m, execution in RUNS for c in SPECULATIVE
               if execution == "eager" or c[:2] in EXECUTION_SHAPES]
# int8 weights: specpipe with many hits (the target as its own float draft) and with
# misses (n-gram)
INT8_CONFIGS = [(8, 4, "self-draft", "specpipe"), (2, 1, "ngram", "specpipe")]
METHOD_RUNS += [pytest.param(INT8_STAGES, "eager", c, "int8",
                             id=f"w{c[0]}-k{c[1]}-{c[2]}-{c[3]}-{INT8_STAGES}-int8")
                for c in INT8_CONFIGS]


@pytest.mark.parametrize("m,execution,config,quantize", METHOD_RUNS)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_every_method_matches_ar(m, execution, config, quantize, sampling):
    w, k, name, method = config
    out = speculative_run(m, sampling, w, k, name, method, execution, quantize)
    assert out.tokens == ar_reference(sampling, quantize), (method, m, w, k, name, execution,
                                                            quantize)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("m", STAGES)
def test_hit_path_is_exercised(m, sampling):
    hits = sum(sum(s.hits for s in speculative_run(m, sampling, *c).steps)
               for mc, c in PAIRWISE if mc == m)
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


def test_stop_token_ends_generation():
    ref = ar_reference("greedy")
    stop = ref[5]
    out = PipelineEngine(target_shards(3), NgramSource()).generate(
        PROMPT, N_NEW, SamplingParams(), "specpipe", stop_ids=[stop])
    assert out.tokens == ref[: ref.index(stop) + 1]
