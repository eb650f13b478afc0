"""Entry points of the pipeline's model processes: ``treepipe stage`` and ``treepipe draft serve``.

Each loads what it runs (one layer shard, or the token source), binds its
inbox, connects to the next hop, and serves the synchroniser's control list
until SIGTERM (orchestrator/serving/participant_process.py).  The launcher starts
them; on a cluster each runs in its pod.  The gateway, which runs no model, has its
own entry point (:mod:`orchestrator.cli.gateway_commands`).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    INT32_MAX,
    add_execution_flags,
    add_kv_tokens,
    add_pipeline_args,
    add_quantize_flag,
    listen_address,
    peer_address,
    port,
    positive_int,
    positive_seconds,
    resolve_exit,
    shown,
)
from orchestrator.cli.pipeline_config import default_of, resolve_pipeline
from orchestrator.models.loading import (
    EngineSpec,
    check_device,
    make_source,
    prepare_shards,
    quantize_shards,
    source_shards,
    torch_dtype,
)
from orchestrator.models.registry import resolve_model
from orchestrator.serving.participant_process import serve_participant
from orchestrator.serving.process_log import log_to_stderr
from protocol.config.pipeline import PipelineConfig
from protocol.config.recovery import Recovery, parse_recovery
from protocol.errors import TreepipeError
from protocol.links.keys import TRANSPORTS, resolve
from protocol.links.transport import open_inbox, open_outbox
from protocol.scheduling.kv_blocks import pool_blocks
from protocol.sync.synchroniser import Synchroniser, participant_names
from stages.model.checkpoint import load_head, load_model_args, load_shard
from stages.model.early_exit import exit_head
from stages.model.tokenizer import TextTokenizer
from stages.runtime.draft_service import DraftService
from stages.runtime.worker import ExitChannel, StageWorker
from stages.speculation.engine import check_tree_shape


def _layers(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not START:END (e.g. 0:10)") from None
    if not 0 <= a < b <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"layer range {shown(text)} is empty or too large; "
                                         f"need 0 <= START < END <= {INT32_MAX}")
    return a, b


def _common(p: argparse.ArgumentParser) -> None:
    add_pipeline_args(p)
    p.add_argument("--name", required=True, help="this worker's name in the step barrier")
    # the pipeline's settings default to None: unset, so --config can refuse a flag that
    # disagrees with it; the config holds the defaults (PipelineConfig)
    p.add_argument("--dtype", default=None,
                   help=f"float32, float64, bfloat16 or float16 (default {default_of('dtype')})")
    p.add_argument("--device", default="cpu")
    add_execution_flags(p, default=None)
    add_quantize_flag(p, default=None)
    p.add_argument("--transport", default=None, choices=TRANSPORTS,
                   help=f"default {default_of('transport')}")
    p.add_argument("--insecure-links", action="store_true",
                   help="without $TREEPIPE_LINK_KEYS, run the stage links in plaintext and "
                        "unauthenticated (a demo: anyone who reaches a port can change "
                        "requests); by default a worker without keys refuses to start")
    p.add_argument("--next", dest="next_addr", type=peer_address, default=None,
                   help="HOST:PORT of the next stage's inbox (none for the last stage)")
    p.add_argument("--recovery", default=None, metavar="none|draft:K|early-exit:J:K",
                   help="miss recovery: correction children from the draft's top-K per node, "
                        "or from stage J's early exit, in the width's spare slots "
                        f"(docs/engine.md; default {default_of('recovery')})")
    # below the gateway's 120 s stall limit, so a lost message heals before a client gives up
    p.add_argument("--input-timeout", type=positive_seconds, default=60.0,
                   help="seconds to wait for a step's input before restarting the request "
                        "from its token log under a new epoch")
    p.add_argument("--plan", default=None,
                   help="id of the stage layout this worker belongs to (from treepipe up or "
                        "the operator); workers of a new plan take the pipeline over")
    p.add_argument("--stages", type=positive_int, default=None,
                   help="stage count of --plan: the barrier is draft + stage0..N-1")
    p.add_argument("--health-port", type=port,
                   default=int(os.environ.get("TREEPIPE_HEALTH_PORT", "0")),
                   help="serve grpc.health.v1 on this port (for Kubernetes probes; "
                        "default $TREEPIPE_HEALTH_PORT, 0 = off)")


def add_process_parsers(sub: Any, draft_sub: Any) -> None:
    """Register ``treepipe stage`` and ``treepipe draft serve``."""
    s = sub.add_parser("stage", help=COMMANDS["stage"])
    _common(s)
    s.add_argument("--layers", type=_layers, required=True, help="layer range START:END")
    s.add_argument("--listen", type=listen_address, required=True,
                   help="HOST:PORT to bind this stage's inbox")
    s.add_argument("--exit-to", type=peer_address, default=None, metavar="HOST:PORT",
                   help="the draft service's --listen: this is stage J of --recovery "
                        "early-exit:J:K, which sends every node's early-exit candidates there")
    s.add_argument("--profile-rows", type=positive_int, default=None, metavar="N",
                   help="measure the forward time up to N rows at start and publish it for "
                        "the draft service's adaptive width (treepipe up passes it when the "
                        "manifest sets draft.adaptive)")
    s.add_argument("--profile-requests", type=positive_int, default=1, metavar="B",
                   help="with --profile-rows, also pack the rows over 2, 4 ... B requests "
                        "(treepipe up passes limits.concurrency; default 1)")
    add_kv_tokens(s, "allocated at start, and the gateway admits requests within it "
                     "(default: a pool that grows with the requests)")
    s.set_defaults(func=cmd_stage)
    d = draft_sub.add_parser("serve", help="run the draft service (started by treepipe up)")
    _common(d)
    d.add_argument("--source", default=None,
                   help="token source: ngram, hybrid, layers:N, a draft model, or none (pp) "
                        f"(default {default_of('source')})")
    d.add_argument("--draft-model", default=None,
                   help=f"draft model of --source hybrid (default {default_of('draft_model')})")
    d.add_argument("--draft-vocab", default="", metavar="FILE[:K]",
                   help="reduced draft vocabulary from `treepipe draft vocab` (default: full)")
    d.add_argument("--width", type=positive_int, default=None,
                   help=f"default {default_of('width')}")
    d.add_argument("--topk", type=positive_int, default=None,
                   help=f"default {default_of('topk')}")
    d.add_argument("--adaptive", action="store_true", default=None,
                   help="choose each request's width every step, up to --width, from the "
                        "stages' published forward time and each request's hit rate "
                        "(default: every level --width wide)")
    d.add_argument("--listen", type=listen_address, default=None, metavar="HOST:PORT",
                   help="bind the inbox of early-exit recovery's token channel (the exit "
                        "stage's --exit-to); needed with --recovery early-exit:J:K only")
    add_kv_tokens(d, "the draft model's pool (layers:N, hybrid or a draft model source), "
                     "allocated at start like a stage's (default: a pool that grows with "
                     "the requests)")
    d.set_defaults(func=cmd_draft_serve)


def _barrier_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The layout id, barrier and input timeout keyword arguments of a participant."""
    if bool(a.plan) != bool(a.stages):
        raise TreepipeError("pass --plan and --stages together (or neither, when something else "
                            "registers the participants)")
    names = participant_names(a.stages) if a.stages else []
    if names and a.name not in names:
        raise TreepipeError(f"--name {a.name} is not in the barrier of --stages {a.stages} "
                            f"({', '.join(names)})")
    # --plan carries the layout id; the participant's keyword keeps its historic name
    return {"layout_id": a.plan, "participants": names, "input_timeout_s": a.input_timeout}


