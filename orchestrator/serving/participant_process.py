"""A pipeline participant (stage worker or draft service) served as a process until SIGTERM,
with an optional grpc.health.v1 port for probes.  ``treepipe stage`` and ``treepipe
draft serve`` (orchestrator/cli/worker_commands.py) build the participant and call it."""

from __future__ import annotations

import signal
from concurrent import futures
from typing import Any

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


def serve_participant(worker: Participant, health_port: int = 0) -> int:
    """Run ``worker`` until SIGTERM or SIGINT; exit status 0."""
    def stop(*_: object) -> None:
        worker.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = _health_server(health_port) if health_port else None
    # loaded and profiled: later full collections need not walk the model and imports
    settle_heap()
    worker.run()
    if server is not None:
        server.stop(0)
    return 0
