"""Kubernetes objects for a TreePipeline: what the operator creates and ``treepipe render`` prints.

Per pipeline ``NAME``:

* ``NAME-plan`` ConfigMap: ``pipeline.json`` (spec, plan, every component's address) and
  ``config.json``, the pipeline's one :class:`~protocol.config.pipeline.PipelineConfig`
  that every stage, the draft and the gateway read at start (``--config``);
* ``NAME-stage-I`` StatefulSet (one pod) + headless Service per stage, so stage I is
  ``NAME-stage-I-0.NAME-stage-I`` in DNS and can be pinned to its rack on its own;
* ``NAME-draft`` Deployment + headless Service; ``NAME-gateway`` Deployment + Service;
* ``NAME-redis`` Deployment + Service unless the synchroniser is external;
* ``NAME-internal`` and ``NAME-gateway-clients`` NetworkPolicies: stage/draft links,
  health and Redis accept only the pipeline's own pods, the gateway's gRPC/HTTP ports
  accept ``gateway.allowFrom`` (default: anyone).

The Secret ``NAME-redis-auth`` (embedded Redis) is not among them: :func:`redis_secret`
describes it without a value, and the operator creates it with a random password only
when it is missing (:mod:`orchestrator.deploy.reconcile`), so nothing ever overwrites it.
Nor is ``NAME-link-keys`` (:func:`link_secret`): the stage links' keys (ZeroMQ CURVE,
gRPC mutual TLS; :mod:`protocol.links.keys`), which the operator creates the same way and
the stage and draft pods mount read-only at ``/etc/treepipe-links``
(``$TREEPIPE_LINK_KEYS``).

Every pod runs as non-root with no capabilities, seccomp ``RuntimeDefault``, a read-only
root filesystem (emptyDir volumes for ``/tmp``, the cache and Redis's data) and no
service-account token: no worker talks to the API server.

Every container runs the same image with the runtime's own command lines
(``treepipe stage``, ``treepipe draft serve``, ``treepipe gateway``), built by
:func:`orchestrator.deploy.commands.worker_commands` exactly as ``treepipe up`` builds
them locally, with cluster DNS names instead of 127.0.0.1.
Liveness and readiness use the gRPC health service (``TREEPIPE_HEALTH_PORT``).
A gateway with ``gateway.tlsSecret`` serves gRPC over TLS from that Secret (mounted
read-only) and health alone in plaintext on the health port, which the probes use;
without it, its plaintext gRPC port carries ``--insecure``.  ``gateway.apiKeySecret``
reaches it as ``$TREEPIPE_API_KEY``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import yaml

from orchestrator.deploy.commands import Endpoints, config_of, exit_stage, worker_commands
from orchestrator.deploy.manifest import (
    API_VERSION,
    DEFAULT_HTTP_PORT,
    KIND,
    GatewayPeer,
    ManifestError,
    ResourcesSpec,
    TreePipeline,
)
from orchestrator.deploy.planner import Plan, plan
from orchestrator.serving.auth import API_KEY_ENV
from protocol.links.keys import LINK_KEYS_ENV

DATA_PORT = 5555  # stage/draft data link (ZeroMQ or gRPC, spec.transport)
HEALTH_PORT = 50052  # gRPC health service of stages and the draft
REDIS_PORT = 6379
REDIS_IMAGE = "redis:7.4-alpine"
CONFIG_PATH = "/etc/treepipe"
# beside, not under, the read-only ConfigMap mount (a mount point inside it cannot be made)
TLS_PATH = "/etc/treepipe-tls"
TLS_CERT_FILE, TLS_KEY_FILE = f"{TLS_PATH}/tls.crt", f"{TLS_PATH}/tls.key"
LINK_KEYS_PATH = "/etc/treepipe-links"  # the Secret NAME-link-keys, in stage and draft pods
LINK_KEYS_COMPONENT = "links"  # the Secret's component label (the operator fills it by it)
PIPELINE_FILE = f"{CONFIG_PATH}/pipeline.json"
CONFIG_KEY = "config.json"  # the PipelineConfig's key in NAME-plan
CONFIG_FILE = f"{CONFIG_PATH}/{CONFIG_KEY}"  # what every treepipe container's --config names
CACHE_PATH = "/var/cache/treepipe"
TMP_PATH = "/tmp"
TMP_SIZE = "4Gi"  # torch/triton kernel caches land here (HOME=/tmp); bounded for the node
WORKER_UID = 1000
REDIS_UID, REDIS_GID = 999, 1000  # the redis user and group of the official image
REDIS_PASSWORD_KEY = "password"
HASH_ANNOTATION = "treepipe.io/hash"
CONFIG_HASH_ANNOTATION = "treepipe.io/config-hash"
MANAGED_BY = "treepipe-operator"

Obj = dict[str, Any]


def object_hash(obj: Obj) -> str:
    """A stable hash of an object's content (what the operator wrote)."""
    body = {k: v for k, v in obj.items() if k != "status"}
    meta = dict(body.get("metadata", {}))
    meta["annotations"] = {k: v for k, v in meta.get("annotations", {}).items()
                           if k != HASH_ANNOTATION}
    body["metadata"] = meta
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


