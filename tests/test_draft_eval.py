"""Draft evaluation: the simulated level hit rate equals the engine's, top-k hit ratios."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.lab.drafting.draft_eval import (
    evaluate,
    simulate_specpipe,
    source_flops,
    topk_hits,
)
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, HybridSource, NgramSource
from tests.tiny_models import PROMPT, TARGET, other_draft, target_shards, target_whole

N_NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def truth():
    return PipelineEngine([target_whole()]).generate(PROMPT, N_NEW, SamplingParams(), "ar").tokens


def sources():
    return {"self": DraftModelSource(target_whole()), "other": DraftModelSource(other_draft()),
            "ngram": NgramSource(), "hybrid": HybridSource(DraftModelSource(other_draft()))}


@pytest.mark.parametrize("m", [1, 3])
def test_simulated_level_hits_equal_the_engines(m, truth):
    shards = target_shards(m)
    seen = set()
    for name, src in sources().items():
        for w, k in ((1, 1), (16, 8)):
            res = PipelineEngine(shards, src, width=w, topk=k).generate(
                PROMPT, N_NEW, SamplingParams(), "specpipe")
            st = simulate_specpipe(src, PROMPT, truth, m, w, k)
            hits = sum(s.hits for s in res.steps)
            verified = sum(s.verified for s in res.steps)
            assert (st.hits, st.verified, st.steps) == (hits, verified, len(res.steps)), \
                (name, w, k)
            seen.add(st.hits == st.verified)
    # both all-hit and missing configurations were compared (with one stage the level
    # under the root is grown in the step that verifies it, so every step misses)
    assert seen == ({True, False} if m > 1 else {False})


def test_topk_hits(truth):
    ks = (1, 2, 4, 8, 64)
    own, n = topk_hits(DraftModelSource(target_whole()), PROMPT, truth, ks)
    assert n == N_NEW - 1 and own[1] == n  # the target predicts itself perfectly
    other, _ = topk_hits(DraftModelSource(other_draft()), PROMPT, truth, ks)
    assert [other[k] for k in ks] == sorted(other[k] for k in ks)  # more k, more hits
    assert other[1] < n and other[64] == n  # a 64-token vocabulary: top-64 holds everything


def test_evaluate_report_and_flops(truth):
    rep = evaluate(DraftModelSource(other_draft()), [PROMPT], [truth], (1, 4, 64),
                   [(16, 8), (1, 1)], 3, progress=False)
    assert set(rep["topk_hit"]) == {"1", "4", "64"} and rep["topk_hit"]["64"] == 1.0
    assert rep["level_hit_rate"] == rep["level"][0]["level_hit_rate"]
    assert [(r["width"], r["topk"]) for r in rep["level"]] == [(16, 8), (1, 1)]
    fl = source_flops(DraftModelSource(other_draft()), TARGET)
    assert 0 < fl["ratio_body"] < fl["ratio_with_head"] < 1
    assert source_flops(NgramSource(), TARGET)["ratio_with_head"] == 0


def treepipe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *argv],
                          capture_output=True, text=True, timeout=300)


def test_eval_cli_json(smollm2_path, tmp_path):
    cp = treepipe("draft", "eval", "--target", str(smollm2_path), "--draft", "ngram",
                  "--prompts", "humaneval:1", "--max-new-tokens", "8", "--threads", "1",
                  "--cache", str(tmp_path / "truth.json"), "--json")
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(cp.stdout)
    assert list(rep["topk_hit"]) == ["1", "2", "4", "8", "16", "32", "64"]
    assert 0 <= rep["level_hit_rate"] <= 1 and rep["tokens"] == 7
    assert (tmp_path / "truth.json").is_file()


def test_eval_cli_bad_draft_is_one_line(smollm2_path, tmp_path, capsys):
    from orchestrator.cli.main import main
    rc = main(["draft", "eval", "--target", str(smollm2_path), "--draft",
               str(tmp_path / "missing"), "--prompts", "humaneval:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "missing" in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text,needle", [('{"key": "ab', "is not JSON"),
                                         ("[1, 2]", 'no "continuations"')])
def test_eval_cli_bad_cache_is_one_line(smollm2_path, tmp_path, text, needle):
    """A cache cut short while written (or another file) is named with the fix, before
    the target runs: delete it or pass another --cache."""
    cache = tmp_path / "truth.json"
    cache.write_text(text)
    cp = treepipe("draft", "eval", "--target", str(smollm2_path), "--draft", "ngram",
                  "--prompts", "humaneval:1", "--max-new-tokens", "8", "--threads", "1",
                  "--cache", str(cache))
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, cp.stderr
    assert str(cache) in lines[0] and needle in lines[0] and "delete it" in lines[0] \
        and "--cache" in lines[0], lines[0]
    assert cache.read_text() == text  # left for the user to look at
