"""A pipeline participant (stage worker or draft service) served as a process until SIGTERM,
with an optional grpc.health.v1 port for probes.  ``treepipe stage`` and ``treepipe
draft serve`` (orchestrator/cli/worker_commands.py) build the participant and call it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from typing import Any

from orchestrator.serving.gateway import supervisor_gone, watch_supervisor
from protocol.errors import TreepipeError
from protocol.links.grpc_ports import EXCLUSIVE_PORT, bind_port
from stages.runtime.heap import settle_heap
from stages.runtime.participant import Participant


def _health_server(port: int) -> Any:
    """grpc.health.v1 for probes: SERVING once the worker has loaded and connected."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=EXCLUSIVE_PORT)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if not bind_port(server, f"0.0.0.0:{port}"):
        raise TreepipeError(f"cannot serve health on port {port}; pick a free --health-port")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.start()
    return server


log = logging.getLogger("treepipe.worker")
# from the stop signal to the exit, at most: the worker's loop checks ``stop`` between
# waits of about a second, but a step in flight or a blocking call may hold it longer
STOP_S = 10.0


def serve_participant(worker: Participant, health_port: int = 0) -> int:
    """Run ``worker`` until SIGTERM or SIGINT, or until the supervisor that started it
    dies; exit status 0."""
    stopping = threading.Lock()

    def stop(*_: object) -> None:
        worker.stop.set()
        if stopping.acquire(blocking=False):  # the first stop request arms the bound
            timer = threading.Timer(STOP_S, hard_exit)
            timer.daemon = True
            timer.start()

    def hard_exit() -> None:
        log.warning("still running %g s after the stop%s; exiting", STOP_S,
                    " (the supervisor died)" if supervisor_gone() else "")
        logging.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # PR_SET_PDEATHSIG sends SIGTERM when the supervisor dies; this is its backstop
    watch_supervisor(stop)
    server = _health_server(health_port) if health_port else None
    # loaded and profiled: later full collections need not walk the model and imports
    settle_heap()
    worker.run()
    if server is not None:
        server.stop(0)
    return 0
