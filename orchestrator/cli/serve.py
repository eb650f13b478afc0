"""``treepipe serve MODEL``: a local pipeline in one command, like ``vllm serve``.

It writes a TreePipeline manifest with sane defaults into the run folder and
hands it to the local launcher (``treepipe up --detach``, then ``down``), so the
processes, restarts and logs are exactly those of ``treepipe up -f``.  It prints
the HTTP (OpenAI API, ``/metrics``) and gRPC endpoints and stops everything on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

import yaml

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import positive_int
from orchestrator.deploy.launcher import (
    cmd_down,
    cmd_up,
    pid_alive,
    read_state,
    run_dir,
    state_sync,
)
from orchestrator.deploy.manifest import API_VERSION, KIND, ManifestError, validate_manifest
from protocol.errors import TreepipeError


def serve_manifest(a: argparse.Namespace) -> dict[str, Any]:
    """The manifest ``serve`` runs: the flags, the rest as manifests/examples/local.yaml."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": a.name},
            "spec": {"backend": "local",
                     "model": {"source": a.model, "dtype": a.dtype},
                     "stages": {"count": a.stages, "device": {"type": a.device}},
                     "draft": {"source": a.draft, "width": a.width, "topk": a.topk},
                     "transport": "zmq", "synchronizer": {"mode": "embedded"},
                     "gateway": {"port": a.port, "httpPort": a.http_port},
                     "limits": {"contextLength": a.context_length,
                                "concurrency": a.concurrency,
                                # half the context by default, so a prompt always fits
                                "maxNewTokens": a.max_new_tokens
                                or min(1024, a.context_length // 2)}}}


def cmd_serve(a: argparse.Namespace) -> int:
    """``treepipe serve MODEL``: up, print the endpoints, wait for Ctrl-C, down."""
    data = serve_manifest(a)
    try:
        validate_manifest(data, "treepipe serve")
    except ManifestError as e:
        raise TreepipeError(str(e)) from None
    folder = run_dir(a.name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    files = argparse.Namespace(file=str(path), detach=True, timeout=a.timeout)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cmd_up(files)  # prints the gRPC endpoint; returns once every worker is up
    try:
        st = read_state(a.name) or {}
        sync = state_sync(st, a.name)  # the pipeline's Redis needs its secret
        http = (sync.r.get(sync.key("gateway", "http")) or b"").decode()
        print(f"OpenAI API: http://{http}/v1   metrics: http://{http}/metrics", flush=True)
        print(f"gRPC: {st['endpoint']}   logs: {folder}   Ctrl-C stops the pipeline",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            now = read_state(a.name)
            if not now or not pid_alive(int(now["supervisor_pid"])):
                raise TreepipeError(f"the pipeline stopped; see {folder}/supervisor.log")
    finally:
        cmd_down(argparse.Namespace(file=str(path)))
    return 0


def add_serve_parser(sub: Any) -> None:
    """Register ``treepipe serve``."""
    s = sub.add_parser("serve", help=COMMANDS["serve"])
    s.add_argument("model", help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    s.add_argument("--stages", type=positive_int, default=2, help="pipeline stages")
    s.add_argument("--draft", default="ngram",
                   help="token source: ngram, hybrid, layers:N or a draft model")
    s.add_argument("--width", type=positive_int, default=16, help="tree width w")
    s.add_argument("--topk", type=positive_int, default=8, help="top-k per tree node")
    s.add_argument("--port", type=int, default=50151, help="gRPC port (0 = a free one)")
    s.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI API and /metrics port (0 = a free one)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--device", default="cpu")
    s.add_argument("--context-length", type=positive_int, default=2048)
    s.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="largest max_tokens a request may ask (default: half the context, "
                        "at most 1024)")
    s.add_argument("--concurrency", type=positive_int, default=4,
                   help="requests decoded together in one batch (more wait in the queue); "
                        "each stage holds the KV cache of this many whole contexts")
    s.add_argument("--name", default="serve", help="pipeline name (run folder, Redis keys)")
    s.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the workers to come up")
    s.set_defaults(func=cmd_serve)
