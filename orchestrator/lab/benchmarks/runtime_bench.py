"""``treepipe runtime-bench``: what the distributed runtime adds per step.

* **sync**: the step barrier alone.  One process per participant (draft +
  stages) loops ``arrive`` -> blocking pop of the verdict with no compute, the
  last stage committing a token and the draft naming the root's children, as
  in a real step.  Per step and participant: the time from calling ``arrive``
  to holding the verdict, and Redis commands per step (from ``INFO
  commandstats``).
* **transfer**: one hop of a ``hidden`` message (w nodes of [w, dim] float32
  hidden states plus ids), echoed back by a peer process over the same
  transport; one-way time = round trip / 2, including encode, schema checks
  and decode on both sides.
* **hop** (``--hop-requests B``, run alone): the same for a hop that carries B
  requests' parts, as a frame per request and as one frame (as the workers send
  a step's hop).
* **tbt** (optional, ``--tbt``): the wall-clock TBT of a local multi-process
  pipeline (``treepipe up`` with the given manifest) next to the in-process
  engine's pipelined time for the same request, shards and source.
* **batch** (``--batch``, run alone): a pool of ``--requests`` greedy requests
  of ``--max-new-tokens`` tokens through ``treepipe up`` with the given
  manifest, at each ``--concurrency`` B (the paper's scheduler: a new request
  whenever fewer than B run), for each draft source in ``--sources`` (``none``
  is pp); wall-clock throughput, mean and p99 TBT, and every request's tokens
  must be the same at every B.
* **overload** (``--overload``, run alone): ``--clients`` callers at once; how
  many are served (with the tokens the prompt gets alone), refused
  ``RESOURCE_EXHAUSTED``, and how fast health answers meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.deploy.launcher import (
    down_detached,
    load_planned,
    read_state,
    state_sync,
    up_detached,
)
from orchestrator.deploy.redis_server import RedisServer, free_port, new_secret
from orchestrator.lab.benchmarks.runtime_pipelines import per_step, settled_delta, worker_stats
from orchestrator.models.loading import EngineSpec, make_source, quantize_shards, torch_dtype
from orchestrator.models.registry import resolve_model
from orchestrator.serving.client import Client, Completion
from protocol.errors import TreepipeError
from protocol.links import messages
from protocol.links.keys import LinkKeys, write_link_keys
from protocol.links.transport import open_inbox, open_outbox
from protocol.scheduling.prefill import PrefillLayout
from protocol.scheduling.width import adaptive_cap, parse_width
from protocol.sync.control import Start, Step
from protocol.sync.synchroniser import Report, Synchroniser, participant_names
from stages.model.checkpoint import load_shard
from stages.model.tokenizer import TextTokenizer
from stages.runtime.admission import next_joins
from stages.speculation.engine import PipelineEngine

WIDTHS = (1, 16, 64)
JOIN_AFTER_TOKENS = 8  # --long-join: tokens each decoder has before the long prompt joins
JOINER_TOKENS = 16  # --long-join: tokens the long prompt's request generates


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _participant(url: str, pipe: str, name: str, steps: int, role: str, out: Any,
                 password: str | None, names: list[str]) -> None:
    sync = Synchroniser(url, pipe, password=password)
    msg = sync.wait_ctl(name, 30)
    assert isinstance(msg, Start) and msg.more
    rid, epoch = "r1", msg.epoch
    times = []
    for step in range(steps):
        t = time.perf_counter()
        if step == 0:  # the idle pipeline's first barrier: the draft (scheduler) lets r1 in
            joins = next_joins(sync, names, "", len(names) - 1, 0, []) if role == "draft" \
                else []
            sync.arrive(epoch, step, name, {}, joins)
        elif role == "last":
            sync.arrive(epoch, step, name, {rid: Report(token=step % 7)})
        elif role == "draft":
            sync.arrive(epoch, step, name, {rid: Report(root_id=10_000 + step, children=tuple(
                (k, 1000 * step + k) for k in range(8)))})
        else:
            sync.arrive(epoch, step, name, {rid: Report()})
        verdict = sync.wait_ctl(name, 30)
        assert isinstance(verdict, Step) and verdict.step == step
        times.append(time.perf_counter() - t)
    out.put((name, times))


def _processes() -> Any:
    """Peer processes forked from a server that imported this module once: a fork of
    no threads and no sockets, without paying torch's import again per peer (spawn)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def bench_sync(stages: int, steps: int, secure: bool = True) -> dict[str, Any]:
    """Barrier cost per step with ``stages`` stages + the draft, each its own process;
    ``secure``: Redis with a password, as pipelines run it (plain: none)."""
    password = new_secret() if secure else None
    with RedisServer(password=password) as server:
        names = participant_names(stages)
        sync = Synchroniser(server.url, "bench", password=password)
        sync.register(names)
        sync.r.config_resetstat()
        ctx = _processes()
        out = ctx.Queue()
        procs = [ctx.Process(target=_participant, args=(
            server.url, "bench", n, steps,
            "draft" if n == "draft" else "last" if n == f"stage{stages - 1}" else "mid", out,
            password, names))
            for n in names]
        for p in procs:
            p.start()
        time.sleep(1.0)  # let every participant block on its control list
        sync.r.config_resetstat()
        sync.submit("r1", [1, 2, 3], {}, steps + 1, [])
        results = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        stats = sync.r.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k.split("_", 1)[-1] in
                ("evalsha", "blpop", "eval"))
    per_step = [t * 1e6 for ts in results.values() for t in ts[10:]]  # skip warm-up
    script_us = stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0)
    return {"secure": secure, "participants": len(names), "steps": steps,
            "redis_script_us_per_call": script_us,
            "redis_commands_per_step_per_worker": calls / steps / len(names),
            "p50_us": _pct(per_step, 0.5), "p99_us": _pct(per_step, 0.99),
            "mean_us": statistics.fmean(per_step)}


