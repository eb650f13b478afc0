"""Stage links: msgpack tensor frames, link messages and the ZeroMQ and gRPC transports."""
