"""Planning a pipeline: layer split, per-stage memory (SpecPipe §4.5) and rack placement.

:func:`plan` turns a validated :class:`~orchestrator.deploy.manifest.TreePipeline` into a
:class:`Plan`: for every stage its half-open layer range, parameter count, memory
estimate, rack and link to the next stage, plus the draft service's slot.  A plan
that cannot fit (a stage larger than its device, more devices than the racks hold)
raises :class:`~orchestrator.deploy.manifest.ManifestError` naming the stage and the shortfall.

:func:`plan_manifest` / :func:`load_planned` are the one place a manifest is validated
and planned: every caller (launcher, render, CLI, cluster, reconcile) gets a
:class:`Planned` and passes its plan on instead of planning again.

torch is imported only inside the function that reads a model's config.json, so that
planning a manifest (and the CLI's start-up) does not load it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from orchestrator.deploy.manifest import (
    DeviceSpec,
    LinkSpec,
    ManifestError,
    ResourcesSpec,
    TreePipeline,
    TreePipelineSpec,
    load_manifest,
    validate_manifest,
)
from orchestrator.deploy.placement import Slot, place
from orchestrator.models.architectures import KNOWN_ARCHITECTURES, Architecture
from orchestrator.models.registry import KNOWN_MODELS, converted_dir, model_dir
from protocol.scheduling.kv_blocks import (
    DEFAULT_BLOCK_SIZE,
    budget_tokens,
    longest_request,
    pool_blocks,
    request_blocks,
)
from stages.model.config import ModelError, load_model_args
from stages.model.planning import even_bounds

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
LOGIT_BYTES = 4  # the last stage and the draft keep float32 logits for sampling
GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------- architecture


def _config_architecture(source: str, field: str = "spec.model.source"
                         ) -> Architecture | None:
    """The shape from a model's config.json when the model is on this machine (no fetch);
    ``field`` names ``source`` in errors."""
    path = Path(source).expanduser()
    try:
        if source in KNOWN_MODELS:
            folder = model_dir(source)
        elif path.is_dir():
            folder = path
        elif path.is_file() and path.suffix.lower() == ".gguf":
            folder = converted_dir(path.resolve())  # only if converted before: never convert
        else:
            return None  # a path inside a container image: nothing to read here
    except OSError as e:  # a name too long, a folder we may not read: not "absent"
        shown = repr(source) if len(source) <= 60 else repr(source[:60]) + "..."
        raise ManifestError(f"{field}: cannot look at {shown} ({e.strerror}); give a known "
                            f"model name, a model folder or a .gguf file") from None
    if not (folder / "config.json").is_file():
        return None
    try:
        args = load_model_args(folder)
    except ModelError as e:
        raise ManifestError(f"{field}: {e}") from None
    return Architecture(args.n_layers, args.dim, args.intermediate_size, args.n_heads,
                        args.n_kv_heads, args.vocab_size, args.head_dim, args.tie_embeddings)


def resolve_architecture(spec: TreePipelineSpec, required: bool = True) -> Architecture | None:
    """The target's shape: its cached config, else a known name, with spec overrides on top."""
    base = _config_architecture(spec.model.source) or KNOWN_ARCHITECTURES.get(spec.model.source)
    given = spec.model.architecture
    arch = given.resolve(base) if given else base
    if arch is None and required:
        raise ManifestError(f"spec.model.architecture: the shape of {spec.model.source!r} is "
                            f"unknown here (weights not on this machine); add architecture: "
                            f"{{name: ...}} (one of {', '.join(KNOWN_ARCHITECTURES)}) or "
                            f"layers, hiddenSize, intermediateSize, heads, kvHeads, vocabSize")
    return arch


# ---------------------------------------------------------------- parameter counts


def layer_params(a: Architecture, counting: str = "exact") -> int:
    """Parameters of one transformer layer.

    ``paper`` is SpecPipe §4.5's N_layer = 4d² + 3df, which counts K and V as full
    d×d projections; ``exact`` counts GQA's smaller K/V projections and the two norms.
    """
    d, f = a.hidden_size, a.intermediate_size
    if counting == "paper":
        return 4 * d * d + 3 * d * f
    q = a.heads * a.dim_head
    kv = a.kv_heads * a.dim_head
    return d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d