def _echo(transport: str, listen: str, reply: str, dim: int, n: int, keys_dir: str) -> None:
    keys = LinkKeys.load(keys_dir) if keys_dir else None
    inbox = open_inbox(transport, listen, keys=keys, insecure=keys is None)
    outbox = open_outbox(transport, reply, keys=keys, insecure=keys is None)
    for _ in range(n):
        msg = inbox.recv(30)
        assert msg is not None
        outbox.send_nodes(messages.parse(msg, dim, torch.float32))
    time.sleep(0.5)
    inbox.close()
    outbox.close()


def bench_transfer(transport: str, width: int, dim: int, n: int,
                   secure: bool = True, requests: int = 1,
                   frames_per_hop: int = 1) -> dict[str, Any]:
    """One-way time of a hop of ``requests`` requests' w-node hidden states (round trip /
    2), sent as ``frames_per_hop`` frames (1: one frame, as the workers send a step's
    hop; ``requests``: a frame per request, as they did before).

    ``secure``: the links as a pipeline runs them, authenticated and encrypted (CURVE,
    mutual TLS) with throwaway keys; plain: as ``--insecure-links`` runs them.
    """
    if frames_per_hop not in (1, requests):
        raise TreepipeError(f"a hop of {requests} requests goes in 1 or {requests} frames")
    if requests > messages.MAX_PARTS:
        raise TreepipeError(f"a hop carries at most {messages.MAX_PARTS} requests' parts, "
                            f"got {requests}; pass a smaller --hop-requests")
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    tmp = tempfile.TemporaryDirectory()
    keys_dir = str(write_link_keys(Path(tmp.name) / "keys", (transport,))) if secure else ""
    keys = LinkKeys.load(keys_dir) if secure else None
    inbox = open_inbox(transport, a, keys=keys, insecure=not secure)
    ctx = _processes()
    peer = ctx.Process(target=_echo, args=(transport, b, a, dim, n * frames_per_hop,
                                           keys_dir))
    peer.start()
    outbox = open_outbox(transport, b, keys=keys, insecure=not secure)
    ids = torch.arange(1, width + 1)
    x = torch.randn(width, dim)
    per_frame = requests // frames_per_hop
    one_way = []
    for step in range(n):
        t = time.perf_counter()
        parts = [messages.Nodes("hidden", f"r{k}", 0, step, ids, ids - 1, ids, x)
                 for k in range(requests)]
        for f in range(frames_per_hop):
            outbox.send_nodes(parts[f * per_frame:(f + 1) * per_frame])
        for _ in range(frames_per_hop):
            msg = inbox.recv(30)
            assert msg is not None
            messages.parse(msg, dim, torch.float32)
        one_way.append((time.perf_counter() - t) / 2 * 1e6)
    peer.join()
    inbox.close()
    outbox.close()
    tmp.cleanup()
    one_way = one_way[20:]
    nbytes = requests * width * (dim * 4 + 24)
    return {"transport": transport, "width": width, "bytes": nbytes, "secure": secure,
            "requests": requests, "frames": frames_per_hop,
            "p50_us": _pct(one_way, 0.5), "p99_us": _pct(one_way, 0.99)}


