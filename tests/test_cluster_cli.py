"""``treepipe scale|status --backend kubernetes``: the pure parts, then the real client on the wire.

There is no cluster here.  The end-to-end tests run the official ``kubernetes`` client
against :class:`FakeApi`, a small HTTP server in a thread that answers the two REST
paths of a namespaced TreePipeline the way an API server does (bearer token, Status
bodies for errors, resourceVersion preconditions on merge patches, generation bumps),
through a temporary kubeconfig.  It checks what goes over the wire, not how a real
API server, RBAC or the operator behave.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli.pipeline_commands import (
    add_cluster_args,
    cmd_scale_cluster,
    cmd_status_cluster,
)
from orchestrator.deploy import cluster
from orchestrator.deploy.cluster import (
    NO_CREDENTIALS,
    format_status,
    kube_credentials_available,
    progress_line,
    scale_patch,
    status_view,
)
from orchestrator.deploy.manifest import validate_manifest
from orchestrator.deploy.planner import plan
from orchestrator.deploy.reconcile import reconcile
from protocol.errors import TreepipeError

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
NAME, NS = "llama-70b", "treepipe"
TOKEN = "test-token"
PATH = f"/apis/treepipe.io/v1alpha1/namespaces/{NS}/treepipelines/{NAME}"
ENDPOINT = f"{NAME}-gateway.{NS}.svc:50151"


def conds(gen: int, planned: bool = True, ready: bool = True, ready_msg: str = "",
          planned_msg: str = "8 stages, width 16, top-k 8") -> list[dict]:
    """Conditions shaped like the ones reconcile writes."""
    return [
        {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
         "observedGeneration": gen, "lastTransitionTime": "2030-01-01T00:00:00Z"},
        {"type": "Ready", "status": "True" if ready else "False",
         "reason": "Ready" if ready else "Progressing",
         "message": ready_msg or ("all components ready" if ready else "waiting"),
         "observedGeneration": gen, "lastTransitionTime": "2030-01-01T00:00:00Z"},
        {"type": "Planned", "status": "True" if planned else "False",
         "reason": "Planned" if planned else "InvalidSpec", "message": planned_msg,
         "observedGeneration": gen, "lastTransitionTime": "2030-01-01T00:00:00Z"},
    ]


def status(gen: int, stages: int, ready_stages: int, **kw: Any) -> dict:
    """A TreePipeline status as the operator writes it."""
    return {"observedGeneration": gen, "stages": stages, "readyStages": ready_stages,
            "endpoint": ENDPOINT, "conditions": conds(gen, **kw)}


def live_cr(generation: int = 1, rv: str = "100", with_status: bool = True) -> dict:
    """The 70B example as the API server returns it: server metadata, status."""
    d = yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml").read_text())
    d["metadata"].update(uid="3f2a8c44-1d2b-4f7e-9a55-6c1e0b7d9e21", generation=generation,
                         resourceVersion=rv, creationTimestamp="2030-01-01T00:00:00Z",
                         managedFields=[{"manager": "kubectl", "operation": "Update"}])
    if with_status:
        d["status"] = status(generation, 8, 8)
    return d


def bounds_of(cr: dict, count: int) -> list[tuple[int, int]]:
    d = copy.deepcopy(cr)
    d["spec"]["stages"]["count"] = count
    d["metadata"] = {"name": d["metadata"]["name"], "namespace": d["metadata"]["namespace"]}
    d.pop("status", None)
    return [s.layers for s in plan(validate_manifest(d)).stages]


# ---------------------------------------------------------------- scale_patch


def test_scale_patch_valid_and_pure() -> None:
    cr = live_cr()
    before = copy.deepcopy(cr)
    body, bounds = scale_patch(cr, 7)
    assert body == {"metadata": {"resourceVersion": "100"},
                    "spec": {"stages": {"count": 7, "layers": None}}}
    assert bounds == bounds_of(cr, 7) == [(0, 11), (11, 23), (23, 35), (35, 47), (47, 59),
                                          (59, 70), (70, 80)]
    assert cr == before  # the object read from the API is not modified


def test_scale_patch_drops_pinned_layers_and_needs_no_resource_version() -> None:
    cr = live_cr()
    cr["spec"]["stages"]["layers"] = [{"start": a, "end": b} for a, b in bounds_of(cr, 8)]
    del cr["metadata"]["resourceVersion"]
    body, bounds = scale_patch(cr, 7)
    # null removes the pinned ranges in a merge patch: the planner re-splits
    assert body == {"spec": {"stages": {"count": 7, "layers": None}}}
    assert len(bounds) == 7


def _override_stage_7(cr: dict) -> None:
    cr["spec"]["stages"]["overrides"] = [{"stage": 7, "rack": "rack-b"}]


def _local_backend(cr: dict) -> None:
    cr["spec"]["backend"] = "local"
    for secret in ("tlsSecret", "apiKeySecret"):  # Kubernetes-only, refused locally first
        cr["spec"].get("gateway", {}).pop(secret, None)


def _unknown_shape(cr: dict) -> None:
    del cr["spec"]["model"]["architecture"]  # the weights are a path inside the containers


@pytest.mark.parametrize("count,change,words", [
    (2, None, "spec.stages.device.memory: stage 0 (layers 0-41) needs 80.76 GiB"),
    (81, None, "spec.stages.count: 81 stages for a model with 80 layers; use at most 80"),
    (9, None, "spec.placement.racks: the pipeline needs 10 device slots"),
    (0, None, "spec.stages.count: must be >= 1, got 0"),
    (7, _override_stage_7, "spec.stages.overrides[0].stage: names stage 7 but there are 7"),
    (7, _local_backend, "spec.backend: is 'local', which the operator ignores"),
    (7, _unknown_shape, "spec.model.architecture: the shape of"),
])
def test_scale_patch_refusals(count: int, change: Any, words: str) -> None:
    cr = live_cr()
    if change:
        change(cr)
    with pytest.raises(TreepipeError) as e:
        scale_patch(cr, count)
    msg = str(e.value)
    assert msg.startswith(f"TreePipeline {NS}/{NAME} --stages {count}: "), msg
    assert words in msg and "\n" not in msg


# ---------------------------------------------------------------- status_view / format


def test_status_view_ready_and_formatted() -> None:
    v = status_view(live_cr(generation=3) | {"status": status(3, 8, 8)})
    assert v == {
        "name": NAME, "namespace": NS, "generation": 3, "observedGeneration": 3,
        "current": True, "ready": True, "desiredStages": 8, "stages": 8, "readyStages": 8,
        "endpoint": ENDPOINT} | {"conditions": v["conditions"]}  # conditions: below
    assert [(c["type"], c["status"]) for c in v["conditions"]] == [
        ("Planned", "True"), ("Ready", "True"), ("Degraded", "False")]
    assert all(c["current"] for c in v["conditions"])
    json.dumps(v)  # --json prints it as is
    text = format_status(v)
    lines = text.splitlines()
    assert lines[0] == (f"{NAME} (namespace {NS}): 8/8 stages ready, gateway {ENDPOINT}, "
                        f"generation 3")
    assert re.match(r"  Planned +True +Planned +8 stages, width 16, top-k 8$", lines[1])
    assert re.match(r"  Ready +True +Ready +all components ready$", lines[2])
    assert re.match(r"  Degraded +False +AsExpected +-$", lines[3])


def test_status_view_stale_generation() -> None:
    cr = live_cr(generation=4)
    cr["spec"]["stages"]["count"] = 7
    cr["status"] = status(3, 8, 8)
    v = status_view(cr)
    assert (v["current"], v["ready"], v["desiredStages"], v["stages"]) == (False, False, 7, 8)
    assert not any(c["current"] for c in v["conditions"])
    text = format_status(v)
    assert ("8/8 stages ready (spec: 7), gateway " in text
            and "generation 4, status from generation 3 (the operator has not caught up)"
            in text)
    assert "all components ready (generation 3)" in text
    assert progress_line(v, 4) == ("waiting for the operator to observe generation 4 "
                                   "(last observed: 3)")


def test_status_view_without_status_or_conditions() -> None:
    v = status_view(live_cr(with_status=False))
    assert (v["observedGeneration"], v["current"], v["ready"], v["conditions"]) == (
        None, False, False, [])
    assert "no status yet (generation 1): the operator has not reconciled it" in \
        format_status(v)
    assert progress_line(v, 1).endswith("(last observed: none)")
    # a status with counts but no conditions yet
    cr = live_cr()
    cr["status"] = {"observedGeneration": 1, "stages": 8, "readyStages": 2}
    v = status_view(cr)
    assert (v["current"], v["ready"]) == (True, False)
    assert format_status(v).splitlines() == [
        f"{NAME} (namespace {NS}): 2/8 stages ready, gateway -, generation 1"]


def test_status_view_of_what_reconcile_writes() -> None:
    """The operator's real status (first reconcile: everything to create) reads back."""
    cr = live_cr()
    del cr["status"]
    v = status_view(cr | {"status": reconcile(cr, [], "2030-01-01T00:00:00Z").status})
    assert (v["current"], v["ready"], v["stages"], v["readyStages"]) == (True, False, 8, 0)
    assert v["endpoint"] == ENDPOINT
    line = progress_line(v, 1)
    assert line.startswith("0/8 stages ready; waiting for Deployment/llama-70b-redis, "
                           "StatefulSet/llama-70b-stage-0, ")


