"""The draft's reduced vocabulary: the ``--draft-vocab FILE[:K]`` flag and its JSON file.

The file (written by ``treepipe draft vocab``) holds token ids ordered by how
often the target produced them, most frequent first, plus how it was built.
``FILE:K`` keeps the first K ids; ``FILE`` keeps them all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stages.speculation.engine import ConfigError

VOCAB_KIND = "treepipe-draft-vocab"


def parse_vocab_flag(text: str) -> tuple[Path, int | None]:
    """Split ``FILE[:K]``; K must be an integer of 1 or more."""
    path_text, sep, k_text = text.rpartition(":")
    if not sep or not k_text.lstrip("+-").isdigit():
        return Path(text).expanduser(), None  # no :K (or a colon that is part of the path)
    k = int(k_text)
    if k < 1:
        raise ConfigError(f"--draft-vocab {text}: K must be 1 or more, got {k}")
    return Path(path_text).expanduser(), k


def write_vocab(path: Path, ids: list[int], counts: list[int], provenance: dict[str, Any]
                ) -> None:
    """Write a vocabulary file: ``ids`` most frequent first, their counts, provenance."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": VOCAB_KIND, **provenance, "size": len(ids), "ids": ids, "counts": counts}
    path.write_text(json.dumps(doc) + "\n", encoding="utf-8")


def read_vocab(text: str, vocab_size: int) -> Tensor:
    """The ids ``--draft-vocab FILE[:K]`` selects, checked against a ``vocab_size`` model."""
    path, k = parse_vocab_flag(text)
    if not path.is_file():
        raise ConfigError(f"--draft-vocab: {path} not found; build one with `treepipe draft "
                          "vocab --out FILE`")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        ids = doc["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("'ids' is not a list of integers")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--draft-vocab: {path} is not a draft vocabulary file ({e}); "
                          "rebuild it with `treepipe draft vocab`") from None
    if k is not None:
        if k > len(ids):
            raise ConfigError(f"--draft-vocab: {path} holds {len(ids)} ids, fewer than K={k}; "
                              "lower K or rebuild with a larger --size")
        ids = ids[:k]
    if not ids:
        raise ConfigError(f"--draft-vocab: {path} holds no ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--draft-vocab: {path} has ids outside the draft's vocabulary of "
                          f"{vocab_size} (e.g. {bad[0]}); was it built for another model?")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--draft-vocab: {path} repeats ids; rebuild it with "
                          "`treepipe draft vocab`")
    return torch.tensor(ids, dtype=torch.long)


__all__ = ["VOCAB_KIND", "parse_vocab_flag", "read_vocab", "write_vocab"]
