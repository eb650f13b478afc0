"""The ``TreePipeline`` custom resource: one pydantic schema for YAML files, the CLI and the CRD.

Field names are camelCase in YAML (aliases) and snake_case in Python.  Every model
forbids unknown fields so that a typo fails loudly instead of being ignored.
:func:`load_manifest` turns any problem into a one-line :class:`ManifestError` that
names the field path and the fix.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from orchestrator.models.architectures import KNOWN_ARCHITECTURES, Architecture
from protocol.config.limits import DEFAULT_PREFILL_CHUNK_ROWS, MAX_CONCURRENCY
from protocol.config.pipeline import runtime_recovery
from protocol.errors import TreepipeError
from stages.model.execution_modes import resolve_dtype

API_GROUP = "treepipe.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "TreePipeline"
DEFAULT_IMAGE = "ghcr.io/treepipe/treepipe:0.1.0"
DEFAULT_HTTP_PORT = 8000  # vLLM's, so OpenAI clients and dashboards need no change
DEFAULT_GATEWAY_PORT = 50151
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Kubernetes resource quantity (a subset: plain and binary/decimal suffixes).
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
DRAFT_SOURCE = r"^\S+$"
# the bound of every count and size: far above any real model or machine, and below what
# overflows the planner's byte arithmetic (a 400-digit contextLength was an OverflowError)
MAX_COUNT = 2**31 - 1
MAX_RUNTIME_MIB = 2**20  # a TiB of runtime kernel cache per device
CIDR = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"  # a loose shape; ipaddress checks the rest

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


class ManifestError(TreepipeError, ValueError):
    """A manifest that cannot be used; the one-line message names the field and the fix."""

    def __init__(self, message: str, *, origin: str | None = None) -> None:
        """``origin``: the file (or object) ``message`` names already, if it names one."""
        super().__init__(message)
        # a caller names the origin only when the error has none, never twice
        self.origin = origin

    def message_with_origin(self, origin: str) -> str:
        """The message, prefixed with ``origin`` unless it names one already."""
        return str(self) if self.origin is not None else f"{origin}: {self}"


def parse_quantity(q: str) -> float:
    """A Kubernetes quantity such as ``24Gi`` or ``500m`` as a plain number."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", q)
    if not m or m.group(2) not in _SUFFIX:
        raise ManifestError(f"{q!r} is not a Kubernetes quantity; write e.g. 24Gi or 500m")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