# ---------------------------------------------------------------- arguments, credentials


def test_add_cluster_args() -> None:
    p = argparse.ArgumentParser()
    add_cluster_args(p, scale=True)
    a = p.parse_args(["-n", "prod", "--context", "east", "--no-wait"])
    assert (a.namespace, a.context, a.no_wait) == ("prod", "east", True)
    a = p.parse_args([])
    assert (a.namespace, a.context, a.no_wait) == (None, None, False)
    s = argparse.ArgumentParser(exit_on_error=False)
    add_cluster_args(s, scale=False)
    with pytest.raises(SystemExit):
        s.parse_args(["--no-wait"])


def test_kube_credentials_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not kube_credentials_available()
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("{}")
    assert kube_credentials_available()
    # KUBECONFIG replaces ~/.kube/config, as with kubectl; it may list several files
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path}/a:{tmp_path}/b")
    assert not kube_credentials_available()
    (tmp_path / "b").write_text("{}")
    assert kube_credentials_available()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert kube_credentials_available()


# ---------------------------------------------------------------- the stand-in API server


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "details": details or {}, "code": code}


class FakeApi:
    """The API server's answers for ``/apis/treepipe.io/v1alpha1/.../treepipelines/NAME``."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {(NS, NAME): live_cr()}
        self.requests: list[dict] = []  # header names lower-cased: HTTP ignores their case
        self.conflicts = 0  # PATCHes that lose a race against another writer
        self.forbid: set[str] = set()  # verbs RBAC refuses
        self.rollout: list[dict] = []  # statuses the operator writes, one per GET after PATCH
        self.patched = False
        self.crd_installed = True
        self.lock = threading.Lock()
        self.url = ""

    def handle(self, method: str, path: str, headers: dict, raw: bytes) -> tuple[int, Any]:
        body = json.loads(raw) if raw else None
        self.requests.append({"method": method, "path": path, "headers": headers,
                              "body": body})
        if headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, status_body(401, "Unauthorized", "Unauthorized")
        m = re.fullmatch(r"/apis/treepipe\.io/v1alpha1/namespaces/([^/]+)/treepipelines/"
                         r"([^/?]+)", path)
        if not m or not self.crd_installed:
            return 404, "404 page not found"
        ns, name = m.groups()
        verb = method.lower()
        if verb in self.forbid:
            return 403, status_body(403, "Forbidden", (
                f'treepipelines.treepipe.io "{name}" is forbidden: User "dev" cannot {verb} '
                f'resource "treepipelines" in API group "treepipe.io" in the namespace "{ns}"'),
                {"name": name, "group": "treepipe.io", "kind": "treepipelines"})
        obj = self.objects.get((ns, name))
        if obj is None:
            return 404, status_body(404, "NotFound",
                                    f'treepipelines.treepipe.io "{name}" not found',
                                    {"name": name, "group": "treepipe.io",
                                     "kind": "treepipelines"})
        meta = obj["metadata"]
        if method == "GET":
            if self.patched and self.rollout:
                obj["status"] = self.rollout.pop(0)
            return 200, obj
        assert method == "PATCH"
        if headers.get("content-type") != "application/merge-patch+json":
            return 415, status_body(415, "UnsupportedMediaType", "unsupported patch type")
        if self.conflicts:
            self.conflicts -= 1
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)  # another writer
        want_rv = (body.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and want_rv != meta["resourceVersion"]:
            return 409, status_body(409, "Conflict", (
                f'Operation cannot be fulfilled on treepipelines.treepipe.io "{name}": the '
                f'object has been modified; please apply your changes to the latest version '
                f'and try again'), {"name": name, "group": "treepipe.io",
                                    "kind": "treepipelines"})
        new = merge_patch(obj, body)
        if new["spec"] != obj["spec"]:
            new["metadata"]["generation"] = meta["generation"] + 1
        new["metadata"]["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        self.objects[(ns, name)] = new
        self.patched = True
        return 200, new

    def calls(self) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests]


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with fake.lock:
                code, out = fake.handle(self.command, self.path,
                                        {k.lower(): v for k, v in self.headers.items()}, raw)
            data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(out, str)
                             else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join()


def write_kubeconfig(path: Path, server: str, token: str = TOKEN) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "dev", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev",
                                                  "namespace": NS}},
                     {"name": "other", "context": {"cluster": "fake", "user": "dev"}}],
    }))
    return path


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No real credentials or proxies leak in; polling is fast."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cluster, "POLL_S", 0.01)
    return tmp_path


@pytest.fixture
def kube(env: Path, api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(env / "kubeconfig", api.url)))
    return api


def scale_args(stages: int, **kw: Any) -> argparse.Namespace:
    base = {"name": NAME, "stages": stages, "timeout": 5.0, "no_wait": False,
            "namespace": None, "context": None}
    return argparse.Namespace(**(base | kw))


def status_args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**({"name": NAME, "json": False, "namespace": None,
                                  "context": None} | kw))


# ---------------------------------------------------------------- end to end


def test_scale_patches_and_waits_for_ready(kube: FakeApi,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    kube.rollout = [status(1, 8, 8),  # the operator has not seen generation 2 yet
                    status(2, 7, 4, ready=False, ready_msg="waiting for StatefulSet/x-stage-4"),
                    status(2, 7, 4, ready=False, ready_msg="waiting for StatefulSet/x-stage-4"),
                    status(2, 7, 7)]
    assert cmd_scale_cluster(scale_args(7)) == 0
    assert kube.calls() == [("GET", PATH), ("PATCH", PATH), ("GET", PATH), ("GET", PATH),
                            ("GET", PATH), ("GET", PATH)]
    patch = kube.requests[1]
    assert patch["headers"]["content-type"] == "application/merge-patch+json"
    assert patch["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert patch["body"] == {"metadata": {"resourceVersion": "100"},
                             "spec": {"stages": {"count": 7, "layers": None}}}
    stored = kube.objects[(NS, NAME)]
    assert (stored["spec"]["stages"]["count"], stored["metadata"]["generation"]) == (7, 2)
    out, err = capsys.readouterr()
    assert out == f"pipeline '{NAME}': 7 stages {[list(b) for b in bounds_of(live_cr(), 7)]}\n"
    progress = err.splitlines()[1:]
    # one line per change: the repeated 4/7 status is printed once
    assert progress == ["waiting for the operator to observe generation 2 (last observed: 1)",
                        "4/7 stages ready; waiting for StatefulSet/x-stage-4",
                        "7/7 stages ready"]
    assert err.splitlines()[0].startswith(f"TreePipeline {NS}/{NAME}: spec.stages.count = 7 "
                                          f"(generation 2)")


def test_scale_to_the_same_count_returns_at_once(kube: FakeApi,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An unchanged spec keeps its generation, which the operator has already reconciled."""
    assert cmd_scale_cluster(scale_args(8)) == 0
    assert [m for m, _ in kube.calls()] == ["GET", "PATCH"]
    assert kube.objects[(NS, NAME)]["metadata"]["generation"] == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == "8/8 stages ready" and "8 stages" in out


