"""`treepipe up --detach` / `down` with the gateway: the whole local product on the tiny model.

One pipeline (3 stages, gRPC links) serves every test here through the real
gRPC gateway and the Python client: lossless greedy and sampled output,
refused bad requests, concurrent clients, a SIGKILLed stage worker that the
launcher restarts mid-request; last, it is scaled from 3 stages to 2 and back
mid-request, then taken ``down`` cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.cli.main import main
from orchestrator.deploy.launcher import pid_alive, read_state
from orchestrator.lab.benchmarks.runtime_bench import JOINER_TOKENS, join_under_load, run_load
from orchestrator.serving.client import Client
from protocol.links.keys import LINK_KEYS_ENV
from stages.model.sampling import SamplingParams
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import (
    check_own_tokens,
    mixed_clients,
    run_clients,
    tiny_manifest,
    tiny_model_folder,
    treepipe,
    treepipe_cache,
)
from tests.tiny_models import PROMPT, target_shards


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict]]:
    root = tmp_path_factory.mktemp("launcher")
    model = tiny_model_folder(root / "model")
    manifest = root / "tiny.yaml"
    # the adaptive width: the launcher passes --profile-rows and --adaptive, and the
    # stage killed below re-measures its forward time before it rejoins; prompts enter
    # 8 tokens a step (PROMPT's 20 in 3 steps; a resume prefills its log too)
    manifest.write_text(tiny_manifest("tinytest", model, adaptive=True, prefill_chunk=8))
    # without the session's link keys (conftest): the launcher makes its own
    with treepipe_cache(root / "cache", drop=[LINK_KEYS_ENV]) as env:
        res = treepipe("up", "-f", str(manifest), "--detach", env=env)
        assert res.returncode == 0, res.stderr
        # progress while the workers load, then the endpoint
        assert "waiting for" in res.stderr and "every worker is up" in res.stderr
        endpoint = res.stdout.strip().splitlines()[-1]
        try:
            yield endpoint, manifest, env
            # over every test on this pipeline: no worker gave up waiting for a link message
            for log in (root / "cache" / "run" / "tinytest").glob("*.log"):
                assert "starting a new epoch" not in log.read_text(), f"input timeout in {log}"
        finally:
            treepipe("down", "-f", str(manifest), env=env)


def ar(prompt: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    return PipelineEngine(target_shards(1)).generate(prompt, n, sampling, method="ar").tokens


def test_endpoint_is_host_port_and_healthy(up: tuple[str, Path, dict]) -> None:
    endpoint, _, _ = up
    host, port = endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with Client(endpoint) as c:
        assert c.health() == "SERVING"
        assert c.health("treepipe.v1.Inference") == "SERVING"


def test_link_keys_are_private_files_named_in_the_workers_environment(
        up: tuple[str, Path, dict]) -> None:
    st = read_state("tinytest")
    assert st is not None
    keys = Path(st.link_keys)
    assert keys.parent == Path(st.redis_secret).parent  # the pipeline's run folder
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    # gRPC links: the CA, the link certificate and its key; each 0600
    assert sorted(f.name for f in keys.iterdir()) == ["ca.crt", "link.crt", "link.key"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in keys.iterdir())
    secret = (keys / "link.key").read_bytes().split(b"\n")[1]  # a line of the key itself
    for name, pid in st.procs.items():
        if name == "gateway":
            continue
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        assert b"insecure-links" not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"{LINK_KEYS_ENV}={keys}".encode() in environ, name


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_gateway_lossless(up: tuple[str, Path, dict], sampled: bool) -> None:
    sp = SamplingParams(0.8, 0.95, 0, 5) if sampled else SamplingParams()
    with Client(up[0]) as c:
        out = c.generate(prompt_ids=PROMPT, max_tokens=40, temperature=sp.temperature,
                         top_p=sp.top_p, seed=sp.seed)
    assert out.tokens == ar(PROMPT, 40, sp)
    assert out.finish_reason == "length"
    assert len(out.since_request_ms) == 40
    assert out.since_request_ms == sorted(out.since_request_ms)


@pytest.mark.parametrize("kw, code, words", [
    (dict(prompt_ids=PROMPT, max_tokens=-1), "INVALID_ARGUMENT", "max_tokens must be >= 0"),
    (dict(prompt_ids=PROMPT, temperature=-0.5), "INVALID_ARGUMENT", "temperature must be >= 0"),
    (dict(max_tokens=4), "INVALID_ARGUMENT", "empty prompt"),
    (dict(prompt_ids=PROMPT, model="llama-9000"), "NOT_FOUND", "unknown model"),
    (dict(prompt_ids=[10_000]), "INVALID_ARGUMENT", "prompt token ids must lie in"),
    (dict(prompt_ids=PROMPT, max_tokens=481), "INVALID_ARGUMENT", "exceeds this pipeline"),
    (dict(prompt="hello"), "FAILED_PRECONDITION", "no tokenizer"),
], ids=["neg-max", "neg-temp", "empty", "model", "vocab", "too-long", "no-tokenizer"])
def test_bad_requests(up: tuple[str, Path, dict], kw: dict, code: str, words: str) -> None:
    with Client(up[0]) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(**kw)
        assert err.value.code().name == code
        assert words in err.value.details()
        assert c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=5).tokens == ar(PROMPT, 5)


def test_concurrent_clients(up: tuple[str, Path, dict]) -> None:
    """A mixed load decoded as one batch (grpc links): each client gets its own ar tokens."""
    loads = mixed_clients()
    run_clients(up[0], loads)
    check_own_tokens(loads, ar)
    run = Path(os.environ["TREEPIPE_CACHE"]) / "run" / "tinytest"
    assert "curves of 2 front stages" in (run / "draft.log").read_text()
    assert "forward time measured for 1-20 rows" in (run / "stage0.log").read_text()


def test_load_scheduler_keeps_b_in_flight_and_every_request_its_tokens(
        up: tuple[str, Path, dict]) -> None:
    """`runtime-bench --batch`'s scheduler (a new request whenever fewer than B run):
    the figures it reports come from requests that each got their own ar tokens."""
    prompts = [PROMPT, [5, 9, 2, 7], [1, 2, 3, 4, 5, 6]]
    reqs = [{"prompt_ids": p, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            for p in prompts]
    for b in (1, 2):
        r = run_load(up[0], reqs, b)
        assert r["outputs"] == [ar(p, 8) for p in prompts]
        assert r["concurrency"] == b and r["requests"] == 3 and r["tokens"] == 24
        assert r["throughput_tok_s"] == pytest.approx(24 / r["wall_s"])
        assert 0 < r["mean_tbt_ms"] <= r["p99_tbt_ms"]


def test_long_prompts_join_decoding_requests_in_chunks(up: tuple[str, Path, dict]) -> None:
    """runtime-bench --long-join's load: two requests decode, then prompts of 60 and 21
    tokens join at once (8-token chunks pipelined beside them, the chunk a budget the two
    share: the second waits for room; 4 requests fit the fixture's concurrency); every
    request gets its own tokens."""
    short = [{"prompt_ids": p, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
             for p in (PROMPT, [7, 7, 1, 2, 7])]
    long_prompts = [(PROMPT * 3)[:60], (PROMPT * 2)[3:24]]
    outs = join_under_load(up[0], short, long_prompts)
    for kw, out in zip(short, outs, strict=False):
        assert out.tokens == ar(kw["prompt_ids"], 30)
    for ids, out in zip(long_prompts, outs[len(short):], strict=True):
        assert out.tokens == ar(ids, JOINER_TOKENS)


def test_client_cancel_frees_the_pipeline(up: tuple[str, Path, dict]) -> None:
    with Client(up[0]) as c:
        stream = c.stream(temperature=0, prompt_ids=PROMPT, max_tokens=400, ignore_eos=True)
        next(stream)
        stream.cancel()
        out = c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=8, timeout_s=60)
    assert out.tokens == ar(PROMPT, 8)


def test_stage_killed_mid_request(up: tuple[str, Path, dict]) -> None:
    """SIGKILL a stage worker: the launcher restarts it, the request resumes losslessly."""
    state = read_state("tinytest")
    assert state is not None
    victim = state.procs["stage1"]
    # the kill lands at token 20; the 60 after it come once stage1 is back
    want = ar(PROMPT, 80)
    got: list[int] = []
    with Client(up[0]) as c:
        for chunk in c.stream(temperature=0, timeout_s=240, prompt_ids=PROMPT, max_tokens=80,
                              ignore_eos=True):
            got += list(chunk.token_ids)
            if victim and len(got) >= 20:
                os.kill(victim, signal.SIGKILL)
                victim = 0
    assert victim == 0, "the request finished before the kill"
    assert got == want
    log = (Path(os.environ["TREEPIPE_CACHE"]) / "run" / "tinytest" / "supervisor.log")
    assert "stage1 ended, killed by SIGKILL" in log.read_text()  # the cause, named
    # the restarted worker, not the supervisor, started the epoch (as a recreated pod does)
    assert "stage1 joined: epoch" in (log.parent / "stage1.log").read_text()
    # and no link message was lost: nobody had to give up waiting for its input
    for worker in ("stage0", "stage1", "stage2"):
        assert "starting a new epoch" not in (log.parent / f"{worker}.log").read_text()


def test_up_twice_and_bad_manifest(up: tuple[str, Path, dict], tmp_path: Path) -> None:
    _, manifest, env = up
    res = treepipe("up", "-f", str(manifest), "--detach", env=env)
    assert res.returncode == 2 and "already up" in res.stderr
    assert "Traceback" not in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest.read_text().replace("transport: grpc", "transport: carrier-pigeon"))
    res = treepipe("up", "-f", str(bad), env=env)
    assert res.returncode == 2 and "transport" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# Last on the shared pipeline: it re-plans it and takes it down.
def test_scale_3_to_2_and_back_mid_request_then_down(
        up: tuple[str, Path, dict], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """`treepipe scale` re-plans a running pipeline, down and back up; the request in
    flight stays lossless.  Then `down` stops everything: the supervisor and every worker
    it runs now (those the re-plans started), and the state file is gone.

    On the shared pipeline, after every other test of it (a pipeline of its own cost a
    start-up; its fixture's `down` then finds nothing left).  scale and status run in
    this process (the CLI's main()) so that the scale lands while the fast tiny model is
    still generating.
    """
    endpoint, manifest, env = up
    monkeypatch.setenv("TREEPIPE_CACHE", env["TREEPIPE_CACHE"])
    # a scale's workers stop within a second; a few tokens come meanwhile.  The scale back
    # up waits for four new workers to load (12 s on a loaded 2-core machine), and the two
    # stages decode on meanwhile: the longest request the pipeline takes (maxNewTokens)
    # keeps it in flight (240 tokens ended before it once)
    max_tokens = 480
    got: list[int] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            with Client(endpoint) as c:
                for chunk in c.stream(temperature=0, timeout_s=300, prompt_ids=PROMPT,
                                      max_tokens=max_tokens, ignore_eos=True):
                    got.extend(chunk.token_ids)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 120
        while len(got) < n and not failure and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) >= n, f"only {len(got)} tokens ({failure})"

    def status() -> dict:
        capsys.readouterr()
        assert main(["status", "tinytest", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    run = Path(env["TREEPIPE_CACHE"]) / "run" / "tinytest"
    state = run / "state.json"
    reader = threading.Thread(target=read)
    reader.start()
    wait_for(10)
    st0 = status()
    assert len(st0["stages"]) == 3 and "stage2" in st0["processes"]
    epoch0, plan0 = st0["epoch"], st0["plan"]
    assert main(["scale", "tinytest", "--stages", "2"]) == 0
    n = len(got)
    wait_for(n + 30)  # decoding went on with two stages
    st = status()
    assert len(st["stages"]) == 2 and st["epoch"] > epoch0
    assert st["waiting"] == []  # scale returned once every new worker was up
    assert "stage2" not in st["processes"]  # the smaller plan's workers only
    assert st["plan"] != plan0 and all(  # every worker runs the new plan
        p.get("plan") == st["plan"] for n, p in st["processes"].items() if n != "gateway")
    assert all(p["alive"] for p in st["processes"].values())
    assert main(["scale", "tinytest", "--stages", "3"]) == 0
    assert len(got) < max_tokens, "the request ended before scaling back"
    reader.join(300)
    assert not failure, failure
    st = status()
    assert len(st["stages"]) == 3 and st["plan"] == plan0 and "stage2" in st["processes"]
    assert len(got) == max_tokens
    assert got == ar(PROMPT, max_tokens)
    bad = treepipe("scale", "tinytest", "--stages", "9", env=env)
    assert bad.returncode == 2 and "stages" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

    pids = [json.loads(state.read_text())["supervisor_pid"],
            *json.loads(state.read_text())["procs"].values()]
    # the supervisor, the gateway, the draft and the three stages running now
    assert len(pids) == 6 and all(pid_alive(int(p)) for p in pids)
    down = treepipe("down", "-f", str(manifest), env=env)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while any(pid_alive(int(p)) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(int(p)) for p in pids)
    assert not state.exists()


def test_status_text_names_workers_not_up_and_of_another_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The human `status` of a pipeline mid-re-plan: a real Redis, a hand-written state."""
    from orchestrator.deploy.redis_server import RedisServer
    from protocol.sync.synchroniser import Synchroniser

    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path))
    with RedisServer() as redis:
        sync = Synchroniser(redis.url, "midplan")
        sync.register(["draft", "stage0", "stage1"])
        sync.r.set(sync.key("plan"), "A")
        sync.heartbeat("draft", {"pid": 1, "inc": "d", "plan": "A"}, ttl_s=600)
        sync.heartbeat("stage0", {"pid": 2, "inc": "s", "plan": "B"}, ttl_s=600)
        folder = tmp_path / "run" / "midplan"
        folder.mkdir(parents=True)
        me = os.getpid()  # a live pid stands in for the supervisor and its children
        (folder / "state.json").write_text(json.dumps({
            "name": "midplan", "supervisor_pid": me, "redis": redis.url,
            "endpoint": "127.0.0.1:1", "stages": [[0, 2], [2, 4]],
            "procs": {"draft": me, "stage0": me, "stage1": me, "gateway": me}}))
        sync.r.set(sync.key("gateway", "http"), "127.0.0.1:2")
        assert main(["status", "midplan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("midplan: gateway 127.0.0.1:1 (OpenAI API and /metrics: "
                             "http://127.0.0.1:2), epoch 0, plan A, 2 stages")
    assert out[1] == "  not ready: waiting for stage0, stage1"
    assert "heartbeat ok (plan B, not the pipeline's)" in next(x for x in out if "stage0" in x
                                                                  and "pid" in x)
    assert "no heartbeat" in next(x for x in out if x.strip().startswith("stage1"))
