"""Reconcile: create, update (stage count, width, image), delete, drift; status conditions.

``Store`` below stands in for the API server's object store (there is no cluster here):
it keeps objects by (kind, name), adds the server-side defaults and status fields a real
API server adds, and applies the actions reconcile returns.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import pytest
import yaml

from orchestrator.deploy.reconcile import Action, is_subset, reconcile, teardown

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
UID = "3f2a8c44-1d2b-4f7e-9a55-6c1e0b7d9e21"
T0, T1, T2 = "2030-01-01T00:00:00Z", "2030-01-01T00:01:00Z", "2030-01-01T00:02:00Z"


def cr_from(example: str, generation: int = 1, **spec_changes) -> dict:
    d = yaml.safe_load((EXAMPLES / example).read_text())
    d["metadata"].update(uid=UID, generation=generation, namespace="treepipe")
    for dotted, value in spec_changes.items():
        node = d["spec"]
        *path, last = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return d


def small(generation: int = 1, **changes) -> dict:
    """The 8B example (4 stages, external Redis) turned into an embedded-Redis pipeline."""
    base = {"synchronizer": {"mode": "embedded"}}
    d = cr_from("llama-8b-external-redis.yaml", generation)
    d["spec"].update(base)
    for dotted, value in changes.items():
        node = d["spec"]
        *path, last = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return d


class Store:
    """In-memory object store with API-server defaulting (see module docstring)."""

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str], dict] = {}

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            key = (a.kind, a.name)
            if a.verb == "delete":
                del self.objs[key]
                continue
            body = copy.deepcopy(a.body)
            if a.verb == "create":
                assert key not in self.objs, f"create of existing {key}"
                body["metadata"]["uid"] = str(uuid.uuid4())
            else:
                assert key in self.objs, f"update of missing {key}"
                body["metadata"]["uid"] = self.objs[key]["metadata"]["uid"]
            self._default(body)
            self.objs[key] = body

    @staticmethod
    def _default(o: dict) -> None:
        # what the API server adds on write: must not read as drift
        o["metadata"]["resourceVersion"] = str(uuid.uuid4().int % 10**6)
        o["metadata"]["creationTimestamp"] = T0
        if o["kind"] == "Service":
            o["spec"].setdefault("clusterIP", "10.0.0.7")
            o["spec"].setdefault("sessionAffinity", "None")
        tmpl = o.get("spec", {}).get("template")
        if tmpl:
            o["spec"].setdefault("revisionHistoryLimit", 10)
            tmpl["spec"].setdefault("dnsPolicy", "ClusterFirst")
            for c in tmpl["spec"]["containers"]:
                c.setdefault("terminationMessagePath", "/dev/termination-log")
            o["status"] = {"replicas": 0}

    def ready_all(self) -> None:
        for o in self.objs.values():
            n = o.get("spec", {}).get("replicas")
            if o["kind"] in ("StatefulSet", "Deployment"):
                o["status"] = {"replicas": n, "readyReplicas": n, "currentReplicas": n,
                               "availableReplicas": n, "updatedReplicas": n}

    def list(self) -> list[dict]:
        return [copy.deepcopy(o) for o in self.objs.values()]


def converge(cr: dict, store: Store, now: str = T1) -> dict:
    """Reconcile until nothing is left to do; return the CR with its new status."""
    for _ in range(3):
        res = reconcile(cr, store.list(), now)
        store.apply(res.actions)
        store.ready_all()
        cr = {**cr, "status": res.status}
        if not res.actions:
            return cr
    raise AssertionError("did not converge")


def cond(status: dict, ctype: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def kinds(actions, verb):
    return sorted((a.kind, a.name) for a in actions if a.verb == verb)


# ---------------------------------------------------------------- create


def test_create_from_nothing():
    cr = small()
    res = reconcile(cr, [], T0)
    assert {a.verb for a in res.actions} == {"create"}
    assert res.actions[0].kind == "ConfigMap"  # the plan exists before any pod mounts it
    names = [a.name for a in res.actions]
    for i in range(4):
        assert f"llama-8b-stage-{i}" in names
    assert {"llama-8b-draft", "llama-8b-gateway", "llama-8b-redis"} <= set(names)
    assert all(a.reason == "new" for a in res.actions)
    st = res.status
    assert st["observedGeneration"] == 1 and st["stages"] == 4 and st["readyStages"] == 0
    assert cond(st, "Planned")["status"] == "True"
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Ready")["reason"] == "Progressing"
    assert cond(st, "Degraded")["status"] == "False"
    assert all(c["observedGeneration"] == 1 for c in st["conditions"])


def test_converged_pipeline_is_ready_and_stable():
    store = Store()
    cr = converge(small(), store)
    res = reconcile(cr, store.list(), T2)
    assert res.actions == []
    assert cond(res.status, "Ready")["status"] == "True"
    assert cond(res.status, "Degraded")["status"] == "False"
    assert res.status["readyStages"] == 4
    assert res.status["endpoint"] == "llama-8b-gateway.treepipe.svc:50151"
    # Ready became True at T1 and stays put: transition time does not move without a flip
    assert cond(res.status, "Ready")["lastTransitionTime"] == T1


# ---------------------------------------------------------------- update


def test_update_stage_count_down_deletes_and_up_creates():
    store = Store()
    converge(small(stages__count=4), store)
    res = reconcile(small(2, stages__count=2), store.list(), T2)
    assert kinds(res.actions, "delete") == [
        ("Service", "llama-8b-stage-2"), ("Service", "llama-8b-stage-3"),
        ("StatefulSet", "llama-8b-stage-2"), ("StatefulSet", "llama-8b-stage-3")]
    updated = kinds(res.actions, "update")
    assert ("ConfigMap", "llama-8b-plan") in updated
    assert ("StatefulSet", "llama-8b-stage-0") in updated  # new layer range, new plan
    assert not kinds(res.actions, "create")
    assert res.status["stages"] == 2
    store.apply(res.actions)
    # more stages than the rack holds: refused, nothing touched
    res = reconcile(small(3, stages__count=6), store.list(), T2)
    assert res.actions == [] and "short 2" in cond(res.status, "Planned")["message"]
    racks = [{"name": "edge", "capacity": 8,
              "nodeSelector": {"node-role.kubernetes.io/inference": "true"}}]
    res = reconcile(small(3, stages__count=6, placement__racks=racks), store.list(), T2)
    assert kinds(res.actions, "create") == sorted(
        [("Service", f"llama-8b-stage-{i}") for i in range(2, 6)]
        + [("StatefulSet", f"llama-8b-stage-{i}") for i in range(2, 6)])
    assert all(a.reason == "new" for a in res.actions if a.verb == "create")


def test_update_width_rolls_treepipe_pods_but_not_redis():
    store = Store()
    cr = converge(small(), store)
    res = reconcile({**small(2, draft__width=32), "status": cr["status"]}, store.list(), T2)
    updated = kinds(res.actions, "update")
    assert ("ConfigMap", "llama-8b-plan") in updated
    for i in range(4):
        assert ("StatefulSet", f"llama-8b-stage-{i}") in updated
    assert ("Deployment", "llama-8b-draft") in updated
    assert ("Deployment", "llama-8b-redis") not in updated
    assert not kinds(res.actions, "create") and not kinds(res.actions, "delete")
    assert all(a.reason == "spec changed" for a in res.actions)
    assert "width 32" in cond(res.status, "Planned")["message"]
    assert res.status["observedGeneration"] == 2
    assert cond(res.status, "Degraded")["status"] == "False"  # a change is not drift
    assert cond(res.status, "Ready")["status"] == "False"  # pods roll


def test_update_image_changes_every_treepipe_container():
    store = Store()
    cr = converge(small(), store)
    res = reconcile({**small(2, image="ghcr.io/treepipe/treepipe:0.2.0"),
                     "status": cr["status"]}, store.list(), T2)
    store.apply(res.actions)
    for (kind, name), o in store.objs.items():
        if kind in ("StatefulSet", "Deployment") and not name.endswith("redis"):
            assert o["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")
    assert store.objs[("Deployment", "llama-8b-redis")]["spec"]["template"]["spec"][
        "containers"][0]["image"].startswith("redis:")


# ---------------------------------------------------------------- delete


def test_switching_to_external_redis_deletes_the_embedded_one():
    store = Store()
    cr = converge(small(), store)
    external = cr_from("llama-8b-external-redis.yaml", 2)
    res = reconcile({**external, "status": cr["status"]}, store.list(), T2)
    assert kinds(res.actions, "delete") == [("Deployment", "llama-8b-redis"),
                                            ("Service", "llama-8b-redis")]
    assert all(a.reason == "no longer in the spec" for a in res.actions if a.verb == "delete")


def test_teardown_deletes_everything_owned_workloads_first():
    store = Store()
    cr = converge(small(), store)
    foreign = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "someone-else", "namespace": "treepipe"}}
    acts = teardown(cr, store.list() + [foreign])
    assert {(a.kind, a.name) for a in acts} == set(store.objs)
    assert acts[0].kind in ("Deployment", "StatefulSet") and acts[-1].kind == "NetworkPolicy"
    store.apply(acts)
    assert store.objs == {}


def test_objects_owned_by_others_are_never_touched():
    store = Store()
    cr = converge(small(), store)
    stray = copy.deepcopy(store.objs[("StatefulSet", "llama-8b-stage-3")])
    stray["metadata"]["name"] = "llama-8b-stage-9"
    stray["metadata"]["ownerReferences"][0]["uid"] = "another-pipeline"
    res = reconcile(cr, store.list() + [stray], T2)
    assert res.actions == []


# ---------------------------------------------------------------- drift


def test_drift_owned_object_deleted_by_hand_is_recreated_and_degraded():
    store = Store()
    cr = converge(small(), store)
    del store.objs[("StatefulSet", "llama-8b-stage-1")]
    res = reconcile(cr, store.list(), T2)
    assert [(a.verb, a.kind, a.name, a.reason) for a in res.actions] == [
        ("create", "StatefulSet", "llama-8b-stage-1", "deleted outside the operator")]
    deg = cond(res.status, "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "Drift"
    assert "StatefulSet/llama-8b-stage-1 was deleted" in deg["message"]
    assert deg["lastTransitionTime"] == T2
    store.apply(res.actions)
    store.ready_all()
    res = reconcile({**cr, "status": res.status}, store.list(), T2)
    assert res.actions == [] and cond(res.status, "Degraded")["status"] == "False"


@pytest.mark.parametrize("edit", ["image", "replicas", "selector", "env", "service_port",
                                  "label", "configmap"])
def test_drift_owned_object_edited_by_hand_is_restored(edit):
    store = Store()
    cr = converge(small(), store)
    sts = store.objs[("StatefulSet", "llama-8b-stage-2")]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    target = ("StatefulSet", "llama-8b-stage-2")
    if edit == "image":
        c["image"] = "evil:latest"
    elif edit == "replicas":
        sts["spec"]["replicas"] = 3
    elif edit == "selector":
        sts["spec"]["template"]["spec"]["nodeSelector"] = {"somewhere": "else"}
    elif edit == "env":
        c["env"].append({"name": "DEBUG", "value": "1"})
    elif edit == "service_port":
        target = ("Service", "llama-8b-gateway")
        store.objs[target]["spec"]["ports"][0]["port"] = 8080
    elif edit == "label":
        sts["metadata"]["labels"]["app.kubernetes.io/component"] = "other"
    else:
        target = ("ConfigMap", "llama-8b-plan")
        store.objs[target]["data"]["pipeline.json"] = "{}"
    res = reconcile(cr, store.list(), T2)
    assert [(a.verb, a.kind, a.name) for a in res.actions] == [("update", *target)]
    assert res.actions[0].reason == "edited outside the operator"
    assert cond(res.status, "Degraded")["reason"] == "Drift"
    store.apply(res.actions)
    assert reconcile(cr, store.list(), T2).actions == []


def test_server_defaults_are_not_drift():
    store = Store()
    cr = converge(small(), store)
    # Store added clusterIP, dnsPolicy, terminationMessagePath, resourceVersion, status
    assert "clusterIP" in store.objs[("Service", "llama-8b-gateway")]["spec"]
    assert reconcile(cr, store.list(), T2).actions == []


def test_unready_workload_is_degraded_not_rewritten():
    store = Store()
    cr = converge(small(), store)
    store.objs[("StatefulSet", "llama-8b-stage-0")]["status"]["readyReplicas"] = 0
    res = reconcile(cr, store.list(), T2)
    assert res.actions == []
    assert cond(res.status, "Ready")["status"] == "False"
    assert cond(res.status, "Degraded")["reason"] == "Unhealthy"
    assert res.status["readyStages"] == 3


# ---------------------------------------------------------------- bad specs


def test_invalid_spec_changes_nothing_and_says_why():
    store = Store()
    cr = converge(small(), store)
    bad = small(2, draft__width=0)
    res = reconcile({**bad, "status": cr["status"]}, store.list(), T2)
    assert res.actions == []
    planned = cond(res.status, "Planned")
    assert planned["status"] == "False" and planned["reason"] == "InvalidSpec"
    assert "spec.draft.width" in planned["message"]
    assert cond(res.status, "Degraded")["status"] == "True"
    assert res.status["observedGeneration"] == 2


def test_local_backend_is_not_run_by_the_operator():
    cr = cr_from("local.yaml")
    res = reconcile(cr, [], T0)
    assert res.actions == []
    assert "spec.backend" in cond(res.status, "Planned")["message"]


def test_is_subset():
    assert is_subset({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2, "c": 3}], "d": 4})
    assert not is_subset({"a": [1]}, {"a": [1, 2]})
    assert not is_subset({"a": {"b": 1}}, {"a": {"b": 2}})
    assert not is_subset({"a": 1}, {})


# ---------------------------------------------------------------- operator wiring


def test_operator_turns_actions_into_server_side_apply_and_delete():
    from orchestrator.deploy.operator import KINDS, request_for

    store = Store()
    cr = converge(small(), store)
    creates = reconcile(small(), [], T0).actions
    assert {a.kind for a in creates} <= set(KINDS)  # every kind render makes is mapped
    method, path, headers, body = request_for(creates[0])
    assert method == "PATCH" and headers["Content-Type"] == "application/apply-patch+yaml"
    assert path == ("/api/v1/namespaces/treepipe/configmaps/llama-8b-plan"
                    "?fieldManager=treepipe-operator&force=true")
    assert yaml.safe_load(body) == creates[0].body  # JSON is YAML
    sts = next(a for a in creates if a.kind == "StatefulSet")
    assert request_for(sts)[1].startswith("/apis/apps/v1/namespaces/treepipe/statefulsets/")
    gone = teardown(cr, store.list())
    method, path, _, body = request_for(next(a for a in gone if a.kind == "ConfigMap"))
    assert method == "DELETE" and path.endswith("/configmaps/llama-8b-plan")
    assert yaml.safe_load(body)["propagationPolicy"] == "Background"
    assert request_for(gone[-1])[1] == ("/apis/networking.k8s.io/v1/namespaces/treepipe/"
                                        "networkpolicies/llama-8b-internal")


def test_operator_maps_a_service_monitor():
    """gateway.serviceMonitor renders a ServiceMonitor; the operator knows its API."""
    from orchestrator.deploy.operator import KINDS, OPTIONAL_APIS, request_for

    creates = reconcile(small(gateway__serviceMonitor=True), [], T0).actions
    assert {a.kind for a in creates} <= set(KINDS)
    mon = next(a for a in creates if a.kind == "ServiceMonitor")
    path = request_for(mon)[1]
    assert path.startswith("/apis/monitoring.coreos.com/v1/namespaces/treepipe/"
                           "servicemonitors/")
    assert path.startswith(OPTIONAL_APIS)  # a cluster without the CRD lists nothing
    assert not any(request_for(a)[1].startswith(OPTIONAL_APIS) for a in
                   reconcile(small(), [], T0).actions)


def test_operator_registers_handlers_for_treepipelines():
    import kopf

    import orchestrator.deploy.operator  # noqa: F401  (registers the handlers)

    reg = kopf.get_default_registry()
    handlers = [h for group in (reg._changing, reg._spawning) for h in group.get_all_handlers()]
    names = {getattr(h.fn, "__name__", "") for h in handlers}
    assert {"sync", "delete"} <= names


@pytest.mark.parametrize("file, scope", [("operator.yaml", "namespace"),
                                         ("operator-clusterwide.yaml", "cluster")])
def test_operator_manifest_is_valid_and_least_privilege(file, scope):
    from orchestrator.deploy.operator import CREATE_ONLY, KINDS, SCOPE_ENV
    from tests.test_render import k8s_validate

    docs = list(yaml.safe_load_all((EXAMPLES.parent / file).read_text()))
    for d in docs:
        k8s_validate(d)
    kinds_in = {d["kind"] for d in docs}
    role_kind, binding_kind = (("Role", "RoleBinding") if scope == "namespace"
                               else ("ClusterRole", "ClusterRoleBinding"))
    if scope == "namespace":  # nothing cluster-scoped but the namespace itself
        assert not kinds_in & {"ClusterRole", "ClusterRoleBinding"}
    role = next(d for d in docs if d["kind"] == role_kind)
    binding = next(d for d in docs if d["kind"] == binding_kind)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                  "name": role["metadata"]["name"]}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": dep["metadata"]["namespace"]}]
    if scope == "namespace":
        assert role["metadata"]["namespace"] == dep["metadata"]["namespace"]
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    for _, (api_version, _, plural) in KINDS.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert {"list", "create", "patch", "delete"} <= granted[(group, plural)]
    for _, (api_version, _, plural) in CREATE_ONLY.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert granted[(group, plural)] == {"create"}  # never read, list, patch or delete
    assert {"patch"} <= granted[("treepipe.io", "treepipelines/status")]
    assert granted[("treepipe.io", "treepipelines/finalizers")] == {"update"}
    assert "*" not in json_dump(role)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "orchestrator.deploy.operator" in c["command"]
    env = {e["name"]: e for e in c.get("env", [])}
    if scope == "namespace":
        assert "--namespace=$(POD_NAMESPACE)" in c["command"]
        assert "--all-namespaces" not in c["command"]
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        assert env[SCOPE_ENV]["value"] == "namespace"
    else:
        assert "--all-namespaces" in c["command"] and SCOPE_ENV not in env
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_two_operator_manifests_differ_only_in_scope():
    docs = {f: list(yaml.safe_load_all((EXAMPLES.parent / f).read_text()))
            for f in ("operator.yaml", "operator-clusterwide.yaml")}
    rules = {f: [r for d in ds if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
             for f, ds in docs.items()}
    cluster_only = {"customresourcedefinitions", "namespaces"}
    assert rules["operator.yaml"] == [r for r in rules["operator-clusterwide.yaml"]
                                      if not set(r["resources"]) & cluster_only]


@pytest.mark.parametrize("scope, disabled", [("namespace", True), ("", False)])
def test_operator_scanning_follows_its_scope(monkeypatch, scope, disabled):
    import kopf

    from orchestrator.deploy.operator import SCOPE_ENV, configure

    monkeypatch.setenv(SCOPE_ENV, scope)
    settings = kopf.OperatorSettings()
    configure(settings=settings)
    assert settings.scanning.disabled is disabled


# ---------------------------------------------------------------- the Redis Secret


def test_embedded_redis_secret_is_ensured_never_applied():
    store = Store()
    cr = converge(small(), store)
    assert not [k for k in store.objs if k[0] == "Secret"]  # not among applied objects
    for res in (reconcile(small(), [], T0), reconcile(cr, store.list(), T2)):
        # every pass: the operator cannot see whether they exist
        assert [a.name for a in res.ensure] == ["llama-8b-redis-auth", "llama-8b-link-keys"]
        for a in res.ensure:
            assert (a.verb, a.kind, a.namespace) == ("ensure", "Secret", "treepipe")
            assert "never overwritten" in a.reason
            assert "data" not in a.body and "stringData" not in a.body  # no value here
            assert a.body["immutable"] is True
            assert a.body["metadata"]["ownerReferences"][0]["uid"] == UID
    assert reconcile(cr, store.list(), T2).actions == []  # and it is no change
    # an external Redis: its password is the user's, the link keys are still the operator's
    assert [a.name for a in reconcile(cr_from("llama-8b-external-redis.yaml"), [],
                                      T0).ensure] == ["llama-8b-link-keys"]
    assert reconcile(small(2, draft__width=0), [], T0).ensure == []  # invalid: touch nothing


def test_operator_creates_the_secret_with_a_fresh_password_and_never_overwrites():
    from orchestrator.deploy.operator import request_for
    from tests.test_render import k8s_validate

    a, _ = reconcile(small(), [], T0).ensure
    method, path, headers, body = request_for(a)
    # a plain create: the API server answers 409 when it exists, and nothing is replaced
    assert method == "POST"
    assert path == "/api/v1/namespaces/treepipe/secrets?fieldManager=treepipe-operator"
    sent = yaml.safe_load(body)
    password = sent["stringData"]["password"]
    assert len(password) >= 32 and '"' not in password  # fits Redis's config line
    assert yaml.safe_load(request_for(a)[3])["stringData"]["password"] != password
    assert "stringData" not in a.body  # the action itself never carries it
    k8s_validate(sent)


def test_operator_creates_the_link_keys_with_fresh_keys():
    import base64

    from orchestrator.deploy.operator import request_for
    from protocol.links.keys import KEY_FILES, LinkKeys
    from tests.test_render import k8s_validate

    _, a = reconcile(small(), [], T0).ensure
    method, path, _, body = request_for(a)
    assert method == "POST" and path.startswith("/api/v1/namespaces/treepipe/secrets?")
    sent = yaml.safe_load(body)
    assert sent["metadata"]["name"] == "llama-8b-link-keys"
    files = {n: base64.b64decode(v) for n, v in sent["data"].items()}
    assert sorted(files) == sorted(KEY_FILES)  # both transports: spec.transport may change
    keys = LinkKeys(*(files[n] for n in KEY_FILES))
    assert len(keys.curve()[1]) == 40 and b"PRIVATE KEY" in keys.tls()[2]
    again = yaml.safe_load(request_for(a)[3])["data"]
    assert again["curve.secret"] != sent["data"]["curve.secret"]  # fresh every time
    assert "data" not in a.body  # the action itself never carries them
    k8s_validate(sent)


def json_dump(o) -> str:
    import json

    return json.dumps(o)
