"""``treepipe chaos`` on the tiny model: kills mid-request never make a request wrong.

CI runs a short series that kills the gateway and the draft (the stage and Redis
kills have their own tests: tests/test_launcher.py, tests/test_reliability.py);
``treepipe chaos`` runs the long series of docs/reliability.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.cli.main import main
from orchestrator.deploy.chaos import run_chaos
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import tiny_manifest, tiny_model_folder
from tests.tiny_models import target_shards


def test_gateway_and_draft_kills_never_give_wrong_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model_folder(tmp_path / "model")
    manifest = tmp_path / "chaos.yaml"
    manifest.write_text(tiny_manifest("chaos", model, stages=2, transport="zmq",
                                      split="balanced"))
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path / "cache"))
    up = subprocess.run([sys.executable, "-m", "orchestrator", "up", "-f", str(manifest),
                         "--detach"], capture_output=True, text=True, env=dict(os.environ))
    assert up.returncode == 0, up.stderr
    try:
        engine = PipelineEngine(target_shards(1))
        prompts = [[5, 9, 13, 2, 7], [3, 3, 8, 1, 6, 4]]
        threads = torch.get_num_threads()
        try:
            rep = run_chaos("chaos", up.stdout.strip().splitlines()[-1], engine, prompts, 64,
                            seed=3, kill_prob=1.0, deadline_s=60,
                            kinds=("gateway", "draft"))
        finally:
            torch.set_num_threads(threads)
    finally:
        subprocess.run([sys.executable, "-m", "orchestrator", "down", "-f", str(manifest)],
                       capture_output=True, env=dict(os.environ))
    assert rep.wrong == 0, rep.outcomes
    assert rep.serves_after
    assert rep.kills["gateway"] + rep.kills["draft"] >= 2, rep.kills
    assert rep.exact + rep.failed_cleanly == len(prompts)
    print(rep.outcomes)
    for o in rep.outcomes:
        # a killed gateway drops its client's stream: a clear gRPC error, not wrong tokens
        assert o.result == "exact" or (o.killed == "gateway" and o.error), o


@pytest.mark.parametrize("flags, words", [
    (["--kill-prob", "2"], "--kill-prob: must be a finite number in [0, 1]"),
    (["--kinds", "stage,cat"], "--kinds"),
    (["--deadline", "0"], "--deadline")])
def test_chaos_bad_flags(flags: list[str], words: str, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    try:  # the parser refuses a bad number, the command a bad process kind
        rc = main(["chaos", "-f", str(tmp_path / "none.yaml"), *flags])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
