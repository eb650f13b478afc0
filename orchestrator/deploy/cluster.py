"""The kubernetes backend of ``treepipe scale`` and ``treepipe status``.

A ``backend: kubernetes`` pipeline is a ``TreePipeline`` object in a cluster; the
operator (:mod:`orchestrator.deploy.operator`) does the work.  ``scale`` changes
``spec.stages.count`` with a JSON merge patch after checking the new spec here with the
same validation and planner the operator uses, so a count that cannot work is refused
before anything is sent.  ``status`` reads what the operator wrote in ``status``.

The request bodies and the status view are pure functions (:func:`scale_patch`,
:func:`status_view`, :func:`format_status`); only :func:`scale_cluster` and
:func:`status_cluster` talk to the API server, through the official ``kubernetes``
client, which is imported lazily so that building the CLI parser does not load it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.deploy.crd import PLURAL, SHORT_NAMES, VERSION
from orchestrator.deploy.manifest import (
    API_GROUP,
    ManifestError,
    validate_manifest,
    with_stage_count,
)
from orchestrator.deploy.planner import with_plan
from protocol.errors import TreepipeError

Obj = dict[str, Any]

CONFLICT_RETRIES = 3  # a 409 re-reads and re-patches this many times before giving up
POLL_S = 1.0  # seconds between GETs while --wait follows the rollout
REQUEST_TIMEOUT_S = (10.0, 30.0)  # (connect, read): a hung API server must not hang the CLI
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SHORT = SHORT_NAMES[0]
CONDITION_ORDER = ("Planned", "Ready", "Degraded")
NO_CREDENTIALS = ("no Kubernetes credentials: set KUBECONFIG or ~/.kube/config, or run in a "
                  "pod; a local pipeline? use --backend local")


# ---------------------------------------------------------------- arguments




# ---------------------------------------------------------------- pure: scale


def _where(cr: Obj) -> str:
    meta = cr.get("metadata") or {}
    return f"TreePipeline {meta.get('namespace') or 'default'}/{meta.get('name')}"


def _spec_stage_count(spec: Obj) -> int | None:
    st = spec.get("stages") or {}
    if st.get("count") is not None:
        return int(st["count"])
    return len(st["layers"]) if st.get("layers") else None


def scale_patch(cr: Obj, stages: int) -> tuple[Obj, list[tuple[int, int]]]:
    """The merge patch that sets ``stages`` stages on ``cr`` and the layer bounds it plans.

    ``cr`` is the TreePipeline as read from the API.  The changed spec goes through
    :func:`validate_manifest` and :func:`~orchestrator.deploy.planner.with_plan` first, so a count
    that does not fit is a :class:`TreepipeError` naming the field and the fix, and nothing
    is sent.  Explicit ``stages.layers`` are dropped (``null`` in a merge patch removes
    the key): the planner re-splits the layers, as the local ``scale`` does.
    """
    meta = cr.get("metadata") or {}
    origin = f"{_where(cr)} --stages {stages}"
    spec = with_stage_count({"spec": cr.get("spec") or {}}, stages)["spec"]
    try:
        # only name and namespace: the server's fields (uid, resourceVersion, managedFields)
        # are not part of the manifest schema, which refuses unknown fields
        m = validate_manifest({"apiVersion": cr.get("apiVersion"), "kind": cr.get("kind"),
                               "metadata": {"name": meta.get("name"),
                                            "namespace": meta.get("namespace")},
                               "spec": spec}, origin)
        if m.spec.backend != "kubernetes":
            raise ManifestError(f"{origin}: spec.backend: is {m.spec.backend!r}, which the "
                                "operator ignores; run it with treepipe up and use --backend "
                                "local, or set backend: kubernetes", origin=origin)
        p = with_plan(m, origin).plan
    except ManifestError as e:
        raise TreepipeError(str(e)) from None  # every message above starts with the origin
    bounds = [s.layers for s in p.stages]
    body: Obj = {"spec": {"stages": {"count": stages, "layers": None}}}
    if meta.get("resourceVersion"):
        # the API server refuses the patch with 409 when the object changed since this read
        body["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    return body, bounds


# ---------------------------------------------------------------- pure: status


def _condition_view(c: Obj, generation: int | None) -> Obj:
    og = c.get("observedGeneration")
    return {"type": c.get("type", ""), "status": c.get("status", "Unknown"),
            "reason": c.get("reason", ""), "message": c.get("message", ""),
            "observedGeneration": og, "lastTransitionTime": c.get("lastTransitionTime"),
            # a condition written for an older spec says nothing about the current one
            "current": og is None or generation is None or og >= generation}


def status_view(cr: Obj) -> Obj:
    """What ``treepipe status --backend kubernetes`` shows of a TreePipeline object.

    ``current`` is true when the operator has observed the object's latest generation;
    ``ready`` when, in addition, its Ready condition is True.
    """
    meta = cr.get("metadata") or {}
    st = cr.get("status") or {}
    gen = meta.get("generation")
    observed = st.get("observedGeneration")
    conds = [_condition_view(c, gen) for c in st.get("conditions") or []]
    rank = {t: i for i, t in enumerate(CONDITION_ORDER)}
    conds.sort(key=lambda c: rank.get(c["type"], len(rank)))
    current = observed is not None and (gen is None or observed >= gen)
    ready_cond = next((c for c in conds if c["type"] == "Ready"), None)
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace") or "default",
        "generation": gen,
        "observedGeneration": observed,
        "current": current,
        "ready": bool(current and ready_cond and ready_cond["status"] == "True"),
        "desiredStages": _spec_stage_count(cr.get("spec") or {}),
        "stages": st.get("stages"),
        "readyStages": st.get("readyStages"),
        "endpoint": st.get("endpoint"),
        "conditions": conds,
    }


def _stages_text(v: Obj) -> str:
    total = v["stages"] if v["stages"] is not None else v["desiredStages"]
    ready = v["readyStages"] if v["readyStages"] is not None else 0
    return f"{ready}/{total if total is not None else '?'} stages ready"


def format_status(v: Obj) -> str:
    """The human-readable status of :func:`status_view`'s ``v``: a summary line, conditions."""
    head = f"{v['name']} (namespace {v['namespace']}):"
    if v["observedGeneration"] is None and not v["conditions"]:
        return (f"{head} no status yet (generation {v['generation']}): the operator has not "
                f"reconciled it; is it running? kubectl -n treepipe get deploy "
                f"treepipe-operator")
    parts = [_stages_text(v)]
    if v["desiredStages"] is not None and v["stages"] is not None \
            and v["desiredStages"] != v["stages"]:
        parts[0] += f" (spec: {v['desiredStages']})"
    parts.append(f"gateway {v['endpoint'] or '-'}")
    if v["current"]:
        parts.append(f"generation {v['generation']}")
    else:
        parts.append(f"generation {v['generation']}, status from generation "
                     f"{v['observedGeneration']} (the operator has not caught up)")
    lines = [f"{head} " + ", ".join(parts)]
    for c in v["conditions"]:
        msg = c["message"]
        if not c["current"]:
            msg = f"{msg} (generation {c['observedGeneration']})".lstrip()
        lines.append(f"  {c['type']:9s} {c['status']:7s} {c['reason'] or '-':13s} {msg or '-'}")
    return "\n".join(lines)