def check_link_keys(a: argparse.Namespace) -> None:
    """The link keys a worker needs (``$TREEPIPE_LINK_KEYS``, or ``--insecure-links``),
    checked before any weights are read; one line naming the fix otherwise."""
    keys = resolve(None, a.insecure_links)
    if keys is not None:
        if a.transport == "zmq":
            keys.curve()
        else:
            keys.tls()


def check_stage_args(a: argparse.Namespace) -> dict[str, Any]:
    """What ``treepipe stage`` checks before reading the model; the participant's kwargs.

    First of all its pipeline config (``--config FILE`` or the flags), which sets the
    pipeline's fields of ``a``.
    """
    cfg = resolve_pipeline(a)
    check_layout(a, cfg)
    check_exit_stage(a)
    check_link_keys(a)
    check_device(a.device)
    torch_dtype(a.dtype)  # refuses an unknown --dtype before anything is read
    return _barrier_kwargs(a)


def check_layout(a: argparse.Namespace, cfg: PipelineConfig) -> None:
    """A stage's ``--name`` and ``--layers`` against its config's layout, where the config
    has one (a planned pipeline's): a stage of another plan would serve wrong layers."""
    if cfg.layers is None:
        return
    start, end = a.layers
    names = participant_names(len(cfg.layers))
    i = names.index(a.name) - 1 if a.name in names[1:] else None  # names[0]: the draft
    if i is not None and cfg.layers[i] != (start, end):
        raise TreepipeError(f"--layers {start}:{end} of {a.name} disagrees with --config "
                            f"{a.config} (layers {cfg.layers[i][0]}:{cfg.layers[i][1]}); pass the "
                            "file's range, or the config of this stage's plan")


