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

from orchestrator.serving.openai_api import (
    chat_ids,
    parse,
    to_generate_request,
    to_generate_requests,
)
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
        to_generate_requests(body)  # protobuf range errors here would be 500s


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


def test_choices_seeds_and_order() -> None:
    """Prompt p's choice j is choice p * n + j and samples with seed + j; best_of must be
    n; seed + n - 1 must fit uint64."""
    body = parse(CompletionRequest, json.dumps(
        {"prompt": [[1, 2], [3]], "n": 3, "best_of": 3, "seed": 7}).encode())
    reqs = to_generate_requests(body)
    assert [list(r.prompt_ids) for r in reqs] == [[1, 2]] * 3 + [[3]] * 3
    assert [r.sampling.seed for r in reqs] == [7, 8, 9] * 2
    unseeded = to_generate_requests(parse(CompletionRequest, b'{"prompt": ["a", "b"], "n": 2}'))
    assert [r.prompt for r in unseeded] == ["a", "a", "b", "b"]
    assert not any(r.sampling.HasField("seed") for r in unseeded)  # the runner draws each
    for raw, param, words in (
            ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of (1) must equal n (2)"),
            ({"prompt": "x", "n": 2, "seed": 2**64 - 1}, "seed", "seed + n - 1 must be below"),
            ({"prompt": "x", "n": 65}, "n", "n must be in [1, 64]"),
            ({"prompt": [[1], []]}, "prompt", "prompt[1] is empty"),
            ({"prompt": "x", "echo": "yes"}, "echo", "echo must be a boolean")):
        with pytest.raises(RequestError) as e:
            parse(CompletionRequest, json.dumps(raw).encode())
        assert e.value.param == param and words in str(e.value), str(e.value)


def tok_with(template: str) -> Any:
    from tokenizers import Tokenizer, decoders, models

    from stages.model.tokenizer import TextTokenizer

    chars = "abcdefghijklmnopqrstuvwxyz<>[];:_ \n"
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return TextTokenizer(tok, chat_template=template)


TOOLS = [{"type": "function", "function": {"name": "f"}}]
GENERIC = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
ROLES = ("{% for m in messages %}{% if m.role in ['user', 'assistant', 'system'] %}"
         "<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")


def chat(messages: list[dict[str, Any]], tools: Any = None) -> ChatRequest:
    return parse(ChatRequest, json.dumps({"messages": messages, "tools": tools,
                                          "tool_choice": "none" if tools else None}).encode())


def test_what_the_template_would_drop_is_a_400() -> None:
    """tools the template ignores, a tool turn it leaves out, tool_calls it does not show:
    400s naming tools or messages[i], never a prompt without them."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "ok"}
    user = {"role": "user", "content": "hi"}
    for template, body, param, words in (
            (GENERIC, chat([user], TOOLS), "tools", "does not use tools"),
            (ROLES, chat([user, result]), "messages", "messages[1]: the model's chat template "
                                                      "leaves tool messages out"),
            (GENERIC, chat([user, call]), "messages", "leaves an assistant's tool_calls out")):
        with pytest.raises(RequestError) as e:
            chat_ids(tok_with(template), 512, body.messages, body.template_tools())
        assert e.value.param == param and words in str(e.value), str(e.value)
    # rendered where the template reads them; developer as system
    uses = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in "
            "messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
            ";{{ c.function.name }}{% endfor %}{% endfor %}")
    body = chat([{"role": "developer", "content": "x"}, user, call, result], TOOLS)
    tok = tok_with(uses)
    got = chat_ids(tok, 512, body.messages, body.template_tools())
    assert tok.decode(got) == "[f]<system>x<user>hi<assistant>;f<tool>ok"
    with pytest.raises(RequestError, match="more than this pipeline's context"):
        chat_ids(tok, 4, chat([{"role": "user", "content": "a" * 200}]).messages, None)


@pytest.mark.parametrize("raw, param", [
    # found by tests/test_openai_fuzz.py: a lone surrogate or too deep a nesting inside one
    # parameter's value was a 400 with param null; it names the parameter now
    (b'{"prompt": "hi", "best_of": "\\ud800"}', "best_of"),
    (b'{"prompt": "\xc3\xa9", "stop": ["a", "\\udc00"]}', "stop"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # the surrogate's raw bytes: invalid UTF-8
    (b'{"prompt":\n "x",\n "user": ' + b"[" * 1000 + b"]" * 1000 + b"}", "user"),
    (b'{"prompt": ["a\\"]", "\\ud800"]}', "prompt"),  # a quote inside an earlier string
    (b'{"bogus": {"prompt": 1, "y": "\\udc00"}}', "bogus"),  # a nested key is no parameter
    # no one parameter: the body's own nesting, a broken key, text after the object
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"a\\ud800": 1}', None),
    (b'{"prompt": "x"} "\\ud800"', None),
    (b"", None),
])
def test_invalid_json_names_the_parameter_it_is_in(raw: bytes, param: str | None) -> None:
    with pytest.raises(RequestError) as e:
        parse(CompletionRequest, raw)
    assert e.value.param == param and "is not valid JSON" in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{param}: " if param else "the body"), str(e.value)