class _Ctx:
    """What every object of one pipeline shares: names, labels, owner, namespace."""

    def __init__(self, m: TreePipeline, owner_uid: str | None):
        self.m = m
        self.name = m.metadata.name
        self.ns = m.metadata.namespace or "default"
        self.owner_uid = owner_uid

    def labels(self, component: str, **extra: str) -> dict[str, str]:
        return {**self.m.metadata.labels,
                "app.kubernetes.io/name": "treepipe",
                "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component,
                "app.kubernetes.io/part-of": "treepipe",
                "app.kubernetes.io/managed-by": MANAGED_BY, **extra}

    def selector(self, component: str, **extra: str) -> dict[str, str]:
        return {"app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component, **extra}

    def meta(self, name: str, component: str, **extra: str) -> Obj:
        meta: Obj = {"name": name, "namespace": self.ns,
                     "labels": self.labels(component, **extra)}
        if self.owner_uid:
            meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND,
                                        "name": self.name, "uid": self.owner_uid,
                                        "controller": True, "blockOwnerDeletion": True}]
        return meta

    def host(self, svc: str) -> str:
        return f"{svc}.{self.ns}.svc"


def _resources(r: ResourcesSpec, gpus: int) -> Obj:
    req: dict[str, str] = {}
    lim: dict[str, str] = {}
    if r.cpu:
        req["cpu"] = r.cpu
    if r.memory:
        req["memory"] = lim["memory"] = r.memory  # a memory overrun kills the pod, not the node
    if gpus:
        req["nvidia.com/gpu"] = lim["nvidia.com/gpu"] = str(gpus)  # extended: requests == limits
    out: Obj = {}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def _gpus(r: ResourcesSpec, device_type: str) -> int:
    return r.gpus if r.gpus is not None else (1 if device_type == "cuda" else 0)


