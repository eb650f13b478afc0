"""The OpenAI-compatible HTTP API and /metrics of a running pipeline (tiny model, `treepipe up`).

One pipeline serves the module, with a character-level tokenizer and a chat
template added to the tiny model so that text and chat requests work, and an
API key in the gateway's environment.  Clients: the official ``openai`` package
and raw HTTP (httpx).  Every generation is compared with in-process ``ar``.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models

from orchestrator.deploy.launcher import state_sync
from orchestrator.deploy.run_state import RunState
from orchestrator.serving.client import Client
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import (
    check_own_tokens,
    mixed_clients,
    run_clients,
    tiny_manifest,
    tiny_model_folder,
)
from tests.tiny_models import PROMPT, target_shards

KEY = "sk-test-0123456789"
CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,!?:;'\"()-_/<>|=+*\n#@$%&[]~^"[:64]
# the template the gateway serves (gateway.chatTemplate, treepipe serve --chat-template):
# it shows the model the tools' names and the assistant's tool calls
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
            "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# the model folder's own, which the file replaces
FOLDER_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"


def add_tokenizer(folder: Path) -> None:
    """A character-level tokenizer over the tiny model's 64 ids, with a chat template."""
    assert len(CHARS) == 64
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template":
                                                              FOLDER_TEMPLATE}))


