"""Penalties, logit bias and min_tokens (stages.model.sampling.adjust_logits): every
method, stage count and the SpecPipe-DB batch give ar's tokens under the same parameters,
greedy and seeded; each parameter changes ar's tokens; out-of-range values are refused."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from protocol.requests.sampling_params import SamplingError
from stages.model.sampling import SamplingParams, adjust_logits, choose_token, filtered_probs
from stages.speculation.batch import Request, generate_many
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, NgramSource
from tests.tiny_models import PROMPT, target_shards, target_whole

N_NEW = 24
MIN_P = 0.3  # vLLM's min_p filter of the seeded draw (greedy keeps its argmax anyway)
BASE = {"greedy": SamplingParams(),
        "seeded": SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11)}
# each parameter alone, then all together (min_tokens with a stop id that ends plain ar
# early: see stops())
PARAMS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {7: 4.0, 12: -100.0, 40: 2.5}},
    "min_tokens": {"min_tokens": 12},
    "all": {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
            "logit_bias": {3: -3.0, 21: 1.5}, "min_tokens": 6, "min_p": MIN_P},
}


def params(param: str, base: str) -> SamplingParams:
    return replace(BASE[base], **PARAMS[param])


@functools.cache
def stops(param: str, base: str) -> tuple[int, ...]:
    """With min_tokens: a stop id that ends plain ar at its third token (min_tokens then
    holds it off); else none."""
    if "min_tokens" not in PARAMS[param]:
        return ()
    plain = PipelineEngine([target_whole()]).generate(PROMPT, N_NEW, BASE[base], "ar").tokens
    return (plain[2],)


@functools.cache
def ar(param: str, base: str, plain: bool = False) -> tuple[int, ...]:
    """ar's tokens under ``param`` (``plain``: without it, with the same stop ids)."""
    sp = BASE[base] if plain else params(param, base)
    return tuple(PipelineEngine([target_whole()]).generate(
        PROMPT, N_NEW, sp, "ar", stop_ids=stops(param, base)).tokens)


@pytest.mark.parametrize("base", list(BASE))
@pytest.mark.parametrize("param", list(PARAMS))
def test_each_parameter_changes_ar(param: str, base: str) -> None:
    assert ar(param, base) != ar(param, base, plain=True)


# (method, stages, token source): pp, and specpipe and specinfer with the target as its
# own draft (long accepted runs: several positions verified per specinfer step) and n-grams
RUNS = [("pp", 1, None), ("pp", 3, None), ("specpipe", 1, "self"), ("specpipe", 3, "self"),
        ("specpipe", 3, "ngram"), ("specinfer", 1, "self"), ("specinfer", 3, "self")]


# SpecInfer's static tree, shortened: with the target as its draft most of a branch is
# accepted, so one step still verifies several positions (checked below)
BRANCHING = (1, 2, 1, 1)


def engine(m: int, src: str | None) -> PipelineEngine:
    return PipelineEngine(target_shards(m), source(src), width=4, topk=2, branching=BRANCHING)


def source(name: str | None):
    return None if name is None else (DraftModelSource(target_whole()) if name == "self"
                                      else NgramSource())


@pytest.mark.parametrize("base", list(BASE))
@pytest.mark.parametrize("param", list(PARAMS))
@pytest.mark.parametrize("method,m,src", RUNS, ids=[f"{a}-m{b}-{c}" for a, b, c in RUNS])
def test_every_method_matches_ar(method: str, m: int, src: str | None, param: str,
                                 base: str) -> None:
    out = engine(m, src).generate(PROMPT, N_NEW, params(param, base), method,
                                  stop_ids=stops(param, base))
    assert tuple(out.tokens) == ar(param, base), (method, m, src, param, base)
    if method == "specinfer" and param == "all":  # positions after a verified one, too
        assert max(s.verified for s in out.steps) > 1


