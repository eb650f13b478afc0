"""`treepipe serve MODEL`: one command up, OpenAI API answers losslessly, Ctrl-C stops all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import torch
import yaml

from orchestrator.deploy.launcher import pid_alive
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import tiny_model_folder
from tests.tiny_models import PROMPT, target_shards

TREEPIPE = [sys.executable, "-m", "orchestrator"]


def check_logprobs(base: str, key: str, want: list[int]) -> None:
    """The openai client's completions with logprobs=2 against ``treepipe serve`` (a model
    without a tokenizer: tokens shown as vLLM's ``token_id:N``): ar's tokens, each with
    its raw logprob and top 2 equal to teacher forcing."""
    out = openai.OpenAI(base_url=base, api_key=key, max_retries=0).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=len(want), temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in want]
    m = target_shards(1)[0]
    seq = PROMPT + want
    h = m.forward(torch.tensor(seq), torch.arange(len(seq)), m.new_cache(len(seq)))
    ref = torch.log_softmax(m.logits(h).to(torch.float32), -1)[len(PROMPT) - 1:-1]
    for j, t in enumerate(want):
        assert abs(lp.token_logprobs[j] - float(ref[j, t])) < 1e-3, j
        vals, ids = torch.topk(ref[j], 2)
        top = lp.top_logprobs[j]
        assert list(top) == [f"token_id:{i}" for i in ids.tolist()], j
        assert all(abs(top[f"token_id:{i}"] - float(v)) < 1e-3
                   for i, v in zip(ids.tolist(), vals, strict=True))


def test_serve_then_ctrl_c(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path / "model")
    env = dict(os.environ, TREEPIPE_CACHE=str(tmp_path / "cache"))
    key = tmp_path / "api-key"
    key.write_text("k-" + "x" * 20 + "\n")
    auth = {"Authorization": "Bearer k-" + "x" * 20}
    # vLLM's spelling: --port is HTTP, --max-model-len, --served-model-name, a key by file
    proc = subprocess.Popen([*TREEPIPE, "serve", str(model), "--stages", "2", "--port", "0",
                             "--grpc-port", "0", "--dtype", "float64", "--width", "4",
                             "--topk", "2", "--max-model-len", "512", "--name", "servetest",
                             "--served-model-name", "tiny", "--api-key-file", str(key)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grpc_endpoint = proc.stdout.readline().strip()
        api = proc.stdout.readline().split()
        assert api[:2] == ["OpenAI", "API:"] and api[3] == "metrics:", api
        assert grpc_endpoint.startswith("127.0.0.1:")
        base = api[2]
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401  # the key counts
        models = httpx.get(f"{base}/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 512
        r = httpx.post(f"{base}/completions", timeout=120, headers=auth, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        want = PipelineEngine(target_shards(1)).generate(PROMPT, 12, method="ar").tokens
        assert r.json()["choices"][0]["token_ids"] == want
        assert "treepipe_generation_tokens_total 12.0" in httpx.get(api[4], headers=auth).text
        check_logprobs(base, key.read_text().strip(), want)
        run = tmp_path / "cache" / "run" / "servetest"
        # several clients are decoded together by default, as in the local example
        assert yaml.safe_load((run / "serve.yaml").read_text())["spec"]["limits"][
            "concurrency"] == 4
        state = json.loads((run / "state.json").read_text())
        pids = [state["supervisor_pid"], *state["procs"].values()]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(int(p)) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(int(p)) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([*TREEPIPE, "down", "-f",
                            str(tmp_path / "cache" / "run" / "servetest" / "serve.yaml")],
                           env=env, timeout=60)


def test_serve_bad_flags_one_line(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path / "model")
    env = dict(os.environ, TREEPIPE_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([*TREEPIPE, "serve", str(model), "--http-port", "70000"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--http-port" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    res = subprocess.run([*TREEPIPE, "serve", str(model), "--concurrency", "65"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "concurrency" in res.stderr and "64" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
