"""The gRPC gateway: validates requests, queues them, and streams verified tokens.

The request handling lives in orchestrator/serving/runner.py, shared with the
OpenAI-compatible HTTP front end (orchestrator/serving/openai_api.py).  It
tokenizes the prompt (text, chat messages, or ids), admits the request to
the synchroniser when a pipeline slot is free (requests beyond the configured
concurrency wait in a bounded queue), and turns the request's commit events
into ``GenerateChunk`` messages.  A client that cancels, or whose deadline
passes, has its request stopped at the next step boundary; stop strings end
the request the same way.  Health is the standard ``grpc.health.v1`` service:
``""`` is SERVING while Redis answers, ``treepipe.v1.Inference`` while every worker
of the current plan heartbeats (see ``Gateway._watch``).

gRPC server reflection (``grpc.reflection.v1alpha``) lists and describes the
services, so ``grpcurl`` needs no .proto file.

With an API key every call but health needs ``authorization: Bearer <key>``
metadata (orchestrator/serving/auth.py); with a cert/key pair gRPC runs over TLS,
and ``health_listen`` then adds a plaintext health-only port for kubelet probes,
which speak no TLS.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from orchestrator.serving.auth import BearerAuth
from orchestrator.serving.runner import (  # noqa: F401 - GatewayLimits, validate re-exported
    RETRY_AFTER_S,
    Admitted,
    GatewayLimits,
    Observer,
    RequestError,
    RequestRunner,
    validate,
)
from protocol import treepipe_pb2, treepipe_pb2_grpc
from protocol.errors import TreepipeError
from protocol.links.grpc_ports import EXCLUSIVE_PORT, bind_port
from protocol.sync.synchroniser import Synchroniser, is_lost
from stages.model.tokenizer import TextTokenizer

log = logging.getLogger("treepipe.gateway")
SERVICE = "treepipe.v1.Inference"
# the pid of the local supervisor (`treepipe up`) that started this process, if one did
SUPERVISOR_PID_ENV = "TREEPIPE_SUPERVISOR_PID"


def supervisor_pid() -> int | None:
    """The supervisor this process was started by (``$TREEPIPE_SUPERVISOR_PID``), if any."""
    raw = os.environ.get(SUPERVISOR_PID_ENV, "")
    return int(raw) if raw.isdigit() else None


def supervisor_gone() -> bool:
    """True when this process was started by a supervisor that has died since: an
    orphan is re-parented (to init or a subreaper), so its parent pid changes."""
    pid = supervisor_pid()
    return pid is not None and os.getppid() != pid


def watch_supervisor(on_gone: Callable[[], None], poll_s: float = 0.5) -> bool:
    """Call ``on_gone`` (once, from a daemon thread) when the supervisor that started this
    process dies; False when no supervisor started it.

    The kernel's ``PR_SET_PDEATHSIG`` (set by the launcher) is the first notice; this is
    the backstop that needs no prctl: it also holds where the signal is not delivered
    (it is tied to the supervisor *thread* that forked, it is Linux-only and the launcher
    ignores a failed prctl).  A pidfd of the parent (Linux 5.3+) turns readable the moment
    it exits, so the watch is an event, not a poll; the pid is checked to still be our
    parent after opening it, so a recycled pid is never watched.  Without pidfds the
    parent pid is polled every ``poll_s``, which POSIX re-parenting makes exact."""
    pid = supervisor_pid()
    if pid is None:
        return False

    def watch() -> None:
        fd = -1
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here, or the supervisor is gone
            pass
        try:
            if fd >= 0 and os.getppid() == pid:
                select.select([fd], [], [])  # readable once the supervisor has exited
            else:
                while os.getppid() == pid:
                    time.sleep(poll_s)
        finally:
            if fd >= 0:
                os.close(fd)
        on_gone()

    threading.Thread(target=watch, daemon=True, name="supervisor-watch").start()
    return True


class Closing:
    """Set once this process shuts down: every open stream ends with ``reason``
    (UNAVAILABLE / an SSE error event) instead of going silent or waiting on a Redis
    that may have died with the supervisor."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def close(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def error(self) -> RequestError:
        return RequestError(grpc.StatusCode.UNAVAILABLE,
                            f"the gateway is shutting down ({self.reason}); retry once the "
                            f"pipeline is back", retry_after=RETRY_AFTER_S)


class ClosingCall:
    """A call as the runner sees it, inactive once the gateway closes: the runner checks
    ``is_active`` at least every 0.2 s (each event read blocks at most that long, and
    each wait for Redis sleeps that long), so its request ends within that."""

    def __init__(self, call: Any, closing: Closing):
        self.call, self.closing = call, closing

    def is_active(self) -> bool:
        return not self.closing.is_set() and bool(self.call.is_active())

    def time_remaining(self) -> float | None:
        return self.call.time_remaining()


