"""The OpenAI HTTP API's request and response bodies as pydantic models, and their OpenAPI.

Every body is parsed by pydantic from the raw bytes in strict mode: a JSON string is
never read as a boolean or a number (``"stream": "false"`` is refused, not streamed),
integers are bounded to what the wire format holds, JSON nested deeper than the
parser's limit or holding a lone surrogate is invalid JSON, and an unknown parameter
is refused with its name.  :data:`PARAMETERS` says for each parameter whether it works
or is refused; docs/serving.md carries the same table and a test keeps the two equal.
A refused parameter is refused only when it asks for something: its neutral value
(``store: false``, ``suffix: ""`` ...) is what we do anyway.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from protocol.requests.response_format import FormatError, grammar_spec

INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**64  # treepipe.proto: uint64 seed
MAX_STOP_STRINGS = 16
MAX_BIASED_TOKENS = 1024  # logit_bias entries (protocol.requests.sampling_params agrees)
# choices of one request (prompts x n): each is a request of its own in the gateway's
# queue, so a body may not ask for more than a queue holds
MAX_CHOICES = 64
MAX_TOOLS = 128
# OpenAI's bounds on the alternatives per token (chat's top_logprobs, completions'
# logprobs); protocol.requests.logprobs.MAX_TOP_LOGPROBS, the wire's bound, is chat's
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# max_tokens of a text completion that sends none: OpenAI's and vLLM's default
COMPLETION_DEFAULT_TOKENS = 16
# the parameter table of docs/serving.md, from the code: parameter -> support
SUPPORTED, REFUSED, EXTENSION = "supported", "refused", "extension"


class Strict(BaseModel):
    """Strict types, unknown fields refused (by name, see :func:`explain`)."""

    model_config = ConfigDict(strict=True, extra="forbid")


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Text = Annotated[str, Field(max_length=1 << 24)]


class TextPart(Strict):
    """A text content part; images and audio mean nothing to a text-only pipeline."""

    type: Literal["text"]
    text: Text


def _content_kind(v: Any) -> str:
    return "as-parts" if isinstance(v, list) else "as-text"


Content = Annotated[
    Annotated[Text | None, Tag("as-text")] | Annotated[list[TextPart], Tag("as-parts")],
    Discriminator(_content_kind)]


class FunctionCall(Strict):
    """The function an assistant turn called, as the client replays it."""

    name: Text
    arguments: Text  # JSON, as OpenAI sends it


class ToolCall(Strict):
    """One tool call of an earlier assistant turn."""

    id: Text
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    """One chat turn.  ``developer`` is OpenAI's newer name for ``system`` and reaches the
    template as ``system`` (templates written before it know only that); ``tool`` turns
    (a tool's result, with ``tool_call_id``) and an assistant's ``tool_calls`` are handed
    to the chat template, which must render them (openai_api checks that it does)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_call_id: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise Refused("messages", "a tool message needs tool_call_id (the id of the "
                                      "assistant's tool call it answers)")
        if self.role != "tool" and self.tool_call_id is not None:
            raise Refused("messages", f"tool_call_id belongs to tool messages, not "
                                      f"{self.role}; leave it out")
        if self.role != "assistant" and self.tool_calls:
            raise Refused("messages", f"tool_calls belong to assistant messages, not "
                                      f"{self.role}; leave them out")
        return self

    def text(self) -> str:
        """The turn's text, its parts joined."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The turn as Hugging Face chat templates read it: developer as system, and each
        tool call's arguments as an object where they are one (as vLLM hands them: Llama
        and Qwen templates iterate them), else the string as sent."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: Any = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": c.type, "function": {
                    "name": c.function.name,
                    "arguments": args if isinstance(args, dict) else c.function.arguments}})
            out["tool_calls"] = calls
        return out


class FunctionDefinition(Strict):
    """A tool's function: what the template shows the model."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, passed on as sent
    strict: bool | None = None


class Tool(Strict):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    """``tool_choice``'s named function."""

    name: Text


class NamedToolChoice(Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    """``stream_options``."""

    include_usage: bool = False


def _prompt_kind(v: Any) -> str:
    if isinstance(v, list) and v and isinstance(v[0], str):
        return "as-texts"
    if isinstance(v, list) and v and isinstance(v[0], list):
        return "as-id-lists"
    return "as-ids" if isinstance(v, list) else "as-text"


Prompt = Annotated[
    Annotated[Text, Tag("as-text")]
    | Annotated[list[TokenId], Tag("as-ids")]
    | Annotated[list[Text], Tag("as-texts")]
    | Annotated[list[list[TokenId]], Tag("as-id-lists")],
    Discriminator(_prompt_kind)]

Stop = Annotated[Text | list[Text], Field(union_mode="left_to_right")]

# Known OpenAI/vLLM parameters we do not implement, each with the value that asks for
# nothing (what we do anyway) and why it is refused otherwise
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "is not supported by treepipe; leave it out"),
    "function_call": (("none", "auto"), "is not supported (no functions are); leave it out"),
    "chat_template": (("",), "is not supported: the model's own template applies; "
                             "leave it out"),
    "suffix": (("",), "is not supported by treepipe; leave it out"),
    "store": ((False,), "true is not supported: treepipe stores no completions; leave "
                        "it out"),
    # what vLLM's clients send beside OpenAI's (its defaults are served)
    "skip_special_tokens": ((True,), "false is not supported: the text leaves special "
                                     "tokens out (return_token_ids has them); leave it out"),
    "spaces_between_special_tokens": ((True,), "false is not supported; leave it out"),
    "detokenize": ((True,), "false is not supported (return_token_ids adds the ids to the "
                            "text); leave it out"),
    "use_beam_search": ((False,), "true is not supported: treepipe does not search beams; "
                                  "leave it out"),
    "length_penalty": ((1.0,), "is for beam search, which treepipe does not have; leave it "
                               "out"),
    "prompt_logprobs": ((), "is not supported: treepipe does not score the prompt's "
                            "tokens; leave it out"),
    "truncate_prompt_tokens": ((), "is not supported: treepipe does not cut prompts; "
                                   "shorten the prompt and leave it out"),
    "guided_json": ((), "is not supported; send response_format (json_schema) instead"),
    "guided_regex": ((), "is not supported (no regular expressions); response_format takes "
                         "a json_schema"),
    "guided_choice": ((), "is not supported; send response_format (a json_schema with an "
                          "enum) instead"),
    "guided_grammar": ((), "is not supported (no grammars); response_format takes a "
                           "json_schema"),
    "structured_outputs": ((), "is not supported; send response_format (json_object or "
                               "json_schema) instead"),
    "priority": ((0,), "is not supported: requests are served in arrival order; leave it "
                       "out"),
    "service_tier": (("auto", "default"), "is not supported: one tier serves every "
                                          "request; leave it out"),
    "add_generation_prompt": ((True,), "false is not supported: the prompt always opens "
                                       "the assistant's turn; leave it out"),
    "continue_final_message": ((False,), "true is not supported: the prompt always opens "
                                         "a new assistant turn; leave it out"),
    "chat_template_kwargs": (({},), "is not supported: the template gets messages and "
                                    "tools only; leave it out"),
    "modalities": ((["text"],), "other than [\"text\"] is not supported: treepipe "
                                "generates text only"),
    "reasoning_effort": ((), "is not supported: the served template has no reasoning "
                             "setting; leave it out"),
}