def container_security() -> Obj:
    """securityContext of every container: nothing to escalate to, nothing writable but volumes."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def pod_security(uid: int, gid: int) -> Obj:
    """Pod securityContext: a fixed non-root user, the volumes writable by its group."""
    # OnRootMismatch: no recursive chown of a large model volume at every start
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def _probes(port: int) -> Obj:
    probe = {"grpc": {"port": port}, "periodSeconds": 10, "timeoutSeconds": 5}
    # loading a shard of a 70B model takes minutes: a generous startup window, then strict
    return {"startupProbe": {**probe, "failureThreshold": 90},
            "readinessProbe": {**probe, "failureThreshold": 3},
            "livenessProbe": {**probe, "failureThreshold": 6}}


def _container(c: _Ctx, name: str, args: list[str], ports: list[tuple[str, int]],
               env: list[Obj], resources: Obj, health_port: int,
               liveness: Obj | None = None) -> Obj:
    spec = c.m.spec
    mounts = [{"name": "pipeline", "mountPath": CONFIG_PATH, "readOnly": True},
              {"name": "cache", "mountPath": CACHE_PATH},
              {"name": "tmp", "mountPath": TMP_PATH}]
    if spec.model.volume_claim:
        mounts.append({"name": "models", "mountPath": spec.model.mount_path, "readOnly": True})
    return {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["treepipe"],
        "args": args,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
        "env": [{"name": "TREEPIPE_PIPELINE", "value": PIPELINE_FILE},
                {"name": "TREEPIPE_CACHE", "value": CACHE_PATH},
                # the root filesystem is read-only: libraries that write under ~ (torch,
                # triton, Hugging Face) get the /tmp volume
                {"name": "HOME", "value": TMP_PATH},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "TREEPIPE_HEALTH_PORT", "value": str(health_port)},
                *_redis_env(c), *env],
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": container_security(),
        **_probes(health_port),
        **({"livenessProbe": liveness} if liveness else {}),
    }


def redis_auth_secret(c: _Ctx) -> tuple[str, str]:
    """(Secret name, key) of the Redis password: the manifest's for an external Redis,
    else ``NAME-redis-auth``/``password``, which the embedded Redis also reads."""
    sync = c.m.spec.synchronizer
    if sync.mode == "external":
        if not sync.password_secret:
            return "", ""
        return sync.password_secret.name, sync.password_secret.key
    return f"{c.name}-redis-auth", REDIS_PASSWORD_KEY


def redis_secret(m: TreePipeline, owner_uid: str | None = None) -> Obj | None:
    """The Secret ``NAME-redis-auth`` of an embedded Redis, without a value (None if external).

    The operator creates it, adding a random password, only when it does not exist, and
    never updates it (``immutable``): a Secret created by hand is used as it is.
    """
    if m.spec.synchronizer.mode != "embedded":
        return None
    c = _Ctx(m, owner_uid)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": c.meta(redis_auth_secret(c)[0], "redis")}


def link_secret_name(name: str) -> str:
    """Name of a pipeline's link-keys Secret."""
    return f"{name}-link-keys"


def link_secret(m: TreePipeline, owner_uid: str | None = None) -> Obj:
    """The Secret ``NAME-link-keys`` of the stage links, without a value.

    The operator creates it with fresh keys for both transports (so a change of
    ``spec.transport`` needs no new Secret) only when it does not exist, and never
    updates it (``immutable``).
    """
    c = _Ctx(m, owner_uid)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": c.meta(link_secret_name(c.name), LINK_KEYS_COMPONENT)}


def link_secret_command(m: TreePipeline) -> str:
    """The one-line shell command that creates the link-keys Secret by hand."""
    c = _Ctx(m, None)
    return (f"d=$(mktemp -d) && treepipe link-keys $d/keys >/dev/null && kubectl -n {c.ns} "
            f"create secret generic {link_secret_name(c.name)} --from-file=$d/keys "
            "&& rm -r $d")


def _with_link_keys(c: _Ctx, pod: Obj) -> Obj:
    """Mount the link keys into a stage or draft pod and name them in its environment."""
    container = pod["containers"][0]
    container["env"].append({"name": LINK_KEYS_ENV, "value": LINK_KEYS_PATH})
    container["volumeMounts"].append({"name": "link-keys", "mountPath": LINK_KEYS_PATH,
                                      "readOnly": True})
    # files owned by root and group fsGroup (the worker's): 0440 lets the worker, and
    # nobody else, read them (0400 would leave them to root alone)
    pod["volumes"].append({"name": "link-keys", "secret": {
        "secretName": link_secret_name(c.name), "defaultMode": 0o440}})
    return pod


def redis_secret_command(m: TreePipeline) -> str:
    """The one-line kubectl command that creates the embedded Redis's Secret by hand."""
    c = _Ctx(m, None)
    return (f"kubectl -n {c.ns} create secret generic {redis_auth_secret(c)[0]} "
            f"--from-literal={REDIS_PASSWORD_KEY}=\"$(openssl rand -hex 24)\"")


