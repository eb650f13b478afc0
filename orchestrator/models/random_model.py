"""Random-weight models of known shapes, saved as checkpoint folders, for benchmarks.

Speed depends on a model's shape, not on its weights: a random Llama-3.2-1B-shaped
model runs a pipeline exactly as fast as the real one, and with ``--draft replay:P``
(stages/speculation/replay.py) it is drafted at any chosen hit rate.  The folder gets a
byte-level tokenizer (one token per byte) so every command that reads text runs on it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from orchestrator.models.architectures import Architecture
from protocol.errors import TreepipeError
from stages.model.checkpoint import save_checkpoint
from stages.model.model import ModelArgs, random_shards

BYTE_VOCAB = 256  # the byte-level tokenizer's alphabet


def shape_args(arch: Architecture, layers: int | None = None, vocab: int | None = None,
               context: int = 4096) -> ModelArgs:
    """The ModelArgs of ``arch``, optionally with fewer layers or another vocabulary."""
    if arch.dim_head * arch.heads != arch.hidden_size:
        raise TreepipeError("this architecture's head_dim × heads differs from its hidden "
                            "size, which the model code does not support; pick another shape")
    return ModelArgs(vocab_size=vocab or arch.vocab_size, dim=arch.hidden_size,
                     n_layers=layers or arch.layers, n_heads=arch.heads,
                     n_kv_heads=arch.kv_heads, intermediate_size=arch.intermediate_size,
                     max_seq_len=context, tie_embeddings=arch.tie_embeddings)


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer with no merges: one token (id 0-255) per byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def check_byte_vocab(args: ModelArgs) -> None:
    """The byte-level tokenizer needs ids 0-255 in the vocabulary."""
    if args.vocab_size < BYTE_VOCAB:
        raise TreepipeError(f"a vocabulary of {args.vocab_size} is smaller than the byte-level "
                            f"tokenizer's {BYTE_VOCAB} tokens; use --vocab {BYTE_VOCAB} or more")


def save_random_model(folder: Path, args: ModelArgs, seed: int = 0) -> Path:
    """Write a random model of shape ``args`` (float32 weights) and a byte-level tokenizer."""
    check_byte_vocab(args)
    (full,) = random_shards(args, [(0, args.n_layers)], seed=seed)
    params = full.state_dict()
    save_checkpoint(folder, args, {hf: params[n] for hf, n in full.checkpoint_keys().items()},
                    max_shard_bytes=2 << 30)
    save_byte_tokenizer(folder)
    return folder




