"""OpenAI-compatible HTTP front end of the gateway (aiohttp), plus ``/metrics``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /version``,
``POST /tokenize``, ``POST /detokenize``, ``GET /openapi.json`` and ``GET /metrics``.
A body is parsed by its declared model (orchestrator/serving/openai_models.py: strict
types, bounds, every parameter supported or refused by name), turned into the gRPC
``GenerateRequest`` and goes through the same :class:`RequestRunner` as gRPC: one
validation, one queue, one set of slots.
The runner blocks on Redis, so it runs on a thread pool; the event loop only
moves bytes.  A client that disconnects has its request cancelled at the next
step (``HttpCall.is_active`` looks at the connection).  Errors have OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``; a stream that fails after
its headers ends with such an error as an SSE event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import grpc
from aiohttp import web
from pydantic import BaseModel, ValidationError

from orchestrator.serving.gateway import Closing, ListenError
from orchestrator.serving.metrics import CONTENT_TYPE, Metrics
from orchestrator.serving.openai_models import (
    COMPLETION_DEFAULT_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatRequest,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    Message,
    Out,
    TokenizeRequest,
    TopLogprob,
    TreepipeStats,
    Usage,
    dump,
    explain,
    openapi,
)
from orchestrator.serving.runner import (
    PROMPT_BYTES_PER_TOKEN,
    Admitted,
    Chunk,
    RequestError,
    RequestRunner,
)
from protocol import treepipe_pb2
from protocol.requests.logprobs import TokenLogprobs
from stages.model.tokenizer import TextTokenizer

log = logging.getLogger("treepipe.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
          grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAUTHENTICATED: 401,
          grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500}
BAD = grpc.StatusCode.INVALID_ARGUMENT
M = TypeVar("M", bound=BaseModel)
MAX_BODY = 8 << 20  # bytes of a request body (a prompt is bounded far below, by context)


def _error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ("invalid_request_error" if status < 500 else "server_error")
    # a 404 names a model only when the model was what was not found (not a route)
    code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(
        status, "model_not_found" if status == 404 and param == "model" else None)
    if status == 401:
        kind = "authentication_error"
    return dump(ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param,
                                                code=code)))


def _hung_up(request: web.Request) -> bool:
    """Whether ``request``'s client has closed its connection."""
    return request.transport is None or request.transport.is_closing()


