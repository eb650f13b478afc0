"""Binding a gRPC server's port: exclusively, and with one answer when the bind fails.

Torch-free: the stage links (:mod:`protocol.links.transport`), the gateway and the
health servers all bind through it.
"""

from __future__ import annotations

import grpc

# gRPC servers bind with SO_REUSEPORT by default: a second process on the same port would
# then silently share (steal) its connections.  Ours own their port or fail to start.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


def bind_port(server: grpc.Server, address: str,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind ``server`` to ``address``; the port, or 0 when it cannot be bound.

    grpcio returns 0 or raises RuntimeError when a bind fails, depending on its version.
    """
    try:
        return (server.add_secure_port(address, credentials) if credentials
                else server.add_insecure_port(address))
    except RuntimeError:
        return 0