def test_scale_no_wait(kube: FakeApi, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_scale_cluster(scale_args(7, no_wait=True)) == 0
    assert [m for m, _ in kube.calls()] == ["GET", "PATCH"]
    assert capsys.readouterr().out.endswith(
        f"requested; follow with treepipe status {NAME} --backend kubernetes -n {NS}\n")


def test_scale_retries_a_conflict(kube: FakeApi, capsys: pytest.CaptureFixture[str]) -> None:
    kube.conflicts = 2
    assert cmd_scale_cluster(scale_args(7, no_wait=True)) == 0
    assert [m for m, _ in kube.calls()] == ["GET", "PATCH", "GET", "PATCH", "GET", "PATCH"]
    # each retry re-reads and sends the resourceVersion it just read
    sent = [r["body"]["metadata"]["resourceVersion"] for r in kube.requests
            if r["method"] == "PATCH"]
    assert sent == ["100", "101", "102"]
    assert kube.objects[(NS, NAME)]["spec"]["stages"]["count"] == 7
    assert "7 stages" in capsys.readouterr().out


def test_scale_gives_up_after_repeated_conflicts(kube: FakeApi) -> None:
    kube.conflicts = 99
    with pytest.raises(TreepipeError, match=r"kept changing while it was being scaled \(409 "
                                       r"Conflict 4 times\); run the command again"):
        cmd_scale_cluster(scale_args(7, no_wait=True))
    assert [m for m, _ in kube.calls()].count("PATCH") == 4


def test_scale_refused_locally_sends_no_patch(kube: FakeApi) -> None:
    with pytest.raises(TreepipeError, match="spec.stages.count: 81 stages for a model with 80"):
        cmd_scale_cluster(scale_args(81))
    assert kube.calls() == [("GET", PATH)]


def test_scale_times_out_naming_what_is_not_ready(kube: FakeApi) -> None:
    kube.rollout = [status(2, 7, 5, ready=False,
                           ready_msg="waiting for StatefulSet/llama-70b-stage-5")] * 1000
    with pytest.raises(TreepipeError) as e:
        cmd_scale_cluster(scale_args(7, timeout=0.2))
    msg = str(e.value)
    assert msg == (f"pipeline {NAME} in namespace {NS} not ready within 0.2 s: 5/7 stages "
                   f"ready, waiting for StatefulSet/llama-70b-stage-5; see kubectl describe "
                   f"tpl {NAME} -n {NS}")


def test_scale_times_out_when_the_operator_never_observes(kube: FakeApi) -> None:
    with pytest.raises(TreepipeError, match=r"has not observed generation 2 \(last observed: 1\); "
                                       r"is it running\?.*kubectl describe tpl llama-70b -n "
                                       r"treepipe$"):
        cmd_scale_cluster(scale_args(7, timeout=0.1))


def test_scale_reports_an_operator_refusal(kube: FakeApi) -> None:
    kube.rollout = [status(2, 8, 8, planned=False, ready=False,
                           planned_msg="spec.placement.racks: short 1")]
    with pytest.raises(TreepipeError, match=r"the operator refused the new spec of "
                                       r"treepipe/llama-70b: spec.placement.racks: short 1; "
                                       r"the running pipeline is unchanged"):
        cmd_scale_cluster(scale_args(7))


def test_status_human_and_json(kube: FakeApi, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_status_cluster(status_args()) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{NAME} (namespace {NS}): 8/8 stages ready, gateway {ENDPOINT}")
    assert cmd_status_cluster(status_args(json=True)) == 0
    view = json.loads(capsys.readouterr().out)
    assert (view["name"], view["namespace"], view["ready"], view["stages"], view["readyStages"],
            view["endpoint"]) == (NAME, NS, True, 8, 8, ENDPOINT)
    assert [c["type"] for c in view["conditions"]] == ["Planned", "Ready", "Degraded"]
    assert kube.calls() == [("GET", PATH)] * 2
    assert kube.requests[0]["headers"]["accept"] == "application/json"


def test_namespace_and_context_flags(kube: FakeApi) -> None:
    kube.objects[("prod", NAME)] = copy.deepcopy(kube.objects[(NS, NAME)])
    cmd_status_cluster(status_args(namespace="prod"))
    # the context "other" has no namespace: "default"
    with pytest.raises(TreepipeError, match=f"no TreePipeline {NAME} in namespace default"):
        cmd_status_cluster(status_args(context="other"))
    assert [p for _, p in kube.calls()] == [PATH.replace(f"/{NS}/", "/prod/"),
                                            PATH.replace(f"/{NS}/", "/default/")]
    with pytest.raises(TreepipeError, match=r"--context: no context 'nope' in the kubeconfig "
                                       r"\(contexts: fake, other\)"):
        cmd_status_cluster(status_args(context="nope"))


def test_not_found_and_missing_crd(kube: FakeApi) -> None:
    with pytest.raises(TreepipeError) as e:
        cmd_scale_cluster(scale_args(7, name="nope"))
    assert str(e.value).startswith(f"no TreePipeline nope in namespace {NS}; create it with "
                                   f"kubectl apply -f FILE")
    kube.crd_installed = False
    with pytest.raises(TreepipeError, match=r"the TreePipeline CRD is not installed; kubectl apply "
                                       r"-f manifests/crd.yaml"):
        cmd_status_cluster(status_args())


@pytest.mark.parametrize("verb", ["get", "patch"])
def test_forbidden_names_the_verb(kube: FakeApi, verb: str) -> None:
    kube.forbid = {verb}
    with pytest.raises(TreepipeError) as e:
        cmd_scale_cluster(scale_args(7))
    assert str(e.value) == (f"forbidden: these credentials may not {verb} "
                            f"treepipelines.treepipe.io in namespace {NS} (RBAC); ask for a "
                            f"Role granting {verb} on treepipelines (check: kubectl auth can-i "
                            f"{verb} treepipelines.treepipe.io -n {NS})")


def test_bad_token(env: Path, api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(env / "kc", api.url, "stale")))
    with pytest.raises(TreepipeError, match=r"rejected the credentials \(401 Unauthorized\)"):
        cmd_status_cluster(status_args())


def test_connection_refused_names_the_server(env: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(env / "kc",
                                                          f"http://127.0.0.1:{port}")))
    with pytest.raises(TreepipeError) as e:
        cmd_status_cluster(status_args())
    assert str(e.value).startswith(f"cannot reach the Kubernetes API server at "
                                   f"http://127.0.0.1:{port} (connection refused); check "
                                   f"that the cluster is up and that context fake is the "
                                   f"right one")


