"""``treepipe bench-serve``: ``vllm bench serve``-style load against an OpenAI-style server.

N prompts of random token ids (seeded, as vLLM's ``random`` dataset: lengths drawn from
``len * (1 - ratio) .. len * (1 + ratio)``) go to ``/v1/completions`` as ``prompt``
lists of ids, so the input length is exact and no tokenizer is needed on either side.
Each request streams (``stream_options.include_usage``), ignores EOS, asks greedy
decoding (``temperature: 0``) and ``return_token_ids`` (vLLM's extension), so that a
chunk carrying several tokens (a speculative step accepts more than one) is counted as
such.  At each ``max_concurrency`` level every prompt is sent with at most that many
requests in flight, after an untimed warm-up of that many requests at once.

Per request: TTFT (send to the first chunk carrying tokens), ITL (gaps between chunks
carrying tokens; a chunk of k tokens counts as k gaps of gap/k, and extra tokens of the
first chunk as none, as vLLM counts them), E2E latency (send to the end of the stream)
and the output tokens from ``usage``.  Per level: request and token throughput, and
mean / median / p99 of TTFT, TPOT ((E2E - TTFT) / (tokens - 1)), ITL and E2E latency,
in vLLM's names.  The HTTP client is aiohttp (vLLM's benchmark uses it too).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from protocol.errors import RuntimeFailure, TreepipeError

WARMUP_TOKENS = 16  # a warm-up needs the batch shapes, not the whole length
PERCENTILES = (50.0, 99.0)


@dataclass(frozen=True)
class ServeLoadOptions:
    """``treepipe bench-serve``'s options, one field per flag (the API key is apart)."""

    base_url: str
    model: str | None
    num_prompts: int
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    vocab_size: int
    max_concurrency: list[int]
    warmup: bool
    seed: int
    request_timeout: float
    label: str
    progress: bool
    out: Path | None


@dataclass(frozen=True)
class Prompt:
    """One random request: its token ids and how many tokens it asks."""

    ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    """What one streamed request measured (seconds; ``itl`` one entry per token gap)."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # usage.completion_tokens, else the ids counted in the chunks
    counted_tokens: int = 0  # token ids seen in the stream's chunks
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_prompts(n: int, input_len: int, output_len: int, ratio: float, vocab: int,
                   seed: int) -> list[Prompt]:
    """``n`` prompts of uniform random ids in [0, vocab), lengths as vLLM's random dataset."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio))))

    prompts = []
    for _ in range(n):
        k, out = length(input_len), length(output_len)
        prompts.append(Prompt([rng.randrange(vocab) for _ in range(k)], out))
    return prompts


