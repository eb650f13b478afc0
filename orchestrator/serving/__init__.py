"""Serving requests: the gateway, its client, and the workers' serving loop."""
