"""Random-weight models of known shapes, saved as checkpoint folders, for benchmarks.

Speed depends on a model's shape, not on its weights: a random Llama-3.2-1B-shaped
model runs a pipeline exactly as fast as the real one, and with ``--draft replay:P``
(stages/speculation/replay.py) it is drafted at any chosen hit rate.  The folder gets a
byte-level tokenizer (one token per byte) so every command that reads text runs on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from orchestrator.deploy.planner import stage_params
from orchestrator.models.architectures import KNOWN_ARCHITECTURES, Architecture
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


def cmd_model_random(a: argparse.Namespace) -> int:
    """``treepipe model random``: a random-weight model of a known shape."""
    arch = KNOWN_ARCHITECTURES[a.shape]
    if a.layers is not None and a.layers < 1:
        raise TreepipeError(f"--layers {a.layers}: a model needs at least one layer")
    args = shape_args(arch, a.layers, a.vocab, a.context)
    check_byte_vocab(args)
    # the planner's exact count (GQA's smaller K/V, a tied head stored once)
    shape = arch.with_overrides(layers=args.n_layers, vocab_size=args.vocab_size)
    n = stage_params(shape, 0, args.n_layers, first=True, last=True)
    print(f"writing a random {a.shape}-shaped model ({args.n_layers} layers, vocabulary "
          f"{args.vocab_size}, about {n / 1e9:.2f} B parameters) to {a.out}", file=sys.stderr)
    save_random_model(Path(a.out), args, a.seed)
    print(a.out)
    return 0


def add_random_model_parser(msub: argparse._SubParsersAction) -> None:
    """Register ``treepipe model random``."""
    r = msub.add_parser("random", help="write a random-weight model of a known shape "
                                       "(for benchmarks; byte-level tokenizer)")
    r.add_argument("--shape", required=True, choices=sorted(KNOWN_ARCHITECTURES),
                   help="architecture whose layer shapes to use")
    r.add_argument("--layers", type=int, default=None, help="decoder layers (default: the "
                                                            "shape's own)")
    r.add_argument("--vocab", type=int, default=None,
                   help=f"vocabulary size (default: the shape's own; at least {BYTE_VOCAB})")
    r.add_argument("--context", type=int, default=4096, help="max_position_embeddings")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True, help="folder to write")
    r.set_defaults(func=cmd_model_random)
