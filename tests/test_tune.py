"""``treepipe tune``: Eq. (1), the choice, verification, and the bench's predicted column."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from test_bench import bench, prompts_file, tiny_argv, tiny_folder  # noqa: F401
from tiny_models import PROMPT, other_draft, target_shards, target_whole

from orchestrator.cli.tune_commands import add_tune_parser
from orchestrator.lab.benchmarks.simulator import eq1_tbt
from orchestrator.lab.benchmarks.sweeps import eq1_predict, stage_busy
from orchestrator.lab.benchmarks.tune import choose
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource


def test_eq1_as_printed_and_with_our_refill() -> None:
    t = [1.0, 2.0, 3.0, 4.0]
    assert eq1_tbt(t, 0.5) == pytest.approx(4 + 0.5 * 10)  # all m stages, as printed
    assert eq1_tbt(t, 0.5, refill=3) == pytest.approx(4 + 0.5 * 6)  # stages 1..m-1
    assert eq1_tbt(t, 1.0, refill=3) == 4.0


def _synthetic(res: GenerationResult) -> GenerationResult:
    """Stage i costs (1 + i) ms + 0.2 ms per node, the draft 0.5 ms per node: no timer noise."""
    for s in res.steps:
        s.stage_s = [(1 + i + 0.2 * n) * 1e-3 if n else 0.0
                     for i, n in enumerate(s.stage_tokens)]
        s.prune_s = [0.0] * len(s.prune_s)
        s.draft_s = 5e-4 * s.draft_tokens
    return res


@pytest.mark.parametrize("draft", ["self", "other"])
def test_eq1_predict_tracks_pipelined_time(draft: str) -> None:
    """Eq. (1) with the run's own t_i and P predicts its pipelined TBT (structure check)."""
    shard = target_whole() if draft == "self" else other_draft()
    eng = PipelineEngine(target_shards(3), DraftModelSource(shard), width=4, topk=2)
    res = [_synthetic(eng.generate(PROMPT[i:], 14, method="specpipe")) for i in (0, 3)]
    dec = sum(r.decode_tokens for r in res)
    hits = sum(s.hits for r in res for s in r.steps)
    p = hits / sum(s.verified for r in res for s in r.steps)
    assert (p == 1.0) == (draft == "self")
    pred = eq1_predict(stage_busy(res), p, 3, decode_per_request=dec / len(res))
    measured = sum(r.pipelined_s for r in res) / dec
    assert pred == pytest.approx(measured, rel=0.10)


def test_choose_smallest_prediction() -> None:
    pts = [{"w": 8, "k": 4, "eq1_ms": 3.0}, {"w": 2, "k": 4, "eq1_ms": 2.0},
           {"w": 4, "k": 8, "eq1_ms": 2.0}]
    assert (choose(pts)["w"], choose(pts)["k"]) == (2, 4)


def test_tune_then_bench_shows_prediction(tiny_folder: Path, prompts_file: Path,  # noqa: F811
                                          tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    add_tune_parser(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["tune", "--model", str(tiny_folder), "--prompts", str(prompts_file),
                       "--verify-prompts", str(prompts_file), "--stages", "2", "--draft",
                       "ngram", "--widths", "1,4", "--topks", "2", "--max-new-tokens", "6",
                       "--dtype", "float64", "--threads", "1", "--out", str(tmp_path)])
    threads = torch.get_num_threads()
    try:
        assert a.func(a) == 0
    finally:
        torch.set_num_threads(threads)
    rep = json.loads((tmp_path / "tune.json").read_text())
    c = rep["choice"]
    assert c["predicted_ms"] == min(p["eq1_ms"] for p in rep["points"])
    assert (c["w"], c["k"]) in {(1, 2), (4, 2)}
    assert all(p["heldout"]["prompts"] == 2 for p in rep["points"])
    chosen = next(p for p in rep["points"] if (p["w"], p["k"]) == (c["w"], c["k"]))
    assert rep["verify"]["tbt_pipelined_ms"] == chosen["heldout"]["tbt_pipelined_ms"] > 0
    assert (tmp_path / "tune.png").is_file()

    out = tmp_path / "bench"
    try:
        assert bench(tiny_argv(tiny_folder, prompts_file, out, "--methods", "specpipe",
                               "--sources", "ngram", "--width", str(c["w"]), "--topk", "2",
                               "--tune", str(tmp_path / "tune.json"))) == 0
    finally:
        torch.set_num_threads(threads)
    row = json.loads((out / "bench.json").read_text())["rows"][0]
    assert row["tune_predicted_ms"] == pytest.approx(c["predicted_ms"])
    assert row["eq1_tbt_ms"] > 0
    assert "TBT tune (ms)" in (out / "bench.md").read_text()
    with pytest.raises(TreepipeError, match="no prediction for w=3"):
        bench(tiny_argv(tiny_folder, prompts_file, out, "--sources", "ngram", "--width", "3",
                        "--tune", str(tmp_path / "tune.json")))
