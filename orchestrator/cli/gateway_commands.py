"""Entry point of the gateway process (``treepipe gateway``) and ``treepipe link-keys``.

The gateway runs no model: it reads the model's shape and tokenizer, serves Inference
over gRPC (and the OpenAI API over HTTP) and hands requests to the pipeline through the
synchroniser.  It imports no torch, so it starts in a fraction of a stage's time.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    add_kv_tokens,
    add_pipeline_args,
    listen_address,
    positive_int,
)
from orchestrator.cli.pipeline_config import default_of, resolve_pipeline
from orchestrator.models.registry import resolve_model
from orchestrator.serving.auth import (
    API_KEY_FILE_ENV,
    TLS_CERT_FILE_ENV,
    TLS_KEY_FILE_ENV,
    check_plaintext,
    http_ssl_context,
    is_loopback,
    read_api_key,
    server_credentials,
)
from orchestrator.serving.gateway import (
    Gateway,
    GatewayLimits,
    InferenceService,
    supervisor_gone,
    watch_supervisor,
)
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.openai_api import OpenAIServer
from orchestrator.serving.process_log import log_to_stderr
from protocol.config.limits import DEFAULT_PREFILL_CHUNK_ROWS, MAX_CONCURRENCY
from protocol.errors import TreepipeError
from protocol.links.keys import LINK_KEYS_ENV, TRANSPORTS, write_link_keys
from protocol.sync.synchroniser import Synchroniser
from stages.model.config import load_model_args
from stages.model.tokenizer import TextTokenizer, read_chat_template
from stages.runtime.heap import settle_heap

log = logging.getLogger("treepipe.gateway")


def add_gateway_parsers(sub: Any) -> None:
    """Register ``treepipe link-keys`` and ``treepipe gateway``."""
    k = sub.add_parser("link-keys", help=COMMANDS["link-keys"])
    k.add_argument("folder", help="directory to create (mode 0700, files 0600; missing "
                                  "parents too), or an empty one")
    k.add_argument("--force", action="store_true",
                   help="replace the keys of a folder that already holds link keys "
                        "(running pipelines keep the old keys until restarted)")
    k.add_argument("--transport", choices=TRANSPORTS, action="append",
                   help="keys for this transport only (repeatable; default: both)")
    k.set_defaults(func=cmd_link_keys)
    g = sub.add_parser("gateway", help=COMMANDS["gateway"])
    add_pipeline_args(g)
    g.add_argument("--listen", type=listen_address, default="127.0.0.1:50151",
                   help="HOST:PORT to serve gRPC on")
    # the pipeline's settings default to None (unset): from --config, else the config's
    # defaults (PipelineConfig), which the help names
    g.add_argument("--concurrency", type=positive_int, default=None,
                   help="requests decoded at once, in one batch (SpecPipe-DB; default "
                        f"{default_of('concurrency')})")
    g.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests allowed to wait for a slot")
    g.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help=f"prompt tokens entering stage 1 per step (default "
                        f"{DEFAULT_PREFILL_CHUNK_ROWS}) over all joining requests "
                        "(prompts are pipelined through the stages in chunks, one stage a "
                        "step, beside the requests already decoding; a request joins once stage 1 "
                        "has rows left, its first chunk taking them)")
    add_kv_tokens(g, "a request is submitted only while its worst case fits beside the "
                     "running ones' and waits in the queue until then (default: no budget)")
    g.add_argument("--draft-width", type=positive_int, default=None, metavar="W",
                   help="the draft's level width (its cap when adaptive): the tree rows a "
                        "request's worst case holds on a stage, with --kv-tokens (default "
                        f"{default_of('draft_width')})")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="largest max_tokens a request may ask for (default "
                        f"{default_of('max_new_tokens')})")
    g.add_argument("--default-new-tokens", type=positive_int, default=256,
                   help="max_tokens of a gRPC or chat request that sends none (a text "
                        "completion's is 16, OpenAI's), at most the context left after its "
                        "prompt")
    g.add_argument("--context-length", type=positive_int, default=None,
                   help="prompt + new tokens limit (default: the model's)")
    g.add_argument("--http-listen", type=listen_or_off, default="",
                   help="HOST:PORT to serve the OpenAI-compatible HTTP API and /metrics on "
                        "(port 0 = a free one; empty = no HTTP)")
    g.add_argument("--api-key-file", default=os.environ.get(API_KEY_FILE_ENV, ""),
                   help="file holding the bearer token gRPC and HTTP clients must send "
                        "(default $TREEPIPE_API_KEY_FILE; or set $TREEPIPE_API_KEY; none = "
                        "no auth)")
    g.add_argument("--tls-cert-file", default=os.environ.get(TLS_CERT_FILE_ENV, ""),
                   help="PEM certificate (chain) to serve gRPC over TLS with (default "
                        "$TREEPIPE_TLS_CERT_FILE); needs --tls-key-file")
    g.add_argument("--tls-key-file", default=os.environ.get(TLS_KEY_FILE_ENV, ""),
                   help="PEM private key of --tls-cert-file (default $TREEPIPE_TLS_KEY_FILE)")
    g.add_argument("--insecure", action="store_true",
                   help="allow plaintext gRPC and HTTP on an address other than loopback (e.g. TLS "
                        "ends at a proxy or service mesh in front of the gateway)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models and the metrics' "
                        "model_name show (default: --model)")
    g.add_argument("--chat-template", default="", metavar="FILE",
                   help="Jinja chat template file used instead of the model's own")
    g.add_argument("--health-listen", type=listen_or_off, default="",
                   help="HOST:PORT to also serve grpc.health.v1 alone on, in plaintext (for "
                        "kubelet probes, which speak no TLS); empty = none")
    g.set_defaults(func=cmd_gateway)


def listen_or_off(text: str) -> str:
    """argparse type: a HOST:PORT to bind (port 0: any), or "" for none."""
    return listen_address(text) if text else ""


def check_gateway_args(a: argparse.Namespace) -> str | None:
    """What ``treepipe gateway`` checks before loading the model (its pipeline config
    first: ``--config FILE`` or the flags, which sets the pipeline's fields of ``a``);
    returns the API key."""
    if a.concurrency is not None and a.concurrency > MAX_CONCURRENCY:
        raise TreepipeError(f"--concurrency {a.concurrency} is above {MAX_CONCURRENCY} "
                            "requests in one batch; lower it (more requests wait in the queue)")
    resolve_pipeline(a)
    if bool(a.tls_cert_file) != bool(a.tls_key_file):
        raise TreepipeError("pass --tls-cert-file and --tls-key-file together (or neither, "
                            "for plaintext gRPC)")
    check_plaintext(a.listen, bool(a.tls_cert_file), a.insecure)
    if a.http_listen:  # the HTTP API takes the same TLS pair and the same --insecure
        check_plaintext(a.http_listen, bool(a.tls_cert_file), a.insecure, "HTTP")
    # the key never comes from the command line, where every local user can read it
    key = read_api_key(a.api_key_file)
    if a.insecure and not a.tls_cert_file and not key and not is_loopback(a.listen):
        log.warning("gRPC on %s is plaintext and needs no API key: anyone who reaches the "
                    "port can read, change and cancel requests", a.listen)
    return key


def cmd_link_keys(a: argparse.Namespace) -> int:
    """``treepipe link-keys DIR``: fresh stage-link keys for a pipeline run by hand."""
    folder = write_link_keys(a.folder, tuple(a.transport or TRANSPORTS), replace=a.force)
    print(f"export {LINK_KEYS_ENV}={folder.resolve()}")
    return 0


def cmd_gateway(a: argparse.Namespace) -> int:
    """``treepipe gateway``: serve Inference over gRPC for one pipeline."""

    log_to_stderr("gateway")
    api_key = check_gateway_args(a)
    template = read_chat_template(a.chat_template) if a.chat_template else None
    creds = server_credentials(a.tls_cert_file, a.tls_key_file) if a.tls_cert_file else None
    folder = resolve_model(a.model)
    args = load_model_args(folder)
    tok = TextTokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    if template is not None:
        if tok is None:
            raise TreepipeError(f"--chat-template {a.chat_template}: the model has no "
                                f"tokenizer.json to render chat with; add one, or leave "
                                f"--chat-template out")
        tok.use_chat_template(template)
    eos = tok.eos_token_ids if tok else list(args.eos_token_ids)
    limits = GatewayLimits(context_length=min(a.context_length or args.max_seq_len,
                                              args.max_seq_len),
                           max_new_tokens=a.max_new_tokens,
                           default_new_tokens=min(a.default_new_tokens, a.max_new_tokens),
                           concurrency=a.concurrency, max_queue=a.max_queue,
                           prefill_chunk=a.prefill_chunk, kv_tokens=a.kv_tokens or 0,
                           tree_width=a.draft_width)
    sync = Synchroniser(a.redis, a.pipeline)
    served = a.served_model_name or a.model  # what clients call it; --model is where it is
    cfg = resolve_pipeline(a)
    metrics = Metrics(served, sync, limits.concurrency, limits.context_length,
                      limits.kv_tokens, cfg.dtype, cfg.execution, cfg.quantize)
    service = InferenceService(sync, served, tok, args.vocab_size, eos, limits, metrics)
    http = None
    if a.http_listen:
        host, _, port = a.http_listen.rpartition(":")
        ssl_ctx = http_ssl_context(a.tls_cert_file, a.tls_key_file) if creds else None
        # an IPv6 host comes bracketed ([::1]:8000), as sockets do not take it
        http = OpenAIServer(service.runner, metrics, api_key).start(host.strip("[]"),
                                                                    int(port), ssl_ctx)
    gw = Gateway(service, a.listen, api_key=api_key, credentials=creds,
                 health_listen=a.health_listen).start()
    print(f"gateway listening on port {gw.port} ({'TLS' if creds else 'plaintext'}"
          f"{', API key' if api_key else ''})", file=sys.stderr, flush=True)
    if http is not None:
        # where `treepipe serve` and tests find a free port the gateway picked itself
        sync.r.set(sync.key("gateway", "http"), f"{host or '0.0.0.0'}:{http.port}")
        print(f"{'HTTPS' if creds else 'HTTP'} (OpenAI API, /metrics) listening on port "
              f"{http.port}", file=sys.stderr, flush=True)
    settle_heap()  # started: request-time collections need not walk the imports
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    # the supervisor's death reaches us as SIGTERM (PR_SET_PDEATHSIG); the watch is the
    # backstop where that signal does not come
    watch_supervisor(done.set)
    done.wait()
    reason = "its supervisor died" if supervisor_gone() else "it was told to stop"
    log.warning("shutting down: %s; ending open streams", reason)
    exit_within(SHUTDOWN_S)
    service.closing.close(reason)  # gRPC streams end while HTTP shuts down, not after
    if http is not None:
        http.stop(reason, timeout_s=SHUTDOWN_S / 2)
    gw.stop(grace_s=1.0, reason=reason)
    return 0


SHUTDOWN_S = 5.0  # from the stop signal to the process's exit, at most


def exit_within(seconds: float) -> None:
    """Exit the process after ``seconds`` whatever still runs: a handler thread blocked in
    a Redis call (a socket timeout of its own) cannot be interrupted, and the interpreter
    joins such threads at exit, which is how a gateway outlived its supervisor by a
    minute.  By then every open stream has been ended (``Gateway.stop``)."""
    def hard_exit() -> None:
        log.warning("still running %.0f s after the stop signal; exiting", seconds)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.start()