def stage_params(a: Architecture, start: int, end: int, first: bool, last: bool,
                 counting: str = "exact") -> int:
    """Parameters held by a stage owning layers [start, end) (plus embedding / norm + head)."""
    n = (end - start) * layer_params(a, counting)
    if first:
        n += a.vocab_size * a.hidden_size
    if last:
        # a tied head still needs its own copy unless the embedding is on the same device
        shared = first and a.tie_embeddings
        n += a.hidden_size + (0 if shared else a.vocab_size * a.hidden_size)
    return n


def weight_bytes(a: Architecture, spec: TreePipelineSpec, start: int, end: int, first: bool,
                 last: bool, device: DeviceSpec) -> int:
    """Bytes of a stage's weights on ``device``. A CPU in float32 or bfloat16 holds its
    matmul weights (layers and head) twice: the stage multiplies with a copy packed for
    oneDNN (stages.model.model.packed_weight; a CPU without AVX-512 keeps bf16 weights
    unpacked, and the count is then high).  With int8 weights (``model.quantize``)
    the matmul weights take a byte each and have no packed copy."""
    n = stage_params(a, start, end, first, last, spec.memory.param_count)
    # the matmul weights: the layers' and the head's (the norms among them are a rounding)
    mm = stage_params(a, start, end, False, last, spec.memory.param_count) - (
        a.hidden_size if last else 0)
    if spec.model.quantize == "int8":  # a byte each (stages.model.quantization), unpacked
        return (n - mm) * DTYPE_BYTES[spec.model.dtype] + mm
    if device.type == "cpu" and spec.model.dtype in ("float32", "bfloat16"):
        n += mm
    return n * DTYPE_BYTES[spec.model.dtype]


# ---------------------------------------------------------------- split


