"""Hugging Face-style checkpoint folders: ``config.json`` plus safetensors weights.

A stage only needs its own layers, so :func:`load_shard` opens the safetensors
files lazily and reads just the tensors that shard owns; a 30-layer model split
over three hosts never materialises the other two thirds anywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from stages.model.config import CONFIG_FILE, ModelArgs, ModelError, load_model_args, require_folder
from stages.model.model import StageShard, rope_inv_freq

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def _weight_map(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file holding it (single-file or sharded layout)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"cannot parse {index}: {e}; re-download the model") from e
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ModelError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
                     f"re-download or re-convert the model")


def _describe_missing(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
    return ", ".join(keys[:5]) + more


def load_shard(folder: Path, start: int, end: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> StageShard:
    """Build layers ``[start, end)`` of the model in ``folder``, reading only their tensors."""
    return _load(folder, start, end, dtype, device)


def load_head(folder: Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> StageShard:
    """The model's final norm and LM head alone, as a shard with no layers: a middle
    stage's early exit (miss recovery's token channel, ``--recovery early-exit:J:K``)."""
    n = load_model_args(require_folder(folder)).n_layers
    return _load(folder, n - 1, n, dtype, device, head_only=True)


def _load(folder: Path, start: int, end: int, dtype: torch.dtype,
          device: torch.device | str, head_only: bool = False) -> StageShard:
    folder = require_folder(folder)
    args = load_model_args(folder)
    # Build on the meta device so no memory is spent on random initial weights
    # that the checkpoint would overwrite anyway.
    with torch.device("meta"):
        shard = StageShard(args, start, end)
    if head_only:
        shard.layers = nn.ModuleList()  # the norm and the head are what the exit reads
    wanted = shard.checkpoint_keys()
    where = _weight_map(folder)
    source: dict[str, str] = {}
    for hf in wanted:
        if hf not in where and hf == HEAD_KEY and args.tie_embeddings:
            source[hf] = EMBED_KEY
        else:
            source[hf] = hf
    missing = {src for src in source.values() if src not in where}
    if missing:
        raise ModelError(f"{folder} lacks tensors for layers [{start}, {end}): "
                         f"{_describe_missing(missing)}; the checkpoint is incomplete or does "
                         f"not match config.json, re-download or re-convert it")
    by_file: dict[Path, list[str]] = {}
    for src in set(source.values()):
        by_file.setdefault(where[src], []).append(src)
    loaded: dict[str, Tensor] = {}
    for path, keys in by_file.items():
        if not path.is_file():
            raise ModelError(f"{path} is listed in {INDEX_FILE} but missing; "
                             f"re-download the model")
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in keys:
                loaded[key] = f.get_tensor(key).to(dtype=dtype).to(device)
    expected = {name: p.shape for name, p in shard.named_parameters()}
    own: dict[str, Tensor] = {}
    for hf, name in wanted.items():
        t = loaded[source[hf]]
        if t.shape != expected[name]:
            raise ModelError(f"{source[hf]} in {folder} has shape {tuple(t.shape)} but "
                             f"config.json implies {tuple(expected[name])}; the checkpoint "
                             f"does not match its config")
        own[name] = t
    # assign=True adopts the loaded tensors instead of copying into meta storage;
    # a tied head shares the embedding's memory, as it does in Hugging Face.
    shard.load_state_dict(own, strict=True, assign=True)
    # The RoPE table was built on meta; recompute it in float32 (like Hugging Face)
    # so low-precision shards don't round the frequencies.
    shard.register_buffer("inv_freq", rope_inv_freq(args).to(device), persistent=False)
    return shard.eval().fuse()


def _dtype_name(state: dict[str, Tensor]) -> str:
    dtypes = {t.dtype for t in state.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return str(dtype).removeprefix("torch.")


def plan_files(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Group checkpoint keys (in order) into files of at most ``max_bytes`` each."""
    groups: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes.items():
        if max_bytes is not None and groups[-1] and used + nbytes > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    return groups


def file_names(n_files: int) -> list[str]:
    """Safetensors file names for a checkpoint split into ``n_files`` files."""
    if n_files == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]


def write_index(folder: Path, groups: list[list[str]], total_bytes: int) -> None:
    """Write ``model.safetensors.index.json`` for a multi-file checkpoint."""
    names = file_names(len(groups))
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {key: name for name, keys in zip(names, groups, strict=True)
                            for key in keys}}
    write_json(folder / INDEX_FILE, index)


def _umask() -> int:
    # Read rather than set-and-restore os.umask, which would race with other threads.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def publish_permissions(folder: Path) -> None:
    """Give ``folder`` and its files ordinary umask permissions.

    ``tempfile.mkdtemp`` and safetensors create owner-only (0700/0600) entries,
    which would make a shared model cache unreadable to other users.
    """
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write pretty JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def stored_keys(args: ModelArgs) -> set[str]:
    """Hugging Face keys a complete checkpoint of ``args`` stores (tied: no LM head)."""
    with torch.device("meta"):  # shapes only, no memory for weights
        keys = set(StageShard(args, 0, args.n_layers).checkpoint_keys())
    if args.tie_embeddings:
        keys.discard(HEAD_KEY)
    return keys


def save_checkpoint(folder: Path, args: ModelArgs, state: dict[str, Tensor],
                    max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors weights (Hugging Face keys) into ``folder``.

    With ``max_shard_bytes`` the weights are split over several files plus an
    index, as Hugging Face does for large models.  Tied models store no
    ``lm_head.weight``.  Files are written under temporary names and renamed,
    so a crash never leaves a half-written checkpoint behind.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    needed = stored_keys(args)
    state = dict(state)
    if args.tie_embeddings:
        state.pop(HEAD_KEY, None)
    missing, extra = needed - state.keys(), state.keys() - needed
    if missing or extra:
        raise ModelError(f"state does not match the model shape: missing "
                         f"{_describe_missing(missing) or 'nothing'}, unexpected "
                         f"{_describe_missing(extra) or 'nothing'}; pass exactly the "
                         f"Hugging Face keys of a {args.n_layers}-layer Llama")
    # safetensors refuses tensors that share storage, so copy only those.
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for k in sorted(state):
        t = state[k].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    groups = plan_files(sizes, max_shard_bytes)
    names = file_names(len(groups))
    tmp_dir = Path(tempfile.mkdtemp(prefix=".save-", dir=folder))
    try:
        for name, keys in zip(names, groups, strict=True):
            save_file({k: tensors[k] for k in keys}, tmp_dir / name, metadata={"format": "pt"})
        if len(groups) > 1:
            write_index(tmp_dir, groups, sum(sizes.values()))
        cfg = args.to_hf_config()
        cfg["torch_dtype"] = _dtype_name(tensors)
        write_json(tmp_dir / CONFIG_FILE, cfg)
        publish_permissions(tmp_dir)
        # Weights before config, stale files of another layout last: an interrupted
        # save never leaves the folder without a complete set of weights.
        written = [*names, *([INDEX_FILE] if len(groups) > 1 else []), CONFIG_FILE]
        for name in written:
            os.replace(tmp_dir / name, folder / name)
        for stale in [folder / SINGLE_FILE, folder / INDEX_FILE,
                      *folder.glob("model-*-of-*.safetensors")]:
            if stale.name not in written:
                stale.unlink(missing_ok=True)
    finally:
        for path in tmp_dir.iterdir():
            path.unlink()
        tmp_dir.rmdir()
    return folder
