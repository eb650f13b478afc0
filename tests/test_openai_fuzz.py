"""Hypothesis fuzz of the OpenAI HTTP API of a running pipeline (issue 41's fuzz suite).

One pipeline serves the module (tests/test_openai_api.py's ``pipe``: the tiny model with
a character tokenizer and a chat template, `treepipe up`).  Two kinds of bodies go to
/v1/chat/completions, /v1/completions, /tokenize and /detokenize:

- **schema bodies**, drawn from the OpenAPI document the gateway serves
  (``GET /openapi.json``): every declared field, with values within its declared type
  and bounds (the model validators' cross-field rules may still refuse them);
- **hostile bodies**: a valid body with one field (declared or unknown), or a value
  inside one (a message, a tool, a prompt list, a logit_bias entry), set to a wrong JSON
  type, an integer past 2^64, a lone surrogate (escaped, or as raw invalid UTF-8), NaN,
  JSON nested up to 100 000 deep, an unknown key; or a whole body that is empty, not
  JSON, cut short, not an object, or names a key twice.

Every answer is a 2xx whose body fits the declared response model (a stream ends with
``[DONE]`` and no server error event), or a 4xx with OpenAI's error shape, a one-line
message and, where one parameter was broken, ``param`` naming it; never a 5xx.  After
each fuzz the gateway's log has no traceback and no internal error, and a greedy request
still returns ar's tokens.

The runs are derandomized (the same examples every run).  TREEPIPE_FUZZ_EXAMPLES sets the
examples per test and route (default 25: 200 requests in all, about 10 s); a long run is
``TREEPIPE_FUZZ_EXAMPLES=2000 pytest tests/test_openai_fuzz.py`` (docs/reliability.md).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.serving.openai_models import REQUESTS, RESPONSES, ErrorResponse
from tests.schema_strategies import json_values, objects
from tests.test_openai_api import KEY, ar, pipe  # noqa: F401 - pipe: the module's pipeline
from tests.tiny_models import PROMPT

EXAMPLES = int(os.environ.get("TREEPIPE_FUZZ_EXAMPLES", "25"))
ROUTES = sorted(REQUESTS)
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
# A request the schema accepts may generate for long: null max_tokens is 256 tokens, n 64
# choices.  The schema bodies keep these within small bounds (their full ranges are
# tests/test_openai_models.py's, in process) so that a run stays seconds long.
CHEAP: dict[str, dict[str, Any]] = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 3},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "best_of": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 2}, {"type": "null"}]},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
}
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the OpenAPI document as hypothesis strategies -------------------------------------
def schema_bodies(route: str, doc: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies of ``route`` drawn from the served OpenAPI document, the cost fields
    (CHEAP) bounded and max_tokens always set (its default, 256 tokens, is slow here)."""
    schemas = doc["components"]["schemas"]
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    node = dict(schemas[ref["$ref"].rsplit("/", 1)[1]])
    props = {k: CHEAP.get(k, v) for k, v in node["properties"].items()}
    if "max_tokens" in props:
        node["required"] = [*node.get("required", ()), "max_tokens"]
    # a few optional fields at a time: a body with all thirty is refused by one of them
    return objects({**node, "properties": props}, schemas, most=4)


# ---- hostile bodies --------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is (json.dumps cannot write it)."""

    text: str


def deep(depth: int, kind: str) -> Raw:
    return Raw("[" * depth + "]" * depth if kind == "list" else
               '{"a": ' * depth + "1" + "}" * depth)


HOSTILE_VALUES: st.SearchStrategy[Any] = st.one_of(
    json_values(),  # a wrong JSON type for most fields
    st.sampled_from([None, True, False, "", "false", "true", "1", "-1", [], {}, [True, False],
                     -1, 0, -5, 1.5, -0.0, 1e308, math.nan, math.inf, -math.inf]),
    st.integers(min_value=2**31 - 2, max_value=2**200) | st.integers(-(2**200), -(2**31)),
    st.lists(st.integers(2**31 - 2, 2**70), min_size=1, max_size=2),
    st.sampled_from(["\ud800", "a\udfff", "x\ud83d"]),  # lone surrogates
    st.sampled_from([["\ud800"], [{"role": "user", "content": "\udc00"}],
                     [{"type": "text", "text": "\ud800"}]]),
    st.builds(deep, st.sampled_from([150, 250, 1000, 100_000]), st.sampled_from(["list",
                                                                                 "dict"])),
    st.text(max_size=30),  # any text, control characters included
)
NOT_AN_OBJECT: st.SearchStrategy[bytes] = st.one_of(
    st.sampled_from([b"", b" ", b"null", b"[]", b"42", b'"x"', b"true", b"{", b"}",
                     b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b'{"a": 1, "a": 2}',
                     b'{"prompt": "\xed\xa0\x80"}', b"\x00" * 8, b"NaN"]),
    st.binary(max_size=40),
)


def to_json(v: Any, raw_surrogates: bool) -> str:
    """``v`` as JSON text: values as json.dumps writes them, Raw ones as they are; with
    ``raw_surrogates`` a lone surrogate stays a character (written out as its invalid
    UTF-8 bytes by :func:`encode`) instead of a \\u escape."""
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=not raw_surrogates)}: "
                               f"{to_json(x, raw_surrogates)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(to_json(x, raw_surrogates) for x in v) + "]"
    return json.dumps(v, ensure_ascii=not raw_surrogates)


def encode(body: dict[str, Any], raw_surrogates: bool) -> bytes:
    return to_json(body, raw_surrogates).encode("utf-8", "surrogatepass")