def _redis_env(c: _Ctx) -> list[Obj]:
    sync = c.m.spec.synchronizer
    url = sync.url if sync.mode == "external" else f"redis://{c.host(c.name + '-redis')}:6379"
    env: list[Obj] = []
    # the address (no password) goes on command lines; the workers read the password
    # from $TREEPIPE_REDIS_PASSWORD, which Kubernetes sets from the Secret
    env.append({"name": "TREEPIPE_REDIS_ADDRESS", "value": url})
    secret, key = redis_auth_secret(c)
    if secret and url:
        env.append({"name": "TREEPIPE_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": secret, "key": key}}})
        # for tools run in the pod (kubectl exec): the full URL, in the environment only
        scheme, rest = url.split("://", 1)
        url = f"{scheme}://:$(TREEPIPE_REDIS_PASSWORD)@{rest}"
    env.append({"name": "TREEPIPE_REDIS_URL", "value": url})
    return env


def stage_address(c: _Ctx, i: int) -> str:
    """HOST:PORT of stage ``i``'s inbox (the pod behind its headless Service)."""
    return f"{c.name}-stage-{i}-0.{c.host(f'{c.name}-stage-{i}')}:{DATA_PORT}"


def cluster_endpoints(c: _Ctx, p: Plan) -> Endpoints:
    """Endpoints of pods: bind every port, reach stages by DNS, Redis through the env."""
    n = len(p.stages)
    # $(TREEPIPE_REDIS_ADDRESS) is expanded by Kubernetes from the container env
    # (_redis_env): the address only, so the password is neither in the pod spec nor in
    # the process's command line (ps); the worker reads $TREEPIPE_REDIS_PASSWORD
    tls = c.m.spec.gateway.tls_secret
    return Endpoints("$(TREEPIPE_REDIS_ADDRESS)", [f"0.0.0.0:{DATA_PORT}"] * n,
                     [stage_address(c, i) for i in range(n)],
                     "0.0.0.0", c.m.spec.gateway.port,
                     (TLS_CERT_FILE, TLS_KEY_FILE) if tls else None,
                     # kubelet's gRPC probe speaks no TLS: health alone, in plaintext
                     f"0.0.0.0:{HEALTH_PORT}" if tls else "", config_file=CONFIG_FILE,
                     # early-exit recovery's token channel: the exit stage -> the draft
                     draft_listen=f"0.0.0.0:{DATA_PORT}",
                     draft_address=f"{c.host(f'{c.name}-draft')}:{DATA_PORT}")


def _pod_spec(c: _Ctx, container: Obj, node_selector: dict[str, str],
              affinity: Obj | None = None) -> Obj:
    vols: list[Obj] = [{"name": "pipeline", "configMap": {"name": f"{c.name}-plan"}},
                       {"name": "cache", "emptyDir": {}},
                       {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}]
    if c.m.spec.model.volume_claim:
        vols.append({"name": "models", "persistentVolumeClaim": {
            "claimName": c.m.spec.model.volume_claim, "readOnly": True}})
    pod: Obj = {"containers": [container], "volumes": vols,
                "securityContext": pod_security(WORKER_UID, WORKER_UID),
                # no worker talks to the API server: no token to steal from a pod
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 30}
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if affinity:
        pod["affinity"] = affinity
    if container["resources"].get("limits", {}).get("nvidia.com/gpu"):
        # GPU nodes are commonly tainted so that only GPU pods land there
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]
    return pod


def _near(c: _Ctx, component: str, **extra: str) -> Obj:
    """Prefer the zone of the pipeline neighbour (when racks do not already pin it)."""
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 50,
        "podAffinityTerm": {"labelSelector": {"matchLabels": c.selector(component, **extra)},
                            "topologyKey": "topology.kubernetes.io/zone"}}]}}


