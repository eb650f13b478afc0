"""Convert a llama-architecture GGUF file into a Hugging Face-style model folder.

The result holds ``config.json``, float32 safetensors weights with Hugging Face
names, ``tokenizer.json`` and ``tokenizer_config.json``, so everything else in
treepipe (and ``transformers``) reads it like any downloaded checkpoint.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, TokenType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from stages.model.checkpoint import (
    CONFIG_FILE,
    ModelError,
    file_names,
    plan_files,
    publish_permissions,
    stored_keys,
    write_index,
    write_json,
)
from stages.model.model import ModelArgs, rope_inv_freq

SUPPORTED_ARCHS = ("llama",)
MAX_FILE_BYTES = 2 << 30  # float32 output is large; split it like Hugging Face does

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp writes that carry no weights of their own: the RoPE tables
# are recomputed from the config (rope_freqs is turned into rope_scaling).
DERIVED_TENSORS = {"rope_freqs.weight"}
DERIVED_LAYER_TENSORS = {"attn_rot_embd"}

# Pre-tokenizer regexes, named as llama.cpp names them in ``tokenizer.ggml.pre``.
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
GPT2_PRE = {"gpt-2", "gpt2"}
LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3"}
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama-3 GGUFs keep their RoPE scaling only as a rope_freqs tensor; these are the
# published settings it is matched against (Llama 3.1 uses 8, Llama 3.2 uses 32).
LLAMA3_FACTORS = (8.0, 16.0, 32.0)
LLAMA3_ORIGINAL_CTX = 8192


class _Metadata:
    """Typed access to a GGUF file's key/value fields (independent of gguf-py version)."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None or not field.types:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i].tolist()[0] for i in field.data]
        if field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        value = field.parts[field.data[0]].tolist()[0]
        if field.types[0] == GGUFValueType.FLOAT32:
            # Print float32 metadata the short way (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.path} lacks the GGUF field {key!r}; the file is "
                             f"incomplete or not a llama model, re-download it")
        return value


def _hf_name(name: str) -> str | None:
    """Hugging Face key for a GGUF tensor name, or None when it is not a weight we map."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[-1] == "weight":
        hf = LAYER_TENSORS.get(parts[2])
        return f"model.layers.{parts[1]}.{hf}.weight" if hf else None
    if len(parts) == 2 and parts[-1] == "weight":
        hf = GLOBAL_TENSORS.get(parts[0])
        return f"{hf}.weight" if hf else None
    return None


def _is_derived(name: str) -> bool:
    parts = name.split(".")
    return name in DERIVED_TENSORS or (parts[0] == "blk" and len(parts) > 2
                                       and parts[2] in DERIVED_LAYER_TENSORS)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> rotate-half layout).

    llama.cpp stores ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``
    so that RoPE pairs are adjacent rows; this is the inverse.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensor_array(tensor: Any) -> np.ndarray:
    """Dequantised float32 copy of a GGUF tensor, in numpy (row-major) shape."""
    # GGUF lists dimensions fastest-first, the reverse of numpy's order.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    return np.array(values, dtype=np.float32).reshape(shape)


def _llama3_scaling(factors: np.ndarray, base: dict[str, Any]) -> dict[str, Any]:
    """Recover Llama-3 ``rope_scaling`` from llama.cpp's precomputed rope_freqs tensor."""
    plain = ModelArgs(**base)
    inv = rope_inv_freq(plain).numpy()
    for factor in LLAMA3_FACTORS:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0,
                   "original_max_position_embeddings": LLAMA3_ORIGINAL_CTX}
        scaled = rope_inv_freq(ModelArgs(**{**base, "rope_scaling": scaling})).numpy()
        if factors.shape == inv.shape and np.allclose(inv / scaled, factors, rtol=1e-3):
            return scaling
    raise ModelError("the GGUF's rope_freqs tensor matches no known Llama-3 RoPE scaling; "
                     "convert the original Hugging Face checkpoint instead")


