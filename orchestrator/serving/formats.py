"""The gateway's check of a request's ``response_format``: parsed, bounded and compiled
once here, so a bad schema is a 400 naming ``response_format`` (runner.validate turns
these errors into that) before any stage sees it;
the last stage compiles the same canonical text again for its own matcher (once per
distinct format per process, stages/model/grammar.py)."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from protocol import treepipe_pb2
from protocol.requests.response_format import MAX_FORMAT_BYTES, FormatError, grammar_spec
from stages.model.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from stages.model.grammar import GrammarVocab



class NoTokenizer(FormatError):
    """A format asked of a model without a tokenizer."""


class Formats:
    """One model's grammar vocabulary, built at the first request with a format."""

    def __init__(self, tok: TextTokenizer | None, vocab: int):
        self.tok, self.vocab = tok, vocab
        self._grammars: GrammarVocab | None = None
        self._lock = threading.Lock()  # handler threads compile concurrently

    def spec(self, req: treepipe_pb2.GenerateRequest) -> str | None:
        """The canonical grammar text of ``req.response_format`` (None: free text), its
        schema compiled; FormatError (NoTokenizer) saying why not."""
        if not req.HasField("response_format"):
            return None
        if len(req.response_format.encode()) > MAX_FORMAT_BYTES:
            raise FormatError(f"response_format is more than {MAX_FORMAT_BYTES} bytes "
                              "(64 KiB); send a smaller schema")
        try:
            fmt = json.loads(req.response_format)
        except ValueError as e:
            raise FormatError(f"response_format is not JSON: {e}") from None
        spec = grammar_spec(fmt)
        if spec is not None:
            self._compile(spec)
        return spec

    def _compile(self, spec: str) -> None:
        """Compile ``spec`` for this model (cached), or refuse the request."""
        if self.tok is None:
            raise NoTokenizer("response_format needs the model's tokenizer (the grammar masks "
                              "tokens by their text), and this model has none; add its "
                              "tokenizer.json or leave response_format out")
        # imported here: xgrammar and transformers load only for a first format
        from stages.model.grammar import GrammarError, GrammarVocab

        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarVocab(self.tok, self.vocab)
            try:
                self._grammars.constraint(spec)
            except GrammarError as e:
                raise FormatError(f"response_format: {e}") from None