def _headless(c: _Ctx, name: str, component: str, sel: dict[str, str],
              ports: list[tuple[str, int]], **extra: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": c.meta(name, component, **extra),
            "spec": {"clusterIP": "None", "selector": sel, "publishNotReadyAddresses": True,
                     "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                               for n, p in ports]}}


def _stage(c: _Ctx, p: Plan, i: int, args: list[str]) -> list[Obj]:
    st = p.stages[i]
    name = f"{c.name}-stage-{i}"
    extra = {"treepipe.io/stage": str(i)}
    sel = c.selector("stage", **extra)
    ports = [("data", DATA_PORT), ("health", HEALTH_PORT)]
    env = [{"name": "TREEPIPE_STAGE", "value": str(i)},
           {"name": "TREEPIPE_LAYERS", "value": f"{st.layers[0]}-{st.layers[1]}"}]
    container = _container(c, "stage", args, ports, env,
                           _resources(st.resources, _gpus(st.resources, st.device.type)),
                           HEALTH_PORT)
    affinity = None if st.rack or i == 0 else _near(c, "stage",
                                                    **{"treepipe.io/stage": str(i - 1)})
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": c.meta(name, "stage", **extra),
           "spec": {"serviceName": name, "replicas": 1, "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": c.labels("stage", **extra)},
                                 "spec": _with_link_keys(c, _pod_spec(
                                     c, container, st.node_selector, affinity))}}}
    return [_headless(c, name, "stage", sel, ports, **extra), sts]


def _draft(c: _Ctx, p: Plan, args: list[str]) -> list[Obj]:
    d = p.draft
    name = f"{c.name}-draft"
    sel = c.selector("draft")
    # health only: the draft connects to stage 0 (--next) and binds no data port, but
    # for early-exit recovery's token channel (the exit stage sends it candidates)
    ports = [("health", HEALTH_PORT)] + ([("data", DATA_PORT)] if exit_stage(c.m) else [])
    container = _container(c, "draft", args, ports, [],
                           _resources(d.resources, _gpus(d.resources, d.device.type)),
                           HEALTH_PORT)
    affinity = None if d.rack else _near(c, "stage", **{"treepipe.io/stage": "0"})
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": c.meta(name, "draft"),
           "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                    "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": c.labels("draft")},
                                 "spec": _with_link_keys(c, _pod_spec(
                                     c, container, d.node_selector, affinity))}}}
    return [_headless(c, name, "draft", sel, ports), dep]


def _gateway(c: _Ctx, args: list[str]) -> list[Obj]:
    g = c.m.spec.gateway
    name = f"{c.name}-gateway"
    sel = c.selector("gateway")
    http_port = DEFAULT_HTTP_PORT if g.http_port is None else g.http_port
    ports = [("grpc", g.port), ("http", http_port)]
    env: list[Obj] = []
    if g.api_key_secret:  # from the Secret into the environment: in no pod spec or argv
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": g.api_key_secret.name, "key": g.api_key_secret.key}}})
    # with TLS, probes go to the plaintext health-only port (kubelet speaks no TLS)
    health_port = HEALTH_PORT if g.tls_secret else g.port
    if g.tls_secret:
        ports.append(("health", HEALTH_PORT))
    # liveness is the process, not the pipeline: the gateway's health turns NOT_SERVING
    # only without Redis, and stays up (its requests wait) while stages re-plan
    container = _container(c, "gateway", args, ports, env,
                           _resources(ResourcesSpec(cpu="500m", memory="512Mi"), 0),
                           health_port, liveness={"tcpSocket": {"port": "grpc"},
                                                  "periodSeconds": 10, "failureThreshold": 6})
    pod = _pod_spec(c, container, {})
    if g.tls_secret:
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_PATH,
                                          "readOnly": True})
        # owner and group (fsGroup) may read the key; nobody else
        pod["volumes"].append({"name": "tls", "secret": {"secretName": g.tls_secret,
                                                         "defaultMode": 0o440}})
    low = min(g.port, http_port)
    if low < 1024:
        # a non-root process without capabilities binds a port below 1024 only when the
        # pod's own network namespace allows it (a safe, namespaced sysctl)
        pod["securityContext"]["sysctls"] = [{"name": "net.ipv4.ip_unprivileged_port_start",
                                              "value": str(low)}]
    # llm-d's router and endpoint picker find model servers by these pod labels (its
    # InferencePool selects llm-d.ai/inferenceServing); the pod template only: a
    # Deployment's selector cannot change under a running pipeline
    pod_labels = {**c.labels("gateway"), "llm-d.ai/inferenceServing": "true",
                  "llm-d.ai/model": label_value(g.served_model_name or c.m.spec.model.source)}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": c.meta(name, "gateway"),
           "spec": {"replicas": g.replicas, "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": pod_labels}, "spec": pod}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": c.meta(name, "gateway"),
           "spec": {"type": g.service_type, "selector": sel,
                    "ports": [{"name": "grpc", "port": g.port, "targetPort": "grpc",
                               "protocol": "TCP"},
                              {"name": "http", "port": http_port, "targetPort": "http",
                               "protocol": "TCP"}]}}
    objs = [svc, dep]
    if g.service_monitor:  # a Prometheus Operator CRD: only when the manifest asks for it
        objs.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                     "metadata": c.meta(name, "gateway"),
                     "spec": {"selector": {"matchLabels": sel},
                              "endpoints": [{"port": "http", "path": "/metrics",
                                             "interval": "15s", **_scrape_tls(g)}]}})
    return objs


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value: at most 63 of [A-Za-z0-9._-], alphanumeric at
    both ends (a model path or hub id has slashes)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[-63:]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value) or "model"


