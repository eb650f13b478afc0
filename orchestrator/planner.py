"""Planning a pipeline: layer split, per-stage memory (SpecPipe §4.5) and rack placement."""

from __future__ import annotations

from pathlib import Path

from orchestrator.architectures import KNOWN_ARCHITECTURES, Architecture
from orchestrator.manifest import ManifestError, TreePipelineSpec


def _config_architecture(source: str) -> Architecture | None:
    """The shape from a model's config.json when the model is on this machine (no fetch)."""
    from orchestrator.models import KNOWN_MODELS

    path = Path(source).expanduser()
    if source not in KNOWN_MODELS and not (path / "config.json").is_file():
        return None  # a .gguf or a path inside a container: nothing cheap to read
    from orchestrator.models import resolve_model
    from stages.checkpoint import ModelError, load_model_args

    try:
        args = load_model_args(resolve_model(source, fetch=False, progress=False))
    except ModelError:
        return None
    return Architecture(args.n_layers, args.dim, args.intermediate_size, args.n_heads,
                        args.n_kv_heads, args.vocab_size, args.head_dim, args.tie_embeddings)


def resolve_architecture(spec: TreePipelineSpec, required: bool = True) -> Architecture | None:
    """The target's shape: its cached config, else spec.model.architecture, else a known name."""
    base = _config_architecture(spec.model.source) or KNOWN_ARCHITECTURES.get(spec.model.source)
    given = spec.model.architecture
    arch = given.resolve(base) if given else base
    if arch is None and required:
        raise ManifestError(f"spec.model.architecture: the shape of {spec.model.source!r} is "
                            f"unknown here (weights not on this machine); add architecture: "
                            f"{{name: ...}} (one of {', '.join(KNOWN_ARCHITECTURES)}) or "
                            f"layers, hiddenSize, intermediateSize, heads, kvHeads, vocabSize")
    return arch