class Strict(BaseModel):
    """Base of every manifest model: camelCase aliases, unknown fields refused, and no
    type coerced (``true`` is no count, ``"8"`` no integer): what the CRD refuses, so
    ``plan`` never accepts what ``kubectl apply`` would not."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              validate_default=True, strict=True)


# ---------------------------------------------------------------- metadata / model


class Metadata(Strict):
    """The subset of Kubernetes object metadata a manifest file may carry."""

    name: str = Field(pattern=DNS_LABEL, max_length=40,
                      description="Pipeline name (a DNS label); prefixes every rendered object.")
    namespace: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63,
                                  description="Namespace of the pipeline (kubernetes backend).")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations.")


class ArchitectureSpec(Strict):
    """Model shape for planning without weights: a known name, explicit fields, or both."""

    name: str | None = Field(default=None, description=(
        "Known architecture to start from: " + ", ".join(KNOWN_ARCHITECTURES) + "."))
    layers: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                               description="Transformer layers L.")
    hidden_size: int | None = Field(default=None, ge=1, le=MAX_COUNT, description="Hidden size d.")
    intermediate_size: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                          description="Feed-forward size f.")
    heads: int | None = Field(default=None, ge=1, le=MAX_COUNT, description="Attention heads.")
    kv_heads: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                 description="Key/value heads (GQA).")
    vocab_size: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                   description="Vocabulary size V.")
    head_dim: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                 description="Head dimension (default hiddenSize / heads).")
    tie_embeddings: bool | None = Field(default=None,
                                        description="LM head shares the embedding matrix.")

    @model_validator(mode="after")
    def _known_name(self) -> ArchitectureSpec:
        if self.name is not None and self.name not in KNOWN_ARCHITECTURES:
            raise ValueError(f"name: unknown architecture {self.name!r}; use one of "
                             f"{', '.join(KNOWN_ARCHITECTURES)} or give layers, hiddenSize, "
                             f"intermediateSize, heads, kvHeads and vocabSize")
        return self

    def resolve(self, base: Architecture | None = None) -> Architecture | None:
        """The full shape: ``name`` (or ``base``) with the explicit fields on top."""
        start = KNOWN_ARCHITECTURES[self.name] if self.name else base
        fields = {k: getattr(self, k) for k in ("layers", "hidden_size", "intermediate_size",
                                                 "heads", "kv_heads", "vocab_size", "head_dim",
                                                 "tie_embeddings")}
        if start is not None:
            return start.with_overrides(**fields)
        required = ("layers", "hidden_size", "intermediate_size", "heads", "vocab_size")
        if any(fields[k] is None for k in required):
            return None
        fields["kv_heads"] = fields["kv_heads"] or fields["heads"]
        fields["tie_embeddings"] = bool(fields["tie_embeddings"])
        return Architecture(**fields)


class ModelSpec(Strict):
    """The target model."""

    source: str = Field(default="smollm2-135m", min_length=1, description=(
        "Known model name (smollm2-135m), a Hugging Face safetensors folder, or a .gguf file. "
        "On Kubernetes a path is read inside the stage containers."))
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        default="auto", description=(
            "Weight and activation dtype; auto: bfloat16 when the stages run on cuda, and "
            "on cpu for a local pipeline on a machine with bf16 units (AVX-512 BF16, "
            "AMX); float32 on other cpus and on cpu nodes of Kubernetes, whose units "
            "are unknown (what measured fastest on each)."))
    execution: Literal["auto", "eager", "tuned", "compiled"] = Field(
        default="auto", description=(
            "How stages run: auto (compiled on a GPU, tuned on a CPU: what measured "
            "fastest on each), eager (plain PyTorch, for debugging), tuned (matmul and "
            "attention kernels measured fastest on the worker's CPU) or compiled (tuned, "
            "each layer a torch.compile graph and on a GPU each step a CUDA graph, "
            "compiled at start and cached)."))
    quantize: Literal["none", "int8"] = Field(default="none", description=(
        "The stages' weights: none (in dtype) or int8 (weight-only int8 with one scale "
        "per output row for every attention and MLP projection and the LM head; on a CPU "
        "the products run with bfloat16 activations). Every decoding method matches ar "
        "in the same mode."))
    architecture: ArchitectureSpec | None = Field(default=None, description=(
        "Model shape for planning when the weights are not on this machine."))
    volume_claim: str | None = Field(default=None, pattern=DNS_LABEL, description=(
        "PersistentVolumeClaim holding model folders, mounted read-only at mountPath "
        "(kubernetes); without it known models are fetched into a cache volume."))
    mount_path: str = Field(default="/models", pattern=r"^/", description=(
        "Where volumeClaim is mounted in every container."))


# ---------------------------------------------------------------- stages


class DeviceSpec(Strict):
    """The device one stage (or the draft) runs on."""

    type: Literal["cpu", "cuda"] = Field(default="cpu", description="cpu or cuda.")
    memory: str | None = Field(default=None, pattern=QUANTITY, description=(
        "Usable device memory, e.g. 24Gi; the planner refuses a stage that needs more."))
    product: str | None = Field(default=None, description=(
        "GPU product (node label nvidia.com/gpu.product), e.g. NVIDIA-GeForce-RTX-3090."))

    @property
    def memory_bytes(self) -> float | None:
        """``memory`` in bytes, or None when not given."""
        return parse_quantity(self.memory) if self.memory else None


class ResourcesSpec(Strict):
    """Container resources of one stage (or the draft)."""

    cpu: str | None = Field(default=None, pattern=QUANTITY, description="CPU request, e.g. 4.")
    memory: str | None = Field(default=None, pattern=QUANTITY,
                               description="Host memory request, e.g. 32Gi.")
    gpus: int | None = Field(default=None, ge=0, le=MAX_COUNT, description=(
        "nvidia.com/gpu count (default 1 on a cuda device, 0 on cpu)."))


class LayerRange(Strict):
    """A half-open layer range [start, end)."""

    start: int = Field(ge=0, le=MAX_COUNT, description="First layer (inclusive).")
    end: int = Field(ge=1, le=MAX_COUNT, description="Last layer (exclusive).")

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if self.end <= self.start:
            raise ValueError(f"end: {self.end} must be greater than start {self.start}; "
                             f"a range is [start, end)")
        return self


class StageOverride(Strict):
    """Device, resources or rack of one stage, replacing the stage defaults."""

    stage: int = Field(ge=0, le=MAX_COUNT, description="Stage index (0 = first stage).")
    device: DeviceSpec | None = Field(default=None, description="Device of this stage.")
    resources: ResourcesSpec | None = Field(default=None, description="Resources of this stage.")
    rack: str | None = Field(default=None, description="Pin this stage to a rack.")


class StagesSpec(Strict):
    """How the layers are split into pipeline stages."""

    count: int | None = Field(default=None, ge=1, le=MAX_COUNT, description=(
        "Number of stages m (default: the length of layers, else 3)."))
    layers: list[LayerRange] | None = Field(default=None, description=(
        "Explicit contiguous layer ranges, one per stage; omit to let split choose."))
    split: Literal["balanced", "even"] = Field(default="balanced", description=(
        "balanced: equalise per-step compute (the last stage's LM head counts); even: equal "
        "layer counts, earlier stages take the remainder."))
    device: DeviceSpec = Field(default_factory=DeviceSpec, description="Device of every stage.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec,
                                     description="Resources of every stage.")
    overrides: list[StageOverride] = Field(default_factory=list,
                                           description="Per-stage device/resources/rack.")

    @model_validator(mode="after")
    def _consistent(self) -> StagesSpec:
        if self.layers is not None:
            if not self.layers:  # layers[0] below, and a pipeline of no stages
                raise ValueError("layers: is empty; list one range per stage, or leave layers "
                                 "out to let split choose")
            if self.count is not None and self.count != len(self.layers):
                raise ValueError(f"count: is {self.count} but layers lists {len(self.layers)} "
                                 f"ranges; drop count or make them agree")
            if self.layers[0].start != 0:
                raise ValueError(f"layers[0].start: must be 0, not {self.layers[0].start}; the "
                                 f"first stage starts at layer 0")
            for i, (a, b) in enumerate(zip(self.layers, self.layers[1:], strict=False)):
                if b.start != a.end:
                    raise ValueError(f"layers[{i + 1}].start: is {b.start} but layers[{i}] ends "
                                     f"at {a.end}; make the ranges contiguous")
        seen: set[int] = set()
        for j, o in enumerate(self.overrides):
            if o.stage >= self.stage_count:
                raise ValueError(f"overrides[{j}].stage: names stage {o.stage} but there are "
                                 f"{self.stage_count} stages (0..{self.stage_count - 1})")
            if o.stage in seen:
                raise ValueError(f"overrides[{j}].stage: stage {o.stage} is overridden twice; "
                                 f"merge the overrides")
            seen.add(o.stage)
        if self.count is None:
            # always set after validation: the runtime and the CRD's scale subresource read it
            self.count = len(self.layers) if self.layers else 3
        return self

    @property
    def stage_count(self) -> int:
        """m (``count``, which validation fills from ``layers`` or the default 3)."""
        if self.count is not None:
            return self.count
        return len(self.layers) if self.layers else 3

    def override(self, i: int) -> StageOverride | None:
        """The override of stage ``i``, if any."""
        return next((o for o in self.overrides if o.stage == i), None)

    def device_of(self, i: int) -> DeviceSpec:
        """Device of stage ``i`` after overrides."""
        o = self.override(i)
        return o.device if o and o.device else self.device

    def resources_of(self, i: int) -> ResourcesSpec:
        """Resources of stage ``i`` after overrides."""
        o = self.override(i)
        return o.resources if o and o.resources else self.resources


# ---------------------------------------------------------------- placement


class LinkSpec(Strict):
    """A network link model."""

    latency_us: float = Field(default=100.0, ge=0, description="One-way latency (µs).")
    bandwidth_gbps: float = Field(default=10.0, gt=0, description="Bandwidth (Gbit/s).")


class LinksSpec(Strict):
    """Links within a rack and between racks."""

    within_rack: LinkSpec = Field(default_factory=lambda: LinkSpec(latency_us=20.0,
                                                                   bandwidth_gbps=64.0),
                                  description="Link between two stages in one rack (PCIe).")
    between_racks: LinkSpec = Field(default_factory=LinkSpec,
                                    description="Link between racks (Ethernet).")


class RackSpec(Strict):
    """A group of nodes with fast links between them."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="Rack name.")
    node_selector: dict[str, str] = Field(default_factory=dict,
                                          description="Node labels selecting this rack's nodes.")
    capacity: int = Field(ge=1, le=MAX_COUNT,
                          description="Devices (stage or draft slots) in this rack.")