def _scrape_tls(g: Any) -> dict[str, Any]:
    """With ``tlsSecret`` the HTTP port speaks HTTPS: Prometheus verifies it against the
    Secret's ``ca.crt`` (cert-manager writes one; add it to a hand-made Secret)."""
    if not g.tls_secret:
        return {}
    return {"scheme": "https", "tlsConfig": {"ca": {"secret": {"name": g.tls_secret,
                                                               "key": "ca.crt"}}}}


def _redis(c: _Ctx) -> list[Obj]:
    name = f"{c.name}-redis"
    sel = c.selector("redis")
    probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 5}
    container = {
        "name": "redis", "image": REDIS_IMAGE, "imagePullPolicy": "IfNotPresent",
        # the config goes in on stdin (printf is a shell builtin), so the password from
        # the Secret is in no command line; the append-only log on the data volume lets a
        # restarted Redis bring the running request back (it resumes from its token log)
        "command": ["sh", "-c", 'printf \'requirepass "%s"\\nsave ""\\nappendonly yes\\n'
                    'appendfsync everysec\\ndir /data\\nport %s\\n\' "$REDIS_PASSWORD" '
                    f'{REDIS_PORT} | exec redis-server -'],
        "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": redis_auth_secret(c)[0], "key": redis_auth_secret(c)[1]}}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
        # redis-server writes only under `dir` (/data: the append-only log and its
        # rewrites); the config comes on stdin, so nothing else needs to be writable
        "securityContext": container_security(),
    }
    pod = {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}],
           "securityContext": pod_security(REDIS_UID, REDIS_GID),
           "automountServiceAccountToken": False}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": c.meta(name, "redis"),
           "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                    "selector": {"matchLabels": sel},
                    "template": {"metadata": {"labels": c.labels("redis")}, "spec": pod}}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": c.meta(name, "redis"),
           "spec": {"selector": sel, "ports": [{"name": "redis", "port": REDIS_PORT,
                                                "targetPort": "redis", "protocol": "TCP"}]}}
    return [svc, dep]


def _peer(p: GatewayPeer) -> Obj:
    """One ``gateway.allowFrom`` entry as a NetworkPolicyPeer."""
    if p.cidr:
        return {"ipBlock": {"cidr": p.cidr}}
    peer: Obj = {}
    if p.namespace:
        peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": p.namespace}}
    if p.pod_labels:
        peer["podSelector"] = {"matchLabels": dict(p.pod_labels)}
    return peer


def own_pods(c: _Ctx) -> dict[str, str]:
    """Labels every pod of the pipeline carries (and only its pods)."""
    return {"app.kubernetes.io/instance": c.name, "app.kubernetes.io/name": "treepipe"}