def test_broken_kubeconfig(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (env / "kc").write_text("clusters: [\n")
    monkeypatch.setenv("KUBECONFIG", str(env / "kc"))
    with pytest.raises(TreepipeError, match=r"^kubeconfig .*/kc: .*; fix it or point KUBECONFIG at "
                                       r"a working file$") as e:
        cmd_status_cluster(status_args())
    assert "\n" not in str(e.value)


def test_no_credentials(env: Path) -> None:
    assert not kube_credentials_available()
    with pytest.raises(TreepipeError) as e:
        cmd_status_cluster(status_args())
    assert str(e.value) == NO_CREDENTIALS


def test_in_cluster_without_a_service_account(env: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert kube_credentials_available()
    with pytest.raises(TreepipeError, match=r"--context east: there is no kubeconfig"):
        cmd_status_cluster(status_args(context="east"))
    # a pod's real service account (a CI runner in a cluster) must not change the case
    from kubernetes.config import incluster_config

    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(env / "no-token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(env / "no-ca.crt"))
    with pytest.raises(TreepipeError) as e:
        cmd_status_cluster(status_args())
    assert str(e.value).startswith("in-cluster credentials: ")
    assert str(e.value).endswith(NO_CREDENTIALS)


# ---------------------------------------------------------------- the CLI's backend choice


@pytest.mark.parametrize(("asked", "local_running", "creds", "want"), [
    (None, True, True, "local"),  # a pipeline `treepipe up` runs here wins
    (None, False, True, "kubernetes"),
    (None, False, False, "local"),  # and says no local pipeline runs
    ("kubernetes", True, False, "kubernetes"),
    ("local", False, True, "local"),
])
def test_choose_backend(asked: str | None, local_running: bool, creds: bool, want: str) -> None:
    from orchestrator.deploy.launcher import choose_backend

    assert choose_backend(asked, local_running, creds) == want


def test_cli_scale_and_status_reach_the_cluster(kube: FakeApi, env: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`treepipe scale/status NAME` with credentials and no local pipeline: the cluster."""
    from orchestrator.cli.main import main

    monkeypatch.setenv("TREEPIPE_CACHE", str(env / "cache"))  # no local run state
    assert main(["scale", NAME, "--stages", "7", "--no-wait"]) == 0
    assert [m for m, _ in kube.calls()] == ["GET", "PATCH"]
    assert main(["status", NAME, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["desiredStages"] == 7


def test_cli_local_flags_refused_for_a_local_pipeline(env: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli.main import main

    assert main(["status", "nope"]) == 2  # no credentials: the local backend
    err = capsys.readouterr().err
    assert "no local pipeline 'nope' is running" in err and "--backend kubernetes" in err
    assert main(["status", "nope", "--backend", "local", "-n", "x"]) == 2
    assert "-n/--namespace and --context address a cluster" in capsys.readouterr().err


def test_a_dropped_connection_is_retried_once(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One retry, not urllib3's three: a server that drops every connection is tried
    twice, so the CLI answers promptly."""
    seen: list[int] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(10)

    def drop() -> None:
        try:
            while True:
                conn, _ = listener.accept()
                seen.append(1)
                conn.close()
        except OSError:
            return

    threading.Thread(target=drop, daemon=True).start()
    port = listener.getsockname()[1]
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(env / "kc",
                                                          f"http://127.0.0.1:{port}")))
    try:
        with pytest.raises(TreepipeError):
            cmd_status_cluster(status_args())
    finally:
        listener.close()
    assert len(seen) == 2