def ar(prompt: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    return PipelineEngine(target_shards(1)).generate(prompt, n, sampling, method="ar").tokens


def text_of(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("http")
    model = tiny_model_folder(root / "model")
    add_tokenizer(model)
    manifest = root / "http.yaml"
    (root / "chat.jinja").write_text(TEMPLATE)
    spec = yaml.safe_load(tiny_manifest("httptest", model, transport="zmq", split="balanced",
                                        http=True))
    spec["spec"]["gateway"]["chatTemplate"] = str(root / "chat.jinja")
    manifest.write_text(yaml.safe_dump(spec))
    tok = TextTokenizer.from_folder(model)
    tok.use_chat_template(TEMPLATE)
    env = dict(os.environ, TREEPIPE_CACHE=str(root / "cache"), TREEPIPE_API_KEY=KEY)
    run = [sys.executable, "-m", "orchestrator"]
    res = subprocess.run([*run, "up", "-f", str(manifest), "--detach"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    try:
        state = RunState.model_validate_json(
            (root / "cache" / "run" / "httptest" / "state.json").read_text())
        sync = state_sync(state, "httptest")
        http = sync.r.get(sync.key("gateway", "http")).decode()
        url = f"http://127.0.0.1:{http.rsplit(':', 1)[1]}"
        yield {"url": url, "grpc": res.stdout.strip().splitlines()[-1], "model": str(model),
               "tok": tok,
               "oai": openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)}
    finally:
        subprocess.run([*run, "down", "-f", str(manifest)], env=env, timeout=120)


def post(pipe: dict, path: str, body: object, key: str | None = KEY, **kw: object
         ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(pipe["url"] + path, content=data, timeout=120,
                      headers={**headers, "Content-Type": "application/json", **kw})


def test_concurrent_clients_over_zmq_links(pipe: dict) -> None:
    """A mixed load decoded as one batch (zmq links): each client gets its own ar tokens."""
    loads = mixed_clients()
    run_clients(pipe["grpc"], loads, api_key=KEY)
    check_own_tokens(loads, ar)


def test_models_health_version_and_request_id(pipe: dict) -> None:
    models = pipe["oai"].models.list().data
    assert [m.id for m in models] == [pipe["model"]]
    assert 0 < time.time() - models[0].created < 3600  # the server's start, as vLLM's
    assert httpx.get(pipe["url"] + "/health").json()["status"] == "ok"
    assert httpx.get(pipe["url"] + "/version").status_code == 200
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
             **{"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "abc-123"
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert len(r.headers["X-Request-Id"]) >= 16
    tok = post(pipe, "/tokenize", {"prompt": "hello"}).json()
    assert tok["count"] == 5 and tok["tokens"] == [CHARS.index(c) for c in "hello"]
    assert post(pipe, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "hello"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_lossless(pipe: dict, sampled: bool, stream: bool) -> None:
    sp = SamplingParams(0.8, 0.95, 0, 5) if sampled else SamplingParams()
    want = ar(PROMPT, 30, sp)
    kw = dict(model=pipe["model"], prompt=PROMPT, max_tokens=30, temperature=sp.temperature,
              top_p=sp.top_p, seed=sp.seed, extra_body={"return_token_ids": True})
    if stream:
        ids, text, usage, reasons = [], "", None, []
        for ev in pipe["oai"].completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw):
            if ev.usage:
                usage = ev.usage
            for ch in ev.choices:
                ids += ch.model_extra["token_ids"]
                text += ch.text
                reasons.append(ch.finish_reason)
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    else:
        out = pipe["oai"].completions.create(**kw)
        ids, text, usage = out.choices[0].model_extra["token_ids"], out.choices[0].text, out.usage
        assert out.choices[0].finish_reason == "length"
    assert ids == want
    assert text == text_of(want)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 30)


def test_unseeded_sampling_is_random(pipe: dict) -> None:
    """Without a seed each sampled request draws its own (two differ: 40 tokens over 64
    ids), reports it in treepipe_stats, and that seed reproduces ar's tokens; temperature
    left out is OpenAI's 1.0."""
    body = {"prompt": PROMPT, "max_tokens": 40, "return_token_ids": True,
            "treepipe_stats": True}
    raw = post(pipe, "/v1/completions", {**body, "temperature": 1.0}).json()
    # the official client, temperature left out
    oai = pipe["oai"].completions.create(model=pipe["model"], prompt=PROMPT, max_tokens=40,
                                         extra_body={"return_token_ids": True,
                                                     "treepipe_stats": True})
    ids = [raw["choices"][0]["token_ids"], oai.choices[0].model_extra["token_ids"]]
    seeds = [raw["treepipe_stats"]["seed"], oai.model_extra["treepipe_stats"]["seed"]]
    assert ids[0] != ids[1] and seeds[0] != seeds[1]
    for got, seed in zip(ids, seeds, strict=True):
        assert got == ar(PROMPT, 40, SamplingParams(1.0, 1.0, 0, seed))
    again = post(pipe, "/v1/completions", {**body, "seed": seeds[0]}).json()
    assert again["choices"][0]["token_ids"] == ids[0]
    assert again["treepipe_stats"]["seed"] == seeds[0]
    # gRPC agrees: no seed (treepipe.proto's optional seed) draws one, seed 0 is seed 0
    with Client(pipe["grpc"], api_key=KEY) as c:
        drawn = [c.generate(prompt_ids=PROMPT, max_tokens=40, temperature=1.0).tokens
                 for _ in range(2)]
        zero = c.generate(prompt_ids=PROMPT, max_tokens=40, temperature=1.0, seed=0).tokens
    assert drawn[0] != drawn[1]
    assert zero == ar(PROMPT, 40, SamplingParams(1.0, 1.0, 0, 0))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_lossless(pipe: dict, stream: bool) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = pipe["tok"].chat_ids(msgs)
    want = text_of(ar(prompt, 25))
    kw = dict(model=pipe["model"], messages=msgs, max_completion_tokens=25, temperature=0)
    if stream:
        evs = list(pipe["oai"].chat.completions.create(stream=True, **kw))
        assert evs[0].choices[0].delta.role == "assistant"
        got = "".join(e.choices[0].delta.content or "" for e in evs)
        assert evs[-1].choices[0].finish_reason == "length"
    else:
        out = pipe["oai"].chat.completions.create(**kw)
        got = out.choices[0].message.content
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 25
    assert got == want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string(pipe: dict, stream: bool) -> None:
    full = text_of(ar(PROMPT, 60))
    stop = full[20:23]
    want = full[:full.index(stop)]
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stop": [stop, "~~~"],
            "stream": stream}
    r = post(pipe, "/v1/completions", body)
    assert r.status_code == 200
    if stream:
        lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        evs = [json.loads(x) for x in lines[:-1]]
        text = "".join(e["choices"][0]["text"] for e in evs)
        reason = evs[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (text, reason) == (want, "stop")


@pytest.mark.parametrize("body, key, status, words", [
    ({"prompt": PROMPT, "model": "llama-9000"}, KEY, 404, "unknown model"),
    ({"prompt": PROMPT, "n": 0}, KEY, 400, "n must be in [1, 64], got 0"),
    ({"prompt": PROMPT, "max_tokens": -1}, KEY, 400, "max_tokens must be >= 1"),
    ('{"prompt": [1, 2], "temperature": NaN}', KEY, 400, "temperature must be a finite"),
    ({"prompt": PROMPT, "top_p": 1.5}, KEY, 400, "top_p must be in (0, 1]"),
    ({"prompt": PROMPT, "max_tokens": 481}, KEY, 400, "exceeds this pipeline"),
    ('{"prompt": [1, 2', KEY, 400, "not valid JSON"),
    ({"prompt": PROMPT}, None, 401, "API key"),
    ({"prompt": PROMPT}, "wrong", 401, "API key"),
    # a JSON string is no boolean: "false" neither streams nor ignores EOS
    ({"prompt": PROMPT, "stream": "false"}, KEY, 400, "stream must be a boolean"),
    ({"prompt": PROMPT, "ignore_eos": "false"}, KEY, 400, "ignore_eos must be a boolean"),
    ({"prompt": PROMPT, "top_k": -5}, KEY, 400, "top_k must be -1 or 0 (off)"),
    ({"prompt": PROMPT, "max_tokens": 2**31}, KEY, 400, "max_tokens must be <= 2147483647"),
    ({"prompt": PROMPT, "top_k": 2**31}, KEY, 400, "top_k must be"),
    ({"prompt": [1, 2**31]}, KEY, 400, "token ids in [0, 2147483647]"),
    ({"prompt": [1, True]}, KEY, 400, "prompt[1] is true"),
    ({"prompt": [1, 64]}, KEY, 400, "prompt token ids must lie in [0, 64)"),
    ('{"prompt": "a\\ud800b"}', KEY, 400, "lone surrogates"),
    ("[" * 100_000 + "]" * 100_000, KEY, 400, "nested at most 200 deep"),
    ({"prompt": PROMPT, "max_tokenz": 3}, KEY, 400, "unknown parameter 'max_tokenz'"),
    ({"prompt": ["ab", ""]}, KEY, 400, "prompt[1] is empty"),
    ({"prompt": PROMPT, "n": 2, "best_of": 3}, KEY, 400, "best_of (3) must equal n (2)"),
    ({"prompt": ["ab"] * 9, "n": 8}, KEY, 400, "72 choices; send at most 64"),
    ({"prompt": PROMPT, "seed": -1}, KEY, 400, "seed must be in [0, 2^64)"),
    ({"prompt": "a" * (9 << 20)}, KEY, 413, "the body is over 8 MiB"),
    # a prompt that fills the context; with max_tokens, one that leaves too little room
    ({"prompt": [1] * 512}, KEY, 400, "the prompt (512 tokens) leaves no room"),
    ({"prompt": [1] * 500, "max_tokens": 13}, KEY, 400, "+ max_tokens (13) exceeds the "
                                                         "context of 512"),
], ids=["model", "n", "neg-max", "nan-temp", "top-p", "too-long", "bad-json", "no-auth",
        "bad-auth", "stream-str", "ignore-eos-str", "top-k-neg", "max-int32", "top-k-int32",
        "id-int32", "id-bool", "id-vocab", "surrogate", "deep", "unknown", "prompt-list",
        "best-of", "choices", "neg-seed", "too-big", "full-context", "past-context"])
def test_bad_requests(pipe: dict, body: object, key: str | None, status: int,
                      words: str) -> None:
    r = post(pipe, "/v1/completions", body, key=key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and "\n" not in err["message"]
    assert "Traceback" not in r.text


def test_chat_errors_name_the_problem(pipe: dict) -> None:
    """Chat bodies: a lone surrogate in a message, roles and parts we do not serve."""
    for body, words in [
            ('{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "lone surrogates"),
            ({"messages": [{"role": "tool", "content": "hi"}]},
             "messages[0]: a tool message needs tool_call_id"),
            ({"messages": [{"role": "robot", "content": "hi"}]},
             "must be system, developer, user, assistant or tool"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
             "only text content parts"),
            ({"messages": []}, "messages must be a non-empty list"),
            ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "9"},
             "max_completion_tokens must be an integer")]:
        r = post(pipe, "/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and "Traceback" not in r.text


def test_tokenize_and_detokenize_are_strict(pipe: dict) -> None:
    """/detokenize [true, false] is no list of ids 1 and 0; /tokenize wants one input."""
    r = post(pipe, "/detokenize", {"tokens": [True, False]})
    assert r.status_code == 400 and "tokens[0] is true" in r.json()["error"]["message"]
    r = post(pipe, "/detokenize", {"tokens": [1, 2**40]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(pipe, "/tokenize", {})
    assert r.status_code == 400 and "send prompt (a string) or messages" in r.text
    assert post(pipe, "/tokenize", {"prompt": "hi"}, key=None).status_code == 401


# a value that asks for something, for each parameter refused unless neutral
ASKING = {"chat_template": "{{ messages }}", "function_call": {"name": "f"},
          "functions": [{"name": "f"}], "store": True, "suffix": "end",
          "skip_special_tokens": False, "spaces_between_special_tokens": False,
          "detokenize": False, "use_beam_search": True, "length_penalty": 0.5,
          "prompt_logprobs": 1, "truncate_prompt_tokens": 8, "guided_json": {},
          "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "root ::= a",
          "structured_outputs": {"json": {}}, "priority": 1, "service_tier": "flex",
          "add_generation_prompt": False, "continue_final_message": True,
          "chat_template_kwargs": {"enable_thinking": True}, "modalities": ["audio"],
          "reasoning_effort": "high"}


def test_parameter_table_matches_the_code() -> None:
    """docs/serving.md's parameter table is the models' (name, support, routes)."""
    import re

    from orchestrator.serving.openai_models import PARAMETERS, REFUSED

    doc = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (\w+) \|", doc, re.M)
    assert {n: (s, r) for n, s, r in rows} == PARAMETERS
    assert len(rows) == len(PARAMETERS)  # no parameter listed twice
    assert sorted(n for n, (s, _) in PARAMETERS.items() if s == REFUSED) == sorted(ASKING)


# the character vocabulary has no braces: an array of enums, in its characters
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
          "maxItems": 3}
COLORS_FORMAT = {"type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_json_schema_equals_ar_under_the_grammar(pipe: dict, sampling: dict) -> None:
    """The openai client's json_schema request through specpipe: JSON that validates,
    ended by the grammar (this model has no EOS), with ar's tokens under the same
    grammar; the chat route takes it too."""
    import jsonschema

    from protocol.requests.response_format import grammar_spec
    from stages.model.grammar import GrammarVocab

    out = pipe["oai"].completions.create(
        model=pipe["model"], prompt=PROMPT, max_tokens=40, **sampling,
        extra_body={"response_format": COLORS_FORMAT, "return_token_ids": True})
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.text), COLORS)
    assert choice.finish_reason == "stop"
    spec = grammar_spec(COLORS_FORMAT)
    params = SamplingParams(temperature=sampling["temperature"], seed=sampling.get("seed", 0),
                            response_format=spec)
    grammar = GrammarVocab(pipe["tok"], 64).constraint(spec)
    want = PipelineEngine(target_shards(1)).generate(PROMPT, 40, params, "ar",
                                                     constraint=grammar).tokens
    assert choice.token_ids == want  # type: ignore[attr-defined]
    chat = pipe["oai"].chat.completions.create(
        model=pipe["model"], messages=[{"role": "user", "content": "colors?"}],
        max_tokens=40, response_format=COLORS_FORMAT, **sampling)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), COLORS)


def test_json_schema_over_grpc(pipe: dict) -> None:
    """The gRPC client's response_format: the same tokens as the HTTP API's, and a bad
    schema is INVALID_ARGUMENT naming response_format."""
    from protocol.requests.response_format import grammar_spec
    from stages.model.grammar import GrammarVocab

    spec = grammar_spec(COLORS_FORMAT)
    want = PipelineEngine(target_shards(1)).generate(
        PROMPT, 40, SamplingParams(response_format=spec), "ar",
        constraint=GrammarVocab(pipe["tok"], 64).constraint(spec)).tokens
    with Client(pipe["grpc"], api_key=KEY) as c:
        out = c.generate(temperature=0,
                         prompt_ids=PROMPT, max_tokens=40, response_format=COLORS_FORMAT)
        assert out.tokens == want and out.finish_reason == "eos"
        with pytest.raises(grpc.RpcError) as e:
            c.generate(temperature=0,
                       prompt_ids=PROMPT, max_tokens=4, response_format={"type": "yaml"})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in (e.value.details() or "")


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"schema": {
    "type": "no-such-type"}}}, {"type": "json_object"}, {"type": "xml"}, "json",
    {"type": "json_schema", "json_schema": {"schema": {"description": "x" * 70000}}}],
    ids=["bad-schema", "no-brace-in-vocab", "bad-type", "not-object", "too-big"])