class PlacementSpec(Strict):
    """Where stages run."""

    strategy: Literal["pack", "spread"] = Field(default="pack", description=(
        "pack: fill racks in order so the pipeline crosses as few rack boundaries as possible; "
        "spread: round-robin stages over racks."))
    racks: list[RackSpec] = Field(default_factory=list,
                                  description="Racks; empty means one anonymous rack.")
    links: LinksSpec = Field(default_factory=LinksSpec, description="Link model.")

    @model_validator(mode="after")
    def _unique(self) -> PlacementSpec:
        names = [r.name for r in self.racks]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"racks: {sorted(dup)[0]!r} is listed twice; make rack names "
                             f"unique")
        return self


# ---------------------------------------------------------------- draft / services


class DraftSpec(Strict):
    """The draft service: the token source that grows the speculative tree."""

    source: str = Field(default="ngram", pattern=DRAFT_SOURCE, description=(
        "ngram, hybrid, layers:N (first N target layers), a draft model name/path, or "
        "replay:P / replay:P-Q (benchmarks only)."))
    model: str = Field(default="layers:4", min_length=1,
                       description="Draft model used by source hybrid.")
    width: int = Field(default=16, ge=1, le=MAX_COUNT,
                       description="Tree width w (nodes per level).")
    adaptive: bool = Field(default=False, description=(
        "Choose each request's width every step, up to width, from the stages' measured "
        "forward time and each request's hit rate (narrower as the batch grows); the "
        "stages measure their forward time at start."))
    topk: int = Field(default=8, ge=1, le=MAX_COUNT, description="Draft top-k per node.")
    recovery: str = Field(default="none", max_length=4096, description=(
        "Miss recovery: none (a miss flushes the tree), draft:K (each node's top-K draft "
        "proposals that its level left out follow as correction children in the width's "
        "spare slots; a miss one of them holds re-roots the tree there) or early-exit:J:K "
        "(the same from stage J's early exit, which sends each node's top-K to the draft "
        "service; J below the stage count), optionally +vocab=FILE[:N] (the exit over a "
        "`treepipe draft vocab` file's N most frequent tokens) and +adapter=PATH|auto (a "
        "trained exit adapter, a path in stage J's container)."))
    device: DeviceSpec = Field(default_factory=DeviceSpec, description="Device of the draft.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec,
                                     description="Resources of the draft.")
    rack: str | None = Field(default=None,
                             description="Rack of the draft (default: the rack of stage 0).")
    architecture: ArchitectureSpec | None = Field(default=None, description=(
        "Shape of a separate draft model, for its memory estimate."))

    @field_validator("recovery")
    @classmethod
    def _recovery(cls, v: str) -> str:
        return runtime_recovery(v)  # one rule: the pipeline config's

    @field_validator("source", "model")
    @classmethod
    def _layers_n(cls, v: str) -> str:
        # N of at most 9 digits: the planner's int() of thousands of digits was a ValueError
        if v.startswith("layers:") and not re.fullmatch(r"layers:[1-9][0-9]{0,8}", v):
            shown = repr(v) if len(v) <= 40 else repr(v[:40]) + "..."
            raise ValueError(f"{shown} is not layers:N; write layers:N with N >= 1 target "
                             f"layers (fewer than the target has)")
        if v.startswith("replay:"):
            # here, not at the top: the replay module imports torch, which reading a
            # manifest otherwise does not need
            from stages.speculation.replay import parse_replay
            parse_replay(v)  # a malformed replay:P[-Q][:H] raises, naming the fix
        return v