def _model_args(meta: _Metadata, arch: str, names: set[str],
                rope_freqs: np.ndarray | None) -> ModelArgs:
    """Model shape from GGUF metadata."""
    p = f"{arch}."
    if (meta.get(p + "expert_count") or 0) > 0:
        raise ModelError(f"{meta.path} is a mixture-of-experts model, which treepipe does "
                         f"not support; use a dense Llama-architecture model")
    n_heads = int(meta.require(p + "attention.head_count"))
    n_kv = meta.get(p + "attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ModelError(f"{meta.path} has per-layer KV head counts, which treepipe does "
                         f"not support; use a uniform Llama-architecture model")
    dim = int(meta.require(p + "embedding_length"))
    head_dim = dim // n_heads
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = meta.get(p + key)
        if value is not None and int(value) != head_dim:
            raise ModelError(f"{meta.path} sets {p + key}={value} but treepipe needs "
                             f"hidden_size / heads = {head_dim}; this model is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    base: dict[str, Any] = dict(
        vocab_size=int(meta.get(p + "vocab_size") or len(tokens)),
        dim=dim,
        n_layers=int(meta.require(p + "block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        intermediate_size=int(meta.require(p + "feed_forward_length")),
        norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_base=meta.get(p + "rope.freq_base", 10000.0),
        max_seq_len=int(meta.get(p + "context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
    )
    scaling_type = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor") or meta.get(p + "rope.scale_linear")
    if rope_freqs is not None:
        base["rope_scaling"] = _llama3_scaling(rope_freqs, base)
    elif scaling_type == "linear" or (scaling_type is None and factor not in (None, 1.0)):
        base["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling_type == "yarn":
        base["rope_scaling"] = {
            "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings":
                int(meta.require(p + "rope.scaling.original_context_length")),
        }
    elif scaling_type not in (None, "none"):
        raise ModelError(f"{meta.path} uses RoPE scaling {scaling_type!r}, which treepipe "
                         f"does not support")
    return ModelArgs(**base)


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """Hugging Face pre-tokenizer equivalent to llama.cpp's ``pre`` type; and ignore_merges."""
    if pre in DIGIT_SPLIT_PRE:
        # llama.cpp splits every digit (\p{N}) off first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in LLAMA3_PRE:
        # llama.cpp, like Llama 3's tokenizer.json, takes a whole pre-token from the
        # vocabulary when present instead of applying merges (ignore_merges).
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    supported = sorted(DIGIT_SPLIT_PRE | GPT2_PRE | LLAMA3_PRE)
    raise ModelError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                     f"{', '.join(supported)}); convert the Hugging Face checkpoint instead")


def build_tokenizer(meta: _Metadata, context_length: int) -> tuple[Tokenizer, dict[str, Any]]:
    """``tokenizers`` tokenizer and ``tokenizer_config.json`` contents from GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"{meta.path} uses the {kind!r} tokenizer; only byte-level BPE "
                         f"('gpt2') GGUF tokenizers are supported, convert the Hugging Face "
                         f"checkpoint instead")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"{meta.path} has duplicate vocabulary entries; it cannot be turned "
                         f"into a Hugging Face tokenizer")
    pre_tok, ignore_merges = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    # Control tokens become special added tokens so text like "<|im_start|>" maps to
    # its single id (the BPE merges alone would spell it out); user-defined tokens
    # are matched whole too but stay ordinary text when decoding skips specials.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True)
                            if ty == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True)
                    if ty == TokenType.USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": bos,
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok, {k: v for k, v in config.items() if v is not None}


def _read_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist; check the path")
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelError(f"{path} is not a readable GGUF file ({e}); re-download it") from e


def _write_weights(reader: GGUFReader, args: ModelArgs, folder: Path, progress: bool) -> None:
    """Dequantise, rename and un-permute every weight, writing safetensors files."""
    mapped = {t.name: _hf_name(t.name) for t in reader.tensors}
    unknown = [n for n, hf in mapped.items() if hf is None and not _is_derived(n)]
    if unknown:
        raise ModelError(f"GGUF tensors {', '.join(unknown[:5])} have no Llama equivalent "
                         f"(biases or extra layers?); this model variant is not supported")
    missing = stored_keys(args) - {hf for hf in mapped.values() if hf}
    if missing:
        raise ModelError(f"the GGUF lacks {', '.join(sorted(missing)[:5])}; the file is "
                         f"incomplete or its metadata does not match its tensors")
    by_name = {t.name: t for t in reader.tensors}
    sizes = {gg: 4 * int(by_name[gg].n_elements) for gg, hf in mapped.items() if hf}
    groups = plan_files(sizes, MAX_FILE_BYTES)
    names = file_names(len(groups))
    bar = tqdm(total=len(sizes), desc="converting", unit="tensor", disable=not progress,
               file=sys.stderr)
    with bar:
        for file_name, group in zip(names, groups, strict=True):
            out: dict[str, torch.Tensor] = {}
            for gg in group:
                w = _tensor_array(by_name[gg])
                if gg.endswith(".attn_q.weight"):
                    w = unpermute_rope(w, args.n_heads)
                elif gg.endswith(".attn_k.weight"):
                    w = unpermute_rope(w, args.n_kv_heads)
                out[mapped[gg]] = torch.from_numpy(np.ascontiguousarray(w))
                bar.update(1)
            save_file(out, folder / file_name, metadata={"format": "pt"})
    if len(groups) > 1:
        write_index(folder, [[mapped[g] for g in grp] for grp in groups], sum(sizes.values()))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``, replacing any older conversion."""
    if not dst.exists():
        os.replace(src, dst)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, trash / dst.name)
    os.replace(src, dst)
    shutil.rmtree(trash, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Convert a llama-architecture GGUF into a Hugging Face folder at ``out_dir``.

    Weights are dequantised to float32.  The folder appears only when complete (it
    is built under a temporary name next to ``out_dir`` and renamed), and replaces
    any previous folder of that name.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _read_gguf(gguf_path)
    meta = _Metadata(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{gguf_path} is a {arch!r} model; only {', '.join(SUPPORTED_ARCHS)} "
                         f"GGUF files can be converted")
    names = {t.name for t in reader.tensors}
    rope_freqs = next((_tensor_array(t) for t in reader.tensors if t.name == "rope_freqs.weight"),
                      None)
    args = _model_args(meta, arch, names, rope_freqs)
    # The tokenizer is cheap and the likeliest thing to be unsupported: fail before
    # spending minutes on weights.
    tokenizer, tok_config = build_tokenizer(meta, args.max_seq_len)
    if tokenizer.get_vocab_size(with_added_tokens=True) > args.vocab_size:
        raise ModelError(f"{gguf_path} has {tokenizer.get_vocab_size()} tokens but only "
                         f"{args.vocab_size} embedding rows; the file is inconsistent")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tok_config)
        _write_weights(reader, args, tmp, progress)
        cfg = args.to_hf_config()
        if meta.get("tokenizer.ggml.padding_token_id") is not None:
            cfg["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
        write_json(tmp / CONFIG_FILE, cfg)
        publish_permissions(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        # Also on Ctrl-C: never leave a half-built folder behind.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