def bench_hop(requests: int, width: int, dim: int, n: int) -> list[dict[str, Any]]:
    """A hop of ``requests`` requests' parts over each transport, secure: a frame per
    request against one frame for them all."""
    return [bench_transfer(transport, width, dim, n, True, requests, frames)
            for transport in ("zmq", "grpc") for frames in (requests, 1)]


def hop_markdown(rows: list[dict[str, Any]]) -> str:
    """The ``--hop-requests`` table."""
    r0 = rows[0]
    lines = [f"## one hop of {r0['requests']} requests' parts, w = {r0['width']} each "
             "(secure links, one-way)", "",
             "| transport | frames per hop | bytes | p50 µs | p99 µs |",
             "|---|--:|--:|--:|--:|"]
    lines += [f"| {r['transport']} | {r['frames']} | {r['bytes']} | {r['p50_us']:.0f} | "
              f"{r['p99_us']:.0f} |" for r in rows]
    return "\n".join(lines)


def bench_tbt(manifest: str, prompt: str, max_new: int) -> dict[str, Any]:
    """Wall TBT of `treepipe up` on ``manifest`` beside the engine's pipelined time."""
    m, p = load_planned(manifest)
    bounds = [s.layers for s in p.stages]
    folder = resolve_model(m.spec.model.source)
    dtype = torch_dtype(m.spec.model.dtype)
    tok = TextTokenizer.from_folder(folder)
    ids = tok.chat_ids([{"role": "user", "content": prompt}])

    d = m.spec.draft
    spec = EngineSpec(model=m.spec.model.source, draft=d.source, draft_model=d.model,
                      width=d.width, topk=d.topk)
    shards = quantize_shards([load_shard(folder, a, b, dtype) for a, b in bounds],
                             m.spec.model.quantize)
    engine = PipelineEngine(shards, make_source(spec, folder, dtype, shards), d.width, d.topk)
    res = engine.generate(ids, max_new, method="specpipe", stop_ids=tok.eos_token_ids)
    inproc = res.stats()
    endpoint = _up(manifest)
    try:
        with Client(endpoint) as c:
            out = c.generate(temperature=0,
                             messages=[{"role": "user", "content": prompt}], max_tokens=max_new)
    finally:
        down_detached(manifest)
    assert out.tokens == res.tokens, "multi-process tokens differ from the engine's"
    return {"manifest": manifest, "stages": [list(b) for b in bounds], "tokens": len(out.tokens),
            "multiprocess_tbt_wall_ms": out.tbt_ms, "multiprocess_ttft_ms": out.ttft_ms,
            "engine_tbt_pipelined_ms": inproc["tbt_pipelined_ms"],
            "engine_tbt_wall_ms": inproc["tbt_wall_ms"], "hit_rate": inproc["hit_rate"]}


BATCH_PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
                 "Explain what a hash map is in two sentences.", "Name three prime numbers.",
                 "Write a haiku about pipes.", "What is the capital of France?",
                 "List the days of the week.", "Write a SQL query counting rows of a table.",
                 "Describe the colour blue to a child."]


