"""Tiny randomly initialised models (fixed seeds, float64) shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stages.model.checkpoint import save_checkpoint
from stages.model.model import ModelArgs, StageShard, random_shards
from stages.model.planning import even_bounds

TARGET = ModelArgs(vocab_size=64, dim=32, n_layers=5, n_heads=4, n_kv_heads=2,
                   intermediate_size=64, max_seq_len=512)
DRAFT = ModelArgs(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                  intermediate_size=32, max_seq_len=512)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def target_shards(m: int) -> list[StageShard]:
    """The tiny target split evenly into m stages (float64: no near-tie flips)."""
    return random_shards(TARGET, even_bounds(TARGET.n_layers, m), seed=0, dtype=torch.float64)


def target_whole() -> StageShard:
    return target_shards(1)[0]


def other_draft() -> StageShard:
    """A different random model with the target's vocabulary: mostly wrong guesses."""
    return random_shards(DRAFT, [(0, 1)], seed=5, dtype=torch.float64)[0]


def save_byte_level_model(folder: Path, args: ModelArgs) -> Path:
    """A random Llama of shape ``args`` (vocabulary 256) with a byte-level tokenizer,
    saved as a Hugging Face folder: the commands that read text can run on it."""
    (full,) = random_shards(args, [(0, args.n_layers)], seed=0)
    params = full.state_dict()
    save_checkpoint(folder, args, {hf: params[n] for hf, n in full.checkpoint_keys().items()})
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder
