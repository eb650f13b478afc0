"""Structure of `treepipe runtime-bench` (numbers live in docs/benchmarks.md, not here)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.lab.benchmarks.runtime_bench import bench_sync, bench_transfer
from tests.runtime_harness import (
    TREEPIPE,
    tiny_manifest,
    tiny_model_folder,
    treepipe,
    treepipe_cache,
)


def test_barrier_costs_two_round_trips_per_worker() -> None:
    s = bench_sync(stages=2, steps=40)  # Redis with a password, as pipelines run it
    assert s["participants"] == 3 and s["secure"] is True
    # arrive + blocking pop per step; admission adds a few calls in all
    assert s["redis_commands_per_step_per_worker"] == pytest.approx(2.0, abs=0.1)
    assert 0 < s["p50_us"] <= s["p99_us"]


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "plain"])
@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_transfer_reports_one_hop(transport: str, secure: bool) -> None:
    """Authenticated links (as pipelines run) and plain ones, for the side-by-side table."""
    t = bench_transfer(transport, width=4, dim=32, n=40, secure=secure)
    assert t["bytes"] == 4 * (32 * 4 + 24) and t["secure"] is secure
    assert 0 < t["p50_us"] <= t["p99_us"]


def test_a_hop_of_several_requests_as_one_frame_or_a_frame_each() -> None:
    """--hop-requests: both ways carry the same bytes over both transports; the table
    has a row for each; a frame count other than 1 or B is refused in one line."""
    from orchestrator.lab.benchmarks.runtime_bench import bench_hop, hop_markdown
    from protocol.errors import TreepipeError

    rows = bench_hop(3, width=2, dim=16, n=40)  # the first 20 are warm-up
    assert [(r["transport"], r["frames"]) for r in rows] == [
        ("zmq", 3), ("zmq", 1), ("grpc", 3), ("grpc", 1)]
    assert {r["bytes"] for r in rows} == {3 * 2 * (16 * 4 + 24)}
    assert all(r["secure"] and 0 < r["p50_us"] <= r["p99_us"] for r in rows)
    table = hop_markdown(rows)
    assert "one hop of 3 requests' parts, w = 2" in table and table.count("\n| grpc |") == 2
    with pytest.raises(TreepipeError, match="1 or 3 frames"):
        bench_transfer("zmq", 2, 16, 5, True, requests=3, frames_per_hop=2)
    with pytest.raises(TreepipeError, match="at most 256 requests' parts, got 300"):
        bench_hop(300, width=2, dim=16, n=40)


def test_batch_width_variants_and_their_table_column():
    from orchestrator.lab.benchmarks.runtime_bench import _width_variants, batch_markdown

    draft = {"source": "ngram", "width": 16}
    assert _width_variants(draft, None, "ngram") == [("16", {})]
    assert _width_variants({**draft, "adaptive": True}, None, "ngram") == [("adaptive:16", {})]
    assert _width_variants(draft, [2, "adaptive", "adaptive:4"], "ngram") == [
        ("2", {"width": 2, "adaptive": False}), ("adaptive:16", {"width": 16, "adaptive": True}),
        ("adaptive:4", {"width": 4, "adaptive": True})]
    assert _width_variants(draft, [2, "adaptive"], "none") == [("-", {})]  # pp has no tree
    row = {"method": "specpipe", "source": "ngram", "w": "adaptive:16", "concurrency": 8,
           "tokens": 256, "wall_s": 5.0, "throughput_tok_s": 51.2, "mean_tbt_ms": 100.0,
           "p99_tbt_ms": 200.0, "mean_ttft_ms": 800.0, "wall_vs_first": 0.3,
           "workers": {"workers": {"stage0": {"steps": 90}}, "critical": "stage0",
                       "step_ms": 50.0, "compute_ms": 30.0, "mean_width": 1.75}}
    line = batch_markdown({"requests": 8, "max_new_tokens": 32, "rows": [row]}).splitlines()[4]
    assert line.startswith("| specpipe | ngram | adaptive:16 | 8 | 256 |") and "| 1.75 |" in line


LOCAL = Path(__file__).resolve().parent.parent / "manifests" / "examples" / "local.yaml"


@pytest.mark.parametrize("modes", [["--batch", "--overload"], ["--long-join", "--batch"],
                                   ["--tbt", "--batch"]])
def test_modes_that_run_alone_are_one_at_a_time(modes: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two of them were taken silently, one winning: now a usage error naming both (the
    command's own parser, so nothing would run if it took them)."""
    from orchestrator.cli.main import build_parser

    argv = ["runtime-bench", *(x for m in modes for x in (m, str(LOCAL)))]
    with pytest.raises(SystemExit) as e:
        build_parser("runtime-bench").parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"argument {modes[1]}: not allowed with argument {modes[0]}" in err


def test_sigterm_takes_down_the_pipeline_it_started(tmp_path: Path) -> None:
    """SIGTERM ends the benchmark as Ctrl-C does: the pipeline its `treepipe up` started
    (Redis, the supervisor, the workers) goes down with it instead of running on.  The
    signal comes while the pipeline is starting (its processes run, `up` waits for them)."""
    from orchestrator.deploy.launcher import live_processes, read_state, run_dir
    from protocol.links.keys import LINK_KEYS_ENV

    model = tiny_model_folder(tmp_path / "model")
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_manifest("sigterm", model, stages=2))
    with treepipe_cache(tmp_path / "cache", drop=[LINK_KEYS_ENV]) as env:
        bench = subprocess.Popen([*TREEPIPE, "runtime-bench", "--overload", str(manifest),
                                  "--clients", "2"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while read_state("sigterm") is None:  # the supervisor started its workers
                assert bench.poll() is None, bench.communicate()[1]
                assert time.monotonic() < deadline, "the pipeline never started"
                time.sleep(0.1)
            assert len(live_processes(run_dir("sigterm"))) > 1
            bench.send_signal(signal.SIGTERM)
            err = bench.communicate(timeout=120)[1]
            assert bench.returncode == 130 and "interrupted" in err, (bench.returncode, err)
            assert read_state("sigterm") is None
            assert not live_processes(run_dir("sigterm"))
        finally:
            bench.kill()
            treepipe("down", "-f", str(manifest), env=env)


def test_a_pipeline_it_did_not_start_is_left_running(tmp_path: Path) -> None:
    """A benchmark whose `treepipe up` fails because a pipeline of that name is already up
    fails in one line and leaves that pipeline running: it is not the benchmark's."""
    from orchestrator.deploy.launcher import live_processes, read_state, run_dir
    from protocol.links.keys import LINK_KEYS_ENV

    model = tiny_model_folder(tmp_path / "model")
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_manifest("theirs", model, stages=1))
    with treepipe_cache(tmp_path / "cache", drop=[LINK_KEYS_ENV]) as env:
        try:
            up = treepipe("up", "-f", str(manifest), "--detach", env=env)
            assert up.returncode == 0, up.stderr
            bench = treepipe("runtime-bench", "--overload", str(manifest), "--clients", "2",
                             env=env)
            lines = bench.stderr.strip().splitlines()
            assert bench.returncode != 0 and len(lines) == 1, bench.stderr
            assert read_state("theirs") is not None
            assert live_processes(run_dir("theirs"))
        finally:
            treepipe("down", "-f", str(manifest), env=env)
