"""Build an engine (target stage shards + token source) from user-level names."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrator.models.draft_vocab import read_vocab
from orchestrator.models.registry import cache_dir, resolve_model
from protocol.config.recovery import NO_RECOVERY, Recovery
from protocol.scheduling.records import LinkModel
from stages.model.checkpoint import ModelError, load_model_args, load_shard
from stages.model.compiled import prepare
from stages.model.early_exit import attach_adapter, is_adapter_folder, load_adapter
from stages.model.execution_modes import (
    DEFAULT_EXECUTION,
    DEFAULT_QUANTIZE,
    EXECUTION_MODES,
    resolve_dtype,
)
from stages.model.model import StageShard
from stages.model.planning import even_bounds
from stages.model.quantization import check_mode, quantize_shard
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import ConfigError, PipelineEngine, check_tree_shape
from stages.speculation.replay import ReplaySource, ReplaySpec, parse_replay
from stages.speculation.token_sources import (
    DraftModelSource,
    EarlyExitSource,
    HybridSource,
    NgramSource,
    TokenSource,
    draft_model,
)

log = logging.getLogger("treepipe.loading")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DEFAULT_HYBRID_DRAFT = "layers:4"


@dataclass
class EngineSpec:
    """What a user asks for: model, stages, draft and tree shape."""

    model: str = "smollm2-135m"
    stages: int = 4
    draft: str = "ngram"
    draft_model: str = DEFAULT_HYBRID_DRAFT
    width: int = 16
    topk: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    link_latency_us: float = 100.0
    link_gbps: float = 10.0
    # FILE[:K] from `treepipe draft vocab`: the draft model proposes only these ids
    draft_vocab: str = ""
    execution: str = DEFAULT_EXECUTION  # auto | eager | tuned | compiled (stages.model.compiled)
    recovery: Recovery = NO_RECOVERY  # --recovery (protocol.config.recovery)
    quantize: str = DEFAULT_QUANTIZE  # none | int8: the target's weights (quantization)


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """torch dtype for a CLI name (``auto``: what measured fastest on ``device``)."""
    name = resolve_dtype(name, device)
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


KERNEL_CACHE_ENV = "TREEPIPE_KERNEL_CACHE"


def kernel_cache() -> Path:
    """Where measured kernel choices are kept: ``$TREEPIPE_KERNEL_CACHE``, else
    ``kernels.json`` in treepipe's cache (the choice is the machine's, so processes with
    caches of their own may share one file)."""
    env = os.environ.get(KERNEL_CACHE_ENV)
    return Path(env) if env else cache_dir() / "kernels.json"


def check_quantize(quantize: str) -> str:
    """``quantize`` if it names a :data:`QUANTIZE_MODES` mode; one line naming the fix."""
    try:
        return check_mode(quantize)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def quantize_shards(shards: list[StageShard], quantize: str) -> list[StageShard]:
    """``shards`` with their projections and LM head as ``quantize`` names (none: as
    loaded; int8: :func:`stages.model.quantization.quantize_shard`), in place; call before
    :func:`prepare_shards`, which then measures only the float weights left."""
    devices = sorted({str(p.device) for s in shards for p in s.parameters()} - {"cpu"}) \
        if check_quantize(quantize) == "int8" else []
    if devices:
        # torch's int8 kernel is the CPU's: elsewhere each product dequantizes the weight
        log.warning("--quantize int8 on %s multiplies dequantized weights: it holds half "
                    "the weight memory of bf16 but runs no faster (not measured on a GPU)",
                    ", ".join(devices))
    for shard in shards:
        quantize_shard(shard, quantize)
    return shards


def prepare_shards(shards: list[StageShard], execution: str,
                   progress: bool = True) -> dict[str, float]:
    """Run ``shards`` as ``execution``, with measured kernels and compiled graphs cached
    under treepipe's cache; returns the seconds each warm step shape took to compile (or
    to load from the cache), summed over the shards (empty unless compiled)."""
    if execution not in EXECUTION_MODES:
        raise ConfigError(f"unknown execution {execution!r}; use --execution "
                          f"{'|'.join(EXECUTION_MODES)} (or --eager / --compile)")
    seconds: dict[str, float] = {}
    for shard in shards:
        for shape, s in prepare(shard, execution, cache_dir(), progress,
                                kernel_cache()).items():
            seconds[shape] = seconds.get(shape, 0.0) + s
    return seconds


def check_device(device: str) -> str:
    """Validate --device; 'cuda' needs a visible GPU."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use --device cpu or --device cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for but no CUDA GPU is visible; use --device cpu")
    return device


def early_exit_draft(folder: Path, n_layers: int, dtype: torch.dtype, device: str) -> StageShard:
    """The target's first ``n_layers`` layers plus its final norm and LM head, as a draft."""
    args = load_model_args(folder)
    if not 1 <= n_layers < args.n_layers:
        raise ConfigError(f"layers:{n_layers} draft needs 1 <= N < {args.n_layers} (the "
                          "target's layer count)")
    body = load_shard(folder, 0, n_layers, dtype, device)
    head = load_shard(folder, args.n_layers - 1, args.n_layers, dtype, device)
    draft = StageShard(dataclasses.replace(args, n_layers=n_layers), 0, n_layers)
    state = dict(body.state_dict())
    state.update({k: v for k, v in head.state_dict().items() if k.startswith(("norm", "lm_"))})
    draft.load_state_dict(state, strict=True)
    return draft.to(device=device, dtype=dtype).eval().fuse()


