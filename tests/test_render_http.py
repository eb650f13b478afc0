"""The gateway's HTTP port in rendered Kubernetes objects, and a ServiceMonitor only on request."""

from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.deploy.manifest import validate_manifest
from orchestrator.deploy.render import render

EXAMPLE = (Path(__file__).resolve().parents[1] / "manifests" / "examples"
           / "llama-8b-external-redis.yaml")


def objects(**gateway: object) -> list[dict]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"].setdefault("gateway", {}).update(gateway)
    return render(validate_manifest(data))


def test_http_port_and_service_monitor() -> None:
    objs = objects()
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"].endswith(
        "-gateway"))
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"} in \
        svc["spec"]["ports"]
    gw = next(o for o in objs if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--http-listen") + 1] == "0.0.0.0:8000"
    assert not any(o["kind"] == "ServiceMonitor" for o in objs)
    mon = [o for o in objects(serviceMonitor=True, httpPort=9000) if o["kind"] == "ServiceMonitor"]
    assert len(mon) == 1 and mon[0]["spec"]["endpoints"][0]["port"] == "http"
    assert "scheme" not in mon[0]["spec"]["endpoints"][0]  # plaintext without tlsSecret


def test_service_monitor_scrapes_https_with_tls_secret() -> None:
    """With tlsSecret the HTTP port is HTTPS: Prometheus must scrape it so, verifying it
    against the Secret's ca.crt (not skipping verification)."""
    objs = objects(serviceMonitor=True, tlsSecret="gw-tls")
    (mon,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    ep = mon["spec"]["endpoints"][0]
    assert ep["scheme"] == "https"
    assert ep["tlsConfig"] == {"ca": {"secret": {"name": "gw-tls", "key": "ca.crt"}}}


def test_gateway_pods_carry_the_labels_llm_d_selects_model_servers_by() -> None:
    for gateway, model in (({}, "models-Meta-Llama-3.1-8B-Instruct"),
                           ({"servedModelName": "org/llama-8b"}, "org-llama-8b")):
        gw = next(o for o in objects(**gateway)
                  if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
        labels = gw["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/inferenceServing"] == "true"
        assert labels["llm-d.ai/model"] == model
        # the selector stays as it was: a Deployment's selector is immutable
        assert "llm-d.ai/inferenceServing" not in gw["spec"]["selector"]["matchLabels"]
