"""Tiny randomly initialised models (fixed seeds, float64) shared by the unit tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from orchestrator.models.random_model import save_random_model
from stages.model.model import ModelArgs, StageShard, random_shards
from stages.model.planning import even_bounds

TARGET = ModelArgs(vocab_size=64, dim=32, n_layers=5, n_heads=4, n_kv_heads=2,
                   intermediate_size=64, max_seq_len=512)
DRAFT = ModelArgs(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                  intermediate_size=32, max_seq_len=512)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


# TREEPIPE_TEST_DEVICE=cuda runs the engine tests that use these models on a GPU
# (docs/benchmarks.md, "GPU runs"); CI has none and runs them on the CPU.
DEVICE = os.environ.get("TREEPIPE_TEST_DEVICE", "cpu")


# the execution modes every lossless test runs in (stages.model.compiled): "graphs" is
# steps padded to their bucket (stages.model.step_buckets); on a GPU, compiled layers
# captured as CUDA graphs (what --execution compiled runs there), on a CPU the padding
# alone over eager layers (compiled layers are "compiled"'s to test)
EXECUTIONS = ("eager", "compiled", "graphs")


def executed(shards: list[StageShard], execution: str) -> list[StageShard]:
    """``shards`` run eager, or with compiled layers (compiled lazily: the first forward
    of each shape compiles it, or loads it from inductor's cache that every test shares),
    or (graphs) in padded, on a GPU captured, steps."""
    from stages.model.compiled import compile_shard
    from stages.model.cuda_graphs import StepGraphs

    if execution not in EXECUTIONS:
        raise ValueError(f"unknown execution {execution!r}")
    capture = DEVICE == "cuda"
    for s in shards:
        if execution == "compiled" or (execution == "graphs" and capture):
            compile_shard(s, warm=False, progress=False)
        if execution == "graphs":
            s.step_fn = StepGraphs(s.layer_loop, capture=capture)
    return shards


def target_shards(m: int, dtype: torch.dtype = torch.float64, execution: str = "eager",
                  quantize: str = "none") -> list[StageShard]:
    """The tiny target split evenly into m stages (float64: no near-tie flips), its
    weights as ``quantize`` names (int8: stages.model.quantization)."""
    from stages.model.quantization import quantize_shard

    shards = random_shards(TARGET, even_bounds(TARGET.n_layers, m), seed=0, dtype=dtype,
                           device=DEVICE)
    return executed([quantize_shard(s, quantize) for s in shards], execution)


def target_whole(dtype: torch.dtype = torch.float64, execution: str = "eager",
                 quantize: str = "none") -> StageShard:
    return target_shards(1, dtype, execution, quantize)[0]


def other_draft(dtype: torch.dtype = torch.float64, execution: str = "eager") -> StageShard:
    """A different random model with the target's vocabulary: mostly wrong guesses."""
    return executed(random_shards(DRAFT, [(0, 1)], seed=5, dtype=dtype, device=DEVICE),
                    execution)[0]


def save_byte_level_model(folder: Path, args: ModelArgs) -> Path:
    """A random Llama of shape ``args`` (vocabulary 256) with a byte-level tokenizer,
    saved as a Hugging Face folder: the commands that read text can run on it."""
    return save_random_model(folder, args)