def balanced_bounds(a: Architecture, stages: int, counting: str = "exact") -> list[tuple[int, int]]:
    """Contiguous layer ranges that minimise the slowest stage's per-step compute.

    Per-step compute is proportional to the matmul parameters a stage applies: its layers,
    plus the LM head on the last stage.  The embedding is a table lookup (no compute), so
    the first stage gets no discount, but it is the last to receive a remainder layer.
    """
    if stages > a.layers:
        raise ManifestError(f"spec.stages.count: {stages} stages for a model with {a.layers} "
                            f"layers; use at most {a.layers} stages")
    if stages == 1:
        return [(0, a.layers)]
    c = layer_params(a, counting)
    head = a.vocab_size * a.hidden_size
    best: tuple[float, float, int] | None = None
    for n_last in range(1, a.layers - stages + 2):
        rest = a.layers - n_last
        big = -(-rest // (stages - 1))
        costs = [big * c] * (rest % (stages - 1) or stages - 1) + [n_last * c + head]
        key = (max(costs), sum(x * x for x in costs), -n_last)
        if best is None or key < best:
            best = key
    n_last = -best[2]  # type: ignore[index]
    base, extra = divmod(a.layers - n_last, stages - 1)
    # the remainder goes to the middle stages first: stage 0 already holds the embedding
    sizes = [base] * (stages - 1)
    for i in [*range(1, stages - 1), 0][:extra]:
        sizes[i] += 1
    bounds, start = [], 0
    for n in [*sizes, n_last]:
        bounds.append((start, start + n))
        start += n
    return bounds


def stage_bounds(spec: TreePipelineSpec, a: Architecture) -> list[tuple[int, int]]:
    """Layer ranges per stage: explicit ``layers``, else the chosen split."""
    st = spec.stages
    if st.layers:
        return [(r.start, r.end) for r in st.layers]
    if st.split == "even":
        if st.stage_count > a.layers:
            raise ManifestError(f"spec.stages.count: {st.stage_count} stages for a model with "
                                f"{a.layers} layers; use at most {a.layers} stages")
        return even_bounds(a.layers, st.stage_count)
    return balanced_bounds(a, st.stage_count, spec.memory.param_count)


# ---------------------------------------------------------------- memory (§4.5)


@dataclass(frozen=True)
class Memory:
    """Estimated device memory of one component, in bytes."""

    weights: int
    kv: int
    tree: int
    runtime: int
    activations: int = 0  # one layer's transient tensors of a step (freed layer by layer)

    @property
    def total(self) -> int:
        """Sum of all parts."""
        return self.weights + self.kv + self.tree + self.runtime + self.activations


def kv_tokens(spec: TreePipelineSpec) -> int:
    """KV budget of each stage in tokens: memory.kvTokens, else ``concurrency`` requests
    of a whole context at their worst case (the in-flight tree rows and block rounding
    too), the rows the gateway reserves per request (``request_blocks``)."""
    if spec.memory.kv_tokens is not None:
        return spec.memory.kv_tokens
    lim = spec.limits
    return budget_tokens(lim.concurrency, lim.context_length, spec.stages.stage_count,
                         spec.draft.width)


def stage_memory(a: Architecture, spec: TreePipelineSpec, start: int, end: int,
                 first: bool, last: bool, device: DeviceSpec | None = None) -> Memory:
    """§4.5 memory of one stage on ``device`` (default the stages' device): weights + KV
    budget + tree buffers + runtime cache."""
    b = DTYPE_BYTES[spec.model.dtype]
    w = spec.draft.width
    weights = weight_bytes(a, spec, start, end, first, last, device or spec.stages.device)
    kv = kv_tokens(spec) * (end - start) * 2 * a.kv_heads * a.dim_head * b
    per_request = spec.limits.context_length + spec.stages.stage_count * w
    # one level in and one out, the tree mask (w rows over the request's KV), logits at the end
    tree = spec.limits.concurrency * (2 * w * a.hidden_size * b + w * per_request
                                      + (w * a.vocab_size * LOGIT_BYTES if last else 0))
    return Memory(weights, kv, tree, int(spec.memory.runtime_mib * MIB),
                  activation_bytes(a, spec, device or spec.stages.device))


def activation_bytes(a: Architecture, spec: TreePipelineSpec, device: DeviceSpec) -> int:
    """One layer's transient tensors in a step (stages/model/model.py): every request's
    level (w rows) beside a prefill chunk through the projections and the feed-forward,
    each request's keys and values gathered from the paged pool, and on a CPU the
    float32 attention scores of every head (SDPA's math path with a tree mask holds
    them; CUDA's memory-efficient kernel does not)."""
    lim, w, b = spec.limits, spec.draft.width, DTYPE_BYTES[spec.model.dtype]
    rows = lim.concurrency * w + lim.prefill_chunk
    keys = lim.context_length + spec.stages.stage_count * w
    out = rows * (3 * a.intermediate_size + 4 * a.hidden_size) * b
    out += lim.concurrency * keys * 2 * a.kv_heads * a.dim_head * b
    if device.type == "cpu":
        out += rows * a.heads * keys * LOGIT_BYTES
    return out


def kv_block_bytes(a: Architecture, start: int, end: int, dtype: str,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one paged KV block on a stage holding layers [start, end): K and V rows."""
    return block_size * (end - start) * 2 * a.kv_heads * a.dim_head * DTYPE_BYTES[dtype]


def requests_fit(a: Architecture, spec: TreePipelineSpec, start: int, end: int, first: bool,
                 last: bool, tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: DeviceSpec | None = None) -> int | None:
    """How many concurrent requests of ``tokens`` (prompt + new) tokens fit on one stage
    on ``device`` (default the stages' device).

    Same block arithmetic as the engine's admission (``request_blocks``): the device
    memory left after weights and the runtime, over each request's worst-case KV
    blocks plus its tree buffers.  None when the stage device's memory is not given.
    """
    device = device or spec.stages.device
    cap = device.memory_bytes
    if cap is None:
        return None
    b, w, m = DTYPE_BYTES[spec.model.dtype], spec.draft.width, spec.stages.stage_count
    weights = weight_bytes(a, spec, start, end, first, last, device)
    left = cap - weights - int(spec.memory.runtime_mib * MIB)
    kv = request_blocks(tokens, m, w, block_size) * kv_block_bytes(a, start, end,
                                                                   spec.model.dtype, block_size)
    tree = 2 * w * a.hidden_size * b + w * (tokens + m * w) + (
        w * a.vocab_size * LOGIT_BYTES if last else 0)
    return int(max(left // (kv + tree), 0))


def draft_memory(spec: TreePipelineSpec, target: Architecture) -> tuple[int, Memory] | None:
    """Parameters and device memory of the draft service (None: its shape is unknown here)."""
    d = spec.draft
    src = d.model if d.source == "hybrid" else d.source
    b = DTYPE_BYTES[spec.model.dtype]
    w, k = d.width, d.topk
    counting = spec.memory.param_count
    if src == "ngram":
        return 0, Memory(0, 0, 0, 0)
    if src.startswith("layers:"):
        arch = target.with_overrides(layers=int(src.split(":")[1]))
    elif d.architecture is not None:
        arch = d.architecture.resolve(KNOWN_ARCHITECTURES.get(src))
    else:
        where = "spec.draft.model" if d.source == "hybrid" else "spec.draft.source"
        arch = _config_architecture(src, where) or KNOWN_ARCHITECTURES.get(src)
    if arch is None:
        if d.device.memory is None:
            return None  # nothing to check it against: the plan only notes it
        raise ManifestError(f"spec.draft.architecture: the shape of draft {src!r} is unknown "
                            f"here, so its fit in {d.device.memory} cannot be checked; add "
                            f"architecture: {{name: ...}} (one of "
                            f"{', '.join(KNOWN_ARCHITECTURES)}) or its fields")
    params = stage_params(arch, 0, arch.layers, True, True, counting)
    # its KV pool holds the stages' budget (treepipe draft serve --kv-tokens), allocated
    # at start like theirs
    kv = kv_tokens(spec) * arch.layers * 2 * arch.kv_heads * arch.dim_head * b
    # the draft scores every node of a level: w nodes × top-k candidates from V logits
    tree = spec.limits.concurrency * (w * arch.vocab_size * LOGIT_BYTES + w * k * 16)
    weights = weight_bytes(arch, spec, 0, arch.layers, True, True, d.device)
    return params, Memory(weights, kv, tree, int(spec.memory.runtime_mib * MIB))


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Link:
    """The link from one stage to the next."""

    crosses_racks: bool
    latency_us: float
    bandwidth_gbps: float
    level_us: float  # time to send one level of w hidden states

    def describe(self) -> str:
        """Short text for the plan table."""
        where = "between racks" if self.crosses_racks else "in rack"
        return (f"{where} {self.bandwidth_gbps:g} Gbit/s {self.latency_us:g} µs "
                f"({self.level_us:.0f} µs/level)")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage."""

    index: int
    layers: tuple[int, int]  # half-open [start, end)
    embedding: bool
    head: bool
    params: int
    memory: Memory
    device: DeviceSpec
    resources: ResourcesSpec
    rack: str | None
    node_selector: dict[str, str]
    link: Link | None  # to the next stage; None on the last
    # concurrent requests of limits.contextLength tokens whose paged KV blocks fit
    # (requests_fit); None when the device's memory is not given
    fits: int | None = None


@dataclass(frozen=True)
class DraftPlan:
    """The draft service."""

    source: str
    params: int
    memory: Memory
    device: DeviceSpec
    resources: ResourcesSpec
    rack: str | None
    node_selector: dict[str, str]


def layout_id(m: TreePipeline, bounds: list[tuple[int, int]]) -> str:
    """Id of what every stage must agree on: model, dtype, weights, transport and layer ranges.

    Workers carry it (``--plan``); workers of a new id take the pipeline over once
    the old id's workers are gone, so a re-plan needs no control-plane call.  The
    draft's width and source are not in it: changing them restarts only the draft,
    which rejoins the running request.
    """
    s = m.spec
    # int8 weights are another model: its stages must not serve beside float ones (an
    # unquantized pipeline keeps the id it had before quantize existed)
    model = [s.model.source, s.model.dtype] + ([s.model.quantize]
                                               if s.model.quantize != "none" else [])
    key = json.dumps([*model, s.transport, [list(b) for b in bounds]])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Plan:
    """A whole pipeline: stages in order, then the draft."""

    name: str
    architecture: Architecture
    dtype: str
    stages: list[StagePlan]
    draft: DraftPlan
    rack_crossings: int
    kv_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    layout_id: str = ""  # what the workers pass as --plan (see layout_id())

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for the plan ConfigMap and ``--json``)."""
        def mem(m: Memory) -> dict[str, int]:
            return {**asdict(m), "total": m.total}

        return {
            "name": self.name,
            "dtype": self.dtype,
            "architecture": asdict(self.architecture),
            "kvTokens": self.kv_tokens,
            "rackCrossings": self.rack_crossings,
            "stages": [{"index": s.index, "layers": list(s.layers), "embedding": s.embedding,
                        "head": s.head, "params": s.params, "memory": mem(s.memory),
                        "rack": s.rack, "requestsFit": s.fits} for s in self.stages],
            "draft": {"source": self.draft.source, "params": self.draft.params,
                      "memory": mem(self.draft.memory), "rack": self.draft.rack},
        }


def _gpus(device: DeviceSpec, resources: ResourcesSpec) -> int:
    if resources.gpus is not None:
        return resources.gpus
    return 1 if device.type == "cuda" else 0


def _selector(rack_sel: dict[str, str], device: DeviceSpec) -> dict[str, str]:
    sel = dict(rack_sel)
    if device.product:
        sel["nvidia.com/gpu.product"] = device.product
    return sel


def _check_fit(what: str, mem: Memory, device: DeviceSpec, field_path: str) -> None:
    cap = device.memory_bytes
    if cap is not None and mem.total > cap:
        short = (mem.total - cap) / GIB
        raise ManifestError(
            f"{field_path}: {what} needs {mem.total / GIB:.2f} GiB (weights "
            f"{mem.weights / GIB:.2f}, KV {mem.kv / GIB:.2f}, tree {mem.tree / MIB:.1f} MiB, "
            f"activations {mem.activations / MIB:.1f} MiB, runtime {mem.runtime / MIB:.0f} "
            f"MiB) but its device has {device.memory} "
            f"(short {short:.2f} GiB); add stages, lower limits.contextLength/concurrency "
            f"or memory.kvTokens, or use a bigger device")


def check_shape(spec: TreePipelineSpec, a: Architecture) -> None:
    """Checks of the spec against the model's shape: stage count, last layer, draft layers."""
    st = spec.stages
    if st.stage_count > a.layers:
        raise ManifestError(f"spec.stages.count: {st.stage_count} stages for a model with "
                            f"{a.layers} layers; use at most {a.layers} stages")
    if st.layers and st.layers[-1].end != a.layers:
        raise ManifestError(f"spec.stages.layers[{len(st.layers) - 1}].end: the last range "
                            f"ends at {st.layers[-1].end} but the model has {a.layers} layers; "
                            f"end it at {a.layers}")
    d = spec.draft
    for where, src in (("source", d.source), ("model", d.model if d.source == "hybrid" else "")):
        if src.startswith("layers:") and not 1 <= int(src.split(":")[1]) < a.layers:
            raise ManifestError(f"spec.draft.{where}: {src} needs 1 <= N < {a.layers} (the "
                                f"target's layer count); lower N")


def is_path_like(src: str) -> bool:
    """Whether a draft source names a file or folder rather than a source kind."""
    return "/" in src or src.startswith(("~", ".")) or src.lower().endswith(".gguf")


def draft_names() -> list[str]:
    """The draft sources a manifest may name without a path."""
    return ["ngram", "hybrid", "none", "layers:N", "replay:P", *KNOWN_MODELS]


def check_draft_source(spec: TreePipelineSpec) -> None:
    """A draft source (and a hybrid's model) is a source kind, a known model or a path;
    any other word would only fail in the draft service, as a crash loop."""
    d = spec.draft
    kinds = ("ngram", "none", "hybrid")
    for where, src in (("source", d.source), ("model", d.model if d.source == "hybrid" else "")):
        if (not src or (where == "source" and src in kinds) or src in KNOWN_MODELS
                or src.startswith(("layers:", "replay:")) or is_path_like(src)):
            continue
        if src in kinds:
            raise ManifestError(f"spec.draft.model: {src!r} is a source, not a draft model; use "
                                f"layers:N, a known model ({', '.join(KNOWN_MODELS)}) or a path")
        raise ManifestError(f"spec.draft.{where}: unknown draft source {src!r}; use one of "
                            f"{', '.join(draft_names())}, or a model folder or .gguf path")


def check_kv_budget(spec: TreePipelineSpec) -> None:
    """memory.kvTokens must hold one request of a whole contextLength at its worst case
    (prompt + new tokens + the tree rows in flight), or the gateway could admit nothing
    the limits allow."""
    if spec.memory.kv_tokens is None:
        return
    lim, m, w = spec.limits, spec.stages.stage_count, spec.draft.width
    need = budget_tokens(1, lim.context_length, m, w)
    if pool_blocks(spec.memory.kv_tokens) < request_blocks(lim.context_length, m, w):
        raise ManifestError(f"spec.memory.kvTokens: {spec.memory.kv_tokens} is less than one "
                            f"request's worst case ({need} tokens: contextLength "
                            f"{lim.context_length} and {m} levels of width {w} in flight); "
                            f"raise it to at least {need}, or lower limits.contextLength")


def plan(manifest: TreePipeline) -> Plan:
    """Plan ``manifest``: layer ranges, memory, racks and links; raise ManifestError if unfit."""
    spec = manifest.spec
    a = resolve_architecture(spec)
    assert a is not None  # required=True raises instead
    check_shape(spec, a)
    check_draft_source(spec)
    check_kv_budget(spec)
    bounds = stage_bounds(spec, a)
    m = len(bounds)
    devices = [spec.stages.device_of(i) for i in range(m)]
    resources = [spec.stages.resources_of(i) for i in range(m)]
    mems = [stage_memory(a, spec, s, e, i == 0, i == m - 1, devices[i])
            for i, (s, e) in enumerate(bounds)]
    for i, (mem, (s, e)) in enumerate(zip(mems, bounds, strict=True)):
        where = (f"spec.stages.overrides[{spec.stages.overrides.index(spec.stages.override(i))}]"
                 f".device.memory" if spec.stages.override(i) and spec.stages.override(i).device
                 else "spec.stages.device.memory")
        _check_fit(f"stage {i} (layers {s}-{e})", mem, devices[i], where)
    notes = _budget_notes(spec)
    drafted = draft_memory(spec, a)
    if drafted is None:
        notes.append(f"draft {spec.draft.source!r}: shape unknown here, memory not estimated "
                     f"(set draft.architecture)")
        drafted = (0, Memory(0, 0, 0, 0))
    d_params, d_mem = drafted
    _check_fit("the draft", d_mem, spec.draft.device, "spec.draft.device.memory")

    slots = [Slot(f"stage {i}", _gpus(devices[i], resources[i]) > 0,
                  (spec.stages.override(i).rack if spec.stages.override(i) else None))
             for i in range(m)]
    draft_slot = Slot("the draft", _gpus(spec.draft.device, spec.draft.resources) > 0,
                      spec.draft.rack)
    racks, draft_rack = place(spec.placement, slots, draft_slot)
    selectors = {r.name: r.node_selector for r in spec.placement.racks}

    stages = []
    crossings = 0
    b = DTYPE_BYTES[spec.model.dtype]
    for i, (s, e) in enumerate(bounds):
        link = None
        if i < m - 1:
            crosses = racks[i] != racks[i + 1]
            crossings += crosses
            spec_link: LinkSpec = (spec.placement.links.between_racks if crosses
                                   else spec.placement.links.within_rack)
            level_bytes = spec.draft.width * (a.hidden_size * b + 16)
            level_us = spec_link.latency_us + level_bytes * 8 / (spec_link.bandwidth_gbps * 1e3)
            link = Link(crosses, spec_link.latency_us, spec_link.bandwidth_gbps, level_us)
        stages.append(StagePlan(i, (s, e), i == 0, i == m - 1,
                                stage_params(a, s, e, i == 0, i == m - 1, spec.memory.param_count),
                                mems[i], devices[i], resources[i], racks[i],
                                _selector(selectors.get(racks[i] or "", {}), devices[i]), link,
                                requests_fit(a, spec, s, e, i == 0, i == m - 1,
                                             spec.limits.context_length,
                                             device=devices[i])))
    draft = DraftPlan(spec.draft.source, d_params, d_mem, spec.draft.device,
                      spec.draft.resources, draft_rack,
                      _selector(selectors.get(draft_rack or "", {}), spec.draft.device))
    return Plan(manifest.metadata.name, a, spec.model.dtype, stages, draft, crossings,
                kv_tokens(spec), notes, layout_id(manifest, bounds))


def _budget_notes(spec: TreePipelineSpec) -> list[str]:
    """What a memory.kvTokens below the default means for the requests the gateway takes."""
    lim, m, w = spec.limits, spec.stages.stage_count, spec.draft.width
    budget = kv_tokens(spec)
    blocks = pool_blocks(budget)
    whole = blocks // request_blocks(lim.context_length, m, w)
    if whole >= lim.concurrency:
        return []
    if whole == 0:
        return [f"memory.kvTokens {budget} holds no request of a whole contextLength "
                f"({lim.context_length}): the gateway refuses a prompt + max new tokens above "
                f"{longest_request(blocks, m, w)}; raise memory.kvTokens to "
                f"{budget_tokens(1, lim.context_length, m, w)} for one"]
    return [f"memory.kvTokens {budget} holds {whole} request(s) of a whole "
            f"contextLength at once, fewer than limits.concurrency {lim.concurrency}: long "
            f"requests wait in the gateway's queue for blocks"]


class Planned(NamedTuple):
    """A validated manifest and its plan, computed once per load and passed on together."""

    manifest: TreePipeline
    plan: Plan


def plan_manifest(data: Any, origin: str = "manifest") -> Planned:
    """Validate plain data (parsed YAML) and plan it; one-line ManifestError naming ``origin``."""
    return with_plan(validate_manifest(data, origin), origin)


def load_planned(path: str | Path) -> Planned:
    """Read, validate and plan a ``TreePipeline`` YAML file; one-line ManifestError."""
    return with_plan(load_manifest(path), str(path))


def with_plan(m: TreePipeline, origin: str = "manifest") -> Planned:
    """``m`` (already validated) with its plan; ManifestError messages name ``origin``."""
    try:
        return Planned(m, plan(m))
    except ManifestError as e:
        raise ManifestError(f"{origin}: {e}", origin=origin) from None


# ---------------------------------------------------------------- table


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def format_plan(p: Plan) -> str:
    """The plan as a text table (``treepipe plan``)."""
    a = p.architecture
    head = (f"pipeline {p.name}: {a.layers} layers, d={a.hidden_size}, V={a.vocab_size}, "
            f"{p.dtype}, {len(p.stages)} stages, KV budget {p.kv_tokens} tokens, "
            f"{p.rack_crossings} rack crossing(s)")
    rows = [("stage", "layers", "params", "est. memory", "fits", "device", "rack/node",
             "link to next")]
    for s in p.stages:
        extra = "+emb" if s.embedding else ""
        extra += "+head" if s.head else ""
        rows.append((str(s.index), f"{s.layers[0]}-{s.layers[1]}{extra}", _count(s.params),
                     f"{s.memory.total / GIB:.2f} GiB", "-" if s.fits is None else str(s.fits),
                     _dev(s.device), _where(s.rack, s.node_selector),
                     s.link.describe() if s.link else "-"))
    d = p.draft
    rows.append(("draft", d.source, _count(d.params), f"{d.memory.total / GIB:.2f} GiB", "-",
                 _dev(d.device), _where(d.rack, d.node_selector), "-> stage 0"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                      for r in rows]
    if any(s.fits is not None for s in p.stages):
        lines.append("fits: concurrent requests of the full context length whose paged KV "
                     "blocks and tree buffers fit beside the stage's weights (the engine's "
                     "admission arithmetic)")
    return "\n".join(lines + [f"note: {n}" for n in p.notes])


def _dev(d: DeviceSpec) -> str:
    return d.type + (f" {d.memory}" if d.memory else "")


def _where(rack: str | None, sel: dict[str, str]) -> str:
    if rack is None and not sel:
        return "(any)"
    parts = [rack] if rack else []
    parts += [f"{k}={v}" for k, v in sel.items() if k != "nvidia.com/gpu.product"]
    return " ".join(parts) if parts else "(any)"