@pytest.mark.parametrize("method,src", [("specpipe", "self"), ("specinfer", "self"),
                                        ("specpipe", "ngram"), ("ar", None)])
def test_batch_matches_ar(method: str, src: str | None) -> None:
    """SpecPipe-DB: requests with different parameters in one batch each give ar's tokens."""
    names = [(p, b) for p in PARAMS for b in BASE]
    reqs = [Request(PROMPT, N_NEW, params(p, b), stops(p, b),
                    source=None if src is None else source(src)) for p, b in names]
    eng = engine(2, src)
    for (p, b), res in zip(names, generate_many(eng, reqs, method, max_batch=4), strict=True):
        assert tuple(res.tokens) == ar(p, b), (method, src, p, b)


def test_min_p_changes_seeded_ar_but_not_greedy() -> None:
    """The "all" rows above sample under min_p: on their own it changes seeded ar's
    tokens (so those rows test it), and greedy's not (the argmax always stays)."""
    def run(sp: SamplingParams) -> list[int]:
        return PipelineEngine([target_whole()]).generate(PROMPT, N_NEW, sp, "ar").tokens
    for base, changes in (("seeded", True), ("greedy", False)):
        assert (run(replace(BASE[base], min_p=MIN_P)) != run(BASE[base])) is changes, base


def test_min_p_is_vllms_order() -> None:
    """min_p drops tokens below min_p x the top probability of the temperature's
    distribution, then top-k and top-p apply to what is left, renormalised (vLLM's)."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    logits = probs.log()
    ids, p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert ids.tolist() == [0, 1, 2]  # 0.15 >= 0.3 x 0.4 = 0.12 > 0.1
    assert torch.allclose(p, probs[:3] / probs[:3].sum())
    # top-p over the renormalised three: 0.47 < 0.8 <= 0.47 + 0.35, so two stay
    ids, _ = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3, top_p=0.8))
    assert ids.tolist() == [0, 1]
    ids, _ = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert ids.tolist() == [0, 1, 2]  # without min_p, 0.4 + 0.3 < 0.8 takes a third


def test_defaults_leave_the_logits_alone() -> None:
    lg = torch.randn(64, dtype=torch.float64)
    assert adjust_logits(lg, SamplingParams(), PROMPT, [1, 2], [3]) is lg


def test_adjustment_is_vllms() -> None:
    lg = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                        logit_bias={4: 1.0}, min_tokens=4)
    # prompt has token 0; generated has 1 twice and 2 once; 3 is a stop id, held off
    got = adjust_logits(lg, sp, [0], [1, 2, 1], [3])
    want = torch.tensor([1.0, -2.0 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, -torch.inf, 2.0],
                        dtype=torch.float64)
    assert torch.equal(got, want)
    assert choose_token(lg, sp, [0], [1, 2, 1], [3]) == 4
    # once min_tokens were generated the stop id may be chosen again
    assert choose_token(lg, SamplingParams(min_tokens=3), [0], [1, 2, 1], [3]) == 3


BAD = [("presence_penalty", 2.5), ("presence_penalty", float("nan")),
       ("frequency_penalty", -3), ("frequency_penalty", True), ("repetition_penalty", 0),
       ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
       ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}),
       ("logit_bias", {1: float("nan")}), ("logit_bias", 5), ("min_tokens", -1),
       ("min_tokens", 1.5), ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
       ("min_p", True)]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_out_of_range_is_refused(field: str, value: object) -> None:
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and str(e.value).startswith(field)
    assert "\n" not in str(e.value)


def test_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(SamplingError, match="^logit_bias token id 64 is outside"):
        PipelineEngine([target_whole()]).generate(PROMPT, 2, SamplingParams(logit_bias={64: 1}),
                                                  "ar")


def test_params_stay_hashable_and_equal() -> None:
    a = SamplingParams(logit_bias={5: 1, 2: -1.5})
    b = SamplingParams(logit_bias=((2, -1.5), (5, 1.0)))
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((2, -1.5), (5, 1.0))