def error_response(status: int, message: str, param: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    """An OpenAI-shaped JSON error (with ``Retry-After`` seconds when given)."""
    resp = web.json_response(_error_body(status, message, param), status=status)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(retry_after)
    return resp


def _version() -> str:
    try:
        return metadata.version("treepipe")
    except metadata.PackageNotFoundError:
        return "unknown"


def _finish(reason: str) -> str:
    # the pipeline says eos when the model ended the text itself; OpenAI calls that "stop"
    return "length" if reason == "length" else "stop"


class HttpCall:
    """The runner's view of an HTTP connection: active until the client goes away, or
    until the gateway shuts down (``closing``), which ends the request at the runner's
    next check (every 0.2 s at most)."""

    def __init__(self, request: web.Request, closing: Closing | None = None):
        self.request = request
        self.cancelled = threading.Event()
        self.closing = closing

    def is_active(self) -> bool:
        if self.closing is not None and self.closing.is_set():
            return False
        t = self.request.transport  # None once the connection is lost
        return not self.cancelled.is_set() and t is not None and not t.is_closing()

    def time_remaining(self) -> float | None:
        return None


def to_generate_requests(body: ChatRequest | CompletionRequest
                         ) -> list[treepipe_pb2.GenerateRequest]:
    """The gRPC requests a parsed OpenAI request body stands for, one per choice, in
    vLLM's choice order: prompt ``p``'s choice ``j`` is choice ``p * n + j``, sampled with
    ``seed + j`` when the body has a seed (vLLM's), else with a seed of its own."""
    out = []
    prompts: list[str | list[int] | None] = (
        [None] if isinstance(body, ChatRequest) else list(body.prompts()))
    for prompt in prompts:
        for j in range(body.n):
            req = treepipe_pb2.GenerateRequest(model=body.model)
            if isinstance(body, ChatRequest):
                # the HTTP API renders the template itself (tools, developer and tool
                # turns: OpenAIServer.chat_ids) and sends ids; the messages stand in here
                for m in body.messages:
                    req.messages.add(role=m.for_template()["role"], content=m.text())
            elif isinstance(prompt, str):
                req.prompt = prompt
            else:
                req.prompt_ids.extend(prompt or [])
            req.max_tokens = body.new_tokens()[1] or 0
            s = req.sampling
            s.temperature, s.top_p = body.temperature, body.top_p
            seed = body.choice_seed(j)
            if seed is not None:  # else the runner draws one (random unless seeded)
                s.seed = seed
            s.top_k = max(body.top_k, 0)  # vLLM: -1 (or 0) is off
            s.min_p = body.min_p
            s.presence_penalty = body.presence_penalty
            s.frequency_penalty = body.frequency_penalty
            if body.repetition_penalty != 1.0:
                s.repetition_penalty = body.repetition_penalty
            for key, bias in body.logit_bias.items():
                s.logit_bias[int(key)] = bias
            s.min_tokens = body.min_tokens
            req.stop.extend(body.stops())
            req.ignore_eos = body.ignore_eos
            if body.logprobs_asked() is not None:
                req.logprobs = body.logprobs_asked()  # type: ignore[assignment]
            if body.format_text() is not None:
                req.response_format = body.format_text()  # type: ignore[assignment]
            out.append(req)
    return out


def token_text(tok: TextTokenizer | None, token: int) -> str:
    """A token's text as logprobs show it: decoded alone, special tokens included
    (vLLM's); ``token_id:N`` for a model without a tokenizer (vLLM's form for ids)."""
    return tok.decode([token]) if tok is not None else f"token_id:{token}"


def chat_logprobs(tok: TextTokenizer | None, ids: list[int],
                  lps: list[TokenLogprobs]) -> ChatLogprobs:
    """``choices[i].logprobs`` of chat tokens ``ids``: OpenAI's ``content`` list."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        text = token_text(tok, t)
        return {"token": text, "logprob": lp,
                "bytes": list(text.encode("utf-8", errors="replace"))}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(t, lp.logprob),
                         top_logprobs=[TopLogprob(**entry(a, v)) for a, v in lp.top])
        for t, lp in zip(ids, lps, strict=True)])


def completion_logprobs(tok: TextTokenizer | None, ids: list[int],
                        lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
    """``choices[i].logprobs`` of text tokens ``ids`` whose first starts at character
    ``offset`` of the choice's text (after its echo, and earlier stream chunks)."""
    texts = [token_text(tok, t) for t in ids]
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=texts, token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{token_text(tok, a): v for a, v in lp.top} for lp in lps],
        text_offset=starts)


def to_generate_request(body: ChatRequest | CompletionRequest) -> treepipe_pb2.GenerateRequest:
    """The gRPC request of a body's first choice."""
    return to_generate_requests(body)[0]


@dataclass
class Choices:
    """The choices of one HTTP request, each a request of its own in the runner, and
    the queue their chunks arrive on (choice index, then a Chunk, None once the choice's
    generator is done, or the exception that ended it)."""

    adms: list[Admitted]
    calls: list[HttpCall]
    echo: list[str]  # text before each choice's (completions' echo), "" without echo
    prompt_tokens: int  # each prompt once, as vLLM and OpenAI count usage with n > 1
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]]
    pumps: list[asyncio.Future[None]] = field(default_factory=list)

    def cancel(self) -> None:
        """End every choice still running at the runner's next check (0.2 s at most)."""
        for c in self.calls:
            c.cancelled.set()

    async def wait(self) -> None:
        """Wait for every choice's generator to have ended."""
        await asyncio.gather(*self.pumps, return_exceptions=True)