# Valid bodies with nested parts to break: a parameter broken deep inside is still named
RICH: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f",
                                                             "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object"}}}],
        "tool_choice": "none", "stream_options": {"include_usage": True},
        "logit_bias": {"1": 1}, "stop": ["x"], "stop_token_ids": [1], "max_tokens": 2},
    "/v1/completions": {"prompt": [[1, 2], [3]], "stop": ["a"], "logit_bias": {"1": 1},
                        "stop_token_ids": [1], "stream_options": {"include_usage": True},
                        "max_tokens": 2},
    "/tokenize": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "/detokenize": {"tokens": [1, 2, 3]},
}


def nested(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of the values inside ``node``'s parameters (two levels down or more)."""
    out = [path] if len(path) >= 2 else []
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for k, v in items:
        out += nested(v, (*path, k))
    return out


@st.composite
def hostile_bodies(draw: st.DrawFn, route: str) -> tuple[bytes, str | None]:
    """A hostile body of ``route`` and the field it broke (None: the whole body)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(NOT_AN_OBJECT), None
    if draw(st.integers(0, 2)) == 0:  # inside a parameter: a value, or an unknown key
        body = copy.deepcopy(RICH[route])
        path = draw(st.sampled_from(nested(body)))
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent["unknown_field"] = draw(HOSTILE_VALUES)
        else:
            parent[path[-1]] = draw(HOSTILE_VALUES)
        return encode(body, raw_surrogates=draw(st.booleans())), path[0]
    fields = sorted(REQUESTS[route].model_fields)
    name = draw(st.sampled_from(fields) | st.sampled_from(["unknown_field", "Prompt", "",
                                                           "max tokens", "\ud800"]))
    body: dict[str, Any] = {**VALID[route], name: draw(HOSTILE_VALUES)}
    raw = encode(body, raw_surrogates=draw(st.booleans()))
    if name == "\ud800":  # a key that is no JSON string breaks the body, not a parameter
        return raw, None
    if draw(st.integers(0, 7)) == 0:  # cut short, or the key twice
        raw = raw[:draw(st.integers(0, len(raw) - 1))] if draw(st.booleans()) else \
            raw[:-1] + b", " + raw[1:]
        return raw, None
    return raw, name


# ---- the checks ------------------------------------------------------------------------
def check(route: str, r: httpx.Response, broken: str | None, statuses: Counter[Any]) -> None:
    """One answer: a 2xx of the declared shape, or a one-line 4xx naming ``broken``;
    ``statuses`` counts the codes and, for 4xx, the parameters named."""
    statuses[r.status_code] += 1
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = ErrorResponse.model_validate(r.json()).error  # OpenAI's shape, every field
        msg = err.message
        assert msg and "\n" not in msg and "Traceback" not in msg and len(msg) < 600, msg
        assert err.type == "invalid_request_error", err
        statuses[(r.status_code, err.param)] += 1
        if broken is not None:  # the parameter it broke is the one named
            assert err.param == broken, (broken, err)
        return
    assert r.status_code == 200, r.text[:500]
    if r.headers["Content-Type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for e in events[:-1]:
            obj = json.loads(e)
            assert "error" not in obj or obj["error"]["type"] != "server_error", obj
            if "error" not in obj:
                RESPONSES[route][1].model_validate(obj)
    elif route in RESPONSES:
        RESPONSES[route][0].model_validate(r.json())
    else:
        assert isinstance(r.json(), dict)


@pytest.fixture(scope="module")
def client(pipe: dict) -> Iterator[httpx.Client]:  # noqa: F811 - the imported fixture
    with httpx.Client(base_url=pipe["url"], timeout=60,
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"}) as c:
        yield c


def gateway_log(pipe: dict) -> Path:  # noqa: F811
    return Path(pipe["model"]).parent / "cache" / "run" / "httptest" / "gateway.log"


def still_sound(pipe: dict, client: httpx.Client, log_from: int) -> None:  # noqa: F811
    """No traceback or internal error logged since ``log_from``; ar's greedy tokens."""
    logged = gateway_log(pipe).read_text(errors="replace")[log_from:]
    assert not re.search(r"Traceback|internal error", logged), logged[-3000:]
    r = client.post("/v1/completions", content=json.dumps(
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}))
    assert r.json()["choices"][0]["token_ids"] == ar(PROMPT, 8)


def log_size(pipe: dict) -> int:  # noqa: F811
    return len(gateway_log(pipe).read_text(errors="replace"))


@pytest.mark.parametrize("route", ROUTES)
def test_schema_bodies(pipe: dict, client: httpx.Client, route: str) -> None:  # noqa: F811
    """Bodies drawn from the served /openapi.json: 200s and one-line 400s only."""
    doc = client.get("/openapi.json").json()
    start, statuses = log_size(pipe), Counter[Any]()

    @SETTINGS
    @given(body=schema_bodies(route, doc))
    def one(body: dict[str, Any]) -> None:
        check(route, client.post(route, content=json.dumps(body)), None, statuses)

    one()
    # the fuzz reaches both the pipeline and the refusals
    assert statuses[200] and statuses[400], statuses
    still_sound(pipe, client, start)


@pytest.mark.parametrize("route", ROUTES)
def test_hostile_bodies(pipe: dict, client: httpx.Client, route: str) -> None:  # noqa: F811
    """Wrong types, huge ints, lone surrogates, deep nesting, unknown fields, broken bytes:
    4xx naming the field (or 200 where the value happens to fit), never a 5xx."""
    start, statuses = log_size(pipe), Counter[Any]()

    @SETTINGS
    @given(case=hostile_bodies(route))
    def one(case: tuple[bytes, str | None]) -> None:
        raw, broken = case
        check(route, client.post(route, content=raw), broken, statuses)

    one()
    assert statuses[400], statuses
    still_sound(pipe, client, start)
