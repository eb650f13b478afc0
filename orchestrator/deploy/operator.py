"""The treepipe operator: thin kopf handlers around :func:`orchestrator.deploy.reconcile.reconcile`.

Run inside the cluster with ``kopf run --standalone --namespace=NS -m
orchestrator.deploy.operator`` and ``TREEPIPE_OPERATOR_SCOPE=namespace`` (what
``manifests/operator.yaml`` does, with a Role in NS only), or with ``--all-namespaces``
and a ClusterRole (``manifests/operator-clusterwide.yaml``).  Every event and a 30 s
timer do the same thing: list the objects the pipeline owns, call ``reconcile``, create
the Secrets it needs if they are missing, apply its actions with server-side apply
(field manager ``treepipe-operator``) and write the status.

Not exercised against a live cluster: there was none where this was written.  The
pure parts (reconcile, render, the request each action becomes) are tested.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import ssl
from typing import Any

import kopf

from orchestrator.deploy.crd import PLURAL, VERSION
from orchestrator.deploy.manifest import API_GROUP
from orchestrator.deploy.reconcile import Action, reconcile, teardown
from orchestrator.deploy.redis_server import new_secret
from orchestrator.deploy.render import LINK_KEYS_COMPONENT, REDIS_PASSWORD_KEY
from protocol.links.keys import key_files

FIELD_MANAGER = "treepipe-operator"
# kind -> (apiVersion, collection path prefix, plural): every kind render() produces
KINDS: dict[str, tuple[str, str, str]] = {
    "ConfigMap": ("v1", "/api/v1", "configmaps"),
    "Service": ("v1", "/api/v1", "services"),
    "StatefulSet": ("apps/v1", "/apis/apps/v1", "statefulsets"),
    "Deployment": ("apps/v1", "/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("networking.k8s.io/v1", "/apis/networking.k8s.io/v1", "networkpolicies"),
    # only with gateway.serviceMonitor; the Prometheus Operator's CRD may not be installed
    "ServiceMonitor": ("monitoring.coreos.com/v1", "/apis/monitoring.coreos.com/v1",
                       "servicemonitors"),
}
# APIs a cluster may lack (CRDs of other projects): listing finds nothing there
OPTIONAL_APIS = (KINDS["ServiceMonitor"][1] + "/",)
# kinds the operator only ever creates (RBAC: create, nothing else): it never reads,
# lists, changes or deletes a Secret; the garbage collector removes its own with the pipeline
CREATE_ONLY: dict[str, tuple[str, str, str]] = {
    "Secret": ("v1", "/api/v1", "secrets"),
}
SCOPE_ENV = "TREEPIPE_OPERATOR_SCOPE"  # "namespace": a Role, no cluster-wide reads
_CONN: kopf.ConnectionInfo | None = None


def collection_path(kind: str, namespace: str) -> str:
    """REST path of the namespaced collection of ``kind``."""
    _, prefix, plural = KINDS.get(kind) or CREATE_ONLY[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


def _component(body: dict[str, Any]) -> str:
    return body.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component", "")


def request_for(a: Action) -> tuple[str, str, dict[str, str], bytes | None]:
    """The HTTP request (method, path with query, headers, body) that carries out ``a``.

    An ``ensure`` is a plain create (POST): the API server refuses it with 409 when the
    object exists, so an existing Secret is never overwritten.  A Secret gets its random
    password (the link keys: fresh keys for both transports) here, at the last moment; it
    is in no Action, log line or status.
    """
    if a.verb == "ensure":
        body = dict(a.body or {})
        if a.kind == "Secret" and _component(body) == LINK_KEYS_COMPONENT:
            body["data"] = {n: base64.b64encode(v).decode() for n, v in key_files().items()}
        elif a.kind == "Secret":
            body["stringData"] = {REDIS_PASSWORD_KEY: new_secret()}
        return ("POST", f"{collection_path(a.kind, a.namespace)}?fieldManager={FIELD_MANAGER}",
                {"Content-Type": "application/json"}, json.dumps(body).encode())
    path = f"{collection_path(a.kind, a.namespace)}/{a.name}"
    if a.verb == "delete":
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        return "DELETE", path, {"Content-Type": "application/json"}, json.dumps(body).encode()
    # server-side apply creates or updates, keeps immutable server-set fields (clusterIP)
    # and, with force, takes back fields someone else changed by hand
    query = f"?fieldManager={FIELD_MANAGER}&force=true"
    return ("PATCH", path + query, {"Content-Type": "application/apply-patch+yaml"},
            json.dumps(a.body).encode())


def selector(name: str) -> str:
    """Label selector of a pipeline's objects."""
    return f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by={FIELD_MANAGER}"


