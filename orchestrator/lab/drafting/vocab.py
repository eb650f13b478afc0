"""``treepipe draft vocab``: the target's most frequent output tokens, for a reduced draft head.

FR-Spec / EAGLE-3 style: the draft's LM head is cut to the K tokens the target
itself produces most often, so a draft step computes K logits instead of V.
The command runs the target greedily (``ar``, stopping at EOS as serving does)
on the prompts and counts the tokens it outputs; with ``--count-prompts`` (the
default) prompt tokens count too, since code continues with the identifiers
its prompt introduced.  Ids come out most frequent first (ties: lower id
first); when fewer than ``--size`` distinct tokens were seen, the rest are
filled with the unseen ids in id order (a BPE vocabulary lists earlier merges,
which are the more common pieces, first).  ``--draft-vocab FILE[:K]`` takes the
first K.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from orchestrator.lab.benchmarks.prompts import load_prompts
from orchestrator.models.draft_vocab import write_vocab
from orchestrator.models.loading import check_device, torch_dtype
from orchestrator.models.registry import resolve_model
from protocol.errors import TreepipeError
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine


def count_target_tokens(engine: PipelineEngine, prompts: list[list[int]], max_new: int,
                        stop_ids: list[int], count_prompts: bool = True,
                        progress: bool = True) -> tuple[Counter[int], int, int]:
    """Token counts of the target's greedy outputs (and prompts); (counts, output, prompt)."""
    counts: Counter[int] = Counter()
    n_out = n_prompt = 0
    ctx = engine.args.max_seq_len
    for p in tqdm(prompts, desc="target greedy", unit="prompt", file=sys.stderr,
                  dynamic_ncols=True, disable=not progress):
        n = min(max_new, ctx - len(p))
        out = engine.generate(p, n, SamplingParams(), "ar", stop_ids).tokens if n >= 1 else []
        counts.update(out)
        n_out += len(out)
        if count_prompts:
            counts.update(p)
            n_prompt += len(p)
    return counts, n_out, n_prompt


def frequency_order(counts: Counter[int], vocab_size: int, size: int
                    ) -> tuple[list[int], list[int]]:
    """The ``size`` ids most frequent first (ties: lower id), unseen ids after; their counts."""
    seen = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    chosen = set(seen)
    ids = seen + [t for t in range(vocab_size) if t not in chosen]
    ids = ids[:size]
    return ids, [counts.get(t, 0) for t in ids]


@dataclass(frozen=True)
class DraftVocabOptions:
    """``treepipe draft vocab``'s options, one field per flag."""

    model: str
    prompts: str
    chat: bool
    max_new_tokens: int
    size: int
    count_prompts: bool
    out: Path
    dtype: str
    device: str
    threads: int | None
    quiet: bool


def write_draft_vocab(o: DraftVocabOptions) -> int:
    """``treepipe draft vocab``."""
    device = check_device(o.device)
    dtype = torch_dtype(o.dtype)
    prompts = load_prompts(o.prompts)  # before loading the model: fail fast on bad input
    if o.threads:
        torch.set_num_threads(o.threads)
    folder = resolve_model(o.model)
    args = load_model_args(folder)
    if o.size > args.vocab_size:
        raise TreepipeError(f"--size {o.size} is larger than the model's vocabulary of "
                            f"{args.vocab_size}; use 1..{args.vocab_size}")
    tok = TextTokenizer.from_folder(folder)
    ids = [p.ids(tok, o.chat) for p in prompts]
    engine = PipelineEngine([load_shard(folder, 0, args.n_layers, dtype, device)])
    t0 = time.perf_counter()
    counts, n_out, n_prompt = count_target_tokens(
        engine, ids, o.max_new_tokens, list(tok.eos_token_ids), o.count_prompts,
        progress=not o.quiet)
    order, freq = frequency_order(counts, args.vocab_size, o.size)
    covered = sum(freq)
    total = n_out + n_prompt
    write_vocab(o.out, order, freq, {
        "model": o.model, "folder": str(folder), "vocab_size": args.vocab_size,
        "prompts": o.prompts, "n_prompts": len(ids), "chat": o.chat,
        "max_new_tokens": o.max_new_tokens, "count_prompts": o.count_prompts,
        "dtype": o.dtype, "output_tokens": n_out, "prompt_tokens": n_prompt,
        "distinct_tokens": len(counts), "seconds": round(time.perf_counter() - t0, 1)})
    print(f"wrote {o.out}: {len(order)} ids ({min(len(counts), len(order))} seen, "
          f"{covered}/{total} counted tokens covered) from {n_out} output + {n_prompt} prompt "
          f"tokens of {len(ids)} prompts")
    return 0


__all__ = ["count_target_tokens", "frequency_order", "DraftVocabOptions", "write_draft_vocab"]
