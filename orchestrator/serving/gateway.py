"""The gRPC gateway: validates requests, queues them, and streams verified tokens.

It tokenizes the prompt (text, chat messages, or ids), admits the request to
the synchroniser when a pipeline slot is free (requests beyond the configured
concurrency wait in a bounded queue), and turns the request's commit events
into ``GenerateChunk`` messages.  A client that cancels, or whose deadline
passes, has its request stopped at the next step boundary; stop strings end
the request the same way.  Health is the standard ``grpc.health.v1`` service:
``""`` is SERVING while Redis answers, ``treepipe.v1.Inference`` while every worker
of the current plan heartbeats (see ``Gateway._watch``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protocol import treepipe_pb2, treepipe_pb2_grpc
from protocol.sync.synchroniser import Busy, Synchroniser
from stages.model.tokenizer import StreamDecoder, TextTokenizer

log = logging.getLogger("treepipe.gateway")
SERVICE = "treepipe.v1.Inference"


class RequestError(ValueError):
    """A request the gateway refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class GatewayLimits:
    """What the gateway accepts and how much it queues."""

    context_length: int
    max_new_tokens: int = 1024
    default_new_tokens: int = 256
    concurrency: int = 1
    max_queue: int = 64
    stall_s: float = 120.0  # no commit for this long while every worker is up: stuck
    # no commit for this long while workers are coming up (a restart, a re-plan that
    # reloads shards): the Kubernetes startup window, not the stall limit, applies
    recover_s: float = 900.0


@dataclass
class Admitted:
    """A validated request, ready for the synchroniser."""

    prompt: list[int]
    max_new: int
    params: dict[str, Any]
    stop_ids: list[int]
    stop: list[str]