def _network_policies(c: _Ctx) -> list[Obj]:
    """Ingress only: the links, health and Redis from the pipeline's pods, the gateway's
    ports from ``gateway.allowFrom``.  Egress stays open (DNS, an external Redis, model
    downloads).  Probes need no rule: traffic from the pod's own node is always allowed."""
    g = c.m.spec.gateway
    http_port = DEFAULT_HTTP_PORT if g.http_port is None else g.http_port
    internal = [DATA_PORT, HEALTH_PORT]
    if c.m.spec.synchronizer.mode == "embedded":
        internal.append(REDIS_PORT)
    own = own_pods(c)
    clients: Obj = {"ports": [{"protocol": "TCP", "port": p} for p in (g.port, http_port)]}
    if g.allow_from:
        clients["from"] = [_peer(p) for p in g.allow_from]
    # policies add up: a gateway pod gets both, a stage or Redis only the first
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": c.meta(f"{c.name}-internal", "network"),
             "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {"matchLabels": own}}],
                                   "ports": [{"protocol": "TCP", "port": p}
                                             for p in internal]}]}},
            {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": c.meta(f"{c.name}-gateway-clients", "network"),
             "spec": {"podSelector": {"matchLabels": c.selector("gateway")},
                      "policyTypes": ["Ingress"], "ingress": [clients]}}]


def pipeline_config(m: TreePipeline, p: Plan) -> Obj:
    """``pipeline.json``: the spec, the plan and every component's address."""
    c = _Ctx(m, None)
    n = c.name
    return {
        "name": n,
        "namespace": c.ns,
        "spec": m.spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
        "plan": p.to_dict(),
        "endpoints": {
            "stages": [{"index": s.index, "layers": list(s.layers),
                        "address": stage_address(c, s.index),
                        "healthPort": HEALTH_PORT} for s in p.stages],
            "draft": {"host": c.host(f"{n}-draft"), "healthPort": HEALTH_PORT},
            "gateway": {"host": c.host(f"{n}-gateway"), "port": m.spec.gateway.port},
            "redis": _redis_env(c)[-1]["value"],
        },
    }


def render(m: TreePipeline, owner_uid: str | None = None,
           the_plan: Plan | None = None) -> list[Obj]:
    """Every Kubernetes object of ``m`` (ownerReferences only when the owner's uid is known).

    Pass ``the_plan`` computed with ``m`` (:func:`orchestrator.deploy.planner.plan_manifest`) so
    that it is not planned again; without it ``m`` is planned here.
    """
    if m.spec.gateway.port == 0:
        raise ManifestError("spec.gateway.port: 0 (pick a free port) cannot be rendered for "
                            "Kubernetes; set a fixed port such as 50151")
    p = the_plan or plan(m)
    c = _Ctx(m, owner_uid)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": c.meta(f"{c.name}-plan", "plan"),
          "data": {"pipeline.json": json.dumps(pipeline_config(m, p), indent=2,
                                               sort_keys=True),
                   CONFIG_KEY: config_of(m, p).to_json()}}
    # the policies come before any pod, so no pod of the pipeline ever runs unprotected
    objs: list[Obj] = [cm, *_network_policies(c)]
    if m.spec.synchronizer.mode == "embedded":
        objs += _redis(c)
    args = worker_commands(m, p, cluster_endpoints(c, p))
    for i in range(len(p.stages)):
        objs += _stage(c, p, i, args[f"stage{i}"])
    objs += _draft(c, p, args["draft"])
    objs += _gateway(c, args["gateway"])
    # a changed plan (width, top-k, layer split) rolls every treepipe pod: they read it at start
    config_hash = object_hash(cm)
    for o in objs:
        tmpl = o.get("spec", {}).get("template")
        if tmpl and o["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
            tmpl["metadata"]["annotations"] = {CONFIG_HASH_ANNOTATION: config_hash}
    for o in objs:
        # hash last: it covers everything the operator wrote, so any difference is drift
        o["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = object_hash(o)
    return objs


class _NoAliases(yaml.SafeDumper):
    """Plain YAML for kubectl readers: shared sub-objects are written out, not anchored."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objs: list[Obj]) -> str:
    """Multi-document YAML."""
    return yaml.dump_all(objs, Dumper=_NoAliases, sort_keys=False, width=100)