def test_bad_response_format_is_a_400(pipe: dict, fmt: object) -> None:
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                       "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "response_format" in err["message"], err


@pytest.mark.parametrize("name", sorted(ASKING))
def test_refused_parameters_are_named(pipe: dict, name: str) -> None:
    """Each refused parameter asked for is a 400 naming it; its neutral value is served."""
    from orchestrator.serving.openai_models import NEUTRAL, PARAMETERS

    chat = PARAMETERS[name][1] == "chat"
    route = "/v1/chat/completions" if chat else "/v1/completions"
    base = ({"messages": [{"role": "user", "content": "hi"}]} if chat
            else {"prompt": PROMPT}) | {"max_tokens": 2, "temperature": 0}
    r = post(pipe, route, {**base, name: ASKING[name]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["message"].startswith(name), err
    neutral = NEUTRAL[name][0]
    r = post(pipe, route, {**base, name: neutral[0] if neutral else None})
    assert r.status_code == 200, r.text


def test_a_missing_max_tokens_fits_the_context(pipe: dict) -> None:
    """Without max_tokens a text completion generates OpenAI's and vLLM's 16 tokens and a
    chat the gateway's default (here the manifest's 480), each cut to what the context
    holds after the prompt (vLLM's rule), never a 400 for a limit the client did not set;
    vLLM's own parameters at their defaults are served; the tokens are ar's."""
    usage = lambda r: (r.status_code, r.json()["usage"]["completion_tokens"])  # noqa: E731
    base = {"temperature": 0, "ignore_eos": True}
    assert usage(post(pipe, "/v1/completions", {"prompt": PROMPT, **base})) == (200, 16)
    r = post(pipe, "/v1/completions", {"prompt": [1] * 505, **base, "return_token_ids": True,
                                       "skip_special_tokens": True, "priority": 0,
                                       "metadata": {"team": "a"}})
    assert usage(r) == (200, 7)
    assert r.json()["choices"][0]["token_ids"] == ar([1] * 505, 7)
    tok = pipe["tok"]
    msgs = [{"role": "user", "content": "ab" * 240}]
    room = 512 - len(tok.chat_ids(msgs))
    assert 0 < room < 480
    r = post(pipe, "/v1/chat/completions", {"messages": msgs, **base,
                                            "add_generation_prompt": True,
                                            "parallel_tool_calls": False})
    assert usage(r) == (200, room)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_include_stop_str_in_output(pipe: dict, stream: bool) -> None:
    full = text_of(ar(PROMPT, 60))
    stop = full[20:23]
    want = full[:full.index(stop) + len(stop)]
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                                       "stop": stop, "include_stop_str_in_output": True,
                                       "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        evs = [json.loads(x[6:]) for x in r.text.splitlines()
               if x.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in evs)
    else:
        text = r.json()["choices"][0]["text"]
    assert text == want


def completion(pipe: dict, body: dict) -> tuple[list[int], str, str]:
    """Token ids, text and finish reason of a completion, whole or streamed."""
    r = post(pipe, "/v1/completions", {**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        ch = r.json()["choices"][0]
        return ch["token_ids"], ch["text"], ch["finish_reason"]
    evs = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    chs = [e["choices"][0] for e in evs if e["choices"]]
    return ([t for c in chs for t in c["token_ids"]], "".join(c["text"] for c in chs),
            chs[-1]["finish_reason"])


@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_token_ids(pipe: dict, stream: bool, include: bool) -> None:
    """The pipeline ends at a stop id as at EOS (ignore_eos or not): ar's tokens up to and
    with it; its text only with include_stop_str_in_output (vLLM's rule)."""
    full = ar(PROMPT, 40)
    firsts = [i for i in range(1, 40) if full[i] not in full[:i]]
    assert firsts, full
    k = firsts[-1]  # the latest first occurrence: the most tokens before it
    ids, text, reason = completion(pipe, {
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": stream,
        "stop_token_ids": [full[k]], "include_stop_str_in_output": include,
        "ignore_eos": True})
    assert ids == full[:k + 1]
    assert text == text_of(full[:k + 1] if include else full[:k])
    assert reason == "stop"
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "stop_token_ids": [64]})
    assert r.status_code == 400 and "stop_token_ids must lie in [0, 64)" in r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_penalties_and_logit_bias_equal_ar(pipe: dict, stream: bool) -> None:
    """Penalties, logit_bias and min_tokens over HTTP give in-process ar's tokens under
    the same parameters (seeded); out-of-range values are a 400 naming the parameter,
    and over gRPC an INVALID_ARGUMENT."""
    adjust = {"presence_penalty": 0.5, "frequency_penalty": 0.75, "repetition_penalty": 1.5,
              "logit_bias": {7: 4.0, 12: -100.0}, "min_tokens": 20}
    sp = SamplingParams(0.8, 0.95, 0, 5, **adjust)  # type: ignore[arg-type]
    eos = [PROMPT[3]]  # the tiny model's EOS: min_tokens holds it off
    want = PipelineEngine(target_shards(1)).generate(PROMPT, 30, sp, "ar", stop_ids=eos).tokens
    assert want != ar(PROMPT, 30, SamplingParams(0.8, 0.95, 0, 5))
    ids, text, _ = completion(pipe, {
        "prompt": PROMPT, "max_tokens": 30, "temperature": 0.8, "top_p": 0.95, "seed": 5,
        "stream": stream, "ignore_eos": True, "stop_token_ids": eos,
        **adjust, "logit_bias": {"7": 4.0, "12": -100.0}})
    assert ids == want and text.startswith(text_of(want[:20]))
    for name, value, words in (("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
                               ("repetition_penalty", 0, "repetition_penalty must be in (0"),
                               ("logit_bias", {"64": 1}, "logit_bias token id 64 is outside"),
                               ("logit_bias", {"x": 1}, "logit_bias must map token ids"),
                               ("min_tokens", 99, "min_tokens (99) must be at most max_tokens")):
        r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, name: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and words in err["message"], err
    with Client(pipe["grpc"], api_key=KEY) as c:
        got = c.generate(prompt_ids=PROMPT, max_tokens=30, temperature=0.8, top_p=0.95, seed=5,
                         ignore_eos=True, **adjust)
        assert got.tokens == ar(PROMPT, 30, sp)  # no stop id: EOS is ignored
        e = grpc_error(c, prompt_ids=PROMPT, frequency_penalty=-3.0)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details().startswith("frequency_penalty must be a finite number in [-2, 2]")


def test_openapi_schema(pipe: dict) -> None:
    """GET /openapi.json (open, as vLLM's): the four request bodies, strict types."""
    r = httpx.get(pipe["url"] + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize",
            "/detokenize"} <= set(doc["paths"])
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert chat["properties"]["stream"]["type"] == "boolean"
    assert chat["additionalProperties"] is False and chat["required"] == ["messages"]
    # what the gateway sends is what the schema declares, extensions included
    from orchestrator.serving.openai_models import RESPONSES, ErrorResponse

    chat_body = {"messages": [{"role": "user", "content": "hi"}]}
    for route, extra in (("/v1/completions", {"prompt": PROMPT}),
                         ("/v1/chat/completions", chat_body),
                         ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}),
                         ("/v1/chat/completions",
                          {**chat_body, "logprobs": True, "top_logprobs": 2})):
        whole, event = RESPONSES[route]
        body = {**extra, "max_tokens": 3, "return_token_ids": True, "treepipe_stats": True}
        whole.model_validate(post(pipe, route, body).json())
        r = post(pipe, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        for e in events[:-1]:
            event.model_validate_json(e)
    ErrorResponse.model_validate(post(pipe, "/v1/completions", {"prompt": 5}).json())


def test_openai_client_sees_errors(pipe: dict) -> None:
    with pytest.raises(openai.NotFoundError):
        pipe["oai"].completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        pipe["oai"].chat.completions.create(model=pipe["model"], n=2, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"best_of": 3})
    bad = openai.OpenAI(base_url=pipe["oai"].base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(pipe["url"] + "/v1/nothing", headers={
        "Authorization": f"Bearer {KEY}"}).json()["error"]["message"]


def test_grpc_refuses_nan_temperature(pipe: dict) -> None:
    with Client(pipe["grpc"], api_key=KEY) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_ids=PROMPT, temperature=math.nan)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature must be a finite" in err.value.details()


def grpc_error(c: Client, **kw: object) -> grpc.RpcError:
    """The error a generate call through ``c`` ends with."""
    with pytest.raises(grpc.RpcError) as err:
        c.generate(timeout_s=30, **kw)
    return err.value