class SecretRef(Strict):
    """A key in a Kubernetes Secret."""

    name: str = Field(pattern=DNS_LABEL, description="Secret name.")
    key: str = Field(default="password", min_length=1, description="Key in the Secret.")


class SynchronizerSpec(Strict):
    """The Redis synchroniser."""

    mode: Literal["embedded", "external"] = Field(default="embedded", description=(
        "embedded: treepipe starts its own Redis; external: use url."))
    url: str | None = Field(default=None, pattern=r"^rediss?://", description=(
        "redis:// or rediss:// URL of an external Redis (mode external)."))
    password_secret: SecretRef | None = Field(default=None,
                                              description="Secret holding the Redis password.")

    @model_validator(mode="after")
    def _url_iff_external(self) -> SynchronizerSpec:
        if self.mode == "external" and not self.url:
            raise ValueError("url: mode external needs url (redis://HOST:6379); set url or use "
                             "mode embedded")
        if self.mode == "embedded" and (self.url or self.password_secret):
            raise ValueError("mode: url/passwordSecret are only used with mode external; set "
                             "mode: external or remove them")
        return self


class GatewayPeer(Strict):
    """One source allowed to reach the gateway's ports (a NetworkPolicy peer)."""

    # the pattern is for the API server (CRD); here _network says what is wrong
    cidr: str | None = Field(default=None, json_schema_extra={"pattern": CIDR}, description=(
        "Source addresses (NetworkPolicy ipBlock), e.g. 10.0.0.0/8."))
    namespace: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63, description=(
        "Pods in this namespace (matched by its kubernetes.io/metadata.name label)."))
    pod_labels: dict[str, str] = Field(default_factory=dict, description=(
        "Pods with these labels, in namespace if given, else in the pipeline's namespace."))

    @field_validator("cidr")
    @classmethod
    def _network(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ipaddress.ip_network(v, strict=False)
            except ValueError:
                raise ValueError(f"{v!r} is not a CIDR; write e.g. 10.0.0.0/8 or "
                                 f"2001:db8::/32") from None
            if "/" not in v:
                raise ValueError(f"{v!r} has no prefix length; write e.g. {v}/32")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> GatewayPeer:
        if self.cidr and (self.namespace or self.pod_labels):
            raise ValueError("an entry is either a cidr or pods (namespace/podLabels); "
                             "split it into two entries")
        if not (self.cidr or self.namespace or self.pod_labels):
            raise ValueError("an entry needs cidr, namespace or podLabels; remove the "
                             "empty entry")
        return self


class GatewaySpec(Strict):
    """The gateway clients talk to: gRPC, and the OpenAI-compatible HTTP API with /metrics."""

    replicas: int = Field(default=1, ge=1, le=MAX_COUNT,
                          description="Gateway replicas (kubernetes).")
    port: int = Field(default=DEFAULT_GATEWAY_PORT, ge=0, le=65535,
                      description="gRPC port; 0 (local backend only) picks a free port.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description=(
            "Kubernetes Service type of the gateway. ClusterIP keeps it inside the cluster; "
            "NodePort/LoadBalancer publish it beyond: give it tlsSecret and apiKeySecret "
            "(gRPC and HTTP then both use TLS, docs/security.md) and choose them "
            "consciously."))
    allow_from: list[GatewayPeer] = Field(default_factory=list, description=(
        "Who may reach the gRPC and HTTP (/metrics) ports, as NetworkPolicy peers (kubernetes); "
        "empty: from anywhere. Stage links and Redis only ever accept the pipeline's own "
        "pods."))
    http_port: int | None = Field(
        default=None, ge=0, le=65535,
        description=f"OpenAI-compatible HTTP API and Prometheus /metrics port; 0 (local "
                    f"backend only) picks a free port. Default: {DEFAULT_HTTP_PORT} on "
                    f"kubernetes, a free port locally (so pipelines on one machine never clash).")
    host: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]+$", max_length=253,
                             description=(
        "Address the gateway's gRPC and HTTP ports bind (backend local; default 127.0.0.1, "
        "this machine only). Any other address needs TLS ($TREEPIPE_TLS_CERT_FILE and "
        "$TREEPIPE_TLS_KEY_FILE where treepipe up runs) or insecure: true; on kubernetes "
        "the pods bind every interface and the Service and NetworkPolicy decide who "
        "reaches them."))
    insecure: bool = Field(default=False, description=(
        "Serve plaintext gRPC and HTTP on a non-loopback host (backend local), e.g. when TLS "
        "ends at a proxy in front; set an API key ($TREEPIPE_API_KEY_FILE) too."))
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256,
                                          pattern=r"^\S+$", description=(
        "The model name clients send and /v1/models lists (default: model.source)."))
    chat_template: str | None = Field(default=None, min_length=1, max_length=4096,
                                      description=(
        "A Jinja chat template file that replaces the model's own for chat requests "
        "(backend local; treepipe serve --chat-template)."))
    service_monitor: bool = Field(default=False, description="Render a Prometheus Operator "
                                  "ServiceMonitor scraping /metrics (kubernetes).")
    tls_secret: str | None = Field(default=None, pattern=DNS_LABEL, description=(
        "kubernetes.io/tls Secret (tls.crt, tls.key) the gateway serves gRPC over TLS and the "
        "HTTP API over HTTPS with (kubernetes); probes then use a plaintext health-only "
        "port, and a ServiceMonitor verifies HTTPS against its ca.crt. Without it both are "
        "plaintext (the gateway runs with --insecure)."))
    api_key_secret: SecretRef | None = Field(default=None, description=(
        "Secret key holding the API key gRPC and HTTP clients must send as a bearer token "
        "(kubernetes; locally: $TREEPIPE_API_KEY or $TREEPIPE_API_KEY_FILE where treepipe "
        "up runs). Without it the API needs no key."))


