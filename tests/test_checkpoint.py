"""Checkpoint folders: save_checkpoint / load_shard round trips and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.model.checkpoint import (
    INDEX_FILE,
    ModelError,
    load_model_args,
    load_shard,
    save_checkpoint,
)
from stages.model.model import ModelArgs, StageShard, random_shards

BOUNDS = [(0, 1), (1, 2), (0, 2)]


def tiny_args(tie: bool = False) -> ModelArgs:
    return ModelArgs(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     intermediate_size=128, tie_embeddings=tie, bos_token_id=1,
                     eos_token_ids=[2])


def full_state(args: ModelArgs) -> tuple[StageShard, dict[str, torch.Tensor]]:
    (full,) = random_shards(args, [(0, args.n_layers)], seed=3)
    params = full.state_dict()
    return full, {hf: params[name] for hf, name in full.checkpoint_keys().items()}


def assert_same_params(a: StageShard, b: StageShard) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["single", "sharded"])
def test_round_trip(tmp_path: Path, max_shard_bytes: int | None) -> None:
    args = tiny_args()
    _, state = full_state(args)
    save_checkpoint(tmp_path, args, state, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes is None:
        assert (tmp_path / "model.safetensors").is_file()
        assert not (tmp_path / INDEX_FILE).exists()
    else:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert len(set(index["weight_map"].values())) > 2
        assert not (tmp_path / "model.safetensors").exists()
    assert load_model_args(tmp_path) == args
    for start, end in BOUNDS:
        expected = random_shards(args, [(start, end)], seed=3)[0]
        got = load_shard(tmp_path, start, end)
        assert_same_params(got, expected)
        assert got.layers[0].self_attn.q_proj.weight.device.type == "cpu"


def test_forward_matches_and_dtype(tmp_path: Path) -> None:
    args = tiny_args()
    full, state = full_state(args)
    save_checkpoint(tmp_path, args, state)
    ids = torch.tensor([5, 17, 42, 7])
    pos = torch.arange(4)
    want = full.logits(full(ids, pos, full.new_cache(8)))
    first, last = load_shard(tmp_path, 0, 1), load_shard(tmp_path, 1, 2)
    h = first(ids, pos, first.new_cache(8))
    torch.testing.assert_close(last.logits(last(h, pos, last.new_cache(8))), want)
    half = load_shard(tmp_path, 0, 2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    got = half.logits(half(ids, pos, half.new_cache(8))).float()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_loading_a_shard_does_not_import_dynamo(tmp_path: Path) -> None:
    """Every pipeline worker loads its shard at start: building it on the meta device must
    not run torch's Python references (an embedding's normal_, RoPE's division), whose
    first call imports torch._dynamo, about 2 s of CPU per worker."""
    import subprocess
    import sys

    args = tiny_args()
    save_checkpoint(tmp_path, args, full_state(args)[1])
    code = ("import sys, torch\n"
            "from stages.model.checkpoint import load_shard\n"
            f"s = load_shard({str(tmp_path)!r}, 0, 2)\n"
            "assert s.inv_freq.device.type == 'cpu' and s.embed_tokens.weight.is_meta is False\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_tied_embeddings(tmp_path: Path) -> None:
    args = tiny_args(tie=True)
    _, state = full_state(args)
    save_checkpoint(tmp_path, args, state)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    last = load_shard(tmp_path, 1, 2)
    torch.testing.assert_close(last.lm_head.weight, state["model.embed_tokens.weight"])
    assert_same_params(last, random_shards(args, [(1, 2)], seed=3)[0])
    whole = load_shard(tmp_path, 0, 2)
    # Tied like Hugging Face: one tensor serves as embedding and head.
    assert whole.lm_head.weight.data_ptr() == whole.embed_tokens.weight.data_ptr()


def test_resave_switches_layout(tmp_path: Path) -> None:
    args = tiny_args()
    _, state = full_state(args)
    save_checkpoint(tmp_path, args, state, max_shard_bytes=40_000)
    save_checkpoint(tmp_path, args, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_params(load_shard(tmp_path, 0, 2), random_shards(args, [(0, 2)], seed=3)[0])


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_shard(tmp_path / "nope", 0, 1)
    with pytest.raises(ModelError, match="no config.json"):
        load_model_args(tmp_path)
    args = tiny_args()
    _, state = full_state(args)
    with pytest.raises(ModelError, match="missing model.layers.1"):
        save_checkpoint(tmp_path, args, {k: v for k, v in state.items()
                                         if not k.startswith("model.layers.1.")})
    save_checkpoint(tmp_path, args, state)
    # A checkpoint whose tensors do not cover its config: the second stage fails,
    # naming the absent keys; the first stage still loads.
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_shard(tmp_path, 0, 1)
    with pytest.raises(ModelError, match=r"lacks tensors .*model\.layers\.2\."):
        load_shard(tmp_path, 2, 3)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="neither model.safetensors"):
        load_shard(tmp_path, 0, 1)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    import json

    import pytest as _pytest

    from stages.model.checkpoint import ModelError, load_model_args
    from stages.model.model import ModelArgs

    cfg = ModelArgs(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1,
                    intermediate_size=16).to_hf_config()
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with _pytest.raises(ModelError, match="'yarn' RoPE scaling"):
        load_model_args(tmp_path)
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_args(tmp_path).rope_scaling["rope_type"] == "llama3"