def validate(req: treepipe_pb2.GenerateRequest, model: str, tok: TextTokenizer | None,
             vocab: int, eos_ids: list[int], limits: GatewayLimits) -> Admitted:
    """Check a request and tokenize its prompt; raises RequestError naming the fix."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if req.model and req.model != model:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"unknown model {req.model!r}; this gateway serves {model!r}")
    given = [n for n, v in (("prompt", req.prompt), ("messages", req.messages),
                            ("prompt_ids", req.prompt_ids)) if len(v)]
    if not given:
        raise RequestError(bad, "empty prompt; set one of prompt, messages or prompt_ids")
    if len(given) > 1:
        raise RequestError(bad, f"set only one of prompt, messages, prompt_ids (got "
                                f"{', '.join(given)})")
    if (req.prompt or req.messages) and tok is None:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           "this model has no tokenizer; send prompt_ids")
    if req.prompt:
        if not req.prompt.strip():
            raise RequestError(bad, "empty prompt; the prompt is only whitespace")
        prompt = tok.encode(req.prompt)  # type: ignore[union-attr]
    elif req.messages:
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        if any(m["role"] not in ("system", "user", "assistant") for m in msgs):
            raise RequestError(bad, "message roles must be system, user or assistant")
        try:
            prompt = tok.chat_ids(msgs)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - template errors come in many types
            raise RequestError(bad, f"chat messages do not fit the chat template: {e}") from None
    else:
        prompt = list(req.prompt_ids)
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(bad, f"prompt_ids must lie in [0, {vocab})")
    if not prompt:
        raise RequestError(bad, "the prompt encodes to no tokens; send some text")
    if req.max_tokens < 0:
        raise RequestError(bad, f"max_tokens must be >= 0 (0 = default), got {req.max_tokens}")
    max_new = req.max_tokens or limits.default_new_tokens
    if max_new > limits.max_new_tokens:
        raise RequestError(bad, f"max_tokens {max_new} exceeds this pipeline's limit of "
                                f"{limits.max_new_tokens}")
    if len(prompt) + max_new > limits.context_length:
        raise RequestError(bad, f"prompt ({len(prompt)} tokens) + max_tokens ({max_new}) "
                                f"exceeds the context of {limits.context_length}; shorten one")
    s = req.sampling
    if s.temperature < 0:
        raise RequestError(bad, f"temperature must be >= 0 (0 = greedy), got {s.temperature}")
    top_p = s.top_p or 1.0
    if not 0 < top_p <= 1:
        raise RequestError(bad, f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise RequestError(bad, f"top_k must be >= 0 (0 = off), got {s.top_k}")
    if any(not x for x in req.stop):
        raise RequestError(bad, "stop strings must not be empty")
    params = {"temperature": float(s.temperature), "top_p": float(top_p),
              "top_k": int(s.top_k), "seed": int(s.seed)}
    return Admitted(prompt, max_new, params, [] if req.ignore_eos else list(eos_ids),
                    list(req.stop))


class InferenceService(treepipe_pb2_grpc.InferenceServicer):
    """``treepipe.v1.Inference`` over one pipeline's synchroniser."""

    def __init__(self, sync: Synchroniser, model: str, tok: TextTokenizer | None, vocab: int,
                 eos_ids: list[int], limits: GatewayLimits):
        self.sync, self.model, self.tok = sync, model, tok
        self.vocab, self.eos_ids, self.limits = vocab, eos_ids, limits
        self.slots = threading.Semaphore(limits.concurrency)
        self.waiting = 0
        self.lock = threading.Lock()

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        t0 = time.monotonic()
        try:
            adm = validate(request, self.model, self.tok, self.vocab, self.eos_ids, self.limits)
        except RequestError as e:
            context.abort(e.code, str(e))
        with self.lock:
            if self.waiting >= self.limits.max_queue:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.waiting} requests already queued; retry later")
            self.waiting += 1
        try:
            got = self._acquire(context)
        finally:
            with self.lock:
                self.waiting -= 1
        if not got:
            return
        try:
            yield from self._run(adm, context, t0)
        finally:
            self.slots.release()

    def _acquire(self, context: Any) -> bool:
        while context.is_active():
            left = context.time_remaining()
            if left is not None and left <= 0:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed in the queue")
            if self.slots.acquire(timeout=0.2):
                return True
        return False

    def _submit(self, rid: str, adm: Admitted, context: Any) -> None:
        while True:
            try:
                self.sync.submit(rid, adm.prompt, adm.params, adm.max_new, adm.stop_ids)
                return
            except Busy:  # a cancelled request is still draining out of the pipeline
                if not context.is_active():
                    return
                time.sleep(0.02)

    def _run(self, adm: Admitted, context: Any, t0: float) -> Iterator[Any]:
        rid = uuid.uuid4().hex[:16]
        queue_ms = (time.monotonic() - t0) * 1000
        self._submit(rid, adm, context)
        stream = StreamDecoder(self.tok, skip_special_tokens=True) if self.tok else None
        text, sent_chars = "", 0
        hold = max((len(s) for s in adm.stop), default=1) - 1
        last_id, last_t, last_event = "0", t0, time.monotonic()
        finished = False
        try:
            while not finished:
                left = context.time_remaining()
                if not context.is_active():
                    return
                if left is not None and left <= 0:
                    self.sync.cancel(rid, "deadline")
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline passed while generating")
                block = 200 if left is None else max(1, min(200, int(left * 1000)))
                events = self.sync.events(rid, last_id, block)
                idle = time.monotonic() - last_event
                if not events and idle > self.limits.stall_s:
                    ready = self.sync.ready()
                    if ready or idle > self.limits.recover_s:
                        self.sync.cancel(rid, "stalled")
                        why = "made no progress" if ready else "had workers down"
                        context.abort(grpc.StatusCode.UNAVAILABLE,
                                      f"the pipeline {why} for {idle:.0f} s")
                chunk = treepipe_pb2.GenerateChunk(request_id=rid, queue_ms=queue_ms)
                for eid, ev in events:
                    last_id, last_event = eid, time.monotonic()
                    if "tok" in ev:
                        now = time.monotonic()
                        chunk.token_ids.append(int(ev["tok"]))
                        chunk.timing.add(since_request_ms=(now - t0) * 1000,
                                         since_previous_ms=(now - last_t) * 1000)
                        last_t = now
                        if stream:
                            text += stream.push(int(ev["tok"]))
                    elif "end" in ev:
                        finished = True
                        chunk.finished = True
                        chunk.finish_reason = ev.get("reason", ev["end"])
                        if stream:
                            text += stream.flush()
                cut = self._stop_at(text, adm.stop, sent_chars)
                if cut is not None:
                    text, finished = text[:cut], True
                    self.sync.cancel(rid, "stop")
                    chunk.finished, chunk.finish_reason = True, "stop"
                upto = len(text) if finished else max(sent_chars, len(text) - hold)
                chunk.text = text[sent_chars:upto]
                sent_chars = upto
                if chunk.token_ids or chunk.text or chunk.finished:
                    yield chunk
        finally:
            if not finished:
                self.sync.cancel(rid, "client cancelled")

    @staticmethod
    def _stop_at(text: str, stops: list[str], sent: int) -> int | None:
        hits = [i for s in stops if (i := text.find(s, max(0, sent - len(s)))) >= 0]
        return min(hits) if hits else None


class Gateway:
    """The gRPC server: Inference plus grpc.health.v1, with a heartbeat watcher."""

    def __init__(self, service: InferenceService, listen: str, max_workers: int = 32):
        self.service = service
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        treepipe_pb2_grpc.add_InferenceServicer_to_server(service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(listen)
        if not self.port:
            raise OSError(f"cannot listen on {listen}; pick a free port")
        self.stop_event = threading.Event()

    def start(self) -> Gateway:
        self.server.start()
        threading.Thread(target=self._watch, daemon=True, name="health").start()
        return self

    def _watch(self) -> None:
        """Health: "" = this gateway can take requests (Redis answers); SERVICE = the
        pipeline behind it is ready (every worker of the current plan heartbeats).

        Kubernetes probes the first (readiness) and the port (liveness): a re-plan that
        reloads shards for minutes must not get the gateway restarted or unlisted: its
        requests wait for the workers meanwhile (``GatewayLimits.recover_s``).
        ``treepipe up --detach`` and clients wait on SERVICE.
        """
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while not self.stop_event.is_set():
            try:
                up = bool(self.service.sync.r.ping())
                ready = up and self.service.sync.ready()
            except Exception as e:  # noqa: BLE001 - Redis down means not serving
                log.warning("health check failed: %s", e)
                up = ready = False
            self.health.set("", serving if up else not_serving)
            self.health.set(SERVICE, serving if ready else not_serving)
            self.stop_event.wait(0.5)

    def stop(self, grace_s: float = 2.0) -> None:
        self.stop_event.set()
        self.server.stop(grace_s).wait()