class LimitsSpec(Strict):
    """Request limits; they also size the KV cache."""

    context_length: int = Field(default=2048, ge=16, le=MAX_COUNT,
                                description="Max tokens per request.")
    max_new_tokens: int = Field(default=256, ge=1, le=MAX_COUNT,
                                description="Max generated tokens.")
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY, description=(
        "Requests decoded at once in one batch (SpecPipe-DB: one barrier per step carries "
        "them all); more wait in the gateway's queue."))
    prefill_chunk: int = Field(default=DEFAULT_PREFILL_CHUNK_ROWS, ge=1, le=MAX_COUNT, description=(
        "Prompt tokens entering stage 1 per step, over all joining requests: a prompt "
        "enters in chunks of at most this size, pipelined through the stages (one stage a "
        "step, a one-chunk prompt too) beside the decoding requests' steps, which then wait "
        "for one stage's chunk a step, not a whole prompt's pass; a request joins once stage 1 "
        "has rows left beside the others' chunks, its first chunk taking them."))

    @model_validator(mode="after")
    def _fits(self) -> LimitsSpec:
        if self.max_new_tokens >= self.context_length:
            raise ValueError(f"maxNewTokens: {self.max_new_tokens} leaves no room for a prompt "
                             f"in contextLength {self.context_length}; lower maxNewTokens")
        return self