def check_exit_stage(a: argparse.Namespace) -> None:
    """``--exit-to`` on exactly the exit stage of ``--recovery early-exit:J:K`` (stage J is
    named stage{J-1}); one line naming the fix otherwise."""
    j = parse_recovery(a.recovery).exit_stage
    if a.exit_to and not j:
        raise TreepipeError(f"--exit-to is for the exit stage of --recovery early-exit:J:K; "
                            f"the recovery is {a.recovery}: drop --exit-to")
    if j and (a.name == f"stage{j - 1}") != bool(a.exit_to):
        raise TreepipeError(f"--recovery {a.recovery}: stage{j - 1} (stage {j}) takes "
                            f"--exit-to HOST:PORT (the draft service's --listen), and only it")
    if a.exit_to:  # its vocabulary file and adapter, read before any weights
        a.exit_recovery = resolve_exit_flag(a.recovery)


def resolve_exit_flag(text: str) -> Recovery:
    """The exit stage's ``--recovery``, its vocabulary file and adapter read (one line
    naming the fix for a file that is not one)."""
    try:
        return resolve_exit(parse_recovery(text))
    except ValueError as e:
        raise TreepipeError(str(e)) from None


def check_stage_layers(a: argparse.Namespace, n_layers: int) -> None:
    """``--layers`` and ``--next`` against the model's layer count (before loading weights)."""
    start, end = a.layers
    if end > n_layers:
        raise TreepipeError(f"--layers {start}:{end} exceeds the model's {n_layers} layers")
    if (end == n_layers) == bool(a.next_addr):
        raise TreepipeError("pass --next for every stage but the last one (and not for the last)")


def check_draft_args(a: argparse.Namespace) -> dict[str, Any]:
    """What ``treepipe draft serve`` checks before loading weights (its pipeline config
    first, as a stage's); the participant's kwargs."""
    resolve_pipeline(a)
    check_link_keys(a)
    check_device(a.device)
    torch_dtype(a.dtype)
    kwargs = _barrier_kwargs(a)
    check_tree_shape(a.width, a.topk)
    if not a.next_addr:
        raise TreepipeError("the draft service needs --next HOST:PORT (stage 1's inbox)")
    if bool(parse_recovery(a.recovery).exit_stage) != bool(a.listen):
        raise TreepipeError(f"--recovery {a.recovery}: the draft service takes --listen "
                            "HOST:PORT (the exit stage's --exit-to) with early-exit:J:K, "
                            "and only then")
    return kwargs