def serving(c: Client, service: str = "") -> str:
    """The health of ``service`` once the gateway's watcher has set it (within 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return c.health(service)
        except grpc.RpcError:  # NOT_FOUND until the watcher's first pass
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_grpc_needs_the_api_key(pipe: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC wants the HTTP API's key as bearer metadata; health stays open for probes."""
    from orchestrator.cli.main import main
    from orchestrator.serving.gateway import SERVICE

    for key in ("", "wrong"):  # "": no key at all
        with Client(pipe["grpc"], api_key=key) as c:
            err = grpc_error(c, prompt_ids=PROMPT, max_tokens=4)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            assert "API key" in err.details() and "\n" not in err.details()
            assert serving(c) == serving(c, SERVICE) == "SERVING"
    with Client(pipe["grpc"], api_key=KEY) as c:
        assert c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=8).tokens == ar(PROMPT, 8)
    # treepipe generate --endpoint: the key from a file (or the environment), never argv
    monkeypatch.delenv("TREEPIPE_API_KEY", raising=False)
    monkeypatch.delenv("TREEPIPE_API_KEY_FILE", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    cmd = ["generate", "--endpoint", pipe["grpc"], "--prompt", text_of(PROMPT),
           "--max-new-tokens", "6", "--json"]
    assert main([*cmd, "--api-key-file", str(key_file)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ar(PROMPT, 6)
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert err.startswith("treepipe: error: unauthenticated: missing or wrong API key")
    assert err.count("\n") == 1


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (its own CA) and its key, made by openssl."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1,DNS:localhost",
                        "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no openssl command to make a test certificate")
    return cert, key


def test_grpc_and_http_over_tls(pipe: dict, tmp_path: Path) -> None:
    """A TLS gateway (in process, on the module pipeline's Redis): a client trusting its CA
    gets ar's tokens, a plaintext client gets nothing; kubelet's plaintext health port;
    the HTTP API over HTTPS from the same certificate."""
    from orchestrator.serving.auth import http_ssl_context, server_credentials
    from orchestrator.serving.gateway import Gateway, GatewayLimits, InferenceService
    from orchestrator.serving.openai_api import OpenAIServer
    from stages.model.checkpoint import load_model_args

    cert, key = self_signed(tmp_path)
    state = RunState.model_validate_json(
        (Path(pipe["model"]).parent / "cache" / "run" / "httptest" / "state.json").read_text())
    args = load_model_args(Path(pipe["model"]))
    tok = pipe["tok"]
    service = InferenceService(state_sync(state, "httptest"), pipe["model"], tok,
                               args.vocab_size, tok.eos_token_ids, GatewayLimits(512, 480))
    gw = Gateway(service, "127.0.0.1:0", api_key=KEY,
                 credentials=server_credentials(str(cert), str(key)),
                 health_listen="127.0.0.1:0").start()
    try:
        tls = f"127.0.0.1:{gw.port}"
        with Client(tls, api_key=KEY, tls_ca_file=str(cert)) as c:
            assert serving(c) == "SERVING"
            assert c.generate(temperature=0,
                              prompt_ids=PROMPT, max_tokens=8).tokens == ar(PROMPT, 8)
        with Client(tls, api_key="", tls_ca_file=str(cert)) as c:
            assert grpc_error(c, prompt_ids=PROMPT).code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(tls, api_key=KEY, tls_ca_file="") as c:  # plaintext to a TLS port
            assert grpc_error(c, prompt_ids=PROMPT).code() == grpc.StatusCode.UNAVAILABLE
        with Client(pipe["grpc"], api_key=KEY, tls_ca_file=str(cert)) as c:  # TLS to plaintext
            assert grpc_error(c, prompt_ids=PROMPT).code() == grpc.StatusCode.UNAVAILABLE
        # the health-only port answers probes in plaintext and serves nothing else
        with Client(f"127.0.0.1:{gw.health_port}", api_key="", tls_ca_file="") as c:
            assert serving(c) == "SERVING"
            assert grpc_error(c, prompt_ids=PROMPT).code() == grpc.StatusCode.UNIMPLEMENTED
        # the HTTP API serves HTTPS from the same pair, as `treepipe gateway` starts it
        http = OpenAIServer(service.runner, None, KEY).start(
            "127.0.0.1", 0, http_ssl_context(str(cert), str(key)))
        try:
            url = f"127.0.0.1:{http.port}/v1/models"
            auth = {"Authorization": f"Bearer {KEY}"}
            ok = httpx.get(f"https://{url}", headers=auth, timeout=10,
                           verify=ssl.create_default_context(cafile=str(cert)))
            assert ok.status_code == 200 and ok.json()["data"]
            with pytest.raises(httpx.HTTPError):  # plaintext to the HTTPS port
                httpx.get(f"http://{url}", headers=auth, timeout=10)
            with pytest.raises(httpx.HTTPError):  # a client that does not trust the CA
                httpx.get(f"https://{url}", headers=auth, timeout=10)
        finally:
            http.stop()
    finally:
        gw.stop(0)


def test_plaintext_http_beyond_loopback_needs_insecure() -> None:
    """The HTTP API follows the gRPC API's rule: no plaintext on a reachable address
    unless --insecure says so, and a TLS pair that is not one identity is one line."""
    from orchestrator.serving.auth import check_plaintext
    from protocol.errors import TreepipeError

    with pytest.raises(TreepipeError, match="refusing to serve HTTP in plaintext on "
                                            "0.0.0.0:8000.*--insecure"):
        check_plaintext("0.0.0.0:8000", tls=False, insecure=False, api="HTTP")
    check_plaintext("127.0.0.1:8000", tls=False, insecure=False, api="HTTP")
    check_plaintext("0.0.0.0:8000", tls=False, insecure=True, api="HTTP")


def scrape(pipe: dict) -> dict[tuple[str, tuple], float]:
    text = httpx.get(pipe["url"] + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_disconnect_cancels(pipe: dict) -> None:
    before = scrape(pipe)
    with httpx.stream("POST", pipe["url"] + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                       "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == ar(PROMPT, 8)
    after = scrape(pipe)
    key = ("treepipe_requests_total", (("finish_reason", "cancelled"),))
    assert after.get(key, 0) - before.get(key, 0) == 1
    # it stopped early: far fewer than the 400 tokens it asked for were generated
    gen = ("treepipe_generation_tokens_total", ())
    assert after[gen] - before[gen] < 300


def test_metrics_move_by_the_requests(pipe: dict) -> None:
    before = scrape(pipe)
    assert before[("treepipe_requests_running", ())] == 0
    assert before[("vllm:num_requests_waiting", (("model_name", pipe["model"]),))] == 0
    stats, n = [], [12, 20]
    for i, m in enumerate(n):
        r = post(pipe, "/v1/completions", {"prompt": PROMPT[i:], "max_tokens": m,
                                           "temperature": 0, "treepipe_stats": True})
        stats.append(r.json()["treepipe_stats"])
    after = scrape(pipe)

    def delta(name: str, **labels: str) -> float:
        k = (name, tuple(sorted(labels.items())))
        return after.get(k, 0) - before.get(k, 0)

    assert delta("treepipe_requests_total", finish_reason="length") == 2
    assert delta("treepipe_generation_tokens_total") == sum(n)
    assert delta("treepipe_prompt_tokens_total") == len(PROMPT) * 2 - 1
    assert delta("treepipe_time_to_first_token_seconds_count") == 2
    assert delta("treepipe_e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_count", model_name=pipe["model"]) == 2
    assert delta("treepipe_inter_token_latency_seconds_count") == sum(n) - 2
    assert delta("treepipe_spec_hits_total") == sum(s["hits"] for s in stats)
    assert delta("treepipe_spec_flushes_total") == sum(s["flushes"] for s in stats)
    assert delta("treepipe_spec_steps_total") == sum(s["steps"] for s in stats)
    assert delta("treepipe_spec_tokens_per_step_count") == 2
    for s, m in zip(stats, n, strict=True):
        # every token after each epoch's first was verified as a hit or a flush
        assert s["hits"] + s["flushes"] + s["epochs"] == m
        assert s["hit_rate"] == pytest.approx(s["hits"] / (s["hits"] + s["flushes"]), abs=1e-5)
    assert after[("treepipe_worker_up", (("worker", "stage2"),))] == 1
    assert ("vllm:kv_cache_usage_perc", (("model_name", pipe["model"]),)) in after
    # each stage reports its fixed KV pool (the manifest's budget) and the most it held
    for w in ("stage0", "stage1", "stage2"):
        blocks = after[("treepipe_worker_kv_blocks", (("worker", w),))]
        assert 0 < after[("treepipe_worker_kv_blocks_peak", (("worker", w),))] <= blocks
    assert ("treepipe_worker_kv_blocks", (("worker", "draft"),)) not in after
    # every worker arrived at every decode step of both requests; a worker writes its
    # heartbeat once it has handled the final verdict
    arrivals = sum(s["steps"] for s in stats)
    workers = ["draft", "stage0", "stage1", "stage2"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            delta("treepipe_worker_steps_total", worker=w) != arrivals for w in workers):
        time.sleep(0.2)
        after = scrape(pipe)
    for w in workers:
        assert delta("treepipe_worker_steps_total", worker=w) == arrivals, w
        assert delta("treepipe_worker_compute_seconds_total", worker=w) > 0, w
        assert delta("treepipe_worker_barrier_seconds_total", worker=w) > 0, w
        assert delta("treepipe_worker_prefill_seconds_total", worker=w) > 0, w
    # the draft sends levels, stages 0 and 1 hidden states; the last stage sends nothing
    for w in ["draft", "stage0", "stage1"]:
        assert delta("treepipe_worker_link_sent_bytes_total", worker=w) > 0, w
    assert delta("treepipe_worker_link_sent_bytes_total", worker="stage2") == 0
    assert delta("treepipe_worker_input_wait_seconds_total", worker="stage1") > 0
    assert delta("treepipe_worker_nodes_total", worker="stage2") >= sum(n) - 2


def test_top_once_shows_this_pipeline(pipe: dict, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`treepipe top --once --json`: every worker up, the gateway's figures scraped."""
    from orchestrator.cli.main import main

    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    monkeypatch.setenv("TREEPIPE_CACHE", str(Path(pipe["model"]).parent / "cache"))
    monkeypatch.setenv("TREEPIPE_API_KEY", KEY)
    # an interval over the workers' 1 s heartbeat: the frame has rates where stats exist
    assert main(["top", "httptest", "--once", "--json", "--interval", "1.5"]) == 0
    frame = json.loads(capsys.readouterr().out)
    assert list(frame["workers"]) == ["draft", "stage0", "stage1", "stage2"]
    assert frame["waiting"] == [] and frame["endpoints"]["grpc"] == pipe["grpc"]
    assert pipe["url"].endswith(frame["endpoints"]["http"].rsplit(":", 1)[1])
    for w in frame["workers"].values():
        assert w["alive"] and w["plan_ok"] and w["pid"]
        assert w["util"] is None or 0 <= w["util"] <= 1.5  # None: no new heartbeat yet
    g = frame["gateway"]
    assert g["up"] and g["error"] is None and g["queue"] == 0 and g["running"] == 0
    assert g["requests"] >= 1 and 0 <= g["hit_rate"] <= 1 and g["tbt_s"]["mean"] > 0


def test_dashboard_reads_only_exported_metrics(pipe: dict) -> None:
    """Every metric docs/grafana-dashboard.json queries is one the gateway exports."""
    import re

    dashboard = (Path(__file__).parents[1] / "docs" / "grafana-dashboard.json").read_text()
    wanted = set(re.findall(r"(?:treepipe_|vllm:)[a-z0-9_:]+", dashboard))
    # labelled counters have samples once a request has finished
    assert post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    exported = set(scrape(pipe))
    names = {n for n, _ in exported}
    missing = sorted(w for w in wanted if w not in names)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


def test_unknown_routes_are_openai_shaped_404s(pipe: dict) -> None:
    """An unknown route is a 404 that names no model (vLLM's routes we lack included)."""
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/nothing")):
        r = httpx.request(method, pipe["url"] + path, headers={"Authorization": f"Bearer {KEY}"})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] is None, r.text
        assert err["message"] == f"{method} {path}: no such route; see GET /openapi.json " \
                                 "for the routes"
    r = httpx.get(pipe["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "use POST" in r.json()["error"]["message"]
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


GOOD: dict[str, list[object]] = {
    "temperature": [0, 0.7, 2, None], "top_p": [0.5, 1, None], "top_k": [-1, 0, 3, None],
    "seed": [0, 7, 2**64 - 1, None], "stop": ["a", ["b", "c"], [], None],
    "stream": [True, False, None], "stream_options": [{"include_usage": True}, None],
    "ignore_eos": [True, False], "include_stop_str_in_output": [True, False],
    "stop_token_ids": [[1], [], None], "return_token_ids": [True, False],
    "treepipe_stats": [True, False], "n": [1, 2, None], "logprobs": [None],
    "presence_penalty": [0, 0.0, None], "user": ["u1", None], "model": [None, ""]}


def test_fuzz_never_gets_a_5xx(pipe: dict) -> None:
    """Random bodies from the models' fields and odd values (tests/test_openai_models.py)
    against the running gateway: every answer is a 2xx or a one-line 4xx, the gateway's
    log holds no traceback, and the pipeline answers ar's tokens afterwards."""
    import random

    from orchestrator.serving.openai_models import REQUESTS
    from tests.test_openai_models import ODD, VALID

    log_file = Path(pipe["model"]).parent / "cache" / "run" / "httptest" / "gateway.log"
    rng = random.Random(41)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=pipe["url"], timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        for i in range(160):
            route = sorted(VALID)[i % len(VALID)]
            fields = [*REQUESTS[route].model_fields, "unknown_field"]
            body = dict(VALID[route])
            if rng.random() < 0.5:  # odd values: mostly 400s
                for name in rng.sample(fields, rng.randint(1, min(3, len(fields)))):
                    body[name] = rng.choice(ODD)
            elif route.startswith("/v1/"):  # valid ones, in any mix: 200s
                for name, values in GOOD.items():
                    if rng.random() < 0.4:
                        body[name] = rng.choice(values)
            if "max_tokens" in body and body["max_tokens"] not in (1, 2):
                body["max_tokens"] = 2  # keep the accepted ones short
            body.pop("max_completion_tokens", None)
            r = client.post(route, content=json.dumps(body))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                msg = r.json()["error"]["message"]
                assert "\n" not in msg and "Traceback" not in msg, msg
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
    assert "Traceback" not in log_file.read_text(errors="replace")
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                       "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == ar(PROMPT, 8)


def test_redis_pause_ends_streams_and_answers_503(pipe: dict) -> None:
    """SIGSTOP the pipeline's redis-server mid-stream (a gateway in this process, on the
    module pipeline, waiting out an outage for 2 s): the HTTP stream ends with an error
    event and [DONE], a gRPC stream with UNAVAILABLE, a whole HTTP request with 503, all
    within the bound plus one Redis socket timeout and counted as finish_reason
    unavailable; a new request gets 503 with Retry-After (gRPC: UNAVAILABLE with
    retry-after), and after SIGCONT the pipeline answers ar's tokens again."""
    import signal
    import threading

    from orchestrator.serving.gateway import Gateway, GatewayLimits, InferenceService
    from orchestrator.serving.metrics import Metrics
    from orchestrator.serving.openai_api import OpenAIServer
    from stages.model.checkpoint import load_model_args

    state = RunState.model_validate_json(
        (Path(pipe["model"]).parent / "cache" / "run" / "httptest" / "state.json").read_text())
    tok, bound = pipe["tok"], 2.0
    metrics = Metrics(pipe["model"])
    service = InferenceService(state_sync(state, "httptest"), pipe["model"], tok,
                               load_model_args(Path(pipe["model"])).vocab_size,
                               tok.eos_token_ids,
                               GatewayLimits(512, 480, concurrency=4, sync_outage_s=bound),
                               metrics)
    gw = Gateway(service, "127.0.0.1:0", api_key=KEY).start()
    http = OpenAIServer(service.runner, metrics, KEY).start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{http.port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    paused, got, whole = False, {}, {}

    def grpc_stream() -> None:
        with Client(f"127.0.0.1:{gw.port}", api_key=KEY) as c:
            try:
                for _ in c.stream(temperature=0, prompt_ids=PROMPT, max_tokens=400, timeout_s=60):
                    pass
            except grpc.RpcError as e:
                got["code"], got["at"] = e.code(), time.monotonic()

    def whole_request() -> None:
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={**body, "max_tokens": 400})
        whole["r"], whole["at"] = r, time.monotonic()

    in_flight = [threading.Thread(target=grpc_stream), threading.Thread(target=whole_request)]
    try:
        for t in in_flight:
            t.start()
        deadline = time.monotonic() + 30
        while service.runner.running < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=60,
                          json={**body, "max_tokens": 400, "stream": True}) as r:
            assert r.status_code == 200
            lines, other = [], []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                elif line:  # issue 41: a second "HTTP/1.1 500" written into the stream
                    other.append(line)
                if not paused:
                    os.kill(state.redis_pid, signal.SIGSTOP)
                    paused, t_pause = True, time.monotonic()
            took = time.monotonic() - t_pause
        assert lines[-1] == "[DONE]" and not other, other
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "server_error" and "Redis) has been unreachable" in err["message"]
        assert took < bound + 5 + 3, took  # the bound, one socket timeout, slack
        for t in in_flight:
            t.join(bound + 5 + 3)
        assert got["code"] == grpc.StatusCode.UNAVAILABLE, got
        assert got["at"] - t_pause < bound + 5 + 3
        assert whole["r"].status_code == 503 and whole["r"].headers["Retry-After"] == "5"
        assert whole["at"] - t_pause < bound + 5 + 3
        assert metrics.requests.labels("unavailable")._value.get() == 3
        t = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        r = httpx.post(url + "/v1/completions", headers=auth, json=body, timeout=30)
        assert time.monotonic() - t < 2  # the outage is known: no Redis timeout to wait
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert "retry in 5 s" in r.json()["error"]["message"]
        with Client(f"127.0.0.1:{gw.port}", api_key=KEY) as c:
            e = grpc_error(c, prompt_ids=PROMPT, max_tokens=4)
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert ("retry-after", "5") in tuple(e.trailing_metadata())
    finally:
        if paused:
            os.kill(state.redis_pid, signal.SIGCONT)
        for t in in_flight:
            t.join(60)
        http.stop()
        gw.stop(0)
    # the three requests this gateway gave up on are still in the pipeline (400 tokens
    # each): cancel them, as their clients would, so the next test's requests do not wait
    # beside them (their leases would lapse only after they end)
    sync = state_sync(state, "httptest")
    deadline = time.monotonic() + 60
    while (left := sync.in_flight()) and time.monotonic() < deadline:
        for rid in left:
            sync.cancel(rid, "client")
        time.sleep(0.2)
    deadline = time.monotonic() + 120  # workers that timed out on Redis may restart
    while True:
        r = post(pipe, "/v1/completions", {**body, "return_token_ids": True})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ar(PROMPT, 8)


def local_service(pipe: dict) -> tuple[Any, Any]:
    """An inference service (and its metrics) in this process over ``pipe``'s pipeline."""
    from orchestrator.serving.gateway import GatewayLimits, InferenceService
    from orchestrator.serving.metrics import Metrics
    from stages.model.checkpoint import load_model_args

    state = RunState.model_validate_json(
        (Path(pipe["model"]).parent / "cache" / "run" / "httptest" / "state.json").read_text())
    tok = pipe["tok"]
    metrics = Metrics(pipe["model"])
    service = InferenceService(state_sync(state, "httptest"), pipe["model"], tok,
                               load_model_args(Path(pipe["model"])).vocab_size,
                               tok.eos_token_ids, GatewayLimits(512, 480), metrics)
    return service, metrics


def test_a_client_gone_within_its_body_is_no_bug(pipe: dict,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A client that hangs up while its body is on the way is logged as gone, not as a
    bug, and counts as no failed request; the next request is served."""
    import logging
    import socket

    from orchestrator.serving.openai_api import OpenAIServer

    service, metrics = local_service(pipe)
    http = OpenAIServer(service.runner, metrics, KEY).start("127.0.0.1", 0)
    caplog.set_level(logging.INFO, logger="treepipe.http")
    try:
        with socket.create_connection(("127.0.0.1", http.port)) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: "
                         f"Bearer {KEY}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100\r\n\r\n{{\"prompt\": [1,".encode())
        deadline = time.monotonic() + 30
        while not any("closed the connection" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{http.port}/v1/completions",
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        http.stop()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert metrics.requests.labels("error")._value.get() == 0


def test_bugs_are_500s_logged_once(pipe: dict, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """A bug (here: injected) is a 500 / INTERNAL naming a request id and nothing of the
    exception; the log has one line with that id; treepipe_requests_total{error} counts
    it; a stream that hits one after its headers ends with an error event and [DONE]."""
    import logging

    from orchestrator.serving.gateway import Gateway
    from orchestrator.serving.openai_api import OpenAIServer
    from orchestrator.serving.runner import Chunk, RequestRunner

    service, metrics = local_service(pipe)
    gw = Gateway(service, "127.0.0.1:0", api_key=KEY).start()
    http = OpenAIServer(service.runner, metrics, KEY).start("127.0.0.1", 0)
    url, auth = f"http://127.0.0.1:{http.port}", {"Authorization": f"Bearer {KEY}"}
    secret = "secret-detail-0xdeadbeef"

    def broken(*_a: object) -> None:
        raise ZeroDivisionError(secret)

    def half(self: RequestRunner, rid: str, *_a: object) -> Iterator[Chunk]:
        yield Chunk(request_id=rid, queue_ms=0.0, token_ids=[1], text="a")
        raise KeyError(secret)

    caplog.set_level(logging.ERROR, logger="treepipe.gateway")
    try:
        monkeypatch.setattr(service.runner, "_read_pipeline", broken)
        r = httpx.post(url + "/v1/completions", headers={**auth, "X-Request-Id": "bug-1"},
                       json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and secret not in r.text and "Traceback" not in r.text
        assert r.json()["error"]["message"].startswith("internal error (request ")
        with Client(f"127.0.0.1:{gw.port}", api_key=KEY) as c:
            e = grpc_error(c, prompt_ids=PROMPT, max_tokens=2)
        assert e.code() == grpc.StatusCode.INTERNAL and secret not in e.details()
        monkeypatch.undo()
        monkeypatch.setattr(RequestRunner, "_run", half)
        with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[0])["choices"][0]["text"] == "a"
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "server_error" and secret not in err["message"]
    finally:
        monkeypatch.undo()
        http.stop()
        gw.stop(0)
    lines = [rec.getMessage() for rec in caplog.records if "internal error" in rec.getMessage()]
    assert len(lines) == 3 and all("\n" not in x and secret in x for x in lines), lines
    ids = [m.split("(request ")[1].split(")")[0] for m in (r.json()["error"]["message"],
                                                           e.details(), err["message"])]
    assert all(f"request {i}:" in x for i, x in zip(ids, lines, strict=True))
    counted = metrics.requests.labels("error")._value.get()
    assert counted == 3


def test_grpc_reflection_lists_the_services(pipe: dict) -> None:
    """grpcurl-style reflection: with the key it lists Inference (and describes its file);
    without it, UNAUTHENTICATED like every call but health."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from orchestrator.serving.auth import channel

    def ask(key: str, **req: str) -> reflection_pb2.ServerReflectionResponse:
        with channel(pipe["grpc"]) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            md = (("authorization", f"Bearer {key}"),)
            return next(iter(stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(**req)]), metadata=md,
                timeout=10)))

    names = {s.name for s in ask(KEY, list_services="").list_services_response.service}
    assert {"treepipe.v1.Inference", "grpc.health.v1.Health"} <= names
    files = ask(KEY, file_containing_symbol="treepipe.v1.Inference")
    assert files.file_descriptor_response.file_descriptor_proto
    with pytest.raises(grpc.RpcError) as err:
        ask("wrong", list_services="")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- n, best_of, echo and prompt lists ------------------------------------------------------

def events(r: httpx.Response) -> list[dict]:
    """The JSON events of an SSE response, checked to end with [DONE]."""
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


def by_choice(evs: list[dict]) -> dict[int, dict]:
    """Stream events folded per choice index: ids, text, finish reasons, stats."""
    out: dict[int, dict] = {}
    for e in evs:
        for ch in e["choices"]:
            c = out.setdefault(ch["index"], {"ids": [], "text": "", "reasons": [],
                                             "stats": None})
            c["ids"] += ch.get("token_ids") or []
            c["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            c["reasons"].append(ch["finish_reason"])
            c["stats"] = ch.get("treepipe_stats") or c["stats"]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_are_seed_plus_i(pipe: dict, stream: bool) -> None:
    """n=3 seeded: three choices, choice i sampled with seed + i (vLLM's), each ar's tokens
    under that seed; usage counts the prompt once and every choice's tokens; a stream
    interleaves the choices' chunks, each tagged with its index."""
    sp = [SamplingParams(0.8, 0.95, 0, 11 + i) for i in range(3)]
    want = [ar(PROMPT, 16, p) for p in sp]
    assert len({tuple(w) for w in want}) == 3  # the seeds make three different choices
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 11,
            "n": 3, "best_of": 3, "return_token_ids": True, "treepipe_stats": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = post(pipe, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        evs = events(r)
        got = by_choice(evs)
        assert sorted(got) == [0, 1, 2]
        usage = evs[-1]["usage"]
        # interleaved: a choice's chunks are not all sent before another's first
        order = [ch["index"] for e in evs for ch in e["choices"]]
        assert order != sorted(order), order
        for c in got.values():
            assert c["reasons"][-1] == "length" and set(c["reasons"][:-1]) <= {None}
    else:
        out = r.json()
        got = {ch["index"]: {"ids": ch["token_ids"], "text": ch["text"],
                             "stats": ch["treepipe_stats"]} for ch in out["choices"]}
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
        assert "treepipe_stats" not in out  # per choice, with several
        usage = out["usage"]
    for i in range(3):
        assert got[i]["ids"] == want[i], i
        assert got[i]["text"] == text_of(want[i])
        assert got[i]["stats"]["seed"] == 11 + i
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 48,
                     "total_tokens": len(PROMPT) + 48}
    if not stream:  # choice 1 is the single request with seed 12
        one = post(pipe, "/v1/completions", {**body, "n": 1, "best_of": None, "seed": 12})
        assert one.json()["choices"][0]["token_ids"] == want[1]


def test_chat_n_with_the_openai_client(pipe: dict) -> None:
    """The official client's n: seeded chat choices are ar's under seed + i; unseeded ones
    each draw a seed of their own (they differ), reported per choice."""
    msgs = [{"role": "user", "content": "tell me a joke"}]
    prompt = pipe["tok"].chat_ids(msgs)
    out = pipe["oai"].chat.completions.create(
        model=pipe["model"], messages=msgs, n=3, max_tokens=12, temperature=1.0, seed=3,
        extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert c.model_extra["token_ids"] == ar(prompt, 12, SamplingParams(1.0, 1.0, 0,
                                                                           3 + c.index))
        assert c.message.content == text_of(c.model_extra["token_ids"])
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 36
    drawn = pipe["oai"].chat.completions.create(
        model=pipe["model"], messages=msgs, n=2, max_tokens=24,
        extra_body={"return_token_ids": True, "treepipe_stats": True})
    ids = [c.model_extra["token_ids"] for c in drawn.choices]
    seeds = [c.model_extra["treepipe_stats"]["seed"] for c in drawn.choices]
    assert ids[0] != ids[1] and seeds[0] != seeds[1]
    assert ids[1] == ar(prompt, 24, SamplingParams(1.0, 1.0, 0, seeds[1]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_and_prompt_lists(pipe: dict, stream: bool) -> None:
    """A list of prompts (strings, or token-id lists) with n=2 and echo: choice p*n + j is
    prompt p's j-th, its text the prompt's then ar's (greedy: the two are equal)."""
    texts = [text_of(PROMPT), text_of(PROMPT[2:])]
    want = [ar(PROMPT, 10), ar(PROMPT[2:], 10)]
    for prompt in (texts, [PROMPT, PROMPT[2:]]):
        r = post(pipe, "/v1/completions", {
            "prompt": prompt, "n": 2, "echo": True, "max_tokens": 10, "temperature": 0,
            "return_token_ids": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None})
        assert r.status_code == 200, r.text
        if stream:
            evs = events(r)
            got = by_choice(evs)
            usage = evs[-1]["usage"]
        else:
            got = {ch["index"]: {"ids": ch["token_ids"], "text": ch["text"]}
                   for ch in r.json()["choices"]}
            usage = r.json()["usage"]
        assert sorted(got) == [0, 1, 2, 3]
        for k in range(4):
            p = k // 2
            assert got[k]["ids"] == want[p], k
            assert got[k]["text"] == texts[p] + text_of(want[p]), k
        assert usage["prompt_tokens"] == 2 * len(PROMPT) - 2
        assert usage["completion_tokens"] == 40


# ---- roles, tools and the served chat template -------------------------------------------

def test_the_chat_template_file_replaces_the_models(pipe: dict) -> None:
    """gateway.chatTemplate (treepipe serve --chat-template): chat renders with the file's
    template, not the model folder's."""
    msgs = [{"role": "user", "content": "hi"}]
    own = TextTokenizer.from_folder(Path(pipe["model"]))
    assert own.chat_ids(msgs) != pipe["tok"].chat_ids(msgs)
    r = post(pipe, "/tokenize", {"messages": msgs})
    assert r.json()["tokens"] == pipe["tok"].chat_ids(msgs)


def test_developer_is_system(pipe: dict) -> None:
    """The developer role reaches the template as system: ar's tokens for that prompt."""
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = pipe["tok"].chat_ids([{**msgs[0], "role": "system"}, msgs[1]])
    out = pipe["oai"].chat.completions.create(model=pipe["model"], messages=msgs,
                                              max_tokens=12, temperature=0)
    assert out.choices[0].message.content == text_of(ar(prompt, 12))
    assert out.usage.prompt_tokens == len(prompt)


def test_tools_and_tool_turns_reach_the_template(pipe: dict) -> None:
    """tools (with tool_choice "none"), an assistant's tool_calls and a tool turn are
    rendered by the template: the tokens are ar's for that prompt.  tool_choice "auto" (the
    default with tools), "required" and a named function are 400s naming tool_choice."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    turns = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = pipe["tok"].chat_ids(turns, tools=tools)
    assert text_of(prompt).startswith("<tools>get_weather;<user>")
    assert "[get_weather]" in text_of(prompt) and "<tool>sunny" in text_of(prompt)
    out = pipe["oai"].chat.completions.create(model=pipe["model"], messages=msgs, tools=tools,
                                              tool_choice="none", max_tokens=12,
                                              temperature=0)
    assert out.choices[0].message.content == text_of(ar(prompt, 12))
    assert out.usage.prompt_tokens == len(prompt)
    base = {"messages": msgs, "tools": tools, "max_tokens": 2}
    for choice, words in ((None, "tool_choice \"auto\" (the default with tools)"),
                          ("auto", "needs a tool-call parser"),
                          ("required", "tool_choice \"required\" needs constrained decoding"),
                          ({"type": "function", "function": {"name": "get_weather"}},
                           "a named function ('get_weather')")):
        r = post(pipe, "/v1/chat/completions", {**base, "tool_choice": choice})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and words in err["message"], err


def test_min_p_equals_ar_over_http_and_grpc(pipe: dict) -> None:
    """min_p (vLLM's) over HTTP and gRPC gives in-process ar's tokens under the same
    seeded parameters, which it changes; out of [0, 1] it is a 400 naming min_p, and over
    gRPC an INVALID_ARGUMENT."""
    sp = SamplingParams(1.0, 1.0, 0, 3, min_p=0.3)
    want = ar(PROMPT, 30, sp)
    assert want != ar(PROMPT, 30, SamplingParams(1.0, 1.0, 0, 3))
    ids, _, _ = completion(pipe, {"prompt": PROMPT, "max_tokens": 30, "temperature": 1.0,
                                  "seed": 3, "min_p": 0.3, "ignore_eos": True})
    assert ids == want
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
    with Client(pipe["grpc"], api_key=KEY) as c:
        got = c.generate(prompt_ids=PROMPT, max_tokens=30, temperature=1.0, seed=3,
                         min_p=0.3, ignore_eos=True)
        assert got.tokens == want
        e = grpc_error(c, prompt_ids=PROMPT, min_p=-0.1)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details().startswith("min_p must be a finite number in [0, 1]")


def test_generate_penalty_flags_through_the_gateway(pipe: dict, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`treepipe generate --endpoint` with --presence/--frequency/--repetition-penalty and
    --min-tokens: ar's tokens under the same parameters (EOS held off by min_tokens)."""
    from orchestrator.cli.main import main

    monkeypatch.setenv("TREEPIPE_API_KEY", KEY)
    monkeypatch.delenv("TREEPIPE_API_KEY_FILE", raising=False)
    sp = SamplingParams(0.8, 0.95, 0, 5, presence_penalty=0.5, frequency_penalty=0.75,
                        repetition_penalty=1.5, min_tokens=12)
    want = PipelineEngine(target_shards(1)).generate(
        PROMPT, 16, sp, "ar", stop_ids=pipe["tok"].eos_token_ids).tokens
    assert main(["generate", "--endpoint", pipe["grpc"], "--prompt", text_of(PROMPT),
                 "--max-new-tokens", "16", "--temperature", "0.8", "--top-p", "0.95",
                 "--seed", "5", "--presence-penalty", "0.5", "--frequency-penalty", "0.75",
                 "--repetition-penalty", "1.5", "--min-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want
    # no --seed: the gateway draws one per request, as for HTTP (two runs differ)
    runs = []
    for _ in range(2):
        assert main(["generate", "--endpoint", pipe["grpc"], "--prompt", text_of(PROMPT),
                     "--max-new-tokens", "24", "--temperature", "1", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] != runs[1]


# ---- logprobs ------------------------------------------------------------------------------
# greedy, and seeded sampling under top_k and a penalty: logprobs are the raw distribution's
LOGPROB_CASES = {"greedy": {"temperature": 0},
                 "seeded": {"temperature": 0.8, "seed": 11, "top_k": 8,
                            "presence_penalty": 0.5}}


def teacher_logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The target's raw float32 logprobs of every position that chose one of ``tokens``
    (row j: the distribution token j was chosen from), by teacher forcing in process."""
    from tests.tiny_models import target_whole

    m = target_whole()
    seq = prompt + tokens
    h = m.forward(torch.tensor(seq), torch.arange(len(seq)), m.new_cache(len(seq)))
    return torch.log_softmax(m.logits(h).to(torch.float32), -1)[len(prompt) - 1:len(seq) - 1]


def ar_of(case: dict, prompt: list[int], n: int) -> list[int]:
    """ar's tokens under a LOGPROB_CASES case."""
    return ar(prompt, n, SamplingParams(case["temperature"], 1.0, case.get("top_k", 0),
                                        case.get("seed", 0),
                                        presence_penalty=case.get("presence_penalty", 0.0)))


def check_logprobs(ref: torch.Tensor, ids: list[int], chosen: list[float],
                   tops: list[list[tuple[int, float]]], k: int) -> None:
    """Each token's logprob and top-k alternatives equal the teacher-forced reference:
    sorted, and holding the chosen token whenever it ranks within k."""
    assert len(chosen) == len(tops) == len(ids) == ref.shape[0]
    for j, t in enumerate(ids):
        assert math.isclose(chosen[j], float(ref[j, t]), abs_tol=1e-3), (j, chosen[j])
        vals, want = torch.topk(ref[j], k)
        assert [a for a, _ in tops[j]] == want.tolist(), j
        got = [v for _, v in tops[j]]
        assert got == sorted(got, reverse=True)
        assert all(math.isclose(g, float(v), abs_tol=1e-3) for g, v in zip(got, vals,
                                                                            strict=True))
        if float(ref[j, t]) >= float(vals[-1]):
            assert t in [a for a, _ in tops[j]], j


@pytest.mark.parametrize("case", sorted(LOGPROB_CASES))
def test_completion_logprobs_equal_teacher_forcing(pipe: dict, case: str) -> None:
    """/v1/completions with logprobs=3 (the openai client): ar's tokens, and each token's
    logprob, top-3 and text_offset from the target's raw distribution."""
    c = LOGPROB_CASES[case]
    out = pipe["oai"].completions.create(model=pipe["model"], prompt=PROMPT, max_tokens=24,
                                         logprobs=3, **{k: v for k, v in c.items()
                                                        if k in ("temperature", "seed")},
                                         extra_body={"return_token_ids": True,
                                                     **{k: v for k, v in c.items()
                                                        if k in ("top_k",)}},
                                         presence_penalty=c.get("presence_penalty", 0.0))
    ch = out.choices[0]
    ids = ch.model_extra["token_ids"]
    assert ids == ar_of(c, PROMPT, 24)
    lp = ch.logprobs
    assert lp.tokens == [CHARS[t] for t in ids]
    assert lp.text_offset == list(range(len(ids)))  # one character per token
    tops = [sorted(((CHARS.index(s), v) for s, v in d.items()), key=lambda p: -p[1])
            for d in lp.top_logprobs]
    check_logprobs(teacher_logprobs(PROMPT, ids), ids, lp.token_logprobs, tops, 3)


@pytest.mark.parametrize("case", sorted(LOGPROB_CASES))
def test_chat_logprobs_equal_teacher_forcing(pipe: dict, case: str) -> None:
    """/v1/chat/completions with logprobs and top_logprobs=5 (the openai client): ar's
    tokens for the templated prompt, each token's text, bytes, logprob and top 5."""
    c = LOGPROB_CASES[case]
    messages = [{"role": "user", "content": "hello there"}]
    prompt = post(pipe, "/tokenize", {"messages": messages}).json()["tokens"]
    out = pipe["oai"].chat.completions.create(
        model=pipe["model"], messages=messages, max_tokens=20, logprobs=True, top_logprobs=5,
        presence_penalty=c.get("presence_penalty", 0.0),
        **{k: v for k, v in c.items() if k in ("temperature", "seed")},
        extra_body={"return_token_ids": True, **({"top_k": c["top_k"]} if "top_k" in c
                                                  else {})})
    ch = out.choices[0]
    ids = ch.model_extra["token_ids"]
    assert ids == ar_of(c, prompt, 20)
    content = ch.logprobs.content
    assert [e.token for e in content] == [CHARS[t] for t in ids]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    tops = [[(CHARS.index(a.token), a.logprob) for a in e.top_logprobs] for e in content]
    check_logprobs(teacher_logprobs(prompt, ids), ids, [e.logprob for e in content], tops, 5)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_logprobs_equal_whole(pipe: dict, chat: bool) -> None:
    """A stream's chunks carry the logprobs of their own tokens; together they are the
    whole response's (seeded sampling), and completions' text_offset runs on."""
    base: dict = ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                   "top_logprobs": 2} if chat else {"prompt": PROMPT, "logprobs": 2})
    base |= {"max_tokens": 16, "temperature": 1.0, "seed": 3, "return_token_ids": True}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    whole = post(pipe, route, base).json()["choices"][0]
    r = post(pipe, route, {**base, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    chs = [e["choices"][0] for e in events if e["choices"]]
    ids = [t for ch in chs for t in ch.get("token_ids", [])]
    assert ids == whole["token_ids"]
    with_tokens = [ch for ch in chs if ch.get("token_ids")]
    assert all(ch["logprobs"] is not None for ch in with_tokens)
    if chat:
        got = [e for ch in with_tokens for e in ch["logprobs"]["content"]]
        assert got == whole["logprobs"]["content"]
        assert all(len(ch["logprobs"]["content"]) == len(ch["token_ids"]) for ch in with_tokens)
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for ch in with_tokens for x in ch["logprobs"][key]] == \
                whole["logprobs"][key], key


@pytest.mark.parametrize(("route", "body", "param", "says"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "in [0, 20]"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "in [0, 20]"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("chat", {"logprobs": 1}, "logprobs", "a boolean"),
    ("completions", {"logprobs": 6}, "logprobs", "in [0, 5]"),
    ("completions", {"logprobs": True}, "logprobs", "an integer"),
    ("completions", {"logprobs": 1, "echo": True}, "logprobs", "prompt's tokens"),
    ("completions", {"top_logprobs": 1}, "top_logprobs", "unknown parameter"),
], ids=["top-21", "top-neg", "top-alone", "chat-int", "text-6", "text-bool", "echo",
        "text-top"])
def test_logprobs_refusals_name_the_parameter(pipe: dict, route: str, body: dict, param: str,
                                              says: str) -> None:
    base = ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat"
            else {"prompt": PROMPT}) | {"max_tokens": 2}
    r = post(pipe, f"/v1/{'chat/' if route == 'chat' else ''}completions", base | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_grpc_logprobs(pipe: dict) -> None:
    """gRPC's GenerateRequest.logprobs: one TokenLogprobs per token, equal to the
    teacher-forced reference; out of range is INVALID_ARGUMENT naming it."""
    with Client(pipe["grpc"], api_key=KEY) as c:
        out = c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=16, logprobs=4)
        assert out.tokens == ar(PROMPT, 16)
        check_logprobs(teacher_logprobs(PROMPT, out.tokens), out.tokens,
                       [e.logprob for e in out.logprobs],
                       [[(a.token_id, a.logprob) for a in e.top] for e in out.logprobs], 4)
        assert not c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=4).logprobs  # none asked
        with pytest.raises(grpc.RpcError) as e:
            c.generate(temperature=0, prompt_ids=PROMPT, max_tokens=4, logprobs=21)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logprobs" in e.value.details()


def test_logprobs_of_several_choices(pipe: dict) -> None:
    """n=2 seeded: each choice's logprobs are those of its own tokens (choice i samples
    with seed + i)."""
    r = post(pipe, "/v1/completions", {"prompt": PROMPT, "n": 2, "seed": 21, "max_tokens": 12,
                                       "temperature": 1.0, "logprobs": 1,
                                       "return_token_ids": True})
    assert r.status_code == 200, r.text
    for i, ch in enumerate(r.json()["choices"]):
        ids = ch["token_ids"]
        assert ids == ar(PROMPT, 12, SamplingParams(1.0, 1.0, 0, 21 + i))
        lp = ch["logprobs"]
        tops = [[(CHARS.index(s), v) for s, v in d.items()] for d in lp["top_logprobs"]]
        check_logprobs(teacher_logprobs(PROMPT, ids), ids, lp["token_logprobs"], tops, 1)
