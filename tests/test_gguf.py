"""GGUF conversion: a tiny GGUF written the way llama.cpp writes one, and the real SmolLM2."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchestrator.cli.model_commands import fetch_command
from orchestrator.models.gguf_convert import convert_gguf
from orchestrator.models.registry import KNOWN_MODELS, cache_dir, resolve_model
from stages.model.checkpoint import ModelError, load_model_args, load_shard
from stages.model.model import ModelArgs, random_shards
from stages.model.tokenizer import StreamDecoder, TextTokenizer

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Pipeline parallel inference splits the layers of a model over several hosts.",
    "Speculative decoding drafts tokens and the target model verifies them in one pass.",
    "In 2024 there were 365 days; 1234567890 are digits.",
    "caf\u00e9 na\u00efve \u00fcber \u4e16\u754c \U0001f30d",
    "def main():\n    return 42\n\n\tif x == y:\n        pass",
]
SAMPLES = [
    "Hello world 12345 x",
    "  spaces   and\ttabs\n\nnew lines ",
    "h\u00e9llo \U0001f30d \u4e16\u754c na\u00efve",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "I'm 3.14159, they'll <think> be",
    "a1b22c333",
]
# HF -> GGUF names, as llama.cpp's converter maps them.
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def reference_tokenizer() -> Tokenizer:
    """A small byte-level BPE with SmolLM's pre-tokenizer, trained on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=299, special_tokens=CONTROL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([USER_DEFINED])
    return tok


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF Q/K permutation (convert_hf_to_gguf.py)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama3_rope_factors(head_dim: int, base: float, factor: float) -> np.ndarray:
    """rope_freqs exactly as llama.cpp computes it for Llama 3.1-style scaling."""
    old_ctx, low, high = 8192, 1.0, 4.0
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, args: ModelArgs, state: dict[str, torch.Tensor], ref: Tokenizer,
               quantize_embedding: bool = False, arch: str = "llama",
               tokenizer_model: str = "gpt2", extra: dict[str, np.ndarray] | None = None) -> None:
    """Write ``state`` as a GGUF the way llama.cpp's converter does."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    w.add_rope_dimension_count(args.head_dim)
    tokens = [ref.id_to_token(i) for i in range(ref.get_vocab_size())]
    types = [gguf.TokenType.CONTROL if t in CONTROL else gguf.TokenType.USER_DEFINED
             if t == USER_DEFINED else gguf.TokenType.NORMAL for t in tokens]
    merges = [" ".join(m) for m in json.loads(ref.to_str())["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for hf, t in state.items():
        a = t.numpy().astype(np.float32)
        if hf.startswith("model.layers."):
            n, module = hf.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            name = f"blk.{n}.{LAYER_NAMES[module]}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[hf]
        if name.endswith("attn_q.weight"):
            a = llama_cpp_permute(a, args.n_heads)
        elif name.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, args.n_kv_heads)
        if name == "token_embd.weight" and quantize_embedding:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_model(tokens: int, tie: bool) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    args = ModelArgs(vocab_size=tokens, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     intermediate_size=128, max_seq_len=256, tie_embeddings=tie,
                     bos_token_id=1, eos_token_ids=[2])
    (full,) = random_shards(args, [(0, 2)], seed=5)
    params = full.state_dict()
    state = {hf: params[name] for hf, name in full.checkpoint_keys().items()}
    if tie:
        del state["lm_head.weight"]
    return args, state


@pytest.fixture(scope="module")
def ref_tok() -> Tokenizer:
    return reference_tokenizer()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, ref_tok: Tokenizer):
    """An untied float32 tiny model converted from GGUF: (args, state, folder)."""
    root = tmp_path_factory.mktemp("gguf")
    args, state = tiny_model(ref_tok.get_vocab_size(), tie=False)
    write_gguf(root / "tiny.gguf", args, state, ref_tok)
    return args, state, convert_gguf(root / "tiny.gguf", root / "out", progress=False)


def test_weights_round_trip(converted) -> None:
    args, state, folder = converted
    assert load_model_args(folder) == args
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(state)
        for key, want in state.items():
            # Exact equality also proves the Q/K un-permutation inverts llama.cpp's.
            torch.testing.assert_close(f.get_tensor(key), want, rtol=0, atol=0, msg=key)
    # And it runs: the converted model gives the original model's logits.
    (orig,) = random_shards(args, [(0, 2)], seed=5)
    shard = load_shard(folder, 0, 2)
    ids, pos = torch.tensor([3, 100, 7, 250]), torch.arange(4)
    torch.testing.assert_close(shard.logits(shard(ids, pos, shard.new_cache(8))),
                               orig.logits(orig(ids, pos, orig.new_cache(8))))


def test_tied_and_quantised(tmp_path: Path, ref_tok: Tokenizer) -> None:
    args, state = tiny_model(ref_tok.get_vocab_size(), tie=True)
    write_gguf(tmp_path / "q.gguf", args, state, ref_tok, quantize_embedding=True)
    folder = convert_gguf(tmp_path / "q.gguf", tmp_path / "out", progress=False)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        emb = f.get_tensor("model.embed_tokens.weight")
        want = state["model.embed_tokens.weight"]
        # Q8_0: per 32-value block, steps of max|x|/127; the fp16 scale adds ~127 * 2^-11 steps.
        step = want.abs().reshape(-1, 32).amax(1) / 127
        err = (emb - want).abs().reshape(-1, 32).amax(1)
        assert bool((err <= 0.57 * step + 1e-6).all())
        assert 0 < float((emb - want).abs().max())
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        torch.testing.assert_close(q, state["model.layers.1.self_attn.q_proj.weight"],
                                   rtol=0, atol=0)
    last = load_shard(folder, 1, 2)
    torch.testing.assert_close(last.lm_head.weight, emb)


def test_llama3_rope_freqs(tmp_path: Path, ref_tok: Tokenizer) -> None:
    args, state = tiny_model(ref_tok.get_vocab_size(), tie=True)
    factors = llama3_rope_factors(args.head_dim, args.rope_base, 8.0)
    assert len(set(factors.tolist())) > 2  # low, medium and high frequencies all occur
    write_gguf(tmp_path / "l3.gguf", args, state, ref_tok, extra={"rope_freqs.weight": factors})
    folder = convert_gguf(tmp_path / "l3.gguf", tmp_path / "out", progress=False)
    scaling = load_model_args(folder).rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_unsupported_inputs_leave_nothing(tmp_path: Path, ref_tok: Tokenizer) -> None:
    args, state = tiny_model(ref_tok.get_vocab_size(), tie=True)
    out = tmp_path / "out" / "model"
    write_gguf(tmp_path / "spm.gguf", args, state, ref_tok, tokenizer_model="llama")
    with pytest.raises(ModelError, match="'llama' tokenizer; only byte-level BPE"):
        convert_gguf(tmp_path / "spm.gguf", out, progress=False)
    write_gguf(tmp_path / "phi.gguf", args, state, ref_tok, arch="phi2")
    with pytest.raises(ModelError, match="'phi2' model; only llama"):
        convert_gguf(tmp_path / "phi.gguf", out, progress=False)
    bad = llama3_rope_factors(args.head_dim, args.rope_base, 5.0)
    write_gguf(tmp_path / "rope.gguf", args, state, ref_tok, extra={"rope_freqs.weight": bad})
    with pytest.raises(ModelError, match="rope_freqs"):
        convert_gguf(tmp_path / "rope.gguf", out, progress=False)
    with pytest.raises(ModelError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", out, progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "junk.gguf", out, progress=False)
    # Fails only after the temporary folder exists: it must be cleaned up too.
    bias = {"blk.0.attn_q.bias": np.zeros(args.dim, dtype=np.float32)}
    write_gguf(tmp_path / "bias.gguf", args, state, ref_tok, extra=bias)
    with pytest.raises(ModelError, match="blk.0.attn_q.bias have no Llama equivalent"):
        convert_gguf(tmp_path / "bias.gguf", out, progress=False)
    assert list(out.parent.iterdir()) == []


def test_tokenizer_matches_reference(converted, ref_tok: Tokenizer) -> None:
    tok = TextTokenizer.from_folder(converted[2])
    assert tok.vocab_size == ref_tok.get_vocab_size()
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == ref_tok.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode(USER_DEFINED) == [ref_tok.token_to_id(USER_DEFINED)]
    assert tok.eos_token_ids == [2]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_chat_template_and_stream(converted) -> None:
    tok = TextTokenizer.from_folder(converted[2])
    messages = [{"role": "user", "content": "caf\u00e9 \U0001f30d?"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\ncaf\u00e9 \U0001f30d?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.chat_ids(messages)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids) == text
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("t\n")
    # The emoji and CJK text take several byte-level tokens each; no partial
    # character may be emitted, and the pieces must add up to the full text.
    sample = "h\u00e9llo \U0001f30d \u4e16\u754c!"
    ids = tok.encode(sample)
    assert len(ids) > len(sample)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == sample
    assert "" in pieces  # some tokens completed no character


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, converted,
                       ref_tok: Tokenizer) -> None:
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    folder = converted[2]
    assert resolve_model(str(folder)) == folder
    args, state = tiny_model(ref_tok.get_vocab_size(), tie=True)
    write_gguf(tmp_path / "my-model.gguf", args, state, ref_tok)
    got = resolve_model(str(tmp_path / "my-model.gguf"), progress=False)
    assert got.parent == tmp_path / "cache" / "converted"
    assert got.name.startswith("my-model-") and load_model_args(got) == args
    stamp = (got / "config.json").stat().st_mtime_ns
    assert resolve_model(str(tmp_path / "my-model.gguf"), progress=False) == got
    assert (got / "config.json").stat().st_mtime_ns == stamp  # converted only once
    with pytest.raises(ModelError, match="not fetched yet"):
        resolve_model("smollm2-135m", fetch=False)
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match=f"not a known model \\({', '.join(KNOWN_MODELS)}\\)"):
        resolve_model("llama-9000")
    with pytest.raises(ModelError, match="has no tokenizer.json"):
        TextTokenizer.from_folder(tmp_path)


# --- the real SmolLM2-135M (fetched once into the cache by the smollm2_path fixture) ---


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    return load_shard(smollm2_path, 0, 30), TextTokenizer.from_folder(smollm2_path)


def test_smollm2_matches_transformers(smollm2_path: Path, smol) -> None:
    import transformers  # a dev dependency: missing is a failure, not a skip
    shard, tok = smol
    ids = tok.encode("Pipeline parallelism splits a model's 30 layers across hosts, so")
    ours = shard.logits(shard(torch.tensor(ids), torch.arange(len(ids)),
                              shard.new_cache(len(ids))))
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3


def test_smollm2_knows_paris(smol) -> None:
    shard, tok = smol
    ids = tok.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    cache, x, pos, out = shard.new_cache(len(ids) + 24), torch.tensor(ids), 0, []
    stream = StreamDecoder(tok)
    text = ""
    for _ in range(20):
        h = shard(x, torch.arange(pos, pos + len(x)), cache)
        pos += len(x)
        nxt = int(shard.logits(h[-1]).argmax())
        if nxt in tok.eos_token_ids:
            break
        out.append(nxt)
        text += stream.push(nxt)
        x = torch.tensor([nxt])
    text += stream.flush()
    assert text == tok.decode(out)
    assert "Paris" in text


def test_fetch_command_prints_cached_folder(smollm2_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert fetch_command(argparse.Namespace(name="smollm2-135m", force=False)) == 0
    assert capsys.readouterr().out == f"{smollm2_path}\n"
    assert fetch_command(argparse.Namespace(name="nope", force=False)) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_smollm2_tokenizer_round_trip(smol) -> None:
    _, tok = smol
    assert tok.vocab_size == 49152 and tok.eos_token_ids == [2]
    extra = ["Tel: +33 1 42 68 53 00 (ext. 9)", "\u00c9t\u00e9 \u2014 \u00e0 Z\u00fcrich"]
    for text in [*SAMPLES, *extra]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1]
    # Digits are always split one per token, as in SmolLM's own tokenizer.
    assert len(tok.encode("2024")) == 4
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
