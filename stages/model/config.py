"""A model's shape and its ``config.json``: what a process needs to know about a model
without loading weights.

Torch-free, so the gateway, the launcher and the planner read a model's shape without
importing torch; :mod:`stages.model.checkpoint` loads the weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import TreepipeError

CONFIG_FILE = "config.json"


class ModelError(TreepipeError):
    """A model folder or file that cannot be used; the message names the fix."""


def require_folder(folder: Path) -> Path:
    """``folder`` as a Path, or a ModelError naming the fix when it is not a directory."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"model folder {folder} does not exist; pass a folder holding "
                         f"config.json and model.safetensors, or a known model name")
    return folder


SUPPORTED_ROPE = ("default", "llama3")


def load_model_args(folder: Path) -> ModelArgs:
    """Read the model shape from ``folder/config.json``."""
    folder = require_folder(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelError(f"{folder} has no {CONFIG_FILE}; it is not a Hugging Face model "
                         f"folder (convert a .gguf with `treepipe model fetch` or pass one)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot parse {path}: {e}; re-download or re-convert the model") from e
    arch = cfg.get("model_type")
    if arch not in (None, "llama", "mistral"):
        raise ModelError(f"{path} describes a '{arch}' model; only Llama-architecture "
                         f"decoders are supported")
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE:
        raise ModelError(f"{path} uses {kind!r} RoPE scaling, which treepipe does not implement "
                         f"(supported: {', '.join(SUPPORTED_ROPE)}); use a model without it")
    try:
        return ModelArgs.from_hf_config(cfg)
    except KeyError as e:
        raise ModelError(f"{path} lacks the field {e.args[0]!r}; re-download or re-convert "
                         f"the model") from e


@dataclass
class ModelArgs:
    """Shape of a Llama-style decoder."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Llama-3 style {"rope_type": "llama3", ...}
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dictionary."""
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_base=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dictionary for this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_base,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1
            else self.eos_token_ids or None,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "head_dim": self.head_dim,
            "torch_dtype": "float32",
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
