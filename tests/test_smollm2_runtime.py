"""The local product on the real SmolLM2-135M: `treepipe up`, `generate --endpoint`, `down`.

3 stages + draft service + gateway + Redis as real processes, over ZeroMQ and
over gRPC, prompts prefilled in chunks of 16 tokens; a chat prompt through the CLI
client must give exactly the tokens of in-process autoregressive decoding, greedy
and with seeded sampling.  The gRPC pipeline recovers misses from stage 1's early exit
(an 8 192-token exit head): its candidates cross the token channel to the draft service.
TREEPIPE_TEST_DEVICE=cuda puts the stages (and the in-process reference) on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.lab.benchmarks.runtime_bench import run_load
from orchestrator.models.loading import EngineSpec, build_engine
from stages.model.sampling import SamplingParams
from tests.tiny_models import DEVICE

PROMPT = "Write a Python function that checks whether a string is a palindrome."
# enough for the greedy answer's code block (its "def" and the stop string's "(" come
# within 16 tokens) and for several speculation steps, hits and misses
N_NEW = 24
VOCAB = Path(__file__).resolve().parent.parent / "docs/bench/recovery/heads/vocab-he16-48.json"
EXIT_RECOVERY = f"early-exit:1:8+vocab={VOCAB}:8192"


def treepipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", params=["zmq", "grpc"])
def endpoint(request: pytest.FixtureRequest, smollm2_path: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    root = tmp_path_factory.mktemp(f"smol-{request.param}")
    text = (Path(__file__).parent.parent / "manifests/examples/local.yaml").read_text()
    text = (text.replace("name: local", f"name: smol-{request.param}")
            .replace("port: 50151", "port: 0")
            .replace("transport: zmq", f"transport: {request.param}")
            # the chat prompts (about 30-40 tokens) prefill in pipelined chunks
            .replace("prefillChunk: 128", "prefillChunk: 16")
            .replace("type: cpu", f"type: {DEVICE}"))
    if request.param == "grpc":  # miss recovery through treepipe up, on SmolLM2
        text = text.replace("    topk: 8\n", f"    topk: 8\n    recovery: {EXIT_RECOVERY}\n")
        assert "recovery: early-exit" in text
    assert f"transport: {request.param}" in text and "port: 0" in text
    assert "prefillChunk: 16" in text
    manifest = root / "local.yaml"
    manifest.write_text(text)
    # a cache of this test's own (its run folder too, so another run of this file at
    # the same time cannot collide), with the fetched model linked in
    cache = root / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / smollm2_path.name).symlink_to(smollm2_path, target_is_directory=True)
    env = dict(os.environ, TREEPIPE_CACHE=str(cache))
    res = treepipe("up", "-f", str(manifest), "--detach", env=env)
    assert res.returncode == 0, res.stderr
    try:
        yield res.stdout.strip().splitlines()[-1], env
    finally:
        treepipe("down", "-f", str(manifest), env=env)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    """SmolLM2 in process on the same 3 shards as the pipeline, and its tokenizer: one
    load for the module (ar's tokens and the teacher-forced logprobs share it)."""
    engine, tok, _ = build_engine(EngineSpec(model=str(smollm2_path), stages=3, draft="none",
                                          device=DEVICE))
    return engine, tok


@pytest.fixture(scope="module")
def chat_ar(smol):
    """ar's tokens for a chat prompt, in process on the same 3 shards (each distinct
    request computed once: both transports' tests compare with the same references)."""
    engine, tok = smol
    done: dict[tuple[str, int, str], list[int]] = {}

    def ar(text: str, n: int, sampling: SamplingParams) -> list[int]:
        key = (text, n, repr(sampling))
        if key not in done:
            prompt = tok.chat_ids([{"role": "user", "content": text}])
            done[key] = engine.generate(prompt, n, sampling, "ar", tok.eos_token_ids).tokens
        return list(done[key])
    return ar


@pytest.fixture(scope="module")
def reference(chat_ar):
    return lambda sampling: chat_ar(PROMPT, N_NEW, sampling)


# What depends on the links' transport (the tokens a pipeline decodes) runs on both
# pipelines; what the gateway or the client does alone runs on one.  Greedy through the
# CLI on both, seeded sampling through the CLI on zmq, and on grpc through the gRPC
# client (test_grpc_logprobs_equal_teacher_forcing: the same sampling, ar's tokens), so
# each transport decodes both greedy and sampled requests losslessly.
@pytest.mark.slow
def test_cli_client_lossless(endpoint: tuple[str, dict], reference) -> None:
    cli_lossless(endpoint, reference, sampled=False)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["zmq"], indirect=True)  # grpc: see above
