"""OpenAI's ``response_format``, as the grammar a request's tokens must follow.

Torch-free and library-free: the gateway and the wire read it here; the grammar library
compiles it in :mod:`stages.model.grammar`.  A request carries its format as one canonical
JSON text (:func:`grammar_spec`), ``{"type": "json_object"}`` or ``{"type": "json_schema",
"schema": {...}}``, so equal formats compile once per process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

MAX_FORMAT_BYTES = 64 * 1024  # a schema's canonical JSON text at most
KINDS = ("json_object", "json_schema")


class FormatError(ValueError):
    """A ``response_format`` that is not one treepipe can constrain decoding to."""


def grammar_spec(fmt: object) -> str | None:
    """The canonical grammar text of OpenAI's ``response_format`` object (None: plain
    text, no constraint); raises FormatError saying what is wrong."""
    if not isinstance(fmt, Mapping):
        raise FormatError(f"response_format must be an object, got {fmt!r:.80}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _canonical({"type": "json_object"})
    if kind != "json_schema":
        raise FormatError(f"response_format type must be text, json_object or json_schema, "
                          f"got {kind!r:.80}")
    js = fmt.get("json_schema")
    # OpenAI nests the schema under json_schema.schema; some clients send it directly
    schema = js.get("schema", js.get("json_schema")) if isinstance(js, Mapping) else None
    if not isinstance(schema, Mapping | bool):
        raise FormatError("response_format json_schema needs json_schema.schema, a JSON "
                          "Schema object")
    return _canonical({"type": "json_schema", "schema": schema})


def check_spec(spec: object) -> str:
    """``spec`` as :func:`grammar_spec` wrote it, checked (a request read off the wire)."""
    if not isinstance(spec, str):
        raise FormatError(f"response_format must be a JSON text, got {spec!r:.80}")
    if len(spec.encode()) > MAX_FORMAT_BYTES:
        raise FormatError(f"response_format is {len(spec.encode())} bytes; send at most "
                          f"{MAX_FORMAT_BYTES} (64 KiB)")
    try:
        d = json.loads(spec)
    except ValueError as e:
        raise FormatError(f"response_format is not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("type") not in KINDS:
        raise FormatError(f"response_format type must be one of {', '.join(KINDS)}")
    if d["type"] == "json_schema" and not isinstance(d.get("schema"), dict | bool):
        raise FormatError("response_format json_schema needs a schema object")
    return spec


def _canonical(d: Mapping[str, object]) -> str:
    """One text per format: no spaces, keys in the order sent (a schema's property order
    is the order of the JSON it asks for); bounded by MAX_FORMAT_BYTES."""
    try:
        text = json.dumps(d, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise FormatError(f"response_format is not plain JSON: {e}") from None
    return check_spec(text)