def _same(v: Any, neutral: Any) -> bool:
    """Whether ``v`` is ``neutral``: 1 == True to Python, but a boolean stands only for a
    boolean here, and 0 and 0.0 are one number."""
    if isinstance(neutral, bool) or isinstance(v, bool):
        return v is neutral
    if isinstance(neutral, int | float):
        return isinstance(v, int | float) and v == neutral
    return bool(v == neutral)


class Common(Strict):
    """What chat and text completions share."""

    model: Text = ""
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    # vLLM: -1 or 0 turns top-k off
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0
    # vLLM's: tokens below min_p times the most likely one's probability are dropped
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # the pipeline ends at these as at EOS (vLLM: the id is returned, its text is not)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] = []
    user: Text | None = None  # an end user's id, for the caller's own records
    # OpenAI's tags of a stored completion: treepipe stores none (store), so they tag nothing
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[
        str, Field(max_length=512)]], Field(max_length=16)] | None = None
    # vLLM's penalties and OpenAI's logit_bias (stages.model.sampling.adjust_logits):
    # every method verifies with them, so the tokens stay ar's under the same parameters
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0
    # JSON keys are strings: token ids written in decimal
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                          Field(max_length=MAX_BIASED_TOKENS)] = {}
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    return_token_ids: bool = False
    treepipe_stats: bool = False
    # refused unless neutral (NEUTRAL): vLLM's decoding and output options beside OpenAI's
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    detokenize: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    priority: Any = None
    service_tier: Any = None
    # n choices, each a request of its own (choice i samples with seed + i, as vLLM's)
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    # vLLM ranks best_of candidates by cumulative logprob, which treepipe does not compute:
    # only best_of == n (every candidate returned) is served
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema":
    # ...}}: checked by protocol.requests.response_format (one reading for every front
    # end), compiled by the gateway; typed loosely so that errors name response_format
    response_format: Any = None

    @field_validator("model", "temperature", "top_p", "top_k", "min_p", "stream", "ignore_eos",
                     "include_stop_str_in_output", "stop_token_ids", "return_token_ids",
                     "treepipe_stats", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "min_tokens", "n", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        # OpenAI's spec makes these nullable, and clients send null for "not set"
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) \
            if v is None else v

    @model_validator(mode="after")
    def _refuse(self) -> Common:
        for name in NEUTRAL:
            if name not in type(self).model_fields:
                continue
            v = getattr(self, name)
            ok, why = NEUTRAL[name]
            if v is not None and not any(_same(v, o) for o in ok):
                raise Refused(name, f"{name} {why}")
        if self.response_format is not None:
            try:
                grammar_spec(self.response_format)
            except FormatError as e:
                raise Refused("response_format", str(e)) from None
        for key in self.logit_bias:
            if int(key) > INT32_MAX:
                raise Refused("logit_bias", f"logit_bias keys must be token ids in "
                                            f"[0, {INT32_MAX}], got {key}")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise Refused("stop", f"stop has {len(self.stop)} strings; send at most "
                                  f"{MAX_STOP_STRINGS}")
        if self.best_of is not None and self.best_of != self.n:
            raise Refused("best_of", f"best_of ({self.best_of}) must equal n ({self.n}): "
                                     "treepipe returns every choice it generates and cannot "
                                     "rank them by cumulative logprob; leave best_of out")
        if self.seed is not None and self.seed + self.n - 1 >= SEED_LIMIT:
            raise Refused("seed", "seed + n - 1 must be below 2^64 (choice i samples with "
                                  "seed + i); lower seed")
        return self

    def logprobs_asked(self) -> int | None:
        """The alternatives per token the body asks logprobs for (None: no logprobs)."""
        return None

    def format_text(self) -> str | None:
        """The response_format as the JSON text the gateway reads (None: free text)."""
        if self.response_format is None or grammar_spec(self.response_format) is None:
            return None
        return json.dumps(self.response_format, separators=(",", ":"))

    def choice_seed(self, i: int) -> int | None:
        """The seed of choice ``i`` (vLLM's: seed + i); None: each draws a fresh one."""
        return None if self.seed is None else self.seed + i

    def new_tokens(self) -> tuple[str, int | None]:
        """The max_tokens field the client used and its value."""
        return "max_tokens", self.max_tokens

    def stops(self) -> list[str]:
        """``stop`` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    store: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template_kwargs: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    # treepipe makes no tool calls (tool_choice "none" only): nothing to run in parallel
    parallel_tool_calls: bool | None = None
    # each generated token's logprob (the target's raw distribution) and, with
    # top_logprobs, that many alternatives (OpenAI's and vLLM's chat shape)
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise Refused("top_logprobs", "top_logprobs needs logprobs: true; send both")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        # vLLM's rule: with tools, tool_choice defaults to "auto"; "auto" needs a tool-call
        # parser to turn the model's text into tool_calls, "required" and a named function
        # constrained decoding: treepipe has neither, so only "none" (the template shows
        # the tools, the model answers in text) is served
        choice = self.tool_choice if self.tool_choice is not None else (
            "auto" if self.tools else "none")
        if isinstance(choice, NamedToolChoice) or choice == "required":
            what = (f"a named function ({choice.function.name!r})"
                    if isinstance(choice, NamedToolChoice) else '"required"')
            raise Refused("tool_choice", f"tool_choice {what} needs constrained decoding, "
                                         "which treepipe does not have; send tool_choice "
                                         "\"none\" (the model sees the tools and answers in "
                                         "text)")
        if choice == "auto" and self.tools:
            raise Refused("tool_choice", "tool_choice \"auto\" (the default with tools) "
                                         "needs a tool-call parser, which treepipe does not "
                                         "have; send tool_choice \"none\" (the model sees "
                                         "the tools and answers in text)")
        return self

    def new_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template reads them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(Common):
    """``POST /v1/completions``."""

    prompt: Prompt
    # the prompt's text before each choice's (vLLM's: the prompt as sent, or its ids
    # decoded)
    echo: bool = False
    suffix: Any = None
    # each generated token's logprob and that many alternatives (0: the token's only)
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _echo_logprobs(self) -> CompletionRequest:
        # OpenAI's echo with logprobs scores the prompt's tokens too; an answer without
        # them would be a silent no-op
        if self.echo and self.logprobs is not None:
            raise Refused("logprobs", "logprobs with echo would score the prompt's tokens, "
                                      "which treepipe does not compute; leave out echo or "
                                      "logprobs")
        return self

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, v: Any) -> Any:
        return False if v is None else v

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts:
            raise Refused("prompt", "empty prompt list; send text or token ids")
        for i, p in enumerate(prompts):
            if not p:
                where = f"prompt[{i}]" if len(prompts) > 1 or self._is_list() else "prompt"
                raise Refused("prompt", f"{where} is empty; send text or token ids")
        if len(prompts) * self.n > MAX_CHOICES:
            raise Refused("prompt", f"{len(prompts)} prompts x n={self.n} are "
                                    f"{len(prompts) * self.n} choices; send at most "
                                    f"{MAX_CHOICES} per request")
        return self

    def _is_list(self) -> bool:
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], str | list)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or each of a list (strings or token-id lists)."""
        if self._is_list():
            return list(self.prompt)  # type: ignore[arg-type]
        if isinstance(self.prompt, list) and not self.prompt:
            return [[]]  # no ids: refused as an empty prompt
        return [self.prompt]  # type: ignore[list-item]