def load_draft_model(spec: str, target_folder: Path, dtype: torch.dtype,
                     device: str) -> DraftModelSource:
    """A draft from ``layers:N`` (cut of the target), an early-exit adapter folder, or a
    model name/path (e.g. a ``treepipe draft distill`` output)."""
    if spec.startswith("layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"bad draft {spec!r}; write layers:N with N a layer count") from None
        return DraftModelSource(early_exit_draft(target_folder, n, dtype, device), spec)
    if Path(spec).expanduser().is_dir() and is_adapter_folder(Path(spec).expanduser()):
        # an early-exit adapter (`treepipe draft distill --early-exit L`) on this target
        adapter, meta = load_adapter(Path(spec).expanduser())
        if meta["dim"] != load_model_args(target_folder).dim:
            raise ConfigError(f"adapter {spec} was trained for hidden size {meta['dim']}, not "
                              "this target's; train one for this target")
        cut = early_exit_draft(target_folder, int(meta["exit_layer"]), dtype, device)
        return EarlyExitSource(attach_adapter(cut, adapter), Path(spec).name or spec)
    folder = resolve_model(spec)
    args = load_model_args(folder)
    shard = load_shard(folder, 0, args.n_layers, dtype, device)
    return DraftModelSource(shard, Path(spec).name or spec)


REPLAY_MEMO = 256  # prompts whose replay continuation is kept


def replay_source(spec: ReplaySpec, target: list[StageShard]) -> ReplaySource:
    """``replay:P[-Q]`` over the target ``target``: its continuations come from plain ``ar``,
    computed once per prompt (the per-request copies of a batch share them)."""
    engine = PipelineEngine(target)
    ctx = target[0].args.max_seq_len
    known: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def continuation(prompt: list[int], n: int) -> list[int]:
        n = min(n, ctx - len(prompt))
        key = (tuple(prompt), n)
        if key not in known:
            if len(known) >= REPLAY_MEMO:  # a long-running draft service: forget the oldest
                del known[next(iter(known))]
            known[key] = engine.generate(prompt, n, method="ar").tokens if n >= 1 else []
        return list(known[key])

    return ReplaySource(continuation, spec.p, target[0].args.vocab_size, spec.horizon,
                        limit=spec.limit)


def uses_draft_model(draft: str) -> bool:
    """Whether ``--draft`` names a source with a draft model (what ``--draft-vocab`` reduces)."""
    return draft not in ("none", "", "ngram") and not draft.startswith("replay:")


def make_source(spec: EngineSpec, target_folder: Path, dtype: torch.dtype,
                target: list[StageShard] | None = None) -> TokenSource | None:
    """The token source named by ``--draft``.

    ``target``: the target's shards when the caller holds them (``replay:P`` reuses
    them; a draft service without them loads the whole target once more).
    """
    source = _make_source(spec, target_folder, dtype, target)
    if spec.draft_vocab:
        draft = source.draft if isinstance(source, HybridSource) else source
        if not isinstance(draft, DraftModelSource):
            raise ConfigError(f"--draft-vocab needs a draft model (--draft hybrid, layers:N or a "
                              f"model), not --draft {spec.draft or 'none'}")
        draft.reduce_vocab(read_vocab(spec.draft_vocab, draft.vocab_size))
    return source


def _make_source(spec: EngineSpec, target_folder: Path, dtype: torch.dtype,
                 target: list[StageShard] | None) -> TokenSource | None:
    if spec.draft in ("none", ""):
        return None
    try:
        replay = parse_replay(spec.draft)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if replay is not None:
        if target is None:
            n = load_model_args(target_folder).n_layers
            target = quantize_shards([load_shard(target_folder, 0, n, dtype, spec.device)],
                                     spec.quantize)
        return replay_source(replay, target)
    if spec.draft == "ngram":
        return NgramSource()
    if spec.draft == "hybrid":
        return HybridSource(load_draft_model(spec.draft_model, target_folder, dtype, spec.device))
    return load_draft_model(spec.draft, target_folder, dtype, spec.device)


def source_shards(source: TokenSource | None) -> list[StageShard]:
    """The shard a token source runs (a draft model's), which runs as the stages do."""
    draft = draft_model(source)
    return [draft.shard] if draft is not None else []


def build_engine(spec: EngineSpec) -> tuple[PipelineEngine, TextTokenizer, Path]:
    """Load the target split into ``spec.stages`` shards, the token source and the tokenizer."""
    check_device(spec.device)
    dtype = torch_dtype(spec.dtype, spec.device)
    folder = resolve_model(spec.model)
    args = load_model_args(folder)
    if spec.stages < 1 or spec.stages > args.n_layers:
        raise ConfigError(f"--stages {spec.stages} is impossible for a model with "
                          f"{args.n_layers} layers; use 1..{args.n_layers}")
    check_tree_shape(spec.width, spec.topk)  # before loading: fail fast on a bad tree
    check_quantize(spec.quantize)
    shards = quantize_shards([load_shard(folder, a, b, dtype, spec.device)
                              for a, b in even_bounds(args.n_layers, spec.stages)],
                             spec.quantize)
    source = make_source(spec, folder, dtype, shards)  # a bad source fails before measuring
    prepare_shards(shards + source_shards(source), spec.execution)
    link = LinkModel(spec.link_latency_us * 1e-6, spec.link_gbps * 1e9 / 8)
    engine = PipelineEngine(shards, source, spec.width, spec.topk, link,
                            recovery=spec.recovery)
    return engine, TextTokenizer.from_folder(folder), folder


__all__ = ["EngineSpec", "build_engine", "make_source", "prepare_shards", "quantize_shards",
           "source_shards",
           "uses_draft_model",
           "ModelError", "ConfigError"]