class InferenceService(treepipe_pb2_grpc.InferenceServicer):
    """``treepipe.v1.Inference`` over one pipeline's :class:`RequestRunner`."""

    def __init__(self, sync: Synchroniser, model: str, tok: TextTokenizer | None, vocab: int,
                 eos_ids: list[int], limits: GatewayLimits, observer: Observer | None = None):
        self.runner = RequestRunner(sync, model, tok, vocab, eos_ids, limits, observer)
        self.sync = sync
        self.closing = Closing()

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        t0 = time.monotonic()
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the request is not a GenerateRequest ({request.error}); send text "
                          f"fields as UTF-8 (or token ids in prompt_ids)")
        finished = False
        try:
            adm = self.runner.validate(request)
            for c in self.runner.generate(adm, ClosingCall(context, self.closing), t0):
                finished = finished or c.finished
                chunk = treepipe_pb2.GenerateChunk(
                    request_id=c.request_id, queue_ms=c.queue_ms, token_ids=c.token_ids,
                    text=c.text, finished=c.finished, finish_reason=c.finish_reason)
                for since_request, since_previous in c.timing:
                    chunk.timing.add(since_request_ms=since_request,
                                     since_previous_ms=since_previous)
                for lp in c.logprobs:
                    chunk.logprobs.add(logprob=lp.logprob, top=[
                        treepipe_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                yield chunk
            if not finished and self.closing.is_set():  # ended by the shutdown, not done
                raise self.closing.error()
        except RequestError as e:
            _abort(context, e)
        except Exception as e:  # noqa: BLE001 - a bug of ours: INTERNAL, logged once
            _abort(context, self.runner.internal(e))


def _abort(context: Any, e: RequestError) -> None:
    """End the call with ``e``'s status; a retry hint rides as ``retry-after`` (seconds)
    trailing metadata, as the HTTP API sends a Retry-After header."""
    if e.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
    context.abort(e.code, str(e))


@dataclass
class Undecodable:
    """Bytes that did not parse as a GenerateRequest (e.g. invalid UTF-8 in a string)."""

    error: str


def parse_request(data: bytes) -> Any:
    """The request, or :class:`Undecodable`: gRPC itself would answer a parse error with
    a bare INTERNAL, where the client needs INVALID_ARGUMENT and the reason."""
    try:
        return treepipe_pb2.GenerateRequest.FromString(data)
    except DecodeError as e:
        return Undecodable(str(e).rpartition(": ")[2] or str(e))


def add_inference(service: Any, server: grpc.Server) -> None:
    """Register ``service``'s Generate (the generated registration, with our parser)."""
    handler = grpc.unary_stream_rpc_method_handler(
        service.Generate, request_deserializer=parse_request,
        response_serializer=treepipe_pb2.GenerateChunk.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Generate": handler}),))


class ListenError(TreepipeError, OSError):
    """A gateway port that cannot be bound: one line naming the flag's fix, no traceback
    (an OSError still, for callers that catch that)."""


SPARE_HANDLERS = 8  # handler threads beyond running + queued: health checks and refusals


class Gateway:
    """The gRPC server: Inference plus grpc.health.v1, with a heartbeat watcher.

    ``api_key``: calls but health need it as bearer metadata.  ``credentials``: serve
    TLS (:func:`orchestrator.serving.auth.server_credentials`).  ``health_listen``: also
    serve health alone, in plaintext, on that HOST:PORT (``health_port`` once bound).
    """

    def __init__(self, service: InferenceService, listen: str, max_workers: int | None = None,
                 api_key: str | None = None, credentials: grpc.ServerCredentials | None = None,
                 health_listen: str = ""):
        self.service = service
        interceptors = [BearerAuth(api_key)] if api_key else None
        if max_workers is None:
            # a running or queued request holds a handler thread for its whole stream: with
            # fewer threads than both, callers wait inside gRPC (where max_queue cannot
            # refuse them) and health checks time out behind them
            lim = service.runner.limits
            max_workers = lim.concurrency + lim.max_queue + SPARE_HANDLERS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                  interceptors=interceptors, options=EXCLUSIVE_PORT)
        add_inference(service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # grpcurl and other tools list and call the services without the .proto (behind
        # the API key like Inference: it describes what the key guards)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = bind_port(self.server, listen, credentials)
        if not self.port:
            raise ListenError(f"cannot listen on {listen} (in use, or not an address of "
                              "this machine); pick a free port")
        self.health_server: grpc.Server | None = None
        self.health_port = 0
        if health_listen:
            self.health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                             options=EXCLUSIVE_PORT)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = bind_port(self.health_server, health_listen)
            if not self.health_port:
                raise ListenError(f"cannot serve health on {health_listen} (in use, or not "
                                  "an address of this machine); pick a free port")
        self.stop_event = threading.Event()

    def start(self) -> Gateway:
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()
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
            tried = time.monotonic()
            try:
                up = bool(self.service.sync.r.ping())
                ready = up and self.service.sync.ready()
                # a request left by a gateway that died (its lease lapsed) would decode
                # on to its end and hold the pipeline: stop it within seconds
                self.service.sync.reap_orphan(self.service.runner.owned)
            except Exception as e:  # noqa: BLE001 - Redis down means not serving
                log.warning("health check failed: %s", e)
                up = ready = False
                # requests arriving during an outage are answered UNAVAILABLE without
                # waiting a Redis timeout of their own ...
                if is_lost(e):
                    self.service.runner.sync_state(False, tried)
            else:  # ... and are taken again as soon as it answers
                self.service.runner.sync_state(True)
            self.health.set("", serving if up else not_serving)
            self.health.set(SERVICE, serving if ready else not_serving)
            self.stop_event.wait(0.5)

    def stop(self, grace_s: float = 2.0, reason: str = "") -> None:
        """Stop serving; with ``reason``, open streams first end with UNAVAILABLE naming
        it (within the grace: the runner notices in 0.2 s) instead of being cut."""
        if reason:
            self.service.closing.close(reason)
        self.stop_event.set()
        if self.health_server is not None:
            self.health_server.stop(0)
        self.server.stop(grace_s).wait(grace_s + 1)
