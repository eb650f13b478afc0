"""The OpenAI API's declared request models, in process (no pipeline): a fuzz over every
field with values of every JSON type and edge, and over broken bytes.

Each body either parses, and then maps onto a GenerateRequest without error (every
bounded integer fits the wire format), or is refused with a RequestError: one line,
INVALID_ARGUMENT, naming the parameter.  Nothing else may escape: anything else would
be a 500.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import grpc
import pytest

from orchestrator.serving.openai_api import parse, to_generate_request
from orchestrator.serving.openai_models import (
    INT32_MAX,
    REQUESTS,
    ChatRequest,
    CompletionRequest,
    openapi,
)
from orchestrator.serving.runner import RequestError

VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
deep: list[Any] = []
for _ in range(300):
    deep = [deep]
ODD: list[Any] = [None, True, False, 0, -1, -5, 1, 2, 2**31, 2**63, 2**64, -(2**63), 1.5,
                  -0.0, 1e308, math.nan, math.inf, "", "false", "1", "\x00", "a" * 10_000,
                  [], [0], [True], [-1], [INT32_MAX + 1], ["a"], ["a", "b"], [[1]], [[]],
                  [None], {}, {"type": "text"}, {"type": "json_object"},
                  {"role": "user", "content": "x"}, [{"role": "user"}],
                  [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                  [{"role": "developer", "content": "x"}], {"include_usage": "yes"}, deep]


def check(route: str, raw: bytes) -> None:
    """``raw`` on ``route`` parses and maps cleanly, or is a one-line 400."""
    try:
        body = parse(REQUESTS[route], raw)
    except RequestError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg and len(msg) < 600, msg
        return
    if isinstance(body, ChatRequest | CompletionRequest):
        to_generate_request(body)  # protobuf range errors here would be 500s


@pytest.mark.parametrize("route", sorted(VALID))
def test_every_field_with_every_odd_value(route: str) -> None:
    fields = [*REQUESTS[route].model_fields, "unknown_field"]
    for name in fields:
        for value in ODD:
            raw = json.dumps({**VALID[route], name: value}).encode()  # NaN, Infinity too
            check(route, raw)


@pytest.mark.parametrize("route", sorted(VALID))
def test_random_mutations(route: str) -> None:
    """Bodies built at random from the fields and the odd values, and broken bytes."""
    rng = random.Random(39 + len(route))
    fields = [*REQUESTS[route].model_fields, "unknown_field"]
    for _ in range(400):
        body = dict(VALID[route]) if rng.random() < 0.7 else {}
        for name in rng.sample(fields, rng.randint(1, min(4, len(fields)))):
            body[name] = rng.choice(ODD)
        raw = json.dumps(body).encode()
        if rng.random() < 0.3:  # cut, or a stray byte: invalid UTF-8 included
            cut = rng.randrange(len(raw) + 1)
            raw = raw[:cut] + bytes([rng.randrange(256)]) * rng.randint(0, 2) + raw[cut + 1:]
        check(route, raw)


@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b"42", b'"x"', b'{"prompt": "\xff"}',
                                 b'{"prompt": "a\\ud800"}', b"[" * 100_000 + b"]" * 100_000,
                                 b'{"prompt": "x", "prompt": [1]}'])
def test_broken_bodies(raw: bytes) -> None:
    check("/v1/completions", raw)


def test_bounds_fit_the_wire_format() -> None:
    """The largest values the models accept map onto the proto's int32/uint64 fields."""
    body = parse(CompletionRequest, json.dumps(
        {"prompt": [INT32_MAX], "max_tokens": INT32_MAX, "top_k": INT32_MAX,
         "seed": 2**64 - 1}).encode())
    req = to_generate_request(body)
    assert (req.prompt_ids[0], req.max_tokens, req.sampling.top_k, req.sampling.seed) == (
        INT32_MAX, INT32_MAX, INT32_MAX, 2**64 - 1)
    # top_k -1 and 0 are off, as in vLLM
    for k in (-1, 0):
        body = parse(CompletionRequest, json.dumps({"prompt": "x", "top_k": k}).encode())
        assert to_generate_request(body).sampling.top_k == 0


def test_openapi_document_is_json() -> None:
    doc = json.loads(json.dumps(openapi("1")))
    for route, model in REQUESTS.items():
        ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        assert ref["schema"]["$ref"].endswith(model.__name__)


def test_null_is_the_default() -> None:
    """OpenAI's spec makes most parameters nullable, and clients send null for "not set":
    null is the default, while a string is still no boolean or number."""
    nulls = {n: None for n in ("model", "temperature", "top_p", "top_k", "stream", "seed",
                               "stop", "max_tokens", "n", "logprobs", "presence_penalty",
                               "stop_token_ids", "ignore_eos", "user")}
    got = to_generate_request(parse(CompletionRequest, json.dumps(
        {"prompt": "x", **nulls}).encode()))
    want = to_generate_request(parse(CompletionRequest, b'{"prompt": "x"}'))
    assert got == want and got.sampling.temperature == 1.0
    for name, value in (("temperature", "1"), ("stream", "false"), ("top_k", "5")):
        with pytest.raises(RequestError, match=f"^{name} must be"):
            parse(CompletionRequest, json.dumps({"prompt": "x", name: value}).encode())
