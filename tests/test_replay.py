"""``--draft replay:P``: a benchmark source whose level hit rate is set by P, lossless as any."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from orchestrator.models.loading import replay_source
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from stages.speculation.replay import ReplaySource, ReplaySpec, coin_rank, parse_replay
from tests.tiny_models import PROMPT, target_shards, target_whole

N_NEW = 40
PAUSE = 0.5  # seconds a re-anchored continuation takes in the test that follows one
SAMPLINGS = {"greedy": SamplingParams(),
             "sampled": SamplingParams(temperature=0.9, top_p=0.95, seed=3)}


@pytest.fixture(scope="module")
def ar_tokens() -> dict[str, list[int]]:
    eng = PipelineEngine([target_whole()])
    return {k: eng.generate(PROMPT, N_NEW, sp, "ar").tokens for k, sp in SAMPLINGS.items()}


def run(m: int, p: float, method: str, sampling: str = "greedy", width: int = 4, topk: int = 2,
        limit: float | None = None):
    shards = target_shards(m)
    src = replay_source(ReplaySpec(p, N_NEW + 1, limit), shards)
    return PipelineEngine(shards, src, width, topk).generate(PROMPT, N_NEW, SAMPLINGS[sampling],
                                                             method)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_p1_specpipe_takes_one_step_per_token_after_the_fill(m, ar_tokens):
    res = run(m, 1.0, "specpipe")
    assert res.tokens == ar_tokens["greedy"]
    verifying = [s for s in res.steps if s.verified]
    assert all(s.hits == 1 for s in verifying)
    # the first token comes from the prefill; the root needs m steps to reach the last
    # stage, then every step verifies a token that was already in the tree
    assert len(res.steps) == m + len(res.tokens) - 2
    assert sum(1 for s in res.steps if not s.verified) == m - 1


@pytest.mark.parametrize("m", [2, 3, 4])
def test_p1_specinfer_accepts_the_whole_static_tree_each_pass(m, ar_tokens):
    res = run(m, 1.0, "specinfer")
    assert res.tokens == ar_tokens["greedy"]
    passes = [s for s in res.steps if s.verified]
    depth = len(PipelineEngine(target_shards(m)).branching)
    # every verified token but the one past the tree's depth is a hit; the last pass may stop
    # early at the token budget
    assert all(s.hits == min(depth, s.verified) for s in passes)
    assert all(s.verified == depth + 1 for s in passes[:-1])


@pytest.mark.parametrize("m", [2, 3, 4])
def test_p0_specpipe_takes_pp_steps(m, ar_tokens):
    spec, pp = run(m, 0.0, "specpipe"), run(m, 0.0, "pp")
    assert spec.tokens == pp.tokens == ar_tokens["greedy"]
    assert len(spec.steps) == len(pp.steps)
    assert sum(s.hits for s in spec.steps) == 0


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["specpipe", "specinfer"])
@pytest.mark.parametrize("p", [0.0, 0.9, 1.0])  # 0.5: test_hit_rate_follows_p
def test_lossless_at_every_p(p, method, sampling, ar_tokens):
    assert run(3, p, method, sampling).tokens == ar_tokens[sampling]


def test_hit_rate_follows_p(ar_tokens):
    runs = [run(2, p, "specpipe") for p in (0.0, 0.5, 1.0)]
    assert all(r.tokens == ar_tokens["greedy"] for r in runs)
    rates = [r.stats()["hit_rate"] for r in runs]
    assert rates[0] == 0.0 and rates[2] == 1.0
    assert 0.0 < rates[1] < 1.0


@pytest.mark.parametrize("spec", ["replay:", "replay:x", "replay:1.5", "replay:-0.1",
                                  "replay:0.9:0", "replay:0.9:5:1", "replay:0.9-0.5",
                                  "replay:0.5-0.5", "replay:0.5-1.2", "replay:0.1-0.2-0.3"])
def test_bad_specs_name_the_fix(spec):
    with pytest.raises(ValueError, match="replay:P"):
        parse_replay(spec)


def test_parse():
    assert parse_replay("ngram") is None
    assert parse_replay("replay:0.9") == ReplaySpec(0.9, 256, None)
    assert parse_replay("replay:1:64") == ReplaySpec(1.0, 64, None)
    assert parse_replay("replay:0.6-0.95:40") == ReplaySpec(0.6, 40, 0.95)
    assert parse_replay("replay:1e-3") == ReplaySpec(0.001, 256, None)
    assert parse_replay("replay:1e-3-0.5") == ReplaySpec(0.001, 256, 0.5)


def test_coin_rank_edges():
    assert coin_rank(0.0, 0.5, 0.9, 8) == 0 and coin_rank(0.5, 0.5, 0.9, 8) == 1
    assert coin_rank(0.95, 0.5, 0.9, 8) is None and coin_rank(0.7, 0.5, None, 8) is None
    # a coin one rounding step below the limit must not reach log2(0)
    assert coin_rank(math.nextafter(1.0, 0.0), 0.06, 1.0, 8) is None


def test_curve_ranks_follow_their_law():
    # replay:P-Q puts the target's token first with probability P and r-th with
    # (Q - P) 2^-r: the share within the first w is P + (Q - P)(1 - 2^-(w-1))
    src = ReplaySource(lambda prompt, n: [], 0.5, 1000, limit=0.9)
    n, k = 20000, 8
    ranks = [src._rank(pos, k) for pos in range(n)]
    for w in (1, 2, 4, 8):
        want = 0.5 + 0.4 * (1 - 0.5 ** (w - 1))
        got = sum(1 for r in ranks if r is not None and r < w) / n
        assert abs(got - want) < 0.015, (w, got, want)
    flat = ReplaySource(lambda prompt, n: [], 0.5, 1000)
    assert {flat._rank(pos, k) for pos in range(1000)} == {0, None}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", ["specpipe", "specinfer"])
def test_curve_is_lossless(method, sampling, ar_tokens):
    assert run(3, 0.3, method, sampling, limit=0.9).tokens == ar_tokens[sampling]


def test_curve_hit_rate_grows_with_width(ar_tokens):
    runs = [run(2, 0.2, "specpipe", width=w, topk=4, limit=0.95) for w in (1, 4)]
    assert all(r.tokens == ar_tokens["greedy"] for r in runs)
    narrow, wide = (r.stats()["hit_rate"] for r in runs)
    assert wide > narrow + 0.2, (narrow, wide)


@pytest.mark.slow
def test_cli_refuses_a_bad_p_in_one_line():
    cp = subprocess.run([sys.executable, "-m", "orchestrator", "generate", "--model",
                         "smollm2-135m", "--draft", "replay:2", "--prompt", "hi"],
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 2
    assert cp.stderr.count("\n") == 1 and "replay:P" in cp.stderr, cp.stderr


@pytest.mark.parametrize("engine", ["single", "batch"])
def test_a_target_that_leaves_the_continuation_is_followed(engine, ar_tokens):
    """Where the committed tokens leave the replayed continuation (a near-tie the target
    flips in a batch), the source proposes the target's continuation of what it committed
    from there on, and the time that takes stays out of the step records."""
    from stages.speculation.batch import BatchRun, Request

    plain = PipelineEngine([target_whole()])
    calls: list[int] = []

    def continuation(prompt: list[int], n: int) -> list[int]:
        out = plain.generate(prompt, n, method="ar").tokens
        calls.append(len(prompt))
        if len(calls) == 1:  # as if the plain run had flipped its sixth token
            out[5] = (out[5] + 1) % shards[0].args.vocab_size
        else:
            time.sleep(PAUSE)
        return out

    shards = target_shards(2)
    src = ReplaySource(continuation, 1.0, shards[0].args.vocab_size, N_NEW + 1)
    eng = PipelineEngine(shards, src, 4, 2)
    if engine == "single":
        res = eng.generate(PROMPT, N_NEW, SamplingParams(), "specpipe")
    else:
        req = Request(PROMPT, N_NEW, SamplingParams())
        res = BatchRun(eng, "specpipe", 2).run({0: [req]})[req.rid]
    assert res.tokens == ar_tokens["greedy"]
    # anchored once more, right after the sixth token committed
    assert calls == [len(PROMPT), len(PROMPT) + 6]
    verified = [s for s in res.steps if s.verified]
    assert sum(s.verified - s.hits for s in verified) == 1  # the sixth token alone missed
    assert max(s.draft_s for s in res.steps) < PAUSE


def test_following_is_bounded_and_skips_a_grammars_requests():
    """A request that keeps leaving the continuation (a sampled one) is re-anchored at
    most MAX_FOLLOWS times, and a grammar's request never is."""
    import torch

    from stages.speculation.replay import MAX_FOLLOWS
    from stages.speculation.tree import SpecTree

    calls: list[int] = []

    def continuation(prompt: list[int], n: int) -> list[int]:
        calls.append(len(prompt))
        return [1] * n

    src = ReplaySource(continuation, 1.0, 100, 30)
    src.reset([5, 6])
    for i in range(MAX_FOLLOWS + 3):  # every step commits a 2 where the truth says 1
        committed = [5, 6] + [2] * (i + 1)
        src.expand(SpecTree(committed[-1], len(committed) - 1), torch.tensor([0]), committed, 2)
    assert calls == [2] + [3 + i for i in range(MAX_FOLLOWS)]
    src.reset([5, 6])
    calls.clear()
    committed = [5, 6, 2]
    src.expand(SpecTree(2, 2), torch.tensor([0]), committed, 2,
               allowed=torch.ones(1, 100, dtype=torch.bool))
    assert calls == []
