"""Serving requests: the gateway, its client, and the worker process entry points."""