def test_cli_client_lossless_sampled(endpoint: tuple[str, dict], reference) -> None:
    cli_lossless(endpoint, reference, sampled=True)


def cli_lossless(endpoint: tuple[str, dict], reference, sampled: bool) -> None:
    """`treepipe generate --endpoint --chat --json`: ar's tokens, greedy or seeded."""
    ep, env = endpoint
    flags = ["--temperature", "0.7", "--top-p", "0.9", "--seed", "3"] if sampled else []
    res = treepipe("generate", "--endpoint", ep, "--chat", "--prompt", PROMPT,
                   "--max-new-tokens", str(N_NEW), "--json", *flags, env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    sp = SamplingParams(0.7, 0.9, 0, 3) if sampled else SamplingParams()
    assert out["tokens"] == reference(sp)
    assert out["new_tokens"] == len(out["tokens"]) and out["text"]
    if not sampled:
        assert "def" in out["text"]


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["grpc"], indirect=True)  # the gateway cuts the text
def test_stop_string_cuts_text(endpoint: tuple[str, dict], reference, smollm2_path: Path) -> None:
    from stages.model.tokenizer import TextTokenizer

    ep, env = endpoint
    full = TextTokenizer.from_folder(smollm2_path).decode(reference(SamplingParams()),
                                                          skip_special_tokens=True)
    stop = "("
    assert stop in full
    res = treepipe("generate", "--endpoint", ep, "--chat", "--prompt", PROMPT,
                   "--max-new-tokens", str(N_NEW), "--stop", stop, "--json", env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[: full.index(stop)]


@pytest.mark.slow
def test_concurrent_requests_each_get_their_ar_tokens(endpoint: tuple[str, dict],
                                                      chat_ar) -> None:
    """SpecPipe-DB on the real model: three different requests decoded in one batch
    (greedy and seeded sampling, different lengths), each exactly its own ar."""
    loads = [("Name three prime numbers.", 20, SamplingParams()),
             ("Write a haiku about pipes.", 12, SamplingParams(0.8, 0.95, 0, 7)),
             (PROMPT, 16, SamplingParams())]
    reqs = [{"messages": [{"role": "user", "content": text}], "max_tokens": n,
             "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed}
            for text, n, sp in loads]
    got = run_load(endpoint[0], reqs, concurrency=3)["outputs"]
    assert got == [chat_ar(text, n, sp) for text, n, sp in loads]


@pytest.fixture(scope="module")
def teacher(smol):
    """The target's raw float32 logprobs of the positions that chose ``tokens`` after the
    chat prompt ``text`` (teacher forcing, in process, on the same 3 shards)."""
    import torch

    engine, tok = smol

    def logprobs(text: str, tokens: list[int]) -> torch.Tensor:
        prompt = tok.chat_ids([{"role": "user", "content": text}])
        seq = prompt + tokens
        h = torch.tensor(seq, device=DEVICE)
        pos = torch.arange(len(seq), device=DEVICE)
        for shard in engine.shards:
            h = shard.forward(h, pos, shard.new_cache(len(seq)))
        lp = torch.log_softmax(engine.shards[-1].logits(h).to(torch.float32), -1)
        return lp[len(prompt) - 1:len(seq) - 1].cpu()
    return logprobs


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["grpc"], indirect=True)  # see test_cli_client_lossless
def test_grpc_logprobs_equal_teacher_forcing(endpoint: tuple[str, dict], reference,
                                             teacher) -> None:
    """gRPC logprobs=5 on the real model, seeded sampling: ar's tokens, and each token's
    raw logprob and top 5 equal the teacher-forced target's within float tolerance."""
    import torch

    from orchestrator.serving.client import Client

    ep, _ = endpoint
    with Client(ep) as c:
        out = c.generate(messages=[{"role": "user", "content": PROMPT}], max_tokens=N_NEW,
                         temperature=0.7, top_p=0.9, seed=3, logprobs=5)
    assert out.tokens == reference(SamplingParams(0.7, 0.9, 0, 3))
    ref = teacher(PROMPT, out.tokens)
    assert len(out.logprobs) == len(out.tokens) == ref.shape[0]
    for j, (t, lp) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
        assert abs(lp.logprob - float(ref[j, t])) < 1e-3, j
        vals, ids = torch.topk(ref[j], 5)
        got = [(a.token_id, a.logprob) for a in lp.top]
        assert [v for _, v in got] == sorted((v for _, v in got), reverse=True)
        assert torch.allclose(torch.tensor([v for _, v in got]), vals, atol=1e-3), j
        # near-ties may swap places between the pipeline's and the reference's rounding
        assert {a for a, v in got if v > float(vals[-1]) + 1e-3} <= set(ids.tolist()), j
