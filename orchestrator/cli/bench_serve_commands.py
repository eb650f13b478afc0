"""``treepipe bench-serve``: the argv side of the serving load
(orchestrator/lab/benchmarks/serve_load.py), with ``vllm bench serve``'s flag names."""

from __future__ import annotations

import argparse
import os
from typing import Any
from urllib.parse import urlsplit

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    finite,
    options,
    out_file,
    positive_int,
    positive_int_list,
    positive_seconds,
    seed,
    shown,
)
from orchestrator.lab.benchmarks.serve_load import ServeLoadOptions, serve_load
from orchestrator.serving.auth import API_KEY_ENV, env_api_key, read_api_key

OPENAI_API_KEY_ENV = "OPENAI_API_KEY"  # what the openai client and vllm bench serve read


def base_url(text: str) -> str:
    """argparse type: an http(s) URL of an OpenAI-style API, e.g. http://127.0.0.1:8000/v1."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an http(s) URL; give e.g. "
                                         "http://127.0.0.1:8000/v1")
    return text


def api_key(a: argparse.Namespace) -> str | None:
    """The bearer key: --api-key-file, else $TREEPIPE_API_KEY_FILE or $TREEPIPE_API_KEY (as
    every treepipe client), else $OPENAI_API_KEY (as the openai client)."""
    key = read_api_key(a.api_key_file, "--api-key-file") if a.api_key_file else env_api_key()
    return key or os.environ.get(OPENAI_API_KEY_ENV) or None


def cmd_bench_serve(a: argparse.Namespace) -> int:
    """``treepipe bench-serve``: the load at each --max-concurrency; a table on stdout."""
    return serve_load(options(ServeLoadOptions, a), api_key(a))


def add_bench_serve_parser(sub: Any) -> None:
    """Register ``treepipe bench-serve``."""
    p = sub.add_parser(
        "bench-serve", help=COMMANDS["bench-serve"],
        description="vllm bench serve-style load: random token-id prompts as streamed "
                    "/v1/completions requests (ignore_eos, usage, temperature 0) at each "
                    "--max-concurrency; throughput, TTFT, TPOT, ITL and E2E latency.")
    p.add_argument("--base-url", type=base_url, default="http://127.0.0.1:8000/v1",
                   help="the OpenAI API's base URL (default %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name the requests send (default: the first /v1/models lists)")
    p.add_argument("--num-prompts", type=positive_int, default=16,
                   help="requests at each concurrency level (default %(default)s)")
    p.add_argument("--random-input-len", type=positive_int, default=64,
                   help="prompt tokens, random ids (default %(default)s)")
    p.add_argument("--random-output-len", type=positive_int, default=64,
                   help="max_tokens of each request; ignore_eos makes it exact "
                        "(default %(default)s)")
    p.add_argument("--random-range-ratio", type=finite(0, 1, what=""), default=0.0,
                   help="lengths drawn from LEN * (1 - R) .. LEN * (1 + R), as vLLM's "
                        "(default 0: every request alike)")
    p.add_argument("--vocab-size", type=positive_int, default=49152,
                   help="prompt ids are drawn from [0, N): the served model's vocabulary "
                        "(default %(default)s, SmolLM2's)")
    p.add_argument("--max-concurrency", type=positive_int_list, default=[1, 4, 8],
                   metavar="C,C,...", help="requests in flight at once; one level each "
                                           "(default 1,4,8)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before each level, C untimed short requests at once (default on)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random prompts")
    p.add_argument("--request-timeout", type=positive_seconds, default=600.0,
                   help="seconds one request may take (default %(default)s)")
    p.add_argument("--label", default="run",
                   help="the table's run column and the JSON's label, e.g. pp or specpipe")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar over the requests on stderr (default on)")
    p.add_argument("--out", type=out_file, default=None, metavar="FILE",
                   help="write the JSON report (every level, every request) here")
    p.add_argument("--api-key-file", default="", metavar="FILE",
                   help=f"file holding the server's API key (else ${API_KEY_ENV} or "
                        f"${OPENAI_API_KEY_ENV}; never a flag)")
    p.set_defaults(func=cmd_bench_serve)
