"""Every port a rendered Service publishes has a listener in its pods' command lines.

`treepipe render -f manifests/examples/local.yaml` used to start the gateway with
``--http-listen 0.0.0.0:0`` (a random port: a local manifest's default) while its
Service, containerPort and NetworkPolicy said 8000, so in a cluster the API and the
metrics were unreachable.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.deploy.manifest import validate_manifest
from orchestrator.deploy.render import render

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "manifests" / "examples").glob("*.yaml"))
WORKLOADS = ("Deployment", "StatefulSet")


def variants() -> list[tuple[str, dict[str, Any]]]:
    """Every example as it is, and the cluster ones with TLS (a plaintext health port)."""
    out = []
    for f in EXAMPLES:
        d = yaml.safe_load(f.read_text())
        out.append((f.stem, d))
        if d["spec"].get("backend") == "kubernetes":
            tls = yaml.safe_load(f.read_text())
            tls["spec"].setdefault("gateway", {})["tlsSecret"] = "gw-tls"
            out.append((f"{f.stem}-tls", tls))
    return out


# the flags whose HOST:PORT value a treepipe worker binds (orchestrator/deploy/commands.py);
# any other HOST:PORT word (``--redis redis://h:6379``, ``--next stage1:50061``) is where it
# connects, not where it listens
LISTEN_FLAGS = ("--listen", "--http-listen", "--health-listen")


def listen_ports(words: list[str]) -> set[str]:
    """The ports of the values of the listen flags in ``words`` (``--flag V``, ``--flag=V``)."""
    out = set()
    for i, w in enumerate(words):
        flag, eq, value = w.partition("=")
        if flag not in LISTEN_FLAGS:
            continue
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        host, colon, port = value.rpartition(":")
        if colon and host:
            out.add(port)
    return out


def listens(container: dict[str, Any], port: int) -> bool:
    """Whether the container binds ``port``: the value of a treepipe worker's listen flag,
    the health port a stage or the draft reads from $TREEPIPE_HEALTH_PORT (worker_commands.py
    --health-port), or the port line of the Redis config it writes."""
    words = [str(w) for w in [*container.get("command", []), *container.get("args", [])]]
    if str(port) in listen_ports(words):
        return True
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if env.get("TREEPIPE_HEALTH_PORT") == str(port) and container.get("args", [""])[0] in (
            "stage", "draft"):
        return True
    # Redis: `printf '...port %s\n' "$REDIS_PASSWORD" PORT | exec redis-server -`
    return any(re.search(rf"port %s.*\b{port}\b.*redis-server", w) for w in words)


def test_only_the_listen_flags_count() -> None:
    # a Redis URL or a peer's address names a port the container connects to
    assert not listens({"args": ["gateway", "--redis", "redis://r:6379", "--next", "s:50061"]},
                       6379)
    assert not listens({"args": ["stage", "--next", "s:50061"]}, 50061)
    assert listens({"args": ["gateway", "--listen", "0.0.0.0:50051"]}, 50051)
    assert listens({"args": ["gateway", "--http-listen=0.0.0.0:8000"]}, 8000)
    assert listens({"args": ["gateway", "--health-listen", "[::]:8081"]}, 8081)
    assert not listens({"args": ["gateway", "--http-listen", "0.0.0.0:0"]}, 8000)


@pytest.mark.parametrize("name,data", variants(), ids=[n for n, _ in variants()])
def test_every_service_port_has_a_listener(name: str, data: dict[str, Any]) -> None:
    objs = render(validate_manifest(data))
    pods = [(o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]["spec"])
            for o in objs if o["kind"] in WORKLOADS]
    services = [o for o in objs if o["kind"] == "Service"]
    assert services
    for svc in services:
        selector = svc["spec"]["selector"]
        backing = [spec for labels, spec in pods
                   if all(labels.get(k) == v for k, v in selector.items())]
        assert backing, f"{svc['metadata']['name']} selects no pod"
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            for spec in backing:
                found = [(c, cp["containerPort"]) for c in spec["containers"]
                         for cp in c.get("ports", [])
                         if target in (cp.get("name"), cp["containerPort"])]
                assert found, (svc["metadata"]["name"], sp)
                for c, port in found:
                    assert listens(c, port), (name, svc["metadata"]["name"], sp, c.get("args"))
