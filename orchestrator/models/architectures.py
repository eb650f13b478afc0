"""Shapes of known Llama-architecture models, so a pipeline can be planned without weights."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """What the planner needs to know about a decoder: its shape, not its weights."""

    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // heads
    tie_embeddings: bool = False

    @property
    def dim_head(self) -> int:
        """Per-head dimension d_h."""
        return self.head_dim or self.hidden_size // self.heads

    def with_overrides(self, **fields: Any) -> Architecture:
        """A copy with the given (non-None) fields replaced."""
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


# Published configs (config.json of each model on the Hugging Face hub).
KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    "smollm2-135m": Architecture(30, 576, 1536, 9, 3, 49152, 64, tie_embeddings=True),
    "llama-3.2-1b": Architecture(16, 2048, 8192, 32, 8, 128256, 64, tie_embeddings=True),
    "llama-3.2-3b": Architecture(28, 3072, 8192, 24, 8, 128256, 128, tie_embeddings=True),
    "llama-3.1-8b": Architecture(32, 4096, 14336, 32, 8, 128256, 128),
    "llama-3.1-70b": Architecture(80, 8192, 28672, 64, 8, 128256, 128),
    "llama-2-7b": Architecture(32, 4096, 11008, 32, 32, 32000, 128),
}
