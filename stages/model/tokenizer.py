"""Text <-> token ids for a model folder, chat templates and streaming detokenisation."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from stages.model.config import ModelError

REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot parse {path}: {e}; re-download or re-convert the model") from e


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value or []]


def _pick_template(value: Any) -> str | None:
    """Hugging Face allows a list of named templates; the chat one is called 'default'."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Templates expect Hugging Face's tojson, which keeps non-ASCII text readable.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers so templates written for it render identically;
    # the sandbox matters because templates ship inside downloaded model files.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def read_chat_template(path: str | Path, flag: str = "--chat-template") -> str:
    """The Jinja chat template in the file at ``path``, checked to compile; a ModelError
    naming ``flag``, the file and the fix when it is missing, unreadable or no template."""
    where = f"{flag} {path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelError(f"{where}: no such file; pass a Jinja chat template file") from None
    except UnicodeDecodeError:
        raise ModelError(f"{where}: not UTF-8 text; pass a Jinja chat template file") from None
    except OSError as e:
        raise ModelError(f"{where}: cannot read it ({e.strerror or e}); check the path and "
                         f"its permissions") from None
    if not text.strip():
        raise ModelError(f"{where}: the file is empty; pass a Jinja chat template file")
    try:
        _chat_env().from_string(text)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ModelError(f"{where}: not a valid Jinja template ({e.message or e}"
                         f"{f', line {line}' if line else ''}); fix it") from None
    return text


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special tokens and chat template."""

    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, extra_eos_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.add_bos = add_bos and self.bos_token_id is not None
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        ids = [i for i in [*eos, *(extra_eos_ids or [])] if i is not None]
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        self._template = _chat_env().from_string(chat_template) if chat_template else None

    def use_chat_template(self, template: str) -> None:
        """Render chat with ``template`` instead of the model's own (``--chat-template``)."""
        self.chat_template = template
        self._template = _chat_env().from_string(template)

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer:
        """Load ``tokenizer.json`` with ``tokenizer_config.json`` and config eos ids."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{folder} has no tokenizer.json; re-convert the model or copy "
                             f"tokenizer.json from its Hugging Face repository")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ModelError(f"cannot load {path}: {e}; re-download or re-convert it") from e
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        template = _pick_template(cfg.get("chat_template"))
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        bos = _token_text(cfg.get("bos_token"))
        eos = _token_text(cfg.get("eos_token"))
        if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos = tok.id_to_token(model_cfg["bos_token_id"])
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # Llama-3-style folders leave add_bos_token out and let the post-processor
            # insert BOS; probe it rather than guess.
            bos_id = tok.token_to_id(bos) if bos else None
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]
        extra = (_as_id_list(model_cfg.get("eos_token_id"))
                 + _as_id_list(gen_cfg.get("eos_token_id")))
        return cls(tok, chat_template=template, bos_token=bos, eos_token=eos,
                   add_bos=bool(add_bos), extra_eos_ids=extra)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``; BOS is prepended only when the model asks for it."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's Jinja chat template."""
        if self._template is None:
            raise ModelError("this model has no chat template; pass a raw prompt instead, or "
                             "add chat_template to its tokenizer_config.json")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   **kwargs}
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **context)
        except TemplateError as e:
            raise ModelError(f"the chat template rejected the messages: {e}") from e

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # Templates write BOS themselves when the model wants it; adding it again
        # here would double it, so the rendered text is encoded verbatim.
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class StreamDecoder:
    """Turns a stream of token ids into text, emitting only completed characters.

    Byte-level tokens can split a UTF-8 character; decoding such a prefix yields
    U+FFFD, so text is held back until the character completes.  Decoding a
    window that starts a few tokens back (rather than token by token) keeps
    decoders that strip or add leading spaces from changing the output.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(int(token_id))
        seen = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(seen) or full.endswith(REPLACEMENT_CHAR):
            return ""
        # Keep only what the next window needs, so memory and work stay bounded.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return full[len(seen):]

    def flush(self) -> str:
        """Return whatever is still held back (e.g. an incomplete character at the end)."""
        seen = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        self._ids.clear()
        self._prefix = self._read = 0
        return full[len(seen):]