def run_load(endpoint: str, requests: list[dict[str, Any]], concurrency: int,
             timeout_s: float = 600) -> dict[str, Any]:
    """The paper's scheduler through a gateway: a pool of requests (``Client.generate``
    keyword sets), a new one sent whenever fewer than ``concurrency`` are running.
    Returns throughput, TBT (the gaps between a request's streamed tokens) and every
    request's tokens, in pool order."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(requests)):
        todo.put(i)
    done: list[Completion | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def client() -> None:
        with Client(endpoint) as c:
            while not errors:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done[i] = c.generate(timeout_s=timeout_s, **requests[i])
                except Exception as e:  # noqa: BLE001 - reported below, after the others
                    errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(min(concurrency, len(requests)))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if errors:
        raise TreepipeError(f"a request failed at concurrency {concurrency}: {errors[0]}")
    outs = [d for d in done if d is not None]
    gaps = [b - a for o in outs for a, b in itertools.pairwise(o.since_request_ms)]
    tokens = sum(len(o.tokens) for o in outs)
    return {"concurrency": concurrency, "requests": len(outs), "tokens": tokens,
            "wall_s": wall, "throughput_tok_s": tokens / wall,
            "mean_tbt_ms": statistics.fmean(gaps) if gaps else 0.0,
            "p99_tbt_ms": _pct(gaps, 0.99) if gaps else 0.0,
            "mean_ttft_ms": statistics.fmean(o.ttft_ms for o in outs),
            "outputs": [o.tokens for o in outs]}


def _width_variants(draft: dict[str, Any], widths: list[int | str] | None,
                    source: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, draft fields) per ``--widths`` entry: a fixed width, or ``adaptive[:CAP]``
    (up to the manifest's width); one variant, the manifest's own, without ``--widths``
    or for pp (no tree)."""
    width = int(draft.get("width", 16))
    if not widths or source == "none":
        own = f"adaptive:{width}" if draft.get("adaptive") else str(width)
        return [("-" if source == "none" else own, {})]
    out = []
    for w in widths:
        if isinstance(w, int):
            out.append((str(w), {"width": w, "adaptive": False}))
        else:
            cap = adaptive_cap(w, width)
            out.append((f"adaptive:{cap}", {"width": cap, "adaptive": True}))
    return out


@contextlib.contextmanager
def _variant_up(base: dict[str, Any], edit: Callable[[dict[str, Any]], None]
                ) -> Iterator[tuple[str, Synchroniser, list[str]]]:
    """``treepipe up`` on a copy of the manifest ``base`` whose spec ``edit`` changed; yields
    the gateway endpoint, a synchroniser client and the participants, and takes the
    pipeline down after."""
    data = json.loads(json.dumps(base))
    edit(data["spec"])
    with tempfile.TemporaryDirectory() as tmp:
        variant = str(Path(tmp) / "manifest.yaml")
        Path(variant).write_text(json.dumps(data))  # JSON is YAML
        load_planned(variant)  # a bad source, level or chunk fails here, in one line
        name = data["metadata"]["name"]
        sync = None
        endpoint = _up(variant)
        try:
            state = read_state(name)
            if state is None:
                raise TreepipeError(f"pipeline {name} is up but has no state file; "
                                    f"see treepipe status {name}")
            sync = state_sync(state, name)
            yield endpoint, sync, sync.participants()
        finally:
            if sync is not None:
                sync.close()
            down_detached(variant)