def cmd_stage(a: argparse.Namespace) -> int:
    """``treepipe stage``: serve one layer shard."""

    log_to_stderr(a.name)
    barrier_kw = check_stage_args(a)
    folder = resolve_model(a.model)
    args = load_model_args(folder)
    check_stage_layers(a, args.n_layers)
    shard = quantize_shards([load_shard(folder, *a.layers, torch_dtype(a.dtype), a.device)],
                            a.quantize)[0]
    compiled = prepare_shards([shard], a.execution, progress=False)
    if compiled:  # a worker's log is its progress: what compiling (or the cache) cost
        logging.getLogger("treepipe.stage").info(
            "compiled layers %d-%d: %s", a.layers[0], a.layers[1] - 1, _seconds(compiled))
    sync = Synchroniser(a.redis, a.pipeline)
    inbox = open_inbox(a.transport, a.listen, insecure=a.insecure_links)
    outbox = (open_outbox(a.transport, a.next_addr, insecure=a.insecure_links)
              if a.next_addr else None)
    # the last stage's grammars (response_format) read the model's vocabulary
    tok = TextTokenizer.from_folder(folder) if shard.is_last and \
        (folder / "tokenizer.json").is_file() else None
    exits = None
    if a.exit_to:  # the token channel: this stage's early exit needs the norm and head
        rec = a.exit_recovery
        head = exit_head(load_head(folder, torch_dtype(a.dtype), a.device), a.layers[1], rec)
        exits = ExitChannel(open_outbox(a.transport, a.exit_to, insecure=a.insecure_links),
                            head, rec.k)
    worker = StageWorker(a.name, sync, shard, inbox, outbox, kv_blocks=fixed_pool(a),
                         tokenizer=tok, exits=exits, **barrier_kw)
    try:
        worker.profile(a.profile_rows, a.profile_requests)
        return serve_participant(worker, a.health_port)
    finally:
        inbox.close()
        for box in (outbox, exits.outbox if exits else None):
            if box:
                box.close()


def fixed_pool(a: argparse.Namespace) -> int | None:
    """The KV pool's blocks from ``--kv-tokens``, fixed at start (None: it grows)."""
    return pool_blocks(a.kv_tokens) if a.kv_tokens else None


def _seconds(compiled: dict[str, float]) -> str:
    """Compile seconds per warm step shape, for a worker's log."""
    return ", ".join(f"{shape} {s:.1f} s" for shape, s in compiled.items())


def cmd_draft_serve(a: argparse.Namespace) -> int:
    """``treepipe draft serve``: serve the token source that owns the tree."""

    log_to_stderr(a.name)
    barrier_kw = check_draft_args(a)
    folder = resolve_model(a.model)
    spec = EngineSpec(model=a.model, draft=a.source, draft_model=a.draft_model, width=a.width,
                      topk=a.topk, dtype=a.dtype, device=a.device, draft_vocab=a.draft_vocab,
                      execution=a.execution, quantize=a.quantize)
    source = make_source(spec, folder, torch_dtype(a.dtype))
    compiled = prepare_shards(source_shards(source), a.execution, progress=False)
    if compiled:  # as a stage logs it
        logging.getLogger("treepipe.draft").info("compiled the draft model: %s",
                                                 _seconds(compiled))
    sync = Synchroniser(a.redis, a.pipeline)
    outbox = open_outbox(a.transport, a.next_addr, insecure=a.insecure_links)
    # a request's response_format masks its proposals: the grammar reads the vocabulary
    tok = TextTokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    exits = open_inbox(a.transport, a.listen, insecure=a.insecure_links) if a.listen else None
    service = DraftService(a.name, sync, source, outbox, a.width, a.topk,
                           adaptive=a.adaptive, recovery=parse_recovery(a.recovery),
                           kv_blocks=fixed_pool(a), tokenizer=tok,
                           vocab=load_model_args(folder).vocab_size, exits=exits,
                           **barrier_kw)
    try:
        return serve_participant(service, a.health_port)
    finally:
        outbox.close()
        if exits:
            exits.close()