class TokenizeRequest(Strict):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` or ``messages``."""

    model: Text = ""
    prompt: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: Literal[True] = True
    add_generation_prompt: Literal[True] = True

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise Refused("prompt", "send prompt (a string) or messages, one of them")
        return self


class DetokenizeRequest(Strict):
    """``POST /detokenize`` with ``tokens``."""

    model: Text = ""
    tokens: list[TokenId]


class Refused(ValueError):
    """A parameter refused by a model validator; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


REQUESTS: dict[str, type[Strict]] = {
    "/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


# ---- responses -------------------------------------------------------------------------
Finish = Literal["stop", "length"]


class Out(BaseModel):
    """A response body.  :func:`dump` writes the fields that were set, so the extensions
    (``token_ids``, ``treepipe_stats``) appear only when asked for, while ``logprobs:
    null`` and the like, set explicitly, stay as OpenAI's clients expect them."""

    model_config = ConfigDict(extra="forbid")


def dump(body: Out) -> dict[str, Any]:
    """``body`` as JSON-ready data: the fields that were set."""
    return body.model_dump(mode="json", exclude_unset=True)


class Usage(Out):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TreepipeStats(Out):
    """The ``treepipe_stats`` extension: a request's speculation figures and its seed."""

    # SpecStats.to_dict may grow a figure before this model names it: pass it on, never
    # fail a finished request over it
    model_config = ConfigDict(extra="allow")

    steps: int
    hits: int
    flushes: int
    hit_rate: float
    tokens_per_step: float
    epochs: int
    seed: int  # the seed it was sampled with (drawn when the request sent none)


class AssistantMessage(Out):
    """The generated turn."""

    role: Literal["assistant"]
    content: str


class Delta(Out):
    """What a stream chunk adds to the turn."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class TopLogprob(Out):
    """One alternative of a chat token: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """A generated chat token's logprob and its ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(Out):
    """A chat choice's (or stream chunk's) ``logprobs``: one entry per token."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(Out):
    """A text choice's (or stream chunk's) ``logprobs``, OpenAI's legacy shape: per token
    its text, where it starts in the choice's text, its logprob and the alternatives
    (token text -> logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class Choice(Out):
    """What chat and text choices share."""

    index: int
    logprobs: None  # each kind of choice has its own shape, with the logprobs parameter
    token_ids: list[int] | None = None  # with return_token_ids
    # with treepipe_stats, when a response has several choices: each choice's own
    # (one choice: the response's treepipe_stats)
    treepipe_stats: TreepipeStats | None = None


class ChatChoice(Choice):
    """A chat completion's one choice."""

    logprobs: ChatLogprobs | None  # type: ignore[assignment]
    message: AssistantMessage
    finish_reason: Finish


class CompletionChoice(Choice):
    """A text completion's one choice."""

    logprobs: CompletionLogprobs | None  # type: ignore[assignment]
    text: str
    finish_reason: Finish


class ChatChunkChoice(Choice):
    """A chat stream chunk's choice."""

    logprobs: ChatLogprobs | None  # type: ignore[assignment]
    delta: Delta
    finish_reason: Finish | None


class CompletionChunkChoice(Choice):
    """A text completion stream chunk's choice."""

    logprobs: CompletionLogprobs | None  # type: ignore[assignment]
    text: str
    finish_reason: Finish | None


class ChatCompletion(Out):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None
    treepipe_stats: TreepipeStats | None = None  # with treepipe_stats


class Completion(Out):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None
    treepipe_stats: TreepipeStats | None = None


class ChatCompletionChunk(Out):
    """One SSE event of a chat stream (``choices`` empty in the usage event)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with stream_options.include_usage: null, then the counts
    treepipe_stats: TreepipeStats | None = None  # with treepipe_stats, on the last event


class CompletionChunk(Out):
    """One SSE event of a text completion stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    treepipe_stats: TreepipeStats | None = None


class ErrorDetail(Out):
    """OpenAI's error: a one-line message naming the problem and the fix."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Out):
    """Every error, and the last event but ``[DONE]`` of a stream that failed."""

    error: ErrorDetail


# route -> (whole body, stream event)
RESPONSES: dict[str, tuple[type[Out], type[Out]]] = {
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/completions": (Completion, CompletionChunk)}


def parameters() -> dict[str, tuple[str, str]]:
    """Every chat / completion parameter: its support and the routes that take it (chat,
    completions or both): the table of docs/serving.md."""
    chat, text = set(ChatRequest.model_fields), set(CompletionRequest.model_fields)
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(chat | text):
        out[name] = (REFUSED if name in NEUTRAL else
                     EXTENSION if name in ("return_token_ids", "treepipe_stats")
                     else SUPPORTED,
                     "both" if name in chat and name in text else
                     "chat" if name in chat else "completions")
    return out


PARAMETERS = parameters()

KINDS = {"bool_type": "a boolean (true or false)", "int_type": "an integer",
         "string_type": "a string", "float_type": "a number", "list_type": "a list",
         "dict_type": "an object", "model_type": "an object", "literal_error": None,
         "bool_parsing": "a boolean (true or false)", "int_from_float": "an integer"}
HINTS = {
    "messages": "messages must be a non-empty list of {\"role\": \"system\", "
                "\"developer\", \"user\", \"assistant\" or \"tool\", \"content\": a string "
                "or text parts}",
    "prompt": f"prompt must be a string, a list of token ids in [0, {INT32_MAX}], or a list "
              "of either",
    "tools": "tools must be a list of {\"type\": \"function\", \"function\": {\"name\", "
             "\"description\", \"parameters\"}}",
    "tool_choice": "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                   "\"function\", \"function\": {\"name\"}}",
    "stop": "stop must be a string or a list of strings",
    "logit_bias": "logit_bias must map token ids (decimal strings) to biases in [-100, 100]",
    "tokens": f"tokens must be a list of token ids in [0, {INT32_MAX}]",
}
TOKENIZE_HINTS = {"prompt": "prompt must be a string (or send messages)"}
RANGES = {"temperature": "in [0, 2] (0 = greedy)", "top_p": "in (0, 1]",
          "min_p": "in [0, 1] (0 = off)",
          "top_k": "-1 or 0 (off), or a positive integer", "seed": "in [0, 2^64)",
          "presence_penalty": "in [-2, 2] (0 = off)", "frequency_penalty": "in [-2, 2] (0 = off)",
          "repetition_penalty": "in (0, 100] (1 = off)", "min_tokens": "in [0, 2^31) (0 = off)",
          "n": f"in [1, {MAX_CHOICES}]", "best_of": f"in [1, {MAX_CHOICES}] and equal to n",
          "top_logprobs": f"an integer in [0, {MAX_TOP_LOGPROBS}]",
          # chat's logprobs is a boolean, so only completions' meets a bound
          "logprobs": f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] on /v1/completions"}


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier() or part in ("str", "int", "float", "bool", "dict"):
            continue  # a union member's name or tag ("as-text", "list[str]"), not a field
        else:
            out += f".{part}" if out else part
    return out


# the parser's position in a json_invalid error (the column counts bytes)
_AT = re.compile(r" at line (\d+) column (\d+)$")
# a JSON string, or a structural character: enough to follow an object's top-level keys
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\],]', re.DOTALL)


def _param_at(raw: bytes, why: str) -> str | None:
    """The top-level key whose value holds the spot the JSON parser's error ``why`` names
    (a lone surrogate or too deep a nesting inside ``messages``, say), or None where the
    error is not inside one key's value: a broken value still names its parameter."""
    m = _AT.search(why)
    if m is None:
        return None
    start = 0
    for _ in range(int(m[1]) - 1):
        start = raw.find(b"\n", start) + 1
        if start == 0:
            return None
    at = start + int(m[2]) - 1
    key: str | None = None
    depth, expect_key = 0, False
    for t in _TOKEN.finditer(raw, 0, at + 1):
        c = t[0][:1]
        if c == b'"':
            if depth == 1 and expect_key:
                if t.end() > at:  # the error is in the key itself
                    return None
                try:
                    key = json.loads(t[0])
                except ValueError:
                    return None
                expect_key = False
        elif c in b"{[":
            depth += 1
            expect_key = depth == 1 and c == b"{"
        elif c in b"}]":
            depth -= 1
            if depth < 1:  # the error is after the object's end
                key = None
        elif c == b"," and depth == 1:
            expect_key = True
    return key if key is not None and len(key) <= 64 and key.isprintable() else None


def explain(err: ValidationError, model: type[BaseModel] | None = None, raw: bytes = b""
            ) -> tuple[str, str | None]:
    """One line naming the problem and the fix, and the parameter, for ``err``'s first
    error (pydantic reports every branch of a union; the client needs one sentence);
    ``raw``, the body, names the parameter whose value is not valid JSON."""
    hints = {**HINTS, **(TOKENIZE_HINTS if model is TokenizeRequest else {})}
    e = err.errors(include_url=False)[0]
    kind, loc, got = e["type"], tuple(e["loc"]), e.get("input")
    param = str(loc[0]) if loc else None
    path = _path(loc)
    if kind == "json_invalid":
        why = e["ctx"]["error"] if "ctx" in e else e["msg"]
        param = _param_at(raw, why)
        return (f"{param + ': ' if param else ''}the body is not valid JSON ({why}); send "
                "one JSON object, strings as UTF-8 without lone surrogates, nested at most "
                "200 deep"), param
    if not loc and kind in ("model_type", "model_attributes_type"):
        return "the body must be a JSON object", None
    if kind == "value_error" and isinstance(e.get("ctx", {}).get("error"), Refused):
        r: Refused = e["ctx"]["error"]
        # a nested model's refusal (messages[2]) says which entry it is about
        return (f"{path}: {r}" if len(loc) > 1 else str(r)), r.param
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return (f"unknown parameter {param!r}; leave it out (docs/serving.md lists the "
                    "parameters)"), param
        return f"{path} is not supported; leave it out", param
    if kind == "missing":
        return f"{path} is required", param
    shown = _shown(got)
    if param in hints and (len(loc) > 1 or kind.endswith("_type") or kind in (
            "union_tag_invalid", "literal_error", "too_short")):
        if kind == "literal_error" and path.endswith("role"):
            return (f"{path} must be system, developer, user, assistant or tool, got "
                    f"{shown}"), param
        if kind == "literal_error" and path.endswith("type"):
            return f"only text content parts are supported ({path} is {shown})", param
        return f"{hints[param]}; {path} is {shown}", param
    if kind == "finite_number":
        return f"{path} must be a finite number {RANGES.get(path, '')}".rstrip() + \
            f", got {shown}", param
    ctx = e.get("ctx", {})
    bound = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
             "less_than": "<"}
    if kind in bound:
        if path in RANGES:
            return f"{path} must be {RANGES[path]}, got {shown}", param
        limit = next(iter(ctx.values()))
        return f"{path} must be {bound[kind]} {limit}, got {shown}", param
    if kind in ("too_short", "too_long", "string_too_long"):
        return f"{path} is too {'short' if kind == 'too_short' else 'long'}: {e['msg']}", param
    if kind == "literal_error":  # in JSON's words: true, not True
        want = str(ctx.get("expected")).replace("True", "true").replace("False", "false")
        return f"{path} must be {want}, got {shown}", param
    if KINDS.get(kind):
        return f"{path} must be {KINDS[kind]}, got {shown}", param
    return f"{path}: {e['msg']}, got {shown}", param


def _shown(v: Any, limit: int = 60) -> str:
    """``v`` as the client wrote it, cut short: an error message stays one short line."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def openapi(version: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document of the request and response bodies (``GET /openapi.json``)."""
    outs = [m for pair in RESPONSES.values() for m in pair] + [ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in REQUESTS.values()]
                                 + [(m, "serialization") for m in outs],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs.get("$defs", {})

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}

    paths: dict[str, Any] = {}
    for route, model in REQUESTS.items():
        ok: dict[str, Any] = {"description": "the result", "content": {
            "application/json": {"schema": {"type": "object"}}}}
        if route in RESPONSES:
            whole, event = RESPONSES[route]
            ok = {"description": f"the result; with stream, SSE events of {event.__name__} "
                                 f"ending with data: [DONE]",
                  "content": {"application/json": ref(whole), "text/event-stream": ref(event)}}
        paths[route] = {"post": {
            "summary": (model.__doc__ or "").split("\n")[0],
            "requestBody": {"required": True, "content": {"application/json": ref(model)}},
            "responses": {
                "200": ok,
                **{code: {"description": what, "content": {"application/json": ref(
                    ErrorResponse)}}
                   for code, what in (("400", "bad input"), ("401", "missing or wrong key"),
                                      ("404", "unknown model"), ("429", "queue full"),
                                      ("503", "the synchroniser is unreachable"))}}}}
    return {"openapi": "3.1.0", "info": {"title": "treepipe OpenAI-compatible API",
                                         "version": version},
            "paths": paths, "components": {"schemas": schemas}}
