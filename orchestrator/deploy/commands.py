"""The command lines of a pipeline's workers, built from a computed plan for both backends.

``treepipe up`` (orchestrator/deploy/launcher.py) and the Kubernetes renderer
(orchestrator/deploy/render.py) both call :func:`worker_commands`, so the flags the
workers get cannot drift apart between the backends; only the addresses differ
(:class:`Endpoints`: 127.0.0.1 ports locally, Service DNS names in a cluster).
What the processes must agree on is no flag: :func:`config_of` builds the pipeline's one
:class:`~protocol.config.pipeline.PipelineConfig`, which each process reads from the
file its ``--config`` names (the run folder locally, the plan ConfigMap in a pod).
The workers parse these lines with orchestrator/cli/worker_commands.py (the gateway with
orchestrator/cli/gateway_commands.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.deploy.manifest import DEFAULT_HTTP_PORT, TreePipeline
from orchestrator.deploy.planner import Plan
from orchestrator.serving.auth import is_loopback
from protocol.config.pipeline import DraftConfig, LimitsConfig, PipelineConfig
from protocol.config.recovery import parse_recovery
from protocol.errors import TreepipeError


@dataclass(frozen=True)
class Endpoints:
    """Where one backend's workers listen and how they reach each other and Redis."""

    redis: str  # --redis of every worker: a URL, or "$(TREEPIPE_REDIS_URL)" in a pod
    stage_listen: list[str]  # HOST:PORT stage i binds its inbox on
    stage_address: list[str]  # HOST:PORT the hop before stage i sends to
    # the host the gateway binds, as written before ":PORT" (an IPv6 one in brackets),
    # and its gRPC port: kept apart, so the HTTP listener's host is never parsed back
    gateway_host: str
    gateway_port: int
    # (cert, key) files the gateway serves gRPC over TLS with; None: plaintext
    gateway_tls: tuple[str, str] | None = None
    gateway_health_listen: str = ""  # plaintext health-only HOST:PORT (probes speak no TLS)
    # plaintext beyond loopback without TLS: in a pod the manifest's choice (no tlsSecret);
    # locally only with gateway.insecure, else the gateway refuses it (check_plaintext)
    plaintext_beyond_loopback: bool = True
    # the HTTP port when gateway.httpPort is unset: a pod's Service expects vLLM's 8000;
    # a local gateway picks a free one (0), so pipelines on one machine never clash
    default_http_port: int = DEFAULT_HTTP_PORT
    # the pipeline config file (config_of) every process's --config names
    config_file: str = ""
    # early-exit recovery's token channel: where the draft service binds its inbox, and
    # the address the exit stage sends to ("": no such channel)
    draft_listen: str = ""
    draft_address: str = ""

    @property
    def gateway_listen(self) -> str:
        """HOST:PORT the gateway serves gRPC on."""
        return f"{self.gateway_host}:{self.gateway_port}"


def local_endpoints(redis_url: str, stage_ports: list[int], gateway_port: int,
                    gateway_host: str = "127.0.0.1", insecure: bool = False,
                    config_file: str = "", draft_port: int = 0) -> Endpoints:
    """Endpoints of processes on this machine: everything on 127.0.0.1 but the gateway,
    which binds ``gateway_host`` (gateway.host); ``draft_port``: the draft service's
    token-channel inbox (early-exit recovery)."""
    stages = [f"127.0.0.1:{port}" for port in stage_ports]
    host = f"[{gateway_host}]" if ":" in gateway_host else gateway_host  # IPv6
    draft = f"127.0.0.1:{draft_port}" if draft_port else ""
    return Endpoints(redis_url, stages, stages, host, gateway_port,
                     plaintext_beyond_loopback=insecure, default_http_port=0,
                     config_file=config_file, draft_listen=draft, draft_address=draft)


def config_of(m: TreePipeline, p: Plan) -> PipelineConfig:
    """The pipeline's one config, from its manifest and plan (computed once, here)."""
    s, d, lim = m.spec, m.spec.draft, m.spec.limits
    try:  # the plan fixes the stage count an exit stage must be below
        parse_recovery(d.recovery).check_stages(len(p.stages), "spec.draft.recovery")
    except ValueError as e:
        raise TreepipeError(f"{e}; lower J or plan more stages") from None
    # the layout id makes re-planned workers take the pipeline over and resume the running
    # request themselves (protocol/sync/lua/join.lua): nothing else needs to call Redis
    return PipelineConfig(
        pipeline=m.metadata.name, model=s.model.source, dtype=s.model.dtype,
        execution=s.model.execution, quantize=s.model.quantize, transport=s.transport,
        plan=p.layout_id,
        stages=len(p.stages), layers=tuple(tuple(st.layers) for st in p.stages),
        draft=DraftConfig(source=d.source, model=d.model, width=d.width, topk=d.topk,
                          adaptive=d.adaptive, recovery=d.recovery),
        # the stages' pools: the gateway submits a request once its worst case fits
        limits=LimitsConfig(kv_tokens=p.kv_tokens or None, concurrency=lim.concurrency,
                            prefill_chunk=lim.prefill_chunk,
                            max_new_tokens=lim.max_new_tokens,
                            context_length=lim.context_length))