def progress_line(v: Obj, generation: int) -> str:
    """One line of ``scale``'s progress while waiting for ``generation`` to become Ready."""
    if v["observedGeneration"] is None or v["observedGeneration"] < generation:
        seen = v["observedGeneration"] if v["observedGeneration"] is not None else "none"
        return (f"waiting for the operator to observe generation {generation} "
                f"(last observed: {seen})")
    ready = next((c for c in v["conditions"] if c["type"] == "Ready"), None)
    line = _stages_text(v)
    if ready and ready["status"] != "True" and ready["message"]:
        line += f"; {ready['message']}"
    return line


# ---------------------------------------------------------------- credentials


def _kubeconfig_paths() -> list[Path]:
    """Kubeconfig files kubectl would read: $KUBECONFIG's list, else ~/.kube/config."""
    env = os.environ.get("KUBECONFIG")
    if env:
        # kubectl ignores ~/.kube/config when KUBECONFIG is set, so do the same
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path("~/.kube/config").expanduser()]


def kube_credentials_available() -> bool:
    """True when a kubeconfig file exists (KUBECONFIG or ~/.kube/config) or we run in a pod."""
    if any(p.is_file() for p in _kubeconfig_paths()):
        return True
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


@dataclass
class _Cluster:
    """An API connection and where the commands act."""

    api: Any  # kubernetes.client.CustomObjectsApi
    host: str
    namespace: str
    context: str | None

    def _call(self, verb: str, name: str, fn: Any, *args: Any, **kw: Any) -> Obj:
        """``fn(group, version, namespace, plural, name, ...)`` with errors made one line."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(API_GROUP, VERSION, self.namespace, PLURAL, name, *args,
                      _request_timeout=REQUEST_TIMEOUT_S, **kw)
        except ApiException as e:
            raise self._api_error(verb, name, e) from None
        except urllib3.exceptions.HTTPError as e:
            raise TreepipeError(self._unreachable(e)) from None

    def get(self, name: str) -> Obj:
        """GET the TreePipeline ``name``."""
        return self._call("get", name, self.api.get_namespaced_custom_object)

    def patch(self, name: str, body: Obj) -> Obj:
        """PATCH the TreePipeline ``name`` with a JSON merge patch."""
        # the client sends custom-object patches as application/merge-patch+json (a CRD
        # takes no strategic merge patch); not forced with _content_type, which kubernetes
        # 30.1 refuses. tests/test_cluster_cli.py checks the header on the wire.
        return self._call("patch", name, self.api.patch_namespaced_custom_object, body)

    def _unreachable(self, e: Exception) -> str:
        why = str(getattr(e, "reason", None) or e)
        why = re.sub(r"^<[^>]*>: ", "", why)  # urllib3 prefixes the connection object's repr
        if "refused" in why.lower():
            why = "connection refused"
        elif "timed out" in why.lower() or "timeout" in why.lower():
            why = "timed out"
        ctx = f"context {self.context}" if self.context else "the in-cluster address"
        return (f"cannot reach the Kubernetes API server at {self.host} ({why}); check that "
                f"the cluster is up and that {ctx} is the right one (--context, KUBECONFIG; "
                f"kubectl cluster-info)")

    def _api_error(self, verb: str, name: str, e: Any) -> Exception:
        status = int(getattr(e, "status", 0) or 0)
        try:
            detail = json.loads(e.body or "")
        except (TypeError, ValueError):
            detail = {}
        if not isinstance(detail, dict):
            detail = {}
        server_msg = detail.get("message") or (e.reason or "").strip()
        ns = self.namespace
        if status == 404:
            details = detail.get("details") or {}
            if detail.get("kind") == "Status" and details.get("name") == name:
                return TreepipeError(f"no TreePipeline {name} in namespace {ns}; create it with "
                                     f"kubectl apply -f FILE (metadata.namespace or -n picks the "
                                     f"namespace; list them with kubectl get {SHORT} -A)")
            # a 404 that is not about the object: the API group itself is not served
            return TreepipeError(f"the API server at {self.host} does not serve "
                                 f"{PLURAL}.{API_GROUP}/{VERSION}: the TreePipeline CRD is not "
                                 f"installed; kubectl apply -f manifests/crd.yaml")
        if status == 403:
            return TreepipeError(f"forbidden: these credentials may not {verb} "
                                 f"{PLURAL}.{API_GROUP} in namespace {ns} (RBAC); ask for a Role "
                                 f"granting {verb} on {PLURAL} (check: kubectl auth can-i {verb} "
                                 f"{PLURAL}.{API_GROUP} -n {ns})")
        if status == 401:
            return TreepipeError(f"the API server at {self.host} rejected the credentials (401 "
                                 f"Unauthorized); refresh them or pick another --context (kubectl "
                                 f"get {SHORT} -n {ns} shows the same)")
        if status == 409 and verb == "patch":
            return _Conflict(server_msg)
        if status == 0:
            # the client reports TLS failures as status 0
            first = server_msg.splitlines()[-1] if server_msg else "TLS error"
            return TreepipeError(f"TLS to the API server at {self.host} failed ({first}); check "
                                 f"the cluster's certificate-authority in the kubeconfig")
        one_line = " ".join(server_msg.split())
        return TreepipeError(f"the API server refused to {verb} TreePipeline {ns}/{name}: "
                             f"{status} {one_line}")


class _Conflict(Exception):
    """409: the object changed between our read and our patch."""


def _context_namespace(paths: list[Path], context: str | None) -> tuple[str | None, str | None]:
    """(context name, its namespace) from the kubeconfig files; raise TreepipeError if unknown."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(
            config_file=os.pathsep.join(str(p) for p in paths))
    except (config.ConfigException, yaml.YAMLError, OSError) as e:
        why = " ".join(str(e).split())  # YAML errors span several lines
        raise TreepipeError(f"kubeconfig {', '.join(map(str, paths))}: {why}; fix it or point "
                            f"KUBECONFIG at a working file") from None
    if context is None:
        chosen = active
    else:
        chosen = next((c for c in contexts or [] if c.get("name") == context), None)
        if chosen is None:
            names = ", ".join(c.get("name", "?") for c in contexts or []) or "none"
            raise TreepipeError(f"--context: no context {context!r} in the kubeconfig (contexts: "
                                f"{names}); see kubectl config get-contexts")
    if not chosen:
        return None, None
    return chosen.get("name"), (chosen.get("context") or {}).get("namespace")