def bench_batch(manifest: str, requests: int, max_new: int,
                concurrency: list[int] | None = None,
                sources: list[str] | None = None,
                widths: list[int | str] | None = None) -> dict[str, Any]:
    """Wall-clock throughput and TBT through ``treepipe up`` at each concurrency, for each
    draft source (``none``: pp) and tree width (fixed or adaptive); every request's tokens
    must be the same at every concurrency."""
    base = load_planned(manifest)[0].to_yaml_dict()
    levels = sorted(set(concurrency or [1, requests]))
    prompts = [{"messages": [{"role": "user", "content": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]
                              + (f" ({i // len(BATCH_PROMPTS)})" if i >= len(BATCH_PROMPTS)
                                 else "")}],
                "max_tokens": max_new, "ignore_eos": True,
                "temperature": 0.0} for i in range(requests)]
    rows: list[dict[str, Any]] = []
    variants = [(source, label, fields)
                for source in sources or [base["spec"].get("draft", {}).get("source", "ngram")]
                for label, fields in _width_variants(base["spec"].get("draft", {}), widths,
                                                     source)]
    for source, label, fields in variants:
        def edit(spec: dict[str, Any], source: str = source,
                 fields: dict[str, Any] = fields) -> None:
            spec.setdefault("draft", {}).update(source=source, **fields)
            spec.setdefault("limits", {})["concurrency"] = max(levels)

        with _variant_up(base, edit) as (endpoint, sync, workers):
            # warm-up: first-touch allocations, and anything a source computes once
            # per prompt, outside every measured level
            run_load(endpoint, prompts, max(levels))
            runs = []
            for b in levels:
                before = worker_stats(sync, workers)
                r = run_load(endpoint, prompts, b)
                # the workers' own counters: barrier steps and where a step's time went
                r["workers"] = per_step(settled_delta(sync, workers, before))
                runs.append(r)
                print(f"  {source} w={label} B={b}: {r['throughput_tok_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)
        for r in runs:
            if r["outputs"] != runs[0]["outputs"]:
                raise TreepipeError(f"source {source}: requests got other tokens at "
                                    f"concurrency {r['concurrency']} than at "
                                    f"{runs[0]['concurrency']}")
            rows.append({**{k: v for k, v in r.items() if k != "outputs"}, "source": source,
                         "w": label, "method": "pp" if source == "none" else "specpipe",
                         "wall_vs_first": r["wall_s"] / runs[0]["wall_s"]})
    return {"manifest": manifest, "requests": requests, "max_new_tokens": max_new,
            "rows": rows}


def join_under_load(endpoint: str, short: list[dict[str, Any]],
                    long_prompts: list[list[int]]) -> list[Completion]:
    """Every ``short`` request at once, then, once each has streamed
    :data:`JOIN_AFTER_TOKENS` tokens, every prompt of ``long_prompts`` at once; their
    completions, the short ones first."""
    outs = [Completion() for _ in range(len(short) + len(long_prompts))]
    under_way = threading.Semaphore(0)  # a release per decoder with tokens
    errors: list[BaseException] = []

    def one(i: int, kw: dict[str, Any], signal: bool) -> None:
        try:
            with Client(endpoint) as c:
                for part in c.stream(timeout_s=600, **kw):
                    outs[i].add(part)
                    if signal and len(outs[i].tokens) >= JOIN_AFTER_TOKENS:
                        signal = False
                        under_way.release()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if signal:
                under_way.release()  # ended early: never hold the long prompts back

    threads = [threading.Thread(target=one, args=(i, kw, True)) for i, kw in enumerate(short)]
    for th in threads:
        th.start()
    for _ in threads:  # the long prompts join once every decoder is under way
        under_way.acquire(timeout=600)
    if not errors:
        joiners = [threading.Thread(target=one, args=(
            len(short) + j, {"prompt_ids": ids, "max_tokens": JOINER_TOKENS, "temperature": 0.0,
                             "ignore_eos": True}, False)) for j, ids in enumerate(long_prompts)]
        for th in joiners:
            th.start()
        threads += joiners
    for th in threads:
        th.join()
    if errors:
        raise TreepipeError(f"a request failed: {errors[0]}")
    return outs


def bench_long_join(manifest: str, prompt_tokens: int, chunks: list[int], decoders: int,
                    max_new: int, joiners: int = 1) -> dict[str, Any]:
    """``joiners`` prompts of ``prompt_tokens`` join at once while ``decoders`` requests
    decode, once per prefill chunk size (``limits.prefillChunk``, also the joiners' shared
    budget of rows a step): the decoding requests' gaps between tokens (the join stalls
    them a step's chunks at a time) and the joining requests' times to their first token.
    Every request must get the same tokens at every chunk size."""
    m, plan = load_planned(manifest)
    base = m.to_yaml_dict()
    tok = TextTokenizer.from_folder(resolve_model(base["spec"]["model"]["source"]))
    text = tok.encode(" ".join(BATCH_PROMPTS))
    long_text = text * (prompt_tokens // len(text) + 2)
    # each joiner its own prompt: the same text from another offset
    long_prompts = [long_text[7 * j:7 * j + prompt_tokens] for j in range(joiners)]
    short = [{"messages": [{"role": "user", "content": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]}],
              "max_tokens": max_new, "ignore_eos": True, "temperature": 0.0}
             for i in range(decoders)]
    rows: list[dict[str, Any]] = []
    outputs: list[list[int]] | None = None
    for chunk in chunks:
        def edit(spec: dict[str, Any], chunk: int = chunk) -> None:
            spec.setdefault("limits", {}).update(prefillChunk=chunk,
                                                 concurrency=decoders + joiners)

        with _variant_up(base, edit) as (endpoint, _sync, _workers):
            run_load(endpoint, short, decoders)  # warm-up
            outs = join_under_load(endpoint, short, long_prompts)
        tokens = [o.tokens for o in outs]
        if outputs is not None and tokens != outputs:
            raise TreepipeError(f"prefill chunk {chunk}: requests got other tokens than at "
                                f"chunk {chunks[0]}")
        outputs = tokens
        gaps = [b - a for o in outs[:decoders] for a, b in itertools.pairwise(o.since_request_ms)]
        ttfts = [o.ttft_ms for o in outs[decoders:]]
        layout = PrefillLayout(prompt_tokens, chunk)  # each joiner's, beside nothing
        rows.append({"prefill_chunk": chunk, "prefill_chunks": layout.chunks(),
                     "prefill_steps": layout.steps(len(plan.stages)),
                     "decoder_max_gap_ms": max(gaps), "decoder_p99_gap_ms": _pct(gaps, 0.99),
                     "decoder_mean_tbt_ms": statistics.fmean(gaps),
                     "joiner_ttft_ms": statistics.fmean(ttfts),
                     "joiner_first_ttft_ms": min(ttfts), "joiner_last_ttft_ms": max(ttfts),
                     "joiner_tbt_ms": statistics.fmean(o.tbt_ms for o in outs[decoders:])})
        print(f"  chunk {chunk}: decoders' largest gap {max(gaps):.0f} ms, joiners' TTFT "
              f"{min(ttfts):.0f}-{max(ttfts):.0f} ms", file=sys.stderr, flush=True)
    return {"manifest": manifest, "prompt_tokens": prompt_tokens, "decoders": decoders,
            "joiners": joiners, "max_new_tokens": max_new, "rows": rows}


def long_join_markdown(r: dict[str, Any]) -> str:
    """The table of a ``bench_long_join`` report."""
    k = r["joiners"]
    who = f"a {r['prompt_tokens']}-token prompt joins" if k == 1 else \
        f"{k} prompts of {r['prompt_tokens']} tokens join at once"
    lines = [f"## {who} {r['decoders']} decoding requests ({r['max_new_tokens']} tokens "
             "each), wall clock through treepipe up\n",
             "| prefill chunk | chunks | prefill steps | decoders' largest gap ms "
             "| decoders' p99 gap ms | decoders' mean TBT ms | joiners' TTFT ms (first-last) "
             "| joiners' TBT ms |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for x in r["rows"]:
        ttft = f"{x['joiner_ttft_ms']:.0f}"
        if k > 1:
            ttft += f" ({x['joiner_first_ttft_ms']:.0f}-{x['joiner_last_ttft_ms']:.0f})"
        lines.append(f"| {x['prefill_chunk']} | {x['prefill_chunks']} | {x['prefill_steps']} | "
                     f"{x['decoder_max_gap_ms']:.0f} | {x['decoder_p99_gap_ms']:.0f} | "
                     f"{x['decoder_mean_tbt_ms']:.1f} | {ttft} | {x['joiner_tbt_ms']:.1f} |")
    return "\n".join(lines)


def bench_overload(manifest: str, clients: int, max_new: int) -> dict[str, Any]:
    """``clients`` callers at once against ``treepipe up`` (the issue's overload): how many
    are served (each must get the tokens the prompt gets alone), how many are refused
    ``RESOURCE_EXHAUSTED`` at once, and how fast health answers meanwhile."""
    import grpc

    msgs = [{"role": "user", "content": BATCH_PROMPTS[0]}]
    codes: list[str] = []
    exact = wrong = 0
    refused_ms: list[float] = []
    health_ms: list[float] = []
    endpoint = _up(manifest)
    try:
        with Client(endpoint) as c:
            want = c.generate(temperature=0,
                              messages=msgs, max_tokens=max_new, ignore_eos=True).tokens
        start = threading.Barrier(clients + 1)
        lock = threading.Lock()

        def caller() -> None:
            nonlocal exact, wrong
            with Client(endpoint) as c:
                start.wait()
                t = time.perf_counter()
                try:
                    got = c.generate(temperature=0,
                                     messages=msgs, max_tokens=max_new, ignore_eos=True,
                                     timeout_s=900).tokens
                    code = "OK"
                except grpc.RpcError as e:
                    code, got = e.code().name, None
                with lock:
                    codes.append(code)
                    if code == "RESOURCE_EXHAUSTED":
                        refused_ms.append(1e3 * (time.perf_counter() - t))
                    elif got is not None:
                        exact, wrong = exact + (got == want), wrong + (got != want)

        threads = [threading.Thread(target=caller) for _ in range(clients)]
        for th in threads:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        with Client(endpoint) as probe:
            while any(th.is_alive() for th in threads):
                t = time.perf_counter()
                try:
                    probe.health(timeout_s=5.0)
                    health_ms.append(1e3 * (time.perf_counter() - t))
                except grpc.RpcError:
                    health_ms.append(float("inf"))
                time.sleep(0.2)
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        down_detached(manifest)
    counts = {k: codes.count(k) for k in sorted(set(codes))}
    return {"manifest": manifest, "clients": clients, "max_new_tokens": max_new,
            "codes": counts, "exact": exact, "wrong": wrong, "wall_s": wall,
            "refused_p99_ms": _pct(refused_ms, 0.99) if refused_ms else 0.0,
            "health_checks": len(health_ms), "health_p50_ms": _pct(health_ms, 0.5),
            "health_max_ms": max(health_ms)}


def batch_markdown(b: dict[str, Any]) -> str:
    """The concurrency table of a ``bench_batch`` report."""
    lines = [f"## batch: {b['requests']} requests x {b['max_new_tokens']} tokens, wall clock "
             "through treepipe up\n",
             "| method | source | w | B | tokens | wall s | throughput tok/s | mean TBT ms "
             "| p99 TBT ms | mean TTFT ms | wall / lowest B | steps | step ms "
             "| busiest compute ms | draft mean w |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in b["rows"]:
        w = r.get("workers") or {}
        steps = w["workers"][w["critical"]]["steps"] if w.get("workers") else 0
        mean_w = w.get("mean_width")
        lines.append(
            f"| {r['method']} | {r['source']} | {r.get('w', '-')} | {r['concurrency']} | "
            f"{r['tokens']} | "
            f"{r['wall_s']:.1f} | {r['throughput_tok_s']:.1f} | {r['mean_tbt_ms']:.1f} | "
            f"{r['p99_tbt_ms']:.1f} | {r['mean_ttft_ms']:.0f} | {r['wall_vs_first']:.2f} | "
            f"{steps} | {w.get('step_ms', 0.0):.1f} | {w.get('compute_ms', 0.0):.1f} | "
            f"{'-' if mean_w is None else f'{mean_w:.2f}'} |")
    lines.append("\nsteps: the busiest worker's barrier steps; step ms: its compute, barrier "
                 "wait, input and send per step; busiest compute ms: its forwards and tree "
                 "work per step (the workers' heartbeat counters); draft mean w: the "
                 "widths of the levels the draft service grew, averaged.")
    return "\n".join(lines)


@dataclass(frozen=True)
class RuntimeBenchOptions:
    """``treepipe runtime-bench``'s options, one field per flag."""

    stages: int
    steps: int
    messages: int
    dim: int
    hop_requests: int | None
    hop_width: int
    tbt: str | None
    prompt: str
    max_new_tokens: int
    batch: str | None
    overload: str | None
    long_join: str | None
    prompt_tokens: int
    joiners: int
    chunks: list[int]
    clients: int
    requests: int
    concurrency: list[int] | None
    sources: list[str] | None
    widths: list[str] | None
    out: str | None


def _up(manifest: str) -> str:
    """``treepipe up --detach`` on ``manifest``. An interrupt (Ctrl-C, SIGTERM) while it
    starts takes down what started; a failed ``up`` (a pipeline of that name already up)
    leaves the running pipeline alone, as it is not this benchmark's."""
    try:
        return up_detached(manifest)
    except KeyboardInterrupt:
        down_detached(manifest)
        raise


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt in the main thread as Ctrl-C does, so the
    ``finally`` blocks take down the pipelines ``treepipe up`` started (Python's default
    ends the process on the spot and leaves them running); a second SIGTERM while they
    go down is ignored."""
    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler (a caller's own thread: as before)
        return
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def runtime_bench(o: RuntimeBenchOptions) -> int:
    """Run the runtime benchmarks; print Markdown tables and write JSON."""
    with sigterm_as_interrupt():
        return _runtime_bench(o)


def _runtime_bench(o: RuntimeBenchOptions) -> int:
    torch.set_num_threads(1)
    if o.overload:
        ov = bench_overload(o.overload, o.clients, o.max_new_tokens)
        print(f"## overload: {ov['clients']} callers at once, {ov['max_new_tokens']} tokens each"
              f"\n\n| outcomes | exact | wrong | refusal p99 ms | health checks | health p50 ms "
              f"| health max ms | wall s |\n|---|--:|--:|--:|--:|--:|--:|--:|\n"
              f"| {', '.join(f'{k} {v}' for k, v in ov['codes'].items())} | {ov['exact']} | "
              f"{ov['wrong']} | {ov['refused_p99_ms']:.0f} | {ov['health_checks']} | "
              f"{ov['health_p50_ms']:.0f} | {ov['health_max_ms']:.0f} | {ov['wall_s']:.1f} |")
        _write(o.out, {"overload": ov})
        return 0
    if o.long_join:
        r = bench_long_join(o.long_join, o.prompt_tokens, o.chunks, o.requests,
                            o.max_new_tokens, o.joiners)
        print(long_join_markdown(r))
        _write(o.out, {"long_join": r})
        return 0
    if o.hop_requests:
        rows = bench_hop(o.hop_requests, o.hop_width, o.dim, o.messages)
        print(hop_markdown(rows))
        _write(o.out, {"hop": rows})
        return 0
    if o.batch:
        widths = [parse_width(w) for w in o.widths] if o.widths else None
        b = bench_batch(o.batch, o.requests, o.max_new_tokens, o.concurrency, o.sources,
                        widths)
        print(batch_markdown(b))
        _write(o.out, {"batch": b})
        return 0
    # secure (as pipelines run) and plain side by side: what authentication costs
    modes = {"secure": True, "plain": False}
    report: dict[str, Any] = {"sync": [bench_sync(o.stages, o.steps, sec)
                                       for sec in modes.values()], "transfer": []}
    sync_p99 = {s["secure"]: s["p99_us"] for s in report["sync"]}
    print(f"## sync: {o.stages + 1} participants, {o.steps} steps\n")
    print("| Redis | commands / step / worker | script µs in Redis | p50 µs | p99 µs | mean µs |"
          "\n|---|---|---|---|---|---|")
    for s in report["sync"]:
        print(f"| {'password' if s['secure'] else 'none'} | "
              f"{s['redis_commands_per_step_per_worker']:.2f} | "
              f"{s['redis_script_us_per_call']:.0f} | {s['p50_us']:.0f} | "
              f"{s['p99_us']:.0f} | {s['mean_us']:.0f} |")
    print("\n## transfer (one hop, one-way)\n\n| transport | links | w | bytes | p50 µs | p99 µs "
          "| sync + transfer p99 µs |\n|---|---|---|---|---|---|---|")
    for transport in ("zmq", "grpc"):
        for mode, sec in modes.items():
            for w in WIDTHS:
                t = bench_transfer(transport, w, o.dim, o.messages, sec)
                report["transfer"].append(t)
                print(f"| {transport} | {mode} | {w} | {t['bytes']} | {t['p50_us']:.0f} "
                      f"| {t['p99_us']:.0f} | {sync_p99[sec] + t['p99_us']:.0f} |", flush=True)
    if o.tbt:
        report["tbt"] = bench_tbt(o.tbt, o.prompt, o.max_new_tokens)
        t = report["tbt"]
        print(f"\n## TBT: {t['tokens']} tokens, stages {t['stages']}\n\n| multi-process wall "
              "TBT ms | in-process wall TBT ms | in-process pipelined TBT ms | hit rate |\n"
              f"|---|---|---|---|\n| {t['multiprocess_tbt_wall_ms']:.1f} | "
              f"{t['engine_tbt_wall_ms']:.1f} | {t['engine_tbt_pipelined_ms']:.1f} | "
              f"{t['hit_rate']:.2f} |")
    _write(o.out, report)
    return 0


def _write(out: str | None, report: dict[str, Any]) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))


