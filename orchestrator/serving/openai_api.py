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
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any, TypeVar

import grpc
from aiohttp import web
from pydantic import BaseModel, ValidationError

from orchestrator.serving.gateway import Closing
from orchestrator.serving.metrics import CONTENT_TYPE, Metrics
from orchestrator.serving.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    Delta,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    Out,
    TokenizeRequest,
    TreepipeStats,
    Usage,
    dump,
    explain,
    openapi,
)
from orchestrator.serving.runner import Chunk, RequestError, RequestRunner
from protocol import treepipe_pb2

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


def to_generate_request(body: ChatRequest | CompletionRequest) -> treepipe_pb2.GenerateRequest:
    """The gRPC request a parsed OpenAI request body stands for."""
    req = treepipe_pb2.GenerateRequest(model=body.model)
    if isinstance(body, ChatRequest):
        for m in body.messages:
            req.messages.add(role=m.role, content=m.text())
    else:
        p = body.one_prompt()
        if isinstance(p, str):
            req.prompt = p
        else:
            req.prompt_ids.extend(p)
    req.max_tokens = body.new_tokens()[1] or 0
    s = req.sampling
    s.temperature, s.top_p = body.temperature, body.top_p
    if body.seed is not None:  # else the runner draws one (random unless seeded)
        s.seed = body.seed
    s.top_k = max(body.top_k, 0)  # vLLM: -1 (or 0) is off
    s.presence_penalty, s.frequency_penalty = body.presence_penalty, body.frequency_penalty
    if body.repetition_penalty != 1.0:
        s.repetition_penalty = body.repetition_penalty
    for key, bias in body.logit_bias.items():
        s.logit_bias[int(key)] = bias
    s.min_tokens = body.min_tokens
    req.stop.extend(body.stops())
    req.ignore_eos = body.ignore_eos
    return req