def _common(at: Endpoints) -> list[str]:
    """Flags every process takes: the pipeline's config, and where its Redis is."""
    return ["--config", at.config_file, "--redis", at.redis]


def stage_command(m: TreePipeline, p: Plan, at: Endpoints, i: int) -> list[str]:
    """Arguments of ``treepipe stage`` for stage ``i`` (the last one gets no --next)."""
    st = p.stages[i]
    nxt = ["--next", at.stage_address[i + 1]] if i + 1 < len(p.stages) else []
    d = m.spec.draft
    # the adaptive width prices levels by the front stages' forward time: they measure it
    # up to the most rows they can hold (a level of the cap per request, and its root),
    # packed over up to as many requests as run at once
    front = i + 1 < len(p.stages) or len(p.stages) == 1
    b = m.spec.limits.concurrency
    prof = (["--profile-rows", str((d.width + 1) * b), "--profile-requests", str(b)]
            if d.adaptive and d.source != "none" and front else [])
    exit_to = ["--exit-to", at.draft_address] if exit_stage(m) == i + 1 else []
    return ["stage", "--name", f"stage{i}", *_common(at), "--device", st.device.type,
            "--layers", f"{st.layers[0]}:{st.layers[1]}", "--listen", at.stage_listen[i],
            *nxt, *prof, *exit_to]


def exit_stage(m: TreePipeline) -> int:
    """Stage J (1-based) of ``draft.recovery: early-exit:J:K``, whose early exit feeds the
    draft service over the token channel; 0 without one."""
    return parse_recovery(m.spec.draft.recovery).exit_stage


def draft_command(m: TreePipeline, p: Plan, at: Endpoints) -> list[str]:
    """Arguments of ``treepipe draft serve``: it feeds stage 0."""
    listen = ["--listen", at.draft_listen] if exit_stage(m) else []
    return ["draft", "serve", "--name", "draft", *_common(at),
            "--device", p.draft.device.type, "--next", at.stage_address[0], *listen]


def gateway_command(m: TreePipeline, p: Plan, at: Endpoints) -> list[str]:
    """Arguments of ``treepipe gateway`` (the request limits are in its config)."""
    http_port = m.spec.gateway.http_port
    if http_port is None:
        # by where it runs, not the manifest's backend: a local manifest rendered for a
        # cluster must listen where its Service and NetworkPolicy say
        http_port = at.default_http_port
    return ["gateway", *_common(at), "--listen", at.gateway_listen,
            # a gateway policy, not the pipeline's: by hand it defaults lower
            "--default-new-tokens", str(m.spec.limits.max_new_tokens),
            *(["--served-model-name", m.spec.gateway.served_model_name]
              if m.spec.gateway.served_model_name else []),
            *(["--chat-template", m.spec.gateway.chat_template]
              if m.spec.gateway.chat_template else []),
            # same host as gRPC; port 0 (local) lets the gateway pick one and publish it
            "--http-listen", f"{at.gateway_host}:{http_port}",
            *_gateway_security(at)]


def _gateway_security(at: Endpoints) -> list[str]:
    """TLS flags, or ``--insecure`` where plaintext gRPC listens beyond loopback.

    In a pod that is the manifest's choice (no ``gateway.tlsSecret``), written out in the
    rendered arguments; the key comes from the environment, never from here.
    """
    out: list[str] = []
    if at.gateway_tls:
        out += ["--tls-cert-file", at.gateway_tls[0], "--tls-key-file", at.gateway_tls[1]]
    elif not is_loopback(at.gateway_listen) and at.plaintext_beyond_loopback:
        out.append("--insecure")
    if at.gateway_health_listen:
        out += ["--health-listen", at.gateway_health_listen]
    return out


def worker_commands(m: TreePipeline, p: Plan, at: Endpoints) -> dict[str, list[str]]:
    """Arguments (after the ``treepipe`` program) of every worker: stage0.., draft, gateway."""
    cmds = {f"stage{i}": stage_command(m, p, at, i) for i in range(len(p.stages))}
    cmds["draft"] = draft_command(m, p, at)
    cmds["gateway"] = gateway_command(m, p, at)
    return cmds
