"""Stage-to-stage links with one interface over two transports: ZeroMQ and gRPC.

Each worker has one inbox (it binds) and at most one outbox (it connects to
the next stage's inbox; the draft service connects to stage 1's).  Both carry
the messages of :mod:`protocol.links.frames`.  An inbox validates every message and
drops a bad one (logging why and counting it) instead of dying; a link to a
peer that restarts reconnects by itself.

Links are authenticated by the pipeline's keys (:mod:`protocol.links.keys`): ZeroMQ
CURVE with a ZAP handler, gRPC mutual TLS.  ``open_inbox``/``open_outbox`` take them
from ``keys=`` or ``$TREEPIPE_LINK_KEYS`` and refuse to open a plaintext link unless
``insecure=True`` (a worker's ``--insecure-links``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
import torch
import zmq

from protocol import treepipe_pb2, treepipe_pb2_grpc
from protocol.errors import TreepipeError
from protocol.links import frames
from protocol.links.frames import Message
from protocol.links.grpc_ports import EXCLUSIVE_PORT, bind_port
from protocol.links.keys import (
    LINK_SERVER_NAME,
    TRANSPORTS,
    LinkKeys,
    curve_client,
    curve_server,
    grpc_channel_credentials,
    grpc_server_credentials,
    resolve,
)
from protocol.links.messages import Nodes, encode

log = logging.getLogger("treepipe.transport")


class TransportError(TreepipeError, ValueError):
    """A transport that does not exist or an address that cannot be used."""


def grpc_options(limits: frames.Limits) -> list[tuple[str, int]]:
    """Message size limits of a link (and an exclusive port for its server)."""
    size = limits.max_header_bytes + limits.max_tensors * limits.max_tensor_bytes
    size = min(size, 2**31 - 1)
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            *EXCLUSIVE_PORT]


class Inbox(ABC):
    """Receiving end bound to ``host:port``."""

    def __init__(self, limits: frames.Limits):
        self.limits = limits
        self.rejected = 0  # bad messages dropped
        self.last_error = ""

    def _decode(self, parts: list[Any]) -> Message | None:
        try:
            return Message(*frames.decode(parts, self.limits))
        except frames.FrameError as e:
            self.rejected += 1
            self.last_error = str(e)
            log.warning("dropped a bad message: %s", e)
            return None

    @abstractmethod
    def recv(self, timeout_s: float) -> Message | None:
        """Next valid message, or None when ``timeout_s`` passes first."""

    @abstractmethod
    def close(self) -> None: ...


class Outbox(ABC):
    """Sending end connected to a peer's inbox."""

    sent_bytes = 0  # bytes of every message handed to the transport (a worker's stats)

    @abstractmethod
    def send(self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Queue one message for the peer (never blocks on a dead peer)."""

    def send_nodes(self, parts: Sequence[Nodes]) -> None:
        """Send every request's part of one hop (levels, hidden states or prefill rows)
        as one frame (:func:`~protocol.links.messages.encode`)."""
        if parts:
            self.send(*encode(parts))

    @abstractmethod
    def close(self) -> None: ...


# ---- ZeroMQ: PUSH -> PULL ---------------------------------------------------------------
class ZmqInbox(Inbox):
    def __init__(self, address: str, limits: frames.Limits, keys: LinkKeys | None = None):
        super().__init__(limits)
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        if keys is not None:
            curve_server(self.sock, keys)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, grpc_options(limits)[0][1])
        self.sock.bind(f"tcp://{address}")

    def recv(self, timeout_s: float) -> Message | None:
        deadline_ms = max(int(timeout_s * 1000), 0)
        while self.sock.poll(deadline_ms):
            msg = self._decode(self.sock.recv_multipart(copy=False))
            if msg is not None:
                return msg
            deadline_ms = 0  # a bad message does not restart the wait
        return None

    def close(self) -> None:
        self.sock.close(0)


class ZmqOutbox(Outbox):
    def __init__(self, address: str, keys: LinkKeys | None = None):
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        if keys is not None:
            curve_client(self.sock, keys)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        self.sock.connect(f"tcp://{address}")

    def send(self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        parts = frames.encode(kind, meta, tensors)
        self.sent_bytes += sum(memoryview(p).nbytes for p in parts)
        try:
            self.sock.send_multipart(parts, copy=False)
        except zmq.Again:
            log.warning("peer not reachable; dropped a %s message", kind)

    def close(self) -> None:
        self.sock.close(0)


# ---- gRPC: a client-streaming Push per link ---------------------------------------------------
class _LinkServicer(treepipe_pb2_grpc.StageLinkServicer):
    def __init__(self, inbox: GrpcInbox):
        self.inbox = inbox

    def Push(self, request_iterator: Any, context: Any) -> treepipe_pb2.LinkAck:  # noqa: N802
        n = 0
        for frame in request_iterator:
            msg = self.inbox._decode([frame.header, *frame.tensors])
            if msg is not None:
                self.inbox.queue.put(msg)
                n += 1
        return treepipe_pb2.LinkAck(received=n)


class GrpcInbox(Inbox):
    def __init__(self, address: str, limits: frames.Limits, keys: LinkKeys | None = None):
        super().__init__(limits)
        self.queue: queue.Queue[Message] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=grpc_options(limits))
        treepipe_pb2_grpc.add_StageLinkServicer_to_server(_LinkServicer(self), self.server)
        port = bind_port(self.server, address, grpc_server_credentials(keys) if keys else None)
        if not port:
            raise TransportError(f"cannot bind gRPC link on {address}; pick a free port")
        self.server.start()

    def recv(self, timeout_s: float) -> Message | None:
        try:
            return self.queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        self.server.stop(0)


class GrpcOutbox(Outbox):
    """One long-lived client stream; re-opened when the peer restarts.

    Messages wait in a deque.  Each stream generation has its own reader; when
    a stream fails its reader stops without taking another message, so a
    message sent after the failure goes to the next stream, not the dead one.
    """

    def __init__(self, address: str, limits: frames.Limits, keys: LinkKeys | None = None):
        # a restarted peer must be found again within a second, not after gRPC's default
        # exponential backoff (up to 120 s) has grown while the peer was loading its shard
        options = [*grpc_options(limits), ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        if keys is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:  # every participant's certificate names LINK_SERVER_NAME, not its host
            options.append(("grpc.ssl_target_name_override", LINK_SERVER_NAME))
            self.channel = grpc.secure_channel(address, grpc_channel_credentials(keys),
                                               options=options)
        self.stub = treepipe_pb2_grpc.StageLinkStub(self.channel)
        self.pending: collections.deque[treepipe_pb2.Frame] = collections.deque()
        self.cond = threading.Condition()
        self.generation = 0
        self.closed = False
        self.thread = threading.Thread(target=self._pump, daemon=True, name="grpc-link")
        self.thread.start()

    def _frames(self, generation: int) -> Any:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending or self.closed
                                   or self.generation != generation)
                if self.closed or self.generation != generation:
                    return
                frame = self.pending.popleft()
            yield frame

    def _pump(self) -> None:
        while not self.closed:
            try:
                self.stub.Push(self._frames(self.generation), wait_for_ready=True)
            except grpc.RpcError as e:
                log.info("link stream ended (%s); reconnecting", e.code())
            with self.cond:
                self.generation += 1
                self.cond.notify_all()
            time.sleep(0.05)

    def send(self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        parts = frames.encode(kind, meta, tensors)
        self.sent_bytes += sum(memoryview(p).nbytes for p in parts)
        frame = treepipe_pb2.Frame(header=bytes(parts[0]), tensors=[bytes(p) for p in parts[1:]])
        with self.cond:
            self.pending.append(frame)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.channel.close()


def check_transport(name: str) -> str:
    """Validate a transport name."""
    if name not in TRANSPORTS:
        raise TransportError(f"unknown transport {name!r}; use one of {', '.join(TRANSPORTS)}")
    return name


def _keys(keys: LinkKeys | None, insecure: bool, address: str) -> LinkKeys | None:
    keys = resolve(keys, insecure)
    if keys is None:
        log.warning("stage link %s is plaintext and unauthenticated (--insecure-links): "
                    "anyone who reaches it can change requests", address)
    return keys


def open_inbox(transport: str, address: str, limits: frames.Limits | None = None, *,
               keys: LinkKeys | None = None, insecure: bool = False) -> Inbox:
    """Bind the receiving end of a link at ``host:port``, admitting only holders of the
    pipeline's keys (``keys``, else ``$TREEPIPE_LINK_KEYS``; none only if ``insecure``)."""
    limits = limits or frames.Limits()
    k = _keys(keys, insecure, address) if check_transport(transport) else None
    if transport == "zmq":
        return ZmqInbox(address, limits, k)
    return GrpcInbox(address, limits, k)


def open_outbox(transport: str, address: str, limits: frames.Limits | None = None, *,
                keys: LinkKeys | None = None, insecure: bool = False) -> Outbox:
    """Connect the sending end of a link to ``host:port`` with the pipeline's keys (as for
    :func:`open_inbox`)."""
    k = _keys(keys, insecure, address) if check_transport(transport) else None
    if transport == "zmq":
        return ZmqOutbox(address, k)
    return GrpcOutbox(address, limits or frames.Limits(), k)
