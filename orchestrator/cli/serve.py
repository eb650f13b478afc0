"""``treepipe serve MODEL``: a local pipeline in one command, like ``vllm serve``.

It writes a TreePipeline manifest with sane defaults into the run folder and
hands it to the local launcher (``treepipe up --detach``, then ``down``), so the
processes, restarts and logs are exactly those of ``treepipe up -f``.  It prints
the HTTP (OpenAI API, ``/metrics``) and gRPC endpoints and stops everything on
Ctrl-C or SIGTERM.

The flags are vLLM's where vLLM has one (``--port`` is the HTTP port, ``--host``,
``--served-model-name``, ``--api-key-file``, ``--max-model-len``, ``--chat-template``),
and every error names the flag the user typed, not the manifest field behind it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    add_execution_flags,
    add_quantize_flag,
    positive_int,
    positive_seconds,
    recovery_name,
)
from orchestrator.deploy.launcher import (
    check_plaintext_host,
    down_local,
    port_owner,
    read_state,
    run_dir,
    running_state,
    state_sync,
    supervisor_alive,
    up_local,
)
from orchestrator.deploy.manifest import (
    API_VERSION,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_HTTP_PORT,
    KIND,
    ManifestError,
    validate_manifest,
)
from orchestrator.deploy.redis_server import port_in_use
from orchestrator.models.registry import CONFIG_FILE, KNOWN_MODELS
from orchestrator.serving.auth import API_KEY_ENV, API_KEY_FILE_ENV, read_api_key
from protocol.errors import TreepipeError
from stages.model.execution_modes import DEFAULT_DTYPE
from stages.model.tokenizer import read_chat_template

# owner/name, as the hub spells a repository (and as `vllm serve` takes one)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # what `vllm serve` reads; honoured for the same scripts

# manifest wording -> the flag that sets it, longest first so that a field is replaced
# whole (spec.draft.width before draft.width); errors from validation and planning
# speak manifest, a serve user typed flags
FIELD_FLAGS = [
    ("spec.gateway.insecure: true", "--insecure"),
    ("spec.limits.contextLength", "--max-model-len"),
    ("spec.limits.maxNewTokens", "--max-new-tokens"),
    ("spec.limits.concurrency", "--concurrency"),
    ("spec.stages.device.type", "--device"),
    ("spec.gateway.httpPort", "--port"),
    ("spec.gateway.port", "--grpc-port"),
    ("spec.gateway.host", "--host"),
    ("spec.gateway.servedModelName", "--served-model-name"),
    ("spec.gateway.chatTemplate", "--chat-template"),
    ("spec.stages.count", "--stages"),
    ("spec.draft.source", "--draft"),
    ("spec.draft.width", "--width"),
    ("spec.draft.topk", "--topk"),
    ("spec.draft.recovery", "--recovery"),
    ("spec.model.source", "MODEL"),
    ("spec.model.dtype", "--dtype"),
    ("spec.model.execution", "--execution"),
    ("spec.model.quantize", "--quantize"),
    ("limits.contextLength", "--max-model-len"),
    ("limits.maxNewTokens", "--max-new-tokens"),
    ("limits.concurrency", "--concurrency"),
    ("draft.width", "--width"),
    ("model.dtype", "--dtype"),
    ("metadata.name", "--name"),
    ("contextLength", "--max-model-len"),
    ("maxNewTokens", "--max-new-tokens"),
]


def in_flags(message: str, path: Path | None = None) -> str:
    """An error about the manifest serve wrote, in the words of the flags that set it."""
    if path is not None:
        message = message.replace(f"{path}: ", "").replace(str(path), "treepipe serve")
    for field, flag in FIELD_FLAGS:
        message = message.replace(field, flag)
    # the CLI's own prefix already names the command
    return message.removeprefix("treepipe serve: ")


def check_model(model: str) -> None:
    """MODEL must be a known name, a Hugging Face folder or a .gguf file on this machine;
    otherwise say which of those it missed and how to get there."""
    if model in KNOWN_MODELS:
        return
    path = Path(model).expanduser()
    known = ", ".join(KNOWN_MODELS)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise TreepipeError(f"MODEL {model}: the folder has no {CONFIG_FILE}; pass a Hugging "
                                f"Face model folder ({CONFIG_FILE}, *.safetensors, "
                                f"tokenizer.json), a .gguf file, or one of: {known}")
        return
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TreepipeError(f"MODEL {model}: a file, but not a .gguf; pass a .gguf file, a "
                                f"Hugging Face model folder, or one of: {known}")
        return
    if HUB_ID.fullmatch(model):
        local = model.rsplit("/", 1)[1]
        raise TreepipeError(f"MODEL {model}: no such folder here, and treepipe does not "
                            f"download from the Hugging Face hub; download it first (e.g. "
                            f"`huggingface-cli download {model} --local-dir ./{local}`) and "
                            f"run treepipe serve ./{local}")
    if "/" in model or model.startswith(("~", ".")) or model.lower().endswith(".gguf"):
        raise TreepipeError(f"MODEL {model}: no such file or folder; check the path")
    raise TreepipeError(f"MODEL {model}: unknown model; known models: {known}; or pass a "
                        f"Hugging Face model folder or a .gguf file")


def resolve_ports(a: argparse.Namespace) -> tuple[int, int]:
    """(HTTP port, gRPC port) from --port, --grpc-port and the deprecated --http-port.

    With --http-port (the old spelling), --port keeps its old meaning, the gRPC port,
    so that commands written for it run as before for one release.
    """
    if a.http_port is None:
        http = DEFAULT_HTTP_PORT if a.port is None else a.port
        grpc = DEFAULT_GATEWAY_PORT if a.grpc_port is None else a.grpc_port
    else:
        if a.port is not None and a.grpc_port is not None:
            raise TreepipeError("--http-port is the old spelling of --port; give --port "
                                "(HTTP) and --grpc-port, without --http-port")
        print("treepipe serve: warning: --http-port is deprecated and goes in the next "
              "release; --port is the HTTP port now (as in vllm serve) and --grpc-port the "
              "gRPC one. With --http-port, --port still means the gRPC port.",
              file=sys.stderr, flush=True)
        http = a.http_port
        grpc = next((p for p in (a.grpc_port, a.port) if p is not None), DEFAULT_GATEWAY_PORT)
    if http and http == grpc:
        hf, gf = port_flags(a)
        raise TreepipeError(f"{hf} and {gf} are both {http}; give them different ports (0 "
                            f"picks a free one)")
    return http, grpc


def port_flags(a: argparse.Namespace) -> tuple[str, str]:
    """The flags the user typed for the HTTP and the gRPC port (see :func:`resolve_ports`)."""
    if a.http_port is None:
        return "--port", "--grpc-port"
    return "--http-port", "--grpc-port" if a.grpc_port is not None else "--port"


def check_ports(a: argparse.Namespace, http: int, grpc: int) -> None:
    """A busy port named by the flag that chose it (the manifest check would name the field)."""
    host = a.host
    probe = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    for flag, port in zip(port_flags(a), (http, grpc), strict=True):
        if port and port_in_use(port, probe):
            raise TreepipeError(f"{flag} {port} is already in use on {host} "
                                f"({port_owner(port)}); stop it, or pick another {flag} (0 picks "
                                f"a free one)")


def use_api_key(a: argparse.Namespace) -> None:
    """Hand the API key to the gateway by file or environment, never by argv."""
    # (--api-key itself is refused by the parser: flags.RefusedSecret)
    if a.api_key_file:
        read_api_key(a.api_key_file, "--api-key-file")  # readable and not empty, or one line
        # the supervisor and the gateway inherit the environment (launcher.spawn)
        os.environ[API_KEY_FILE_ENV] = str(Path(a.api_key_file).expanduser().resolve())
    elif os.environ.get(VLLM_API_KEY_ENV) and not (os.environ.get(API_KEY_ENV)
                                                   or os.environ.get(API_KEY_FILE_ENV)):
        os.environ[API_KEY_ENV] = os.environ[VLLM_API_KEY_ENV]


def serve_manifest(a: argparse.Namespace, http: int | None = None,
                   grpc: int | None = None) -> dict[str, Any]:
    """The manifest ``serve`` runs: the flags, the rest as manifests/examples/local.yaml."""
    if http is None or grpc is None:
        http, grpc = resolve_ports(a)
    gateway: dict[str, Any] = {"port": grpc, "httpPort": http}
    if a.host != "127.0.0.1":
        gateway["host"] = a.host
    if a.insecure:
        gateway["insecure"] = True
    if a.served_model_name:
        gateway["servedModelName"] = a.served_model_name
    if a.chat_template:
        # the gateway starts in the run folder's world: hand it an absolute path
        gateway["chatTemplate"] = str(Path(a.chat_template).expanduser().resolve())
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": a.name},
            "spec": {"backend": "local",
                     "model": {"source": a.model, "dtype": a.dtype,
                               "execution": a.execution, "quantize": a.quantize},
                     "stages": {"count": a.stages, "device": {"type": a.device}},
                     "draft": {"source": a.draft, "width": a.width, "topk": a.topk,
                               "recovery": a.recovery},
                     "transport": "zmq", "synchronizer": {"mode": "embedded"},
                     "gateway": gateway,
                     "limits": {"contextLength": a.context_length,
                                "concurrency": a.concurrency,
                                # half the context by default, so a prompt always fits
                                "maxNewTokens": a.max_new_tokens
                                or min(1024, a.context_length // 2)}}}


def cmd_serve(a: argparse.Namespace) -> int:
    """``treepipe serve MODEL``: up, print the endpoints, wait for Ctrl-C, down."""
    check_model(a.model)
    if a.chat_template:  # a bad file is one line now, not a gateway that will not start
        read_chat_template(a.chat_template)
    http_port, grpc_port = resolve_ports(a)
    data = serve_manifest(a, http_port, grpc_port)
    try:
        m = validate_manifest(data, "treepipe serve")
    except ManifestError as e:
        raise TreepipeError(in_flags(str(e))) from None
    check_plaintext_host(m, "treepipe serve", flag="--host", insecure_flag="--insecure")
    check_ports(a, http_port, grpc_port)
    use_api_key(a)
    folder = run_dir(a.name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        # prints the gRPC endpoint; returns once every worker is up
        up_local(str(path), detach=True, timeout=a.timeout)
    except TreepipeError as e:  # the plan's refusals, a busy port: in the flags' words
        raise type(e)(in_flags(str(e), path)) from None
    try:
        st = running_state(a.name)
        sync = state_sync(st, a.name)  # the pipeline's Redis needs its secret
        http = (sync.r.get(sync.key("gateway", "http")) or b"").decode()
        print(f"OpenAI API: http://{http}/v1   metrics: http://{http}/metrics", flush=True)
        print(f"gRPC: {st.endpoint}   logs: {folder}   Ctrl-C stops the pipeline",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            now = read_state(a.name)
            if not now or not supervisor_alive(now):
                raise TreepipeError(f"the pipeline stopped; see {folder}/supervisor.log")
    finally:
        down_local(file=str(path))
    return 0


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (a free one) to 65535."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 (a free one) to 65535, "
                                         f"got {v}")
    return v


def add_serve_parser(sub: Any) -> None:
    """Register ``treepipe serve``."""
    s = sub.add_parser("serve", help=COMMANDS["serve"])
    s.add_argument("model", help="smollm2-135m, a Hugging Face folder, or a .gguf file")
    s.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP and gRPC ports bind (default 127.0.0.1: this "
                        "machine only); another needs $TREEPIPE_TLS_CERT_FILE and "
                        "$TREEPIPE_TLS_KEY_FILE, or --insecure")
    s.add_argument("--port", type=port_number, default=None,
                   help=f"OpenAI API and /metrics port (default {DEFAULT_HTTP_PORT}; "
                        f"0 = a free one)")
    s.add_argument("--grpc-port", type=port_number, default=None,
                   help=f"gRPC port (default {DEFAULT_GATEWAY_PORT}; 0 = a free one)")
    s.add_argument("--http-port", type=port_number, default=None,
                   help="deprecated: the old name of --port (with it, --port means the gRPC "
                        "port, as it used to)")
    s.add_argument("--insecure", action="store_true",
                   help="serve plaintext beyond loopback with --host (TLS ends at a proxy)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: MODEL)")
    s.add_argument("--chat-template", default="", metavar="FILE",
                   help="Jinja chat template file used instead of the model's own (as in "
                        "vllm serve)")
    s.add_argument("--api-key-file", default="", metavar="FILE",
                   help="file holding the key clients must send as a bearer token (or set "
                        f"${API_KEY_FILE_ENV}, ${API_KEY_ENV} or ${VLLM_API_KEY_ENV})")
    s.add_argument("--stages", type=positive_int, default=2, help="pipeline stages")
    s.add_argument("--draft", default="ngram",
                   help="token source: ngram, hybrid, layers:N or a draft model")
    s.add_argument("--width", type=positive_int, default=16, help="tree width w")
    s.add_argument("--topk", type=positive_int, default=8, help="top-k per tree node")
    s.add_argument("--recovery", type=recovery_name, default="none",
                   metavar="none|draft:K|early-exit:J:K",
                   help="miss recovery: draft:K re-roots a miss on one of a node's top-K "
                        "draft proposals issued in the width's spare slots, early-exit:J:K "
                        "on one of stage J's early-exit top-K (docs/engine.md)")
    s.add_argument("--dtype", default=DEFAULT_DTYPE,
                   choices=(DEFAULT_DTYPE, "float32", "bfloat16", "float16", "float64"),
                   help="auto (default): bfloat16 on a GPU and on a CPU with bf16 units, "
                        "float32 on other CPUs")
    s.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_execution_flags(s)
    add_quantize_flag(s)
    s.add_argument("--max-model-len", "--context-length", dest="context_length",
                   type=positive_int, default=2048,
                   help="prompt + generated tokens per request (--context-length: the old name)")
    s.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="largest max_tokens a request may ask (default: half the context, "
                        "at most 1024)")
    s.add_argument("--concurrency", type=positive_int, default=4,
                   help="requests decoded together in one batch (more wait in the queue); "
                        "each stage holds the KV cache of this many whole contexts")
    s.add_argument("--name", default="serve", help="pipeline name (run folder, Redis keys)")
    s.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds to wait for the workers to come up")
    s.set_defaults(func=cmd_serve)