def _ssl(conn: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if conn.insecure:
        return False
    ctx = ssl.create_default_context(
        cafile=str(conn.ca_path) if conn.ca_path else None,
        cadata=conn.ca_data.decode() if isinstance(conn.ca_data, bytes) else conn.ca_data)
    if conn.certificate_path and conn.private_key_path:
        ctx.load_cert_chain(str(conn.certificate_path), str(conn.private_key_path))
    return ctx


async def _call(method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> Any:
    import aiohttp  # a kopf dependency

    if _CONN is None:
        raise kopf.TemporaryError("not logged in to the API server yet", delay=5)
    hdrs = dict(headers or {})
    if _CONN.token:
        hdrs["Authorization"] = f"Bearer {_CONN.token}"
    async with aiohttp.ClientSession() as s, s.request(
            method, _CONN.server.rstrip("/") + path, headers=hdrs, data=body,
            ssl=_ssl(_CONN)) as r:
        if r.status == 404 and method == "DELETE":
            return None  # already gone
        if r.status == 409 and method == "POST":
            return None  # already exists: a create-if-absent has nothing to do
        if r.status == 404 and path.startswith(OPTIONAL_APIS):
            if method == "GET":
                return {"items": []}  # no Prometheus Operator: there is nothing to own
            raise kopf.PermanentError(
                "gateway.serviceMonitor is true but this cluster has no ServiceMonitor API; "
                "install the Prometheus Operator's CRDs or set gateway.serviceMonitor: false")
        if r.status >= 300:
            raise kopf.TemporaryError(f"{method} {path}: {r.status} {await r.text()}", delay=10)
        return await r.json()


async def list_owned(name: str, namespace: str) -> list[dict[str, Any]]:
    """Every object of the pipeline's kinds carrying its labels (reconcile filters owners)."""
    out = []
    for kind, (api_version, _, _) in KINDS.items():
        res = await _call("GET", f"{collection_path(kind, namespace)}?labelSelector="
                                 f"{selector(name)}")
        for item in res.get("items", []):
            out.append({"apiVersion": api_version, "kind": kind, **item})  # lists omit these
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations: status belongs to the TreePipeline schema.

    In one namespace (``$TREEPIPE_OPERATOR_SCOPE=namespace``) the Role cannot list
    namespaces or watch CRDs: kopf is told not to try (it would warn), and reads the
    resources once at start, so the CRD must be installed before the operator starts.
    """
    settings.scanning.disabled = os.environ.get(SCOPE_ENV) == "namespace"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else the kubeconfig; remembered for our own requests."""
    global _CONN
    _CONN = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    return _CONN


@kopf.on.resume(API_GROUP, VERSION, PLURAL)
@kopf.on.create(API_GROUP, VERSION, PLURAL)
@kopf.on.update(API_GROUP, VERSION, PLURAL, field="spec")
@kopf.timer(API_GROUP, VERSION, PLURAL, interval=30, idle=15)  # repairs drift
async def sync(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    """Reconcile one TreePipeline: apply the actions, then write the status."""
    cr = json.loads(json.dumps(dict(body)))  # plain data for the pure reconcile
    observed = await list_owned(body.meta["name"], body.meta["namespace"])
    result = reconcile(cr, observed, _now())
    for a in result.ensure:  # before the pods that read it
        if await _call(*request_for(a)) is not None:
            logger.info(f"created {a.kind}/{a.name}: {a.reason}")
    for a in result.actions:
        logger.info(f"{a.verb} {a.kind}/{a.name}: {a.reason}")
        await _call(*request_for(a))
    patch["status"] = result.status


@kopf.on.delete(API_GROUP, VERSION, PLURAL)
async def delete(body: kopf.Body, logger: Any, **_: Any) -> None:
    """Delete what the pipeline owns (the garbage collector would too, later)."""
    cr = json.loads(json.dumps(dict(body)))
    for a in teardown(cr, await list_owned(body.meta["name"], body.meta["namespace"])):
        logger.info(f"delete {a.kind}/{a.name}")
        await _call(*request_for(a))