@contextmanager
def _connect(context: str | None, namespace: str | None) -> Iterator[_Cluster]:
    """The API connection for ``context`` and the namespace ``namespace`` resolves to."""
    from kubernetes import client, config

    cfg = client.Configuration()
    paths = [p for p in _kubeconfig_paths() if p.is_file()]
    if paths:
        ctx_name, ctx_ns = _context_namespace(paths, context)
        try:
            # config_file explicitly: the library reads $KUBECONFIG once, at import time
            config.load_kube_config(config_file=os.pathsep.join(str(p) for p in paths),
                                    context=context, client_configuration=cfg)
        except config.ConfigException as e:
            raise TreepipeError(f"kubeconfig context {ctx_name or '(current)'}: {e}; fix the "
                                f"kubeconfig or pick another --context") from None
        namespace = namespace or ctx_ns
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        if context:
            raise TreepipeError(f"--context {context}: there is no kubeconfig to choose it from "
                                f"(running in a pod uses its service account); drop --context "
                                f"or set KUBECONFIG")
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException as e:
            raise TreepipeError(f"in-cluster credentials: {e}; {NO_CREDENTIALS}") from None
        ctx_name = None
        if not namespace and SA_NAMESPACE.is_file():
            namespace = SA_NAMESPACE.read_text().strip() or None
    else:
        raise TreepipeError(NO_CREDENTIALS)
    # urllib3's default three retries, each waiting out the connect timeout, would keep
    # a CLI silent for about 40 s on an unreachable server; one retry covers a blip
    cfg.retries = 1
    with client.ApiClient(cfg) as api_client:
        yield _Cluster(client.CustomObjectsApi(api_client), cfg.host, namespace or "default",
                       ctx_name)