def chat_ids(tok: TextTokenizer | None, context_length: int, messages: list[Message],
         tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids of chat ``messages`` (and ``tools``) through the chat template.

    What the template would drop is refused, not ignored: ``tools`` when it renders
    the same prompt without them, a tool turn or an assistant's ``tool_calls`` when it
    renders the same prompt without that turn or those calls."""
    if tok is None:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           "this model has no tokenizer; send prompt token ids to "
                           "/v1/completions", "messages")
    template: TextTokenizer = tok  # for the closures below
    # refuse what cannot fit before rendering it (runner.validate's bound for text)
    size = sum(len(m.text().encode()) for m in messages) + len(json.dumps(tools or []))
    bound = context_length * PROMPT_BYTES_PER_TOKEN
    if size > bound:
        raise RequestError(BAD, f"the messages are {size} bytes, more than this "
                                f"pipeline's context of {context_length}"
                                f" tokens can hold (at most {bound} bytes); shorten them",
                           "messages")
    turns = [m.for_template() for m in messages]
    extra = {"tools": tools} if tools else {}

    def render(ts: list[dict[str, Any]], **kw: Any) -> str:
        try:
            return template.apply_chat_template(ts, **kw)
        except Exception as e:  # noqa: BLE001 - template errors come in many types
            why = " ".join(str(e).split())
            raise RequestError(BAD, f"chat messages do not fit the chat template: {why}",
                               "messages") from None

    def same(ts: list[dict[str, Any]], **kw: Any) -> bool:
        # a template that refuses the conversation without a part (roles that must
        # alternate, say) does read that part
        try:
            return render(ts, **kw) == text
        except RequestError:
            return False

    text = render(turns, **extra)
    if tools and same(turns):
        raise RequestError(BAD, "tools: the model's chat template does not use tools (it "
                                "renders the same prompt without them); leave tools out, "
                                "or serve a template that does (treepipe serve "
                                "--chat-template FILE)", "tools")
    for i, t in enumerate(turns):
        if t["role"] == "tool":
            without = turns[:i] + turns[i + 1:]
            what = "tool messages"
        elif "tool_calls" in t:
            without = [*turns[:i], {k: v for k, v in t.items() if k != "tool_calls"},
                       *turns[i + 1:]]
            what = "an assistant's tool_calls"
        else:
            continue
        if same(without, **extra):
            raise RequestError(BAD, f"messages[{i}]: the model's chat template leaves "
                                    f"{what} out of the prompt; leave them out, or serve "
                                    f"a template that renders them (treepipe serve "
                                    f"--chat-template FILE)", "messages")
    # templates write BOS themselves when the model wants it (TextTokenizer.chat_ids)
    return template.tokenizer.encode(text, add_special_tokens=False).ids


def parse(model: type[M], raw: bytes) -> M:
    """``raw`` as a ``model``; RequestError with one line naming the problem and the fix."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = explain(e, model, raw)
        raise RequestError(BAD, message, param) from None


class OpenAIServer:
    """The aiohttp application over a runner, served from its own thread and loop."""

    def __init__(self, runner: RequestRunner, metrics: Metrics | None = None,
                 api_key: str | None = None, max_workers: int = 96):
        self.runner, self.metrics, self.api_key = runner, metrics, api_key
        self.created = int(time.time())  # /v1/models' "created": when this server started
        # set by stop(reason): open requests end with an error instead of lingering
        self.closing = Closing()
        # the runner blocks (queue wait, Redis reads): one thread per request in flight
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="http")
        self.app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat), web.post("/v1/completions",
                                                                  self.completions),
            web.get("/v1/models", self.models), web.get("/health", self.health),
            web.get("/version", self.version), web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize), web.get("/metrics", self.metrics_page),
            web.get("/openapi.json", self.openapi_page)])
        self.loop: asyncio.AbstractEventLoop | None = None
        self.runner_web: web.AppRunner | None = None
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, host: str, port: int,
              ssl_context: ssl.SSLContext | None = None) -> OpenAIServer:
        """Listen on ``host:port`` (0 = a free port, see ``self.port``) in a thread;
        HTTPS with ``ssl_context``."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self.runner_web = web.AppRunner(self.app, access_log=None)
                self.loop.run_until_complete(self.runner_web.setup())
                site = web.TCPSite(self.runner_web, host, port, ssl_context=ssl_context)
                self.loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
                failure.append(e)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True, name="http").start()
        started.wait(30)
        if failure:
            raise ListenError(f"cannot serve HTTP on {host}:{port} ({failure[0]}); pick a "
                              "free --http-listen port")
        return self

    def stop(self, reason: str = "", timeout_s: float = 5.0) -> None:
        """Stop listening and drop the connections, within ``timeout_s``.  With ``reason``,
        open requests end first: a stream with an error event naming it and ``[DONE]``, a
        whole request with 503 (aiohttp's cleanup waits for running handlers, which end
        within the runner's next check of ``HttpCall.is_active``)."""
        if reason:
            self.closing.close(reason)
        if self.loop is None or self.runner_web is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.runner_web.cleanup(), self.loop)
        try:
            fut.result(timeout_s)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- plumbing ----------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        protected = request.path.startswith("/v1/") or request.path in ("/tokenize",
                                                                        "/detokenize")
        if self.api_key and protected:
            got = request.headers.get("Authorization", "")
            token = got[7:] if got.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                resp: web.StreamResponse = error_response(
                    401, "missing or wrong API key; send Authorization: Bearer <key>")
                resp.headers["X-Request-Id"] = rid
                return resp
        try:
            resp = await handler(request)
        except RequestError as e:
            resp = error_response(STATUS.get(e.code, 500), str(e), e.param, e.retry_after)
        except web.HTTPException as e:  # unknown route, wrong method: still OpenAI-shaped
            if e.status == 404:
                why = "no such route; see GET /openapi.json for the routes"
            elif e.status == 405:
                why = f"method not allowed; use {', '.join(sorted(e.allowed_methods))}" \
                    if isinstance(e, web.HTTPMethodNotAllowed) else e.reason
            elif e.status == 413:
                why = f"the body is over {MAX_BODY >> 20} MiB; shorten it"
            else:
                why = e.reason
            resp = error_response(e.status, f"{request.method} {request.path}: {why}")
        except Exception as e:  # noqa: BLE001 - a bug: one line in the log, none to the client
            if isinstance(e, ConnectionResetError) and _hung_up(request):
                # the client left before the response (within its body, say): no bug, and
                # no request of it was admitted; the answer goes nowhere
                log.info("request %s: the client closed the connection before the response",
                         rid)
                resp = error_response(400, "the connection closed before the response")
            else:
                err = self.runner.internal(e, rid)
                resp = error_response(500, str(err))
        if not resp.prepared:
            resp.headers["X-Request-Id"] = rid
        return resp

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- generation --------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        body = parse(ChatRequest if chat else CompletionRequest, await request.read())
        reqs = to_generate_requests(body)
        lim = self.runner.limits
        if len(reqs) > lim.concurrency + lim.max_queue:
            # each choice waits in the queue as a request does: more would be refused half-way
            raise RequestError(BAD, f"{len(reqs)} choices are more than this gateway runs "
                                    f"and queues at once ({lim.concurrency + lim.max_queue}); "
                                    f"lower n or send fewer prompts", "n")
        adms, echo, prompt_tokens = await self._blocking(self._admit, body, reqs)
        choices = Choices(adms, [HttpCall(request, self.closing) for _ in adms], echo,
                          prompt_tokens, asyncio.Queue())
        loop = asyncio.get_running_loop()
        gens = [self.runner.generate(adm, call, t0)
                for adm, call in zip(choices.adms, choices.calls, strict=True)]

        def put(item: tuple[int, Chunk | BaseException | None]) -> None:
            try:
                loop.call_soon_threadsafe(choices.queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        def pump(i: int) -> None:
            # one thread runs a choice's generator from its first step to its close
            end: BaseException | None = None
            try:
                for c in gens[i]:
                    put((i, c))
            except BaseException as e:  # noqa: BLE001 - handed to the event loop
                end = e
            finally:
                gens[i].close()
            put((i, end))

        choices.pumps = [loop.run_in_executor(self.pool, pump, i) for i in range(len(gens))]
        rid_header = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        meta = {"created": int(time.time()), "model": self.runner.model,
                "chat": chat, "stats": body.treepipe_stats,
                "token_ids": body.return_token_ids}
        try:
            if body.stream:
                meta["usage"] = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream(request, choices, meta, rid_header)
            return await self._whole(choices, meta, rid_header)
        finally:
            choices.cancel()  # a failed or abandoned choice ends the others
            await choices.wait()

    def _admit(self, body: ChatRequest | CompletionRequest,
               reqs: list[treepipe_pb2.GenerateRequest]
               ) -> tuple[list[Admitted], list[str], int]:
        """Validate every choice's request: the admitted requests, each choice's echo
        text and the prompt tokens (each prompt once)."""
        if isinstance(body, ChatRequest):
            ids = self.chat_ids(body.messages, body.template_tools())
            for r in reqs:
                r.ClearField("messages")
                r.prompt_ids.extend(ids)
        if any(t >= self.runner.vocab for t in body.stop_token_ids):
            raise RequestError(BAD, f"stop_token_ids must lie in [0, {self.runner.vocab})",
                               "stop_token_ids")
        adms, echo, prompt_tokens = [], [], 0
        for i, r in enumerate(reqs):
            # an unseeded choice draws its own seed here; a text completion without
            # max_tokens generates OpenAI's and vLLM's 16 tokens, a chat the gateway's default
            adm = self.runner.validate(r, COMPLETION_DEFAULT_TOKENS if isinstance(
                body, CompletionRequest) else None)
            if i % body.n == 0:
                prompt_tokens += len(adm.prompt)
            adm.include_stop = body.include_stop_str_in_output
            if body.stop_token_ids:
                adm.stop_token_ids = list(body.stop_token_ids)
                # the pipeline ends a request at these ids as at EOS (arrive.lua),
                # ignore_eos or not: the tokens before are ar's
                adm.stop_ids += [t for t in body.stop_token_ids if t not in adm.stop_ids]
            adms.append(adm)
            echo.append(self._echo(r) if isinstance(body, CompletionRequest) and body.echo
                        else "")
        return adms, echo, prompt_tokens

    def _echo(self, req: treepipe_pb2.GenerateRequest) -> str:
        """A prompt's text as ``echo`` returns it: as sent, or its ids decoded (vLLM's)."""
        if req.prompt:
            return req.prompt
        if self.runner.tok is None:
            raise RequestError(BAD, "echo of token ids needs a tokenizer, and this model has "
                                    "none; leave echo out", "echo")
        return self.runner.tok.decode(list(req.prompt_ids))

    def chat_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None
                 ) -> list[int]:
        """The prompt ids of chat ``messages`` (and ``tools``): :func:`chat_ids`."""
        return chat_ids(self.runner.tok, self.runner.limits.context_length, messages, tools)

    def _choice_stats(self, choices: Choices, i: int, last: Chunk | None,
                      meta: dict[str, Any]) -> TreepipeStats | None:
        """Choice ``i``'s ``treepipe_stats`` from its last chunk, when asked for."""
        if not meta["stats"] or last is None or last.stats is None:
            return None
        return TreepipeStats(**last.stats.to_dict(), seed=choices.adms[i].params["seed"])

    def _logprobs(self, choices: Choices, i: int, ids: list[int], lps: list[TokenLogprobs],
                  offset: int, chat: bool) -> ChatLogprobs | CompletionLogprobs | None:
        """Choice ``i``'s logprobs of tokens ``ids`` in the route's shape (None: it did
        not ask)."""
        if choices.adms[i].logprobs is None:
            return None
        if chat:
            return chat_logprobs(self.runner.tok, ids, lps)
        return completion_logprobs(self.runner.tok, ids, lps, offset)

    async def _whole(self, choices: Choices, meta: dict[str, Any],
                     rid_header: str) -> web.StreamResponse:
        """Every choice to its end, then one JSON body."""
        n = len(choices.adms)
        got: list[list[Chunk]] = [[] for _ in range(n)]
        done = 0
        while done < n:
            i, item = await choices.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                done += 1
            else:
                got[i].append(item)
        if self.closing.is_set() and not all(c and c[-1].finished for c in got):
            raise self.closing.error()  # ended by the shutdown: 503, not a cut-off 200
        if not all(got):  # the client went away before anything came
            return web.Response(status=499)
        chat = meta["chat"]
        out_choices: list[ChatChoice] | list[CompletionChoice] = []
        completion_tokens = 0
        stats: list[TreepipeStats | None] = []
        for i, chunks in enumerate(got):
            text = choices.echo[i] + "".join(c.text for c in chunks)
            ids = [t for c in chunks for t in c.token_ids]
            completion_tokens += len(ids)
            last = chunks[-1]
            stats.append(self._choice_stats(choices, i, last, meta))
            common: dict[str, Any] = {"index": i, "logprobs": self._logprobs(
                choices, i, ids, [lp for c in chunks for lp in c.logprobs],
                len(choices.echo[i]), chat),
                "finish_reason": _finish(last.finish_reason)}
            if meta["token_ids"]:
                common["token_ids"] = ids
            if n > 1 and stats[i] is not None:
                common["treepipe_stats"] = stats[i]
            out_choices.append(  # type: ignore[arg-type]
                ChatChoice(message=AssistantMessage(role="assistant", content=text), **common)
                if chat else CompletionChoice(text=text, **common))
        usage = Usage(prompt_tokens=choices.prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=choices.prompt_tokens + completion_tokens)
        out = (ChatCompletion if chat else Completion)(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{got[0][-1].request_id}",
            object="chat.completion" if chat else "text_completion",
            created=meta["created"], model=meta["model"], choices=out_choices,
            usage=usage, system_fingerprint=None,
            **({"treepipe_stats": stats[0]} if n == 1 and stats[0] else {}))
        resp = web.json_response(dump(out))
        resp.headers["X-Request-Id"] = rid_header
        return resp

    async def _stream(self, request: web.Request, choices: Choices, meta: dict[str, Any],
                      rid_header: str) -> web.StreamResponse:
        """SSE events of every choice as their tokens come, each tagged with its index."""
        n = len(choices.adms)
        # the first chunk comes before the headers, so a refusal (full queue) gets its status
        i, first = await choices.queue.get()
        if isinstance(first, BaseException):
            raise first
        if first is None:
            if self.closing.is_set():  # the shutdown ended it before its first chunk
                raise self.closing.error()
            return web.Response(status=499)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": rid_header})
        await resp.prepare(request)
        chat = meta["chat"]
        event_type = ChatCompletionChunk if chat else CompletionChunk
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{first.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": meta["created"], "model": meta["model"]}
        n_tokens = 0
        finished = [False] * n
        # where each choice's next token starts in its text (completions' text_offset)
        offsets = [len(e) for e in choices.echo]

        async def send(body: Out | dict[str, Any]) -> None:
            obj = dump(body) if isinstance(body, Out) else body
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def event(index: int, c: Chunk | None, delta: Delta) -> Out:
            lps = None
            if c is not None and choices.adms[index].logprobs is not None:
                lps = self._logprobs(choices, index, c.token_ids, c.logprobs, offsets[index],
                                     chat)
                offsets[index] += sum(len(t) for t in lps.tokens) \
                    if isinstance(lps, CompletionLogprobs) else 0
            common: dict[str, Any] = {
                "index": index, "logprobs": lps,
                "finish_reason": _finish(c.finish_reason) if c is not None and c.finished
                else None}
            if meta["token_ids"] and c is not None:
                common["token_ids"] = c.token_ids
            stats = self._choice_stats(choices, index, c, meta) \
                if c is not None and c.finished else None
            if n > 1 and stats is not None:
                common["treepipe_stats"] = stats
            choice = (ChatChunkChoice(delta=delta, **common) if chat
                      else CompletionChunkChoice(text=delta.content or "", **common))
            return event_type(choices=[choice], **base,
                              **({"usage": None} if meta["usage"] else {}),
                              **({"treepipe_stats": stats} if n == 1 and stats else {}))

        item: Chunk | BaseException | None = first
        try:
            for k in range(n):  # each choice opens with its role (chat) or its echo
                if chat:
                    await send(event(k, None, Delta(role="assistant", content="")))
                elif choices.echo[k]:
                    await send(event(k, None, Delta(content=choices.echo[k])))
            ended = 0
            while True:
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    ended += 1
                    if ended == n:
                        break
                else:
                    n_tokens += len(item.token_ids)
                    finished[i] = finished[i] or item.finished
                    await send(event(i, item, Delta(content=item.text)
                                     if item.text or not chat else Delta()))
                i, item = await choices.queue.get()
            if not all(finished):
                if self.closing.is_set():  # ended by the shutdown, not done
                    raise self.closing.error()
                return resp  # the client went away
            if meta["usage"]:
                p = choices.prompt_tokens
                await send(event_type(choices=[], usage=Usage(
                    prompt_tokens=p, completion_tokens=n_tokens, total_tokens=p + n_tokens),
                    **base))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, OSError):  # the client went away: cancel at next step
            choices.cancel()
        except Exception as e:  # noqa: BLE001 - the headers are sent: end the stream itself
            choices.cancel()
            # a second HTTP response cannot follow the first: an error event, then [DONE]
            err = e if isinstance(e, RequestError) else self.runner.internal(e, rid_header)
            try:
                await send(_error_body(STATUS.get(err.code, 500), str(err), err.param))
                await resp.write(b"data: [DONE]\n\n")
            except (ConnectionResetError, OSError):
                pass
        return resp

    # ---- the rest ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one model this pipeline serves."""
        return web.json_response({"object": "list", "data": [{
            "id": self.runner.model, "object": "model", "created": self.created,
            "owned_by": "treepipe",
            "max_model_len": self.runner.limits.context_length}]})

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 when Redis answers and every worker of the plan is up."""
        if self.runner.down_for() is not None:  # a known outage: no socket timeout's wait
            return web.json_response({"status": "unavailable", "redis": False,
                                      "pipeline_ready": False}, status=503)

        def check() -> tuple[bool, bool]:
            try:
                return bool(self.runner.sync.r.ping()), self.runner.sync.ready()
            except Exception:  # noqa: BLE001 - Redis down
                return False, False

        redis_up, ready = await self._blocking(check)
        ok = redis_up and ready
        return web.json_response({"status": "ok" if ok else "unavailable", "redis": redis_up,
                                  "pipeline_ready": ready}, status=200 if ok else 503)

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version``."""
        return web.json_response({"version": _version()})

    async def openapi_page(self, request: web.Request) -> web.Response:
        """``GET /openapi.json``: the request bodies' schema (open, as vLLM serves it)."""
        return web.json_response(openapi(_version()))

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize`` with ``prompt`` or ``messages`` (vLLM's shape)."""
        body = parse(TokenizeRequest, await request.read())
        req = treepipe_pb2.GenerateRequest(model=body.model, max_tokens=1)
        if body.messages is not None:  # rendered as /v1/chat/completions renders them
            req.prompt_ids.extend(await self._blocking(self.chat_ids, body.messages, None))
        else:
            req.prompt = body.prompt or ""
        adm = await self._blocking(self.runner.validate, req)
        return web.json_response({"count": len(adm.prompt), "tokens": adm.prompt,
                                  "max_model_len": self.runner.limits.context_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize`` with ``tokens``."""
        ids = parse(DetokenizeRequest, await request.read()).tokens
        if self.runner.tok is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this model has no tokenizer", "tokens")
        if any(t >= self.runner.vocab for t in ids):
            raise RequestError(BAD, f"tokens must be a list of ids in [0, {self.runner.vocab})",
                               "tokens")
        return web.json_response({"prompt": self.runner.tok.decode(ids)})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text format."""
        if self.metrics is None:
            return error_response(404, "metrics are off")
        data = await self._blocking(self.metrics.render)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})