def parse(model: type[M], raw: bytes) -> M:
    """``raw`` as a ``model``; RequestError with one line naming the problem and the fix."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = explain(e, model)
        raise RequestError(BAD, message, param) from None


class OpenAIServer:
    """The aiohttp application over a runner, served from its own thread and loop."""

    def __init__(self, runner: RequestRunner, metrics: Metrics | None = None,
                 api_key: str | None = None, max_workers: int = 96):
        self.runner, self.metrics, self.api_key = runner, metrics, api_key
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
            raise OSError(f"cannot serve HTTP on {host}:{port} ({failure[0]}); pick a free "
                          "--http-listen port")
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
        adm = await self._blocking(self.runner.validate, to_generate_request(body))
        adm.include_stop = body.include_stop_str_in_output
        if body.stop_token_ids:
            if any(t >= self.runner.vocab for t in body.stop_token_ids):
                raise RequestError(BAD, f"stop_token_ids must lie in [0, {self.runner.vocab})",
                                   "stop_token_ids")
            adm.stop_token_ids = list(body.stop_token_ids)
            # the pipeline ends a request at these ids as at EOS (arrive.lua), ignore_eos
            # or not: the tokens before are ar's
            adm.stop_ids += [t for t in body.stop_token_ids if t not in adm.stop_ids]
        call = HttpCall(request, self.closing)
        gen = self.runner.generate(adm, call, t0)
        rid_header = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        meta = {"created": int(time.time()), "model": self.runner.model,
                "chat": chat, "stats": body.treepipe_stats,
                "token_ids": body.return_token_ids,
                "prompt_tokens": len(adm.prompt), "seed": adm.params["seed"]}
        try:
            if body.stream:
                meta["usage"] = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream(request, gen, call, meta, rid_header)
            chunks: list[Chunk] = await self._blocking(list, gen)
        finally:
            await self._blocking(gen.close)
        if self.closing.is_set() and not (chunks and chunks[-1].finished):
            raise self.closing.error()  # ended by the shutdown: 503, not a cut-off 200
        if not chunks:  # the client went away before anything came
            return web.Response(status=499)
        text = "".join(c.text for c in chunks)
        ids = [t for c in chunks for t in c.token_ids]
        last = chunks[-1]
        extra: dict[str, Any] = {"token_ids": ids} if meta["token_ids"] else {}
        common = {"index": 0, "logprobs": None, "finish_reason": _finish(last.finish_reason),
                  **extra}
        choice = (ChatChoice(message=AssistantMessage(role="assistant", content=text), **common)
                  if chat else CompletionChoice(text=text, **common))
        stats = self._stats(meta, last)
        out = (ChatCompletion if chat else Completion)(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{last.request_id}",
            object="chat.completion" if chat else "text_completion",
            created=meta["created"], model=meta["model"], choices=[choice],
            usage=self._usage(meta, len(ids)), system_fingerprint=None,
            **({"treepipe_stats": stats} if stats else {}))
        resp = web.json_response(dump(out))
        resp.headers["X-Request-Id"] = rid_header
        return resp

    @staticmethod
    def _usage(meta: dict[str, Any], completion: int) -> Usage:
        p = meta["prompt_tokens"]
        return Usage(prompt_tokens=p, completion_tokens=completion,
                     total_tokens=p + completion)

    @staticmethod
    def _stats(meta: dict[str, Any], last: Chunk) -> TreepipeStats | None:
        """``treepipe_stats`` of the request's last chunk, when asked for."""
        if not meta["stats"] or last.stats is None:
            return None
        return TreepipeStats(**last.stats.to_dict(), seed=meta["seed"])

    async def _stream(self, request: web.Request, gen: Iterator[Chunk], call: HttpCall,
                      meta: dict[str, Any], rid_header: str) -> web.StreamResponse:
        # the first chunk comes before the headers, so a refusal (full queue) gets its status
        first = await self._blocking(next, gen, None)
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

        async def send(body: Out | dict[str, Any]) -> None:
            obj = dump(body) if isinstance(body, Out) else body
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def event(c: Chunk | None, delta: Delta) -> Out:
            common: dict[str, Any] = {
                "index": 0, "logprobs": None,
                "finish_reason": _finish(c.finish_reason) if c is not None and c.finished
                else None}
            if meta["token_ids"] and c is not None:
                common["token_ids"] = c.token_ids
            choice = (ChatChunkChoice(delta=delta, **common) if chat
                      else CompletionChunkChoice(text=delta.content or "", **common))
            stats = self._stats(meta, c) if c is not None and c.finished else None
            return event_type(choices=[choice], **base,
                              **({"usage": None} if meta["usage"] else {}),
                              **({"treepipe_stats": stats} if stats else {}))

        chunk: Chunk | None = first
        try:
            if chat:
                await send(event(None, Delta(role="assistant", content="")))
            while chunk is not None:
                n_tokens += len(chunk.token_ids)
                await send(event(chunk, Delta(content=chunk.text)
                                 if chunk.text or not chat else Delta()))
                if chunk.finished:
                    break
                chunk = await self._blocking(next, gen, None)
            if chunk is None and self.closing.is_set():  # ended by the shutdown, not done
                raise self.closing.error()
            if chunk is not None and meta["usage"]:
                await send(event_type(choices=[], usage=self._usage(meta, n_tokens), **base))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, OSError):  # the client went away: cancel at next step
            call.cancelled.set()
        except Exception as e:  # noqa: BLE001 - the headers are sent: end the stream itself
            # a second HTTP response cannot follow the first: an error event, then [DONE]
            err = e if isinstance(e, RequestError) else self.runner.internal(e, rid_header)
            try:
                await send(_error_body(STATUS.get(err.code, 500), str(err), err.param))
                await resp.write(b"data: [DONE]\n\n")
            except (ConnectionResetError, OSError):
                call.cancelled.set()
        return resp

    # ---- the rest ----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one model this pipeline serves."""
        return web.json_response({"object": "list", "data": [{
            "id": self.runner.model, "object": "model", "created": 0, "owned_by": "treepipe",
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
        if body.messages is not None:
            for m in body.messages:
                req.messages.add(role=m.role, content=m.text())
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
