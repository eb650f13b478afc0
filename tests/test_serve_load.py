"""`treepipe bench-serve`: vllm bench serve-style load against a real tiny pipeline's HTTP API."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.deploy.launcher import state_sync
from orchestrator.deploy.run_state import RunState
from orchestrator.lab.benchmarks.serve_load import (
    RequestResult,
    ServeLoadOptions,
    random_prompts,
    record_chunk,
    run_load,
)
from tests.runtime_harness import tiny_manifest, tiny_model_folder
from tests.tiny_models import TARGET

KEY = "sk-load-0123456789"
TREEPIPE = [sys.executable, "-m", "orchestrator"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 2-stage tiny pipeline (n-gram draft: chunks of several tokens) with an API key:
    its OpenAI base URL."""
    root = tmp_path_factory.mktemp("load")
    model = tiny_model_folder(root / "model")
    manifest = root / "load.yaml"
    spec = yaml.safe_load(tiny_manifest("loadtest", model, stages=2, transport="zmq",
                                        http=True))
    manifest.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, TREEPIPE_CACHE=str(root / "cache"), TREEPIPE_API_KEY=KEY)
    res = subprocess.run([*TREEPIPE, "up", "-f", str(manifest), "--detach"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    try:
        state = RunState.model_validate_json(
            (root / "cache" / "run" / "loadtest" / "state.json").read_text())
        sync = state_sync(state, "loadtest")
        http = sync.r.get(sync.key("gateway", "http")).decode()
        yield f"http://127.0.0.1:{http.rsplit(':', 1)[1]}/v1"
    finally:
        subprocess.run([*TREEPIPE, "down", "-f", str(manifest)], env=env, timeout=120)


def options(base: str, **kw: object) -> ServeLoadOptions:
    o = dict(base_url=base, model=None, num_prompts=4, random_input_len=8,
             random_output_len=12, random_range_ratio=0.0, vocab_size=TARGET.vocab_size,
             max_concurrency=[1, 2], warmup=True, seed=0, request_timeout=120.0,
             label="tiny", progress=False, out=None)
    o.update(kw)
    return ServeLoadOptions(**o)  # type: ignore[arg-type]


def test_the_load_figures_are_sane(server: str) -> None:
    report = asyncio.run(run_load(options(server), KEY))
    assert [lv["max_concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert (lv["completed"], lv["failed"]) == (4, 0), lv["errors"]
        assert lv["total_output_tokens"] == 4 * 12  # ignore_eos: every max_tokens
        assert lv["total_input_tokens"] == 4 * 8
        assert lv["request_throughput"] > 0 and lv["output_throughput"] > 0
        for r in lv["requests"]:
            assert r["ok"] and r["output_tokens"] == r["counted_tokens"] == 12
            assert 0 < r["ttft"] <= r["latency"]
            # one gap per token after the first chunk's, summing to the time after it
            # (none for tokens that came in the first chunk)
            assert len(r["itl"]) <= 11 and sum(r["itl"]) <= r["latency"] - r["ttft"]
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = lv[name]
            assert 0 <= s["median"] <= s["p99"] and (name == "itl_ms" or s["mean"] > 0), s
        assert lv["ttft_ms"]["mean"] <= lv["e2el_ms"]["mean"]


def test_the_command_prints_the_table_and_writes_json(
        server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    out = tmp_path / "load.json"
    monkeypatch.delenv("TREEPIPE_API_KEY", raising=False)
    monkeypatch.delenv("TREEPIPE_API_KEY_FILE", raising=False)
    rc = main(["bench-serve", "--base-url", server, "--num-prompts", "2", "--random-input-len",
               "6", "--random-output-len", "5", "--vocab-size", str(TARGET.vocab_size),
               "--max-concurrency", "2", "--label", "specpipe", "--no-warmup",
               "--no-progress", "--api-key-file", str(key), "--out", str(out)])
    assert rc == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| specpipe")]
    assert len(table) == 1 and "| 2 | 2 / 0 |" in table[0], table
    report = json.loads(out.read_text())
    assert report["label"] == "specpipe" and report["temperature"] == 0
    assert KEY not in out.read_text()  # the secret stays out of the report
    assert report["levels"][0]["total_output_tokens"] == 10


def test_a_wrong_key_and_a_too_long_workload_are_one_line(
        server: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TREEPIPE_API_KEY_FILE", raising=False)
    monkeypatch.setenv("TREEPIPE_API_KEY", "wrong")
    base = ["bench-serve", "--base-url", server, "--no-progress", "--vocab-size", "64"]
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 401" in err[0] and "API key" in err[0], err
    monkeypatch.setenv("TREEPIPE_API_KEY", KEY)
    assert main([*base, "--random-input-len", "500", "--random-output-len", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_model_len 512" in err[0], err


@pytest.mark.parametrize("argv,needle,rc", [
    (["--num-prompts", "0"], "--num-prompts", 2),
    (["--max-concurrency", "1,x"], "--max-concurrency", 2),
    (["--random-range-ratio", "nan"], "--random-range-ratio", 2),
    (["--base-url", "localhost:8000"], "--base-url", 2),
    (["--base-url", "http://127.0.0.1:99999/v1"], "--base-url", 2),
    (["--api-key-file", "/no/such/key"], "--api-key-file", 2),
    # nothing listens: a runtime failure, worth a retry
    (["--base-url", "http://127.0.0.1:9/v1"], "is the server up?", 1),
])
def test_bad_flags_are_one_line_without_a_traceback(argv: list[str], needle: str,
                                                    rc: int) -> None:
    res = subprocess.run([*TREEPIPE, "bench-serve", "--no-progress", *argv],
                         capture_output=True, text=True, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == rc and len(lines) == 1, res.stderr
    assert needle in lines[0] and "Traceback" not in res.stderr


def test_prompts_are_seeded_and_chunks_split_into_per_token_gaps() -> None:
    a = random_prompts(3, 10, 4, 0.5, 64, seed=7)
    assert a == random_prompts(3, 10, 4, 0.5, 64, seed=7) != random_prompts(3, 10, 4, 0.5, 64, 8)
    assert all(5 <= len(p.ids) <= 15 and 2 <= p.output_len <= 6 for p in a)
    assert all(0 <= t < 64 for p in a for t in p.ids)
    r = RequestResult()
    record_chunk(r, 2, now=1.0, start=0.0, last=0.0)  # first chunk: TTFT, no gap
    record_chunk(r, 3, now=1.6, start=0.0, last=1.0)  # 3 tokens in 0.6 s: 3 gaps of 0.2
    assert r.ttft == 1.0 and r.counted_tokens == 5 and r.itl == pytest.approx([0.2] * 3)


def test_the_key_comes_from_the_file_then_treepipe_then_openai_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from orchestrator.cli.bench_serve_commands import api_key

    for var in ("TREEPIPE_API_KEY_FILE", "TREEPIPE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    none = argparse.Namespace(api_key_file="")
    assert api_key(none) is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert api_key(none) == "sk-openai"
    monkeypatch.setenv("TREEPIPE_API_KEY", "sk-treepipe")
    assert api_key(none) == "sk-treepipe"
    (tmp_path / "k").write_text("sk-file\n")
    assert api_key(argparse.Namespace(api_key_file=str(tmp_path / "k"))) == "sk-file"


def test_the_command_starts_without_torch() -> None:
    """A load generator is a client: it may run where no model (and no torch) is."""
    code = ("import sys\nfrom orchestrator.cli.main import build_parser\n"
            "build_parser('bench-serve')\nimport orchestrator.lab.benchmarks.serve_load\n"
            "assert 'torch' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