def request_body(model: str, p: Prompt, max_tokens: int | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` body ``vllm bench serve`` sends, greedy, with the ids back."""
    return {"model": model, "prompt": p.ids, "max_tokens": max_tokens or p.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


def chunk_tokens(event: dict[str, Any]) -> int:
    """Tokens a streamed chunk carries: its ``token_ids``; a server without them: 1 per
    chunk with text (vLLM's own count)."""
    n = 0
    for c in event.get("choices") or []:
        ids = c.get("token_ids")
        n += len(ids) if isinstance(ids, list) else int(bool(c.get("text")))
    return n


def record_chunk(r: RequestResult, k: int, now: float, start: float, last: float) -> None:
    """Book a chunk of ``k`` tokens that arrived at ``now`` (``last``: the previous one)."""
    if r.counted_tokens == 0:
        r.ttft = now - start
    else:
        r.itl.extend([(now - last) / k] * k)
    r.counted_tokens += k


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> RequestResult:
    """Stream one completion and time its chunks; a failure is a result, never raised."""
    r = RequestResult(prompt_len=len(body["prompt"]))
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            usage = await read_stream(resp, r, start)
        r.latency = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError, ValueError, LookupError, TypeError,
            AttributeError) as e:  # a network failure or a malformed event
        r.error = f"{type(e).__name__}: {e}"[:200]
        return r
    if r.error:
        return r
    r.output_tokens = usage if usage is not None else r.counted_tokens
    r.ok = r.counted_tokens > 0
    if not r.ok:
        r.error = "the stream carried no tokens"
    return r


async def read_stream(resp: aiohttp.ClientResponse, r: RequestResult, start: float
                      ) -> int | None:
    """Read the SSE events into ``r`` up to ``[DONE]``: the usage's completion tokens."""
    usage, last = None, start
    async for raw in resp.content:
        now = time.perf_counter()  # the chunk's arrival, before parsing it
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # SSE blank lines and comments
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:  # the server's error event after the headers
            err = event["error"]
            r.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            break
        if (k := chunk_tokens(event)) > 0:
            record_chunk(r, k, now, start, last)
            last = now
        if event.get("usage"):
            usage = int(event["usage"]["completion_tokens"])
    return usage


async def run_level(session: aiohttp.ClientSession, url: str, model: str,
                    prompts: list[Prompt], concurrency: int, headers: dict[str, str],
                    bar: Any) -> tuple[list[RequestResult], float]:
    """Every prompt with at most ``concurrency`` in flight: (results, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(p: Prompt) -> RequestResult:
        async with gate:
            res = await send(session, url, request_body(model, p), headers)
        if bar is not None:
            bar.update(1)
        return res

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - t0


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, median and p99 of ``values`` (milliseconds by default; 0 when empty)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    xs = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, numpy's default
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs) * scale, "median": pct(PERCENTILES[0]) * scale,
            "p99": pct(PERCENTILES[1]) * scale}


def summarize(results: list[RequestResult], duration: float, concurrency: int
              ) -> dict[str, Any]:
    """One level's figures in ``vllm bench serve``'s names (times in ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": concurrency, "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "requests": [asdict(r) for r in results]}


def _cell(s: dict[str, float]) -> str:
    return f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}"


def markdown_table(label: str, levels: list[dict[str, Any]]) -> str:
    """The levels as a Markdown table, ready for docs/benchmarks.md."""
    rows = ["| run | clients | done / failed | req/s | output tok/s | TTFT ms mean / p50 / p99 "
            "| TPOT ms mean / p50 / p99 | ITL ms mean / p50 / p99 | E2E ms mean |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for lv in levels:
        rows.append(f"| {label} | {lv['max_concurrency']} | {lv['completed']} / {lv['failed']} "
                    f"| {lv['request_throughput']:.2f} | {lv['output_throughput']:.1f} "
                    f"| {_cell(lv['ttft_ms'])} | {_cell(lv['tpot_ms'])} "
                    f"| {_cell(lv['itl_ms'])} | {lv['e2el_ms']['mean']:.0f} |")
    return "\n".join(rows)


async def served_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str]
                       ) -> tuple[str, int | None]:
    """(the first model ``/v1/models`` lists, its ``max_model_len`` if given)."""
    try:
        async with session.get(f"{base}/models", headers=headers) as resp:
            if resp.status != 200:
                hint = " (check the API key)" if resp.status == 401 else ""
                raise TreepipeError(f"--base-url {base}: GET /models answered HTTP "
                                    f"{resp.status}{hint}")
            data = (await resp.json())["data"]
    except (TimeoutError, aiohttp.ClientConnectionError) as e:
        # nothing answered: a server down or starting is a runtime failure (exit 1)
        raise RuntimeFailure(f"--base-url {base}: nothing answers there ({type(e).__name__}: "
                             f"{e}); is the server up?") from None
    except (aiohttp.ClientError, KeyError, ValueError) as e:
        raise TreepipeError(f"--base-url {base}: no OpenAI API answers there "
                            f"({type(e).__name__}: {e})") from None
    if not data:
        raise TreepipeError(f"--base-url {base}: /models lists no model")
    return str(data[0]["id"]), data[0].get("max_model_len")


def check_fits(o: ServeLoadOptions, prompts: list[Prompt], max_len: int | None) -> None:
    """Refuse a workload the server's context cannot hold, before sending it."""
    need = max(len(p.ids) + p.output_len for p in prompts)
    if max_len is not None and need > max_len:
        raise TreepipeError(f"--random-input-len + --random-output-len need up to {need} "
                            f"tokens a request, more than the server's max_model_len "
                            f"{max_len}; lower them")


async def run_load(o: ServeLoadOptions, api_key: str | None = None) -> dict[str, Any]:
    """Run the load at every level of ``o.max_concurrency``: the JSON report."""
    base = o.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=o.request_timeout)
    connector = aiohttp.TCPConnector(limit=max(o.max_concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model, max_len = await served_model(session, base, headers)
        model = o.model or model
        prompts = random_prompts(o.num_prompts, o.random_input_len, o.random_output_len,
                                 o.random_range_ratio, o.vocab_size, o.seed)
        check_fits(o, prompts, max_len)
        levels = [await _level(o, session, f"{base}/completions", model, prompts, c, headers)
                  for c in o.max_concurrency]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()}
    return {"label": o.label, "model": model, "base_url": base, "config": config,
            "temperature": 0, "levels": levels}


async def _level(o: ServeLoadOptions, session: aiohttp.ClientSession, url: str, model: str,
                 prompts: list[Prompt], c: int, headers: dict[str, str]) -> dict[str, Any]:
    """One concurrency level: the warm-up, then every prompt timed."""
    if o.warmup:
        # c requests at once, so that every batch shape up to c is seen before timing
        # (the stages measure or compile kernels per shape on first sight)
        warm = [send(session, url, request_body(model, prompts[i % len(prompts)],
                                                min(WARMUP_TOKENS, o.random_output_len)),
                     headers) for i in range(c)]
        failed = [r.error for r in await asyncio.gather(*warm) if not r.ok]
        if failed:
            raise TreepipeError(f"the warm-up request failed at {c} clients: {failed[0]}")
    bar = None
    if o.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc=f"{o.label} clients={c}", unit="req",
                   file=sys.stderr, leave=False)
    try:
        results, duration = await run_level(session, url, model, prompts, c, headers, bar)
    finally:
        if bar is not None:
            bar.close()
    return summarize(results, duration, c)


def serve_load(o: ServeLoadOptions, api_key: str | None = None) -> int:
    """``treepipe bench-serve``: run the load, print the Markdown table, write ``o.out``."""
    report = asyncio.run(run_load(o, api_key))
    print(f"{o.label}: {report['model']} at {report['base_url']}, {o.num_prompts} prompts, "
          f"input {o.random_input_len}, output {o.random_output_len}, temperature 0, "
          f"ignore_eos\n")
    print(markdown_table(o.label, report["levels"]), flush=True)
    if o.out is not None:
        o.out.parent.mkdir(parents=True, exist_ok=True)
        o.out.write_text(json.dumps(report, indent=1) + "\n")
    errors = [e for lv in report["levels"] for e in lv["errors"]]
    if errors:
        print(f"treepipe bench-serve: some requests failed, e.g. {errors[0]}", file=sys.stderr)
        return 1
    return 0