class MemorySpec(Strict):
    """Knobs of the planner's memory model (SpecPipe §4.5)."""

    kv_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT, description=(
        "KV-cache budget of each stage in tokens, shared by the running requests: each "
        "stage's pool (and the draft model's, for a draft-model or hybrid source) holds this "
        "many rows (in whole 16-row blocks) and the gateway admits a "
        "request only while its worst case (prompt + maxNewTokens + in-flight tree rows) fits "
        "beside those of the running ones; the others wait in its queue. Default: "
        "concurrency requests of a whole contextLength at their worst case."))
    # bounded and finite: the planner counts it in whole bytes (inf was an OverflowError)
    runtime_mib: float = Field(default=256.0, ge=0, le=MAX_RUNTIME_MIB, allow_inf_nan=False,
                               description="Runtime kernel cache per device (MiB).")
    param_count: Literal["exact", "paper"] = Field(default="exact", description=(
        "exact: count GQA projections and norms; paper: N_layer = 4d² + 3df as in §4.5."))


class TreePipelineSpec(Strict):
    """The desired state of a pipeline."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="Target model.")
    stages: StagesSpec = Field(default_factory=StagesSpec, description="Pipeline stages.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Placement.")
    draft: DraftSpec = Field(default_factory=DraftSpec, description="Draft service.")
    transport: Literal["zmq", "grpc"] = Field(default="zmq",
                                              description="Stage-to-stage transport.")
    synchronizer: SynchronizerSpec = Field(default_factory=SynchronizerSpec,
                                           description="Redis synchroniser.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="gRPC gateway.")
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description="Request limits.")
    memory: MemorySpec = Field(default_factory=MemorySpec, description="Planner memory model.")
    backend: Literal["local", "kubernetes"] = Field(default="local", description=(
        "local: processes on this machine (treepipe up); kubernetes: the operator."))
    image: str = Field(default=DEFAULT_IMAGE, min_length=1,
                       description="Container image of every treepipe component (kubernetes).")

    @model_validator(mode="after")
    def _cross_fields(self) -> TreePipelineSpec:
        if self.model.dtype == "auto":  # the plan, the config and the workers see one dtype
            # local stages run on this machine, whose CPU is known; Kubernetes nodes' not
            self.model.dtype = resolve_dtype("auto", self.stages.device.type,
                                             here=self.backend == "local")
        racks = {r.name for r in self.placement.racks}
        named = [(f"stages.overrides[{i}].rack", o.rack)
                 for i, o in enumerate(self.stages.overrides) if o.rack]
        if self.draft.rack:
            named.append(("draft.rack", self.draft.rack))
        for where, rack in named:
            if rack not in racks:
                known = ", ".join(sorted(racks)) or "none declared"
                raise ValueError(f"{where}: unknown rack {rack!r} (racks: {known}); add "
                                 f"it to placement.racks or fix the name")
        g = self.gateway
        if self.backend == "local" and (g.tls_secret or g.api_key_secret):
            raise ValueError("gateway.tlsSecret/apiKeySecret are Kubernetes Secrets (backend "
                             "kubernetes); locally set $TREEPIPE_TLS_CERT_FILE, "
                             "$TREEPIPE_TLS_KEY_FILE and $TREEPIPE_API_KEY_FILE where treepipe "
                             "up runs")
        if self.backend == "kubernetes" and self.gateway.http_port == 0:
            raise ValueError("gateway.httpPort: 0 (pick a free port) only works with backend "
                             f"local; set a fixed port such as {DEFAULT_HTTP_PORT}")
        if self.backend == "kubernetes" and (g.host is not None or g.insecure):
            raise ValueError("gateway.host/insecure: only for backend local; in a cluster "
                             "the pods bind every interface and tlsSecret decides TLS; "
                             "remove them")
        if self.backend == "kubernetes" and g.chat_template is not None:
            raise ValueError("gateway.chatTemplate: a file on this machine, only for backend "
                             "local; in a cluster put the template in the model folder's "
                             "tokenizer_config.json (chat_template) and remove it")
        if self.backend == "kubernetes" and self.gateway.port == 0:
            raise ValueError("gateway.port: 0 (pick a free port) only works with backend local; "
                             f"set a fixed port such as {DEFAULT_GATEWAY_PORT}")
        return self


class Condition(Strict):
    """A status condition (Kubernetes convention)."""

    type: str = Field(description="Planned, Ready or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    observed_generation: int | None = Field(default=None, description="Generation seen.")
    last_transition_time: str | None = Field(default=None, description="RFC 3339 time.")


class TreePipelineStatus(Strict):
    """What the operator last observed."""

    observed_generation: int | None = Field(default=None, description="Generation reconciled.")
    stages: int | None = Field(default=None, description="Planned stage count.")
    ready_stages: int | None = Field(default=None, description="Stages whose pods are ready.")
    endpoint: str | None = Field(default=None, description="Gateway address host:port.")
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")


class TreePipeline(Strict):
    """A ``TreePipeline`` object: a whole pipeline, from model to gateway."""

    api_version: Literal["treepipe.io/v1alpha1"] = Field(
        default=API_VERSION, description="treepipe.io/v1alpha1.")
    kind: Literal["TreePipeline"] = Field(default=KIND, description="TreePipeline.")
    metadata: Metadata = Field(description="Name (and namespace) of the pipeline.")
    spec: TreePipelineSpec = Field(default_factory=TreePipelineSpec, description="Desired state.")
    status: TreePipelineStatus | None = Field(default=None, description="Observed state.")

    def to_yaml_dict(self) -> dict[str, Any]:
        """The object as camelCase plain data (defaults filled in, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def with_stage_count(data: dict[str, Any], stages: int) -> dict[str, Any]:
    """A copy of manifest ``data`` scaled to ``stages`` stages.

    Pinned ``stages.layers`` are dropped, so the planner re-splits the layers: what
    ``treepipe scale`` does on either backend.
    """
    out = copy.deepcopy(data)
    st = out.setdefault("spec", {}).setdefault("stages", {})
    st["count"] = stages
    st.pop("layers", None)
    return out


# ---------------------------------------------------------------- error messages


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic validator frames, not field names
        elif not str(part).isprintable():  # an unknown key with a newline: still one line
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (for listing its known fields)."""
    cls: Any = TreePipeline
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = next((f for n, f in cls.model_fields.items()
                      if (f.alias or n) == part or n == part), None)
        if field is None:
            return None
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        # list[X] and X | None both reduce to X
        while inner and getattr(inner[0], "__origin__", None) is not None:
            inner = list(inner[0].__args__)
        nxt = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


# what a strict field takes, by pydantic's error type (a YAML value of another type)
_TYPE_NOUNS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
               "model_type": "a mapping of fields"}


def _shown(got: Any) -> str:
    """``got`` for a one-line message: its repr, cut at about 40 characters."""
    text = repr(got)
    return text if len(text) <= 40 else text[:40] + "..."


def _describe(err: dict[str, Any]) -> str:
    """One line for pydantic's first error: the field's path, what is wrong, the fix."""
    loc = tuple(err["loc"])
    path = _path(loc)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = err.get("input")
    if kind in _TYPE_NOUNS:
        fix = ""
        if isinstance(got, str) and kind == "bool_type":
            fix = "; write true or false, without quotes"
        elif isinstance(got, str) and kind in ("int_type", "float_type"):
            fix = "; write it without quotes"
        elif kind == "string_type" and isinstance(got, int | float):
            fix = "; quote it"
        return f"{path} must be {_TYPE_NOUNS[kind]}, got {_shown(got)}{fix}"
    if kind in ("string_too_long", "string_too_short") and isinstance(got, str):
        if not got:
            return f"{path} is empty; give a value"
        most = "most" if kind == "string_too_long" else "least"
        limit = ctx.get("max_length" if most == "most" else "min_length")
        return f"{path} has {len(got)} characters; use at {most} {limit}"
    if kind in ("too_long", "too_short"):
        most = "most" if kind == "too_long" else "least"
        limit = ctx.get("max_length" if most == "most" else "min_length")
        return f"{path} has {ctx.get('actual_length')} items; give at {most} {limit}"
    if kind == "extra_forbidden":
        cls = _model_at(loc)
        known = sorted(f.alias or n for n, f in cls.model_fields.items()) if cls else []
        near = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        listing = f" (known fields: {', '.join(known)})" if known else ""
        return f"{path}: unknown field; {hint}remove or rename it{listing}"
    if kind == "missing":
        return f"{path}: required field is missing; add it"
    if kind == "literal_error":
        return f"{path}: {got!r} is not allowed; use one of {ctx.get('expected')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
              "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"{path}: must be {op} {bound}, got {_shown(got)}; set a value {op} {bound}"
    if kind == "finite_number":
        return f"{path}: must be a finite number, got {got!r}; set a number"
    if kind == "string_pattern_mismatch":
        return f"{path}: {got!r} does not match {ctx.get('pattern')}; fix its format"
    if kind == "value_error":
        msg = str(ctx.get("error", err["msg"]))
        # validators start their message with the field path relative to their model
        m = re.match(r"^([A-Za-z][\w.\[\]]*): (.*)$", msg)
        if m:
            return f"{path}.{m.group(1)}: {m.group(2)}"
        return f"{path}: {msg}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"{path}: {err['msg'].lower()}, got {_shown(got)}; fix the value's type"
    return f"{path}: {err['msg'].lower()}, got {_shown(got)}; fix the value"


def validate_manifest(data: Any, origin: str = "manifest") -> TreePipeline:
    """Validate plain data (parsed YAML) into a :class:`TreePipeline` or raise ManifestError.

    A pure schema check: nothing is read from disk.  What needs the model's shape (stage
    count, memory fit, racks) is :func:`orchestrator.deploy.planner.plan_manifest`'s job.
    """
    if not isinstance(data, dict):
        raise ManifestError(f"{origin}: expected a TreePipeline mapping (apiVersion, kind, "
                            f"metadata, spec), got {type(data).__name__}", origin=origin)
    if data.get("apiVersion") not in (None, API_VERSION):
        raise ManifestError(f"{origin}: apiVersion: {data.get('apiVersion')!r} is not "
                            f"supported; use {API_VERSION}", origin=origin)
    if data.get("kind") not in (None, KIND):
        raise ManifestError(f"{origin}: kind: {data.get('kind')!r} is not a treepipe object; "
                            f"use kind: {KIND}", origin=origin)
    try:
        m = TreePipeline.model_validate(data)
    except ValidationError as e:
        raise ManifestError(f"{origin}: {_describe(e.errors()[0])}", origin=origin) from None
    return m


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a mapping naming one key twice.

    PyYAML keeps the last of duplicate keys silently, so a manifest that sets
    ``width`` twice would run with whichever came last.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping of ``node``; a key seen before raises, naming both lines."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first}); keep one",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer; one past Python's 4300 digits for int() is a YAML error at its line,
        not a ValueError out of the loader."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} digits; no field takes one "
                            "that long", node.start_mark) from None


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
# YAML 1.2's floats that YAML 1.1 (PyYAML) reads as text: an exponent without a dot or
# without a sign (1e3, 1.5e300).  kubectl reads them as numbers, and the schema takes no
# text for a number, so they are numbers here too.
UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml_documents(text: str) -> list[Any]:
    """The non-empty documents of ``text``, read with :class:`UniqueKeyLoader`."""
    return [d for d in yaml.load_all(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
            if d is not None]


def read_manifest_text(p: Path) -> str:
    """The text of manifest file ``p``; ManifestError (one line) if unreadable or not UTF-8."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ManifestError(f"cannot read manifest {p}: {e.strerror or e}; check the path "
                            f"(-f FILE)", origin=str(p)) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ManifestError(f"{p}: line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                            f"offset {e.start}); save the manifest as UTF-8",
                            origin=str(p)) from None


def load_manifest(path: str | Path) -> TreePipeline:
    """Read and schema-check a ``TreePipeline`` YAML file; raise ManifestError in one line."""
    p = Path(path)
    text = read_manifest_text(p)
    try:
        docs = load_yaml_documents(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{p}: line {mark.line + 1}" if mark else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if problem.startswith(("duplicate key", "an integer of")):  # UniqueKeyLoader's
            raise ManifestError(f"{at}: {problem}", origin=str(p)) from None
        raise ManifestError(f"{at}: not valid YAML ({problem}); fix the syntax",
                            origin=str(p)) from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise ManifestError(f"{p}: nested too deeply to be a manifest; fix the file",
                            origin=str(p)) from None
    if len(docs) != 1:
        raise ManifestError(f"{p}: expected exactly one YAML document, found {len(docs)}; put "
                            f"one TreePipeline per file", origin=str(p))
    return validate_manifest(docs[0], str(p))