# ---------------------------------------------------------------- commands


def status_cluster(name: str, context: str | None = None, namespace: str | None = None,
                   as_json: bool = False) -> int:
    """``treepipe status NAME --backend kubernetes [-n NS] [--context C] [--json]``."""
    with _connect(context, namespace) as k:
        view = status_view(k.get(name))
    print(json.dumps(view) if as_json else format_status(view))
    return 0


def _wait_ready(k: _Cluster, name: str, cr: Obj, generation: int, timeout: float) -> Obj:
    """Poll until the operator reports ``generation`` Ready; progress lines on stderr."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        v = status_view(cr)
        line = progress_line(v, generation)
        if line != last:
            print(line, file=sys.stderr, flush=True)
            last = line
        observed = v["observedGeneration"] is not None and v["observedGeneration"] >= generation
        if observed and v["ready"]:
            return v
        planned = next((c for c in v["conditions"] if c["type"] == "Planned"), None)
        if observed and planned and planned["status"] == "False":
            # checked here too, since the operator may see what this machine cannot
            raise TreepipeError(f"the operator refused the new spec of {k.namespace}/{name}: "
                                f"{planned['message']}; the running pipeline is unchanged")
        if time.monotonic() >= deadline:
            break
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        cr = k.get(name)
    if not observed:
        what = (f"the operator has not observed generation {generation} (last observed: "
                f"{v['observedGeneration']}); is it running? kubectl -n treepipe get deploy "
                f"treepipe-operator")
    else:
        ready = next((c for c in v["conditions"] if c["type"] == "Ready"), None)
        what = _stages_text(v) + (f", {ready['message']}" if ready and ready["message"] else "")
    raise TreepipeError(f"pipeline {name} in namespace {k.namespace} not ready within {timeout:g} "
                        f"s: {what}; see kubectl describe {SHORT} {name} -n {k.namespace}")


def scale_cluster(name: str, stages: int, timeout: float, context: str | None = None,
                  namespace: str | None = None, wait: bool = True) -> int:
    """``treepipe scale NAME --stages N --backend kubernetes [-n NS] [--context C] [--no-wait]``.

    Reads the TreePipeline, checks the new count locally, patches ``spec.stages.count``
    guarded by the resourceVersion just read (a 409 re-reads and re-patches), then waits
    up to ``--timeout`` seconds for the operator to report the new generation Ready.
    """
    with _connect(context, namespace) as k:
        for _ in range(1 + CONFLICT_RETRIES):
            body, bounds = scale_patch(k.get(name), stages)
            try:
                patched = k.patch(name, body)
                break
            except _Conflict:
                continue  # someone else changed it: start from their version
        else:
            raise TreepipeError(f"TreePipeline {k.namespace}/{name} kept changing while it was "
                                f"being scaled (409 Conflict {1 + CONFLICT_RETRIES} times); run "
                                f"the command again")
        gen = (patched.get("metadata") or {}).get("generation")
        shown = [list(b) for b in bounds]  # as `treepipe status` prints them
        print(f"TreePipeline {k.namespace}/{name}: spec.stages.count = {stages} "
              f"(generation {gen}), planned layers {shown}", file=sys.stderr)
        if not wait or gen is None:
            print(f"pipeline {name!r}: {len(bounds)} stages {shown} requested; follow "
                  f"with treepipe status {name} --backend kubernetes -n {k.namespace}")
            return 0
        _wait_ready(k, name, patched, int(gen), timeout)
    print(f"pipeline {name!r}: {len(bounds)} stages {shown}")
    return 0
