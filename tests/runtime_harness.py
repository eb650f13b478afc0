"""Start real pipeline processes (Redis, stage workers, draft service) for runtime tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orchestrator.deploy.redis_server import RedisServer, free_port
from protocol.config.recovery import parse_recovery
from protocol.sync.synchroniser import PASSWORD_ENV, Synchroniser, participant_names
from stages.model.checkpoint import save_checkpoint
from stages.model.model import random_shards
from stages.model.planning import even_bounds
from stages.model.sampling import SamplingParams
from stages.runtime.admission import TRACE_ENV
from tests.tiny_models import DEVICE, PROMPT, TARGET

TREEPIPE = [sys.executable, "-m", "orchestrator"]


def treepipe(*args: str, env: dict[str, str],
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``treepipe ARGS`` in a child process with ``env``, its output captured."""
    return subprocess.run([*TREEPIPE, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@contextmanager
def treepipe_cache(folder: Path, drop: Sequence[str] = ()) -> Iterator[dict[str, str]]:
    """An environment whose $TREEPIPE_CACHE is ``folder`` (without the variables in
    ``drop``) for the commands a test runs; this process uses the folder too while it
    lasts (its ``read_state()`` calls), and gets its own value back after."""
    env = dict(os.environ, TREEPIPE_CACHE=str(folder))
    for name in drop:
        env.pop(name, None)
    old = os.environ.get("TREEPIPE_CACHE")
    os.environ["TREEPIPE_CACHE"] = env["TREEPIPE_CACHE"]
    try:
        yield env
    finally:
        if old is None:
            os.environ.pop("TREEPIPE_CACHE", None)
        else:
            os.environ["TREEPIPE_CACHE"] = old


def tiny_model_folder(folder: Path) -> Path:
    """The tiny float64 target of the unit tests, saved as a checkpoint folder."""
    (full,) = random_shards(TARGET, [(0, TARGET.n_layers)], seed=0, dtype=torch.float64)
    params = full.state_dict()
    save_checkpoint(folder, TARGET, {hf: params[n] for hf, n in full.checkpoint_keys().items()})
    return folder


def tiny_manifest(name: str, model: Path, stages: int = 3, transport: str = "grpc",
                  split: str = "even", http: bool = False, concurrency: int = 4,
                  adaptive: bool = False, prefill_chunk: int = 512) -> str:
    """A backend-local TreePipeline of the tiny float64 model: n-gram draft (w=4, k=2;
    ``adaptive``: widths chosen up to 4), free gateway ports (and an HTTP port if
    ``http``), ``concurrency`` requests at once, prompts prefilled ``prefill_chunk``
    tokens a step."""
    http_port = "\n    httpPort: 0" if http else ""
    return f"""\
apiVersion: treepipe.io/v1alpha1
kind: TreePipeline
metadata:
  name: {name}
spec:
  backend: local
  model:
    source: {model}
    dtype: float64
  stages:
    count: {stages}
    split: {split}
  draft:
    source: ngram
    width: 4
    adaptive: {str(adaptive).lower()}
    topk: 2
  transport: {transport}
  gateway:
    port: 0{http_port}
  limits:
    contextLength: 512
    maxNewTokens: 480
    concurrency: {concurrency}
    prefillChunk: {prefill_chunk}
"""


@dataclass
class Pipeline:
    """Processes of one pipeline, started without the launcher (the launcher has its tests)."""

    model: str
    stages: int
    transport: str = "zmq"
    source: str = "ngram"
    width: int = 4
    topk: int = 2
    dtype: str = "float64"
    log_dir: Path | None = None
    adaptive: bool = False  # the draft chooses widths; the front stages publish curves
    device: str = DEVICE  # TREEPIPE_TEST_DEVICE=cuda puts the workers on a GPU
    kv_tokens: int | None = None  # each stage's (and the draft model's) fixed KV pool
    recovery: str = "none"  # every process's --recovery (none, draft:K or early-exit:J:K)
    quantize: str = "none"  # every process's --quantize (none or int8)
    name: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    redis: RedisServer | None = None
    plan: str = ""  # workers get --plan/--stages and register themselves
    n_layers: int = 0
    last_rid: str = ""  # id of the request generate() submitted last
    stopping: set[subprocess.Popen[bytes]] = field(default_factory=set)  # replaced workers

    def start(self, n_layers: int) -> Pipeline:
        self.redis = RedisServer().start()
        self.n_layers = n_layers
        if not self.plan:  # else the workers register themselves (join.lua)
            Synchroniser(self.redis.url, self.name).register(self.names)
        self.argv = self.commands()
        for n in self.names:
            self.spawn(n)
        return self

    @property
    def names(self) -> list[str]:
        return participant_names(self.stages)

    def commands(self) -> dict[str, list[str]]:
        assert self.redis is not None
        ports = [free_port() for _ in range(self.stages + 1)]  # and the draft's inbox
        common = ["--pipeline", self.name, "--redis", self.redis.address, "--model", self.model,
                  "--dtype", self.dtype, "--device", self.device, "--transport", self.transport,
                  *(["--recovery", self.recovery] if self.recovery != "none" else []),
                  *(["--quantize", self.quantize] if self.quantize != "none" else [])]
        exit_stage = parse_recovery(self.recovery).exit_stage
        channel = f"127.0.0.1:{ports[-1]}"
        if self.plan:
            common += ["--plan", self.plan, "--stages", str(self.stages)]
        argv = {}
        for i, (a, b) in enumerate(even_bounds(self.n_layers, self.stages)):
            nxt = ["--next", f"127.0.0.1:{ports[i + 1]}"] if i + 1 < self.stages else []
            prof = (["--profile-rows", str(4 * (self.width + 1)), "--profile-requests", "4"]
                    if self.adaptive and nxt else [])
            if self.kv_tokens is not None:
                prof += ["--kv-tokens", str(self.kv_tokens)]
            argv[f"stage{i}"] = [*TREEPIPE, "stage", "--name", f"stage{i}", *common,
                                 "--layers", f"{a}:{b}", "--listen", f"127.0.0.1:{ports[i]}",
                                 *nxt, *prof,
                                 *(["--exit-to", channel] if i + 1 == exit_stage else [])]
        argv["draft"] = [*TREEPIPE, "draft", "serve", "--name", "draft", *common,
                         "--source", self.source, "--width", str(self.width), "--topk",
                         str(self.topk), "--next", f"127.0.0.1:{ports[0]}",
                         *(["--adaptive"] if self.adaptive else []),
                         *(["--listen", channel] if exit_stage else []),
                         *(["--kv-tokens", str(self.kv_tokens)] if self.kv_tokens else [])]
        return argv

    def replan(self, stages: int, plan: str) -> None:
        """Stop every worker and start a new layout, as a rollout does: no control plane."""
        old = {n: self.procs[n] for n in self.names}
        self.stopping.update(old.values())  # their exits are not failures (check_alive)
        for proc in old.values():
            proc.terminate()
        for n, proc in old.items():
            proc.wait(30)
            self.procs.pop(n)
        self.stages, self.plan = stages, plan
        self.argv = self.commands()
        for n in self.names:
            self.spawn(n)

    def spawn(self, name: str) -> None:
        log = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if self.redis:  # the password through the environment, never the command line
            env[PASSWORD_ENV] = self.redis.password
        if self.log_dir and name == "draft":  # the scheduler's plans, for a replay
            env[TRACE_ENV] = str(self.plan_trace)
        self.procs[name] = subprocess.Popen(self.argv[name], stdout=log, stderr=subprocess.STDOUT,
                                            env=env)

    def restart(self, name: str) -> None:
        """SIGKILL worker ``name`` and start it again (a crashed pod that comes back)."""
        self.procs[name].kill()
        self.procs[name].wait()
        self.spawn(name)

    @property
    def plan_trace(self) -> Path:
        """The file the draft service appends its step plans to (with a ``log_dir``)."""
        assert self.log_dir is not None
        return self.log_dir / "draft.plans.jsonl"

    def sync(self) -> Synchroniser:
        assert self.redis is not None
        return Synchroniser(self.redis.url, self.name)

    def generate(self, prompt: Sequence[int], max_new: int, params: dict | None = None,
                 stop_ids: Sequence[int] = (), timeout_s: float = 120.0,
                 at: tuple[int, Callable[[], None]] | None = None, slots: int = 1,
                 rid: str = "", on_token: Callable[[int], None] | None = None,
                 chunk: int = 0) -> list[int]:
        """Submit through the synchroniser and collect the committed tokens.

        ``at = (n, fn)`` calls ``fn`` once ``n`` tokens are committed (a kill, a re-plan);
        ``on_token(n)`` is called with the count after every token.  ``slots``: how many
        requests may run at once (the gateway's concurrency); ``chunk``: prompt tokens
        prefilled per step (0: all in one).
        """
        rid = self.last_rid = rid or uuid.uuid4().hex[:12]
        self.sync().submit(rid, list(prompt), params or {}, max_new, stop_ids, slots, chunk)
        return self.collect(rid, timeout_s, at, on_token)

    def collect(self, rid: str, timeout_s: float = 120.0,
                at: tuple[int, Callable[[], None]] | None = None,
                on_token: Callable[[int], None] | None = None) -> list[int]:
        """The committed tokens of the submitted request ``rid`` (see :meth:`generate`)."""
        sync = self.sync()
        tokens: list[int] = []
        last = "0"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for eid, ev in sync.events(rid, last, 500):
                last = eid
                if "tok" in ev:
                    assert int(ev["i"]) == len(tokens), "token log out of order"
                    tokens.append(int(ev["tok"]))
                    if at and len(tokens) == at[0]:
                        at[1]()
                    if on_token is not None:
                        on_token(len(tokens))
                if "end" in ev:
                    return tokens
            self.check_alive()
        raise TimeoutError(f"request not finished in {timeout_s} s; got {tokens}")

    def input_timeouts(self) -> list[str]:
        """Log lines of workers that gave up waiting for a link message (a lost message)."""
        assert self.log_dir is not None
        return [line for f in sorted(self.log_dir.glob("*.log"))
                for line in f.read_text(errors="replace").splitlines()
                if "starting a new epoch" in line]

    def check_alive(self) -> None:
        # a copy: another thread may be replacing workers (replan)
        for n, p in list(self.procs.items()):
            if p in self.stopping:
                continue
            if p.poll() is not None and p.returncode not in (None, -9):
                raise RuntimeError(f"{n} exited with {p.returncode}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.redis:
            self.redis.stop()


@dataclass
class ClientLoad:
    """One client of a mixed load through a gateway: what it sends, and when."""

    name: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    after: tuple[str, int] | None = None  # send once that client has n tokens
    cancel_after: int = 0  # cancel the stream once it has this many tokens (0: never)
    got: list[int] = field(default_factory=list)
    finish_reason: str = ""


def mixed_clients() -> list[ClientLoad]:
    """Different prompts and lengths, greedy and seeded sampling, two clients arriving
    while others decode, and one cancelling mid-way."""
    sampled = SamplingParams(0.9, 0.9, 20, 11)
    return [ClientLoad("a", PROMPT, 30),
            ClientLoad("b", [7, 7, 7, 7, 1, 2, 7, 7, 7], 24, sampled),
            ClientLoad("c", PROMPT[2:], 40, after=("a", 3)),
            ClientLoad("d", [3, 1, 4, 1, 5, 9, 2, 6], 300, cancel_after=5),
            ClientLoad("e", PROMPT[:5], 20, SamplingParams(0.8, 0.95, 0, 3), after=("b", 6))]


class Arrivals:
    """Staggered starts of a load: an item with ``after=(name, n)`` starts once item
    ``name`` has n tokens, or has ended (so an early end never strands the next)."""

    def __init__(self, items: Sequence[Any]):
        self.gates = {x.name: threading.Event() for x in items}
        self.opens: dict[str, list[tuple[int, threading.Event]]] = {x.name: [] for x in items}
        for x in items:
            if x.after is None:
                self.gates[x.name].set()
            else:
                self.opens[x.after[0]].append((x.after[1], self.gates[x.name]))

    def progress(self, name: str, n: int) -> None:
        """Item ``name`` has ``n`` tokens: start whatever waits for that many."""
        for k, gate in self.opens[name]:
            if n >= k:
                gate.set()

    def ended(self, name: str) -> None:
        """Item ``name`` ended (done, cancelled or failed): start everything waiting on it."""
        for _, gate in self.opens[name]:
            gate.set()

    def run(self, items: Sequence[Any], fn: Callable[[Any], None], timeout_s: float) -> None:
        """``fn(item)`` for every item in its own thread, each once its gate opens; raises
        what any of them raised."""
        errors: list[BaseException] = []

        def one(x: Any) -> None:
            try:
                assert self.gates[x.name].wait(timeout_s), f"{x.name} never started"
                fn(x)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                self.ended(x.name)

        threads = [threading.Thread(target=one, args=(x,)) for x in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 30)
        assert not errors, errors


def run_clients(endpoint: str, loads: list[ClientLoad], api_key: str | None = None,
                timeout_s: float = 120.0) -> None:
    """Every client in its own thread through the gRPC gateway, streaming."""
    from orchestrator.serving.client import Client

    arrivals = Arrivals(loads)

    def one(c: ClientLoad) -> None:
        sp = c.sampling
        with Client(endpoint, api_key=api_key) as client:
            stream = client.stream(timeout_s=timeout_s, prompt_ids=c.prompt,
                                   max_tokens=c.max_tokens, temperature=sp.temperature,
                                   top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
                                   ignore_eos=True)
            for chunk in stream:
                c.got += list(chunk.token_ids)
                c.finish_reason = chunk.finish_reason or c.finish_reason
                arrivals.progress(c.name, len(c.got))
                if c.cancel_after and len(c.got) >= c.cancel_after:
                    stream.cancel()
                    break

    arrivals.run(loads, one, timeout_s)


def check_own_tokens(loads: list[ClientLoad],
                     ar: Callable[[list[int], int, SamplingParams], list[int]]) -> None:
    """Every client got exactly its own plain autoregressive tokens (a prefix of them if it
    cancelled)."""
    for c in loads:
        if c.cancel_after:
            assert c.cancel_after <= len(c.got) < c.max_tokens, c.name
            assert c.got == ar(c.prompt, len(c.got), c.sampling), c.name
        else:
            assert (c.got, c.finish_reason) == (ar(c.prompt, c.max_tokens, c.sampling),
                                                "length"), c.name
