"""``treepipe sweep width|topk|layer-time`` and ``treepipe timeline`` on tiny models."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from test_bench import prompts_file, tiny_folder  # noqa: F401  (module fixtures)
from tiny_models import PROMPT, target_shards, target_whole

from orchestrator.cli.sweep_commands import add_sweep_parser
from orchestrator.cli.timeline_commands import add_timeline_parser
from orchestrator.lab.benchmarks.simulator import result_to_dict
from orchestrator.lab.benchmarks.sweeps import source_ranks
from orchestrator.lab.benchmarks.timeline import layout
from protocol.errors import TreepipeError
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, NgramSource


def _cli(register, argv: list[str]) -> int:  # noqa: ANN001
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command"))
    a = ap.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return a.func(a)
    finally:
        torch.set_num_threads(threads)


def test_sweep_width(tiny_folder: Path, prompts_file: Path, tmp_path: Path) -> None:  # noqa: F811
    assert _cli(add_sweep_parser, [
        "sweep", "width", "--model", str(tiny_folder), "--prompts", str(prompts_file),
        "--stages", "2", "--draft", "ngram", "--widths", "1,4", "--topks", "1,2",
        "--max-new-tokens", "6", "--dtype", "float64", "--threads", "1",
        "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "sweep_width.json").read_text())
    assert sorted((p["w"], p["k"]) for p in rep["points"]) == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for p in rep["points"]:
        assert 0.0 <= p["hit_rate"] <= 1.0 and p["tbt_pipelined_ms"] > 0
        assert p["decode_tokens"] == 2 * 5 and len(p["t_i_ms"]) == 2
        assert p["eq1_ms"] > 0
    assert rep["pp"]["steps"] == 2 * 2 * 5  # pp: m steps per decode token
    assert (tmp_path / "sweep_width.png").stat().st_size > 1000


def test_source_ranks_self_draft_always_top1() -> None:
    """The target as its own draft ranks every greedy token first; a bad offset would not."""
    shards = target_shards(2)
    cont = PipelineEngine(shards).generate(PROMPT, 10, method="ar").tokens
    ranks = source_ranks(DraftModelSource(target_whole()), PROMPT, cont, 4)
    assert ranks == [0] * len(cont)
    # n-gram lookup through the TokenSource API: ranks are within 0..k
    ng = source_ranks(NgramSource(), PROMPT, cont, 4)
    assert len(ng) == len(cont) and all(0 <= r <= 4 for r in ng)


def test_sweep_topk(tiny_folder: Path, prompts_file: Path, tmp_path: Path) -> None:  # noqa: F811
    assert _cli(add_sweep_parser, [
        "sweep", "topk", "--model", str(tiny_folder), "--prompts", str(prompts_file),
        "--drafts", "layers:2,ngram", "--ks", "1,4,16", "--max-new-tokens", "8",
        "--dtype", "float64", "--threads", "1", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "sweep_topk.json").read_text())
    for curve in rep["curves"].values():
        hits = [curve["hit"][k] for k in ("1", "4", "16")]
        assert hits == sorted(hits) and 0.0 <= hits[0] and hits[-1] <= 1.0
        assert curve["positions"] == 2 * 8
    assert (tmp_path / "sweep_topk.png").is_file()
    with pytest.raises(TreepipeError, match="--ks"):
        _cli(add_sweep_parser, ["sweep", "topk", "--ks", "0", "--out", str(tmp_path)])


def test_sweep_layer_time(tiny_folder: Path, tmp_path: Path) -> None:  # noqa: F811
    assert _cli(add_sweep_parser, [
        "sweep", "layer-time", "--model", str(tiny_folder), "--tokens", "1,8,32",
        "--context", "64", "--repeats", "3", "--threads", "1", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "sweep_layer_time.json").read_text())
    assert [p["tokens"] for p in rep["points"]] == [1, 8, 32]
    assert all(p["ms"] > 0 for p in rep["points"])
    assert (tmp_path / "sweep_layer_time.png").is_file()
    with pytest.raises(TreepipeError, match="exceeds the model's context"):
        _cli(add_sweep_parser, ["sweep", "layer-time", "--model", str(tiny_folder),
                                "--context", "1000", "--out", str(tmp_path)])


def test_sweep_layer_time_of_a_known_shape(tmp_path: Path) -> None:
    """--shape times one random layer of that shape (no model folder); the report says so."""
    assert _cli(add_sweep_parser, [
        "sweep", "layer-time", "--shape", "smollm2-135m", "--tokens", "1,4", "--context", "16",
        "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "sweep_layer_time.json").read_text())
    assert rep["config"]["model"] == "smollm2-135m (random weights)"
    assert rep["config"]["layer"] == 15 and rep["config"]["device_name"]
    assert [p["tokens"] for p in rep["points"]] == [1, 4]


def test_sweep_layer_time_of_compiled_layers_against_the_memory_floor(tiny_folder: Path,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    """--layers times consecutive layers per layer, --compile compiles them, and every point
    carries its ratio to the memory floor (one layer's weight bytes over the probed read
    rate)."""
    assert _cli(add_sweep_parser, [
        "sweep", "layer-time", "--model", str(tiny_folder), "--tokens", "1,4", "--layers", "2",
        "--compile", "--context", "16", "--repeats", "2", "--threads", "1",
        "--out", str(tmp_path)]) == 0
    cfg = json.loads((tmp_path / "sweep_layer_time.json").read_text())["config"]
    points = json.loads((tmp_path / "sweep_layer_time.json").read_text())["points"]
    assert cfg["layers"] == 2 and cfg["execution"] == "compiled" and cfg["compile_s"]
    assert cfg["bandwidth_gb_s"] > 0 and cfg["floor_ms"] > 0
    for p in points:
        assert p["floor_ratio"] == pytest.approx(p["ms"] / cfg["floor_ms"])
    with pytest.raises(TreepipeError, match="--layers"):
        _cli(add_sweep_parser, ["sweep", "layer-time", "--model", str(tiny_folder),
                                "--layers", "99", "--out", str(tmp_path)])


def test_sweep_device_cuda_without_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from stages.speculation.engine import ConfigError
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        _cli(add_sweep_parser, ["sweep", "layer-time", "--device", "cuda",
                                "--out", str(tmp_path)])


def test_timeline_layout_and_picture(tmp_path: Path) -> None:
    eng = PipelineEngine(target_shards(3), NgramSource(), width=4, topk=2)
    res = eng.generate(PROMPT, 16, method="specpipe")
    lay = layout(res)
    assert lay["total_ms"] == pytest.approx(1e3 * res.pipelined_s)
    assert len(lay["flushes"]) == sum(1 for s in res.steps if s.flushed)
    assert len(lay["verifies"]) == len(res.tokens) - 1
    assert len(lay["rows"]) == 4  # draft + 3 stages
    computes = [b for row in lay["rows"][1:] for b in row if b[2] == "compute"]
    assert len(computes) == sum(1 for s in res.steps for n in s.stage_tokens if n)
    assert all(0 <= a and a + b <= lay["total_ms"] + 1e-9 for a, b, _ in computes)

    rec = tmp_path / "records.json"
    rec.write_text(json.dumps({"results": [{**result_to_dict(res), "prompt": 0}]}))
    assert _cli(add_timeline_parser, ["timeline", "--records", str(rec), "--source", "ngram",
                                      "--out", str(tmp_path)]) == 0
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    with pytest.raises(TreepipeError, match="no recorded run"):
        _cli(add_timeline_parser, ["timeline", "--records", str(rec), "--method", "pp",
                                   "--out", str(tmp_path)])
