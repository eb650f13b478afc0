"""Hardened pods and NetworkPolicies on every rendered pipeline (issue 12).

Every pod template of every example: non-root, no capabilities, seccomp RuntimeDefault,
read-only root filesystem with emptyDir volumes for what is written, no privilege
escalation, no service-account token, no secret on a command line.  Every pipeline gets
NetworkPolicies that let only its own pods reach the links and Redis.  Checked on the
objects only (strict kubernetes-validate in tests/test_render.py): no cluster here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.deploy.manifest import ManifestError, load_manifest, validate_manifest
from orchestrator.deploy.render import (
    DATA_PORT,
    HEALTH_PORT,
    REDIS_PORT,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    TMP_PATH,
    link_secret,
    link_secret_command,
    redis_secret,
    redis_secret_command,
    render,
)
from tests.test_render import k8s_validate

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "manifests" / "examples")
                  .glob("*.yaml"))
UID = "0b6f3c1e-6f0e-4c56-9d1a-2f4a8e9b7c10"
SENTINEL = "S3CRET-VALUE-FROM-A-SECRET"

Obj = dict[str, Any]


def templates(objs: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(workload, pod template) of every object that makes pods."""
    return [(o, o["spec"]["template"]) for o in objs if o.get("spec", {}).get("template")]


def containers(pod: Obj) -> list[Obj]:
    return pod.get("initContainers", []) + pod["containers"]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  text)


def container_env(c: Obj) -> dict[str, str]:
    """The container's environment as Kubernetes builds it, a Secret's value as SENTINEL."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = SENTINEL
        elif "value" in e:
            env[e["name"]] = expand(e["value"], env)  # only earlier variables expand
        else:
            env[e["name"]] = "from-the-downward-api"
    return env


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # all we render
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def example(name: str) -> Path:
    return next(p for p in EXAMPLES if name in p.name)


def objects_of(**gateway: Any) -> list[Obj]:
    data = yaml.safe_load(example("external").read_text())
    data["spec"]["gateway"] = {"port": 50151, **gateway}
    return render(validate_manifest(data))


# ---------------------------------------------------------------- pods


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_pod_is_non_root_capless_read_only_and_tokenless(path: Path) -> None:
    objs = render(load_manifest(path), owner_uid=UID)
    assert len(templates(objs)) >= 4  # stages, draft, gateway (and Redis)
    for o, tmpl in templates(objs):
        where = f"{o['kind']}/{o['metadata']['name']}"
        pod = tmpl["spec"]
        psc = pod["securityContext"]
        assert pod["automountServiceAccountToken"] is False, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, where
        assert psc["runAsGroup"] > 0 and psc["fsGroup"] > 0, where
        writable = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc.get("runAsNonRoot", psc["runAsNonRoot"]) is True, where
            assert sc.get("runAsUser", psc["runAsUser"]) > 0, where
            assert not sc.get("privileged"), where
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}, where
            # with a read-only root, whatever is written is on an emptyDir volume
            for mount in c["volumeMounts"]:
                if not mount.get("readOnly"):
                    assert mount["name"] in writable, (where, mount)
        k8s_validate(o)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_treepipe_containers_write_only_to_their_volumes(path: Path) -> None:
    for _, tmpl in templates(render(load_manifest(path))):
        c = tmpl["spec"]["containers"][0]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        if c["name"] == "redis":
            # redis-server writes only under `dir` (its AOF and rewrites): /data
            assert set(mounts) == {"/data"} and "dir /data" in c["command"][-1]
            continue
        env = container_env(c)
        assert TMP_PATH in mounts and not mounts[TMP_PATH].get("readOnly")
        assert env["HOME"] == TMP_PATH  # ~/.cache of torch, triton, Hugging Face
        assert not mounts[env["TREEPIPE_CACHE"]].get("readOnly")
        assert mounts["/etc/treepipe"]["readOnly"] is True
        for m in mounts.values():
            if m["name"] == "models":
                assert m["readOnly"] is True


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_no_secret_value_reaches_a_command_line(path: Path) -> None:
    objs = render(load_manifest(path))
    assert not [o for o in objs if o["kind"] == "Secret"]  # values never pass through render
    seen_secret_refs = 0
    for o, tmpl in templates(objs):
        for c in containers(tmpl["spec"]):
            env = container_env(c)
            seen_secret_refs += SENTINEL in env.values()
            for e in c.get("env", []):
                if "PASSWORD" in e["name"]:
                    assert "secretKeyRef" in e["valueFrom"], e  # never a literal value
            argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            assert not any(SENTINEL in a for a in argv), (o["metadata"]["name"], argv)
            if c["name"] == "redis":
                # the shell expands $REDIS_PASSWORD only as an argument of printf, a
                # builtin: redis-server's own argv is `redis-server -` (config on stdin)
                script = c["command"][-1]
                feed, run = script.split(" | ")
                assert feed.startswith("printf ") and run == "exec redis-server -"
                assert "$REDIS_PASSWORD" in feed and "$" not in run
    assert seen_secret_refs  # the workers do get the password, from the environment


def test_gateway_on_a_low_port_binds_without_capabilities() -> None:
    objs = objects_of(httpPort=80)
    gw = next(o for o in objs if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
    psc = gw["spec"]["template"]["spec"]["securityContext"]
    assert psc["sysctls"] == [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "80"}]
    k8s_validate(gw)
    plain = next(o for o in objects_of() if o["kind"] == "Deployment"
                 and "gateway" in o["metadata"]["name"])
    assert "sysctls" not in plain["spec"]["template"]["spec"]["securityContext"]


# ---------------------------------------------------------------- services


def test_gateway_service_is_cluster_ip_unless_the_manifest_says_otherwise() -> None:
    svc = next(o for o in objects_of() if o["kind"] == "Service"
               and o["metadata"]["name"].endswith("-gateway"))
    assert svc["spec"]["type"] == "ClusterIP"
    for path in EXAMPLES:
        m = load_manifest(path)
        svcs = [o for o in render(m) if o["kind"] == "Service"]
        exposed = [s for s in svcs if s["spec"].get("type", "ClusterIP") != "ClusterIP"]
        # only the gateway, and only where the example chose it in writing
        assert [s["metadata"]["name"] for s in exposed] == (
            [] if m.spec.gateway.service_type == "ClusterIP" else [f"{m.metadata.name}-gateway"])
        if exposed:
            assert "serviceType:" in path.read_text() and "conscious choice" in path.read_text()


# ---------------------------------------------------------------- network policies


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_network_policies_admit_only_the_pipelines_own_pods(path: Path) -> None:
    m = load_manifest(path)
    objs = render(m, owner_uid=UID)
    pols = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    name = m.metadata.name
    assert set(pols) == {f"{name}-internal", f"{name}-gateway-clients"}
    # created before any workload, so no pod runs unprotected
    first_workload = next(i for i, o in enumerate(objs) if o.get("spec", {}).get("template"))
    assert all(objs.index(p) < first_workload for p in pols.values())
    internal, clients = pols[f"{name}-internal"]["spec"], pols[f"{name}-gateway-clients"]["spec"]
    for spec in (internal, clients):
        assert spec["policyTypes"] == ["Ingress"]
    own = internal["podSelector"]
    assert own == {"matchLabels": {"app.kubernetes.io/instance": name,
                                   "app.kubernetes.io/name": "treepipe"}}
    [rule] = internal["ingress"]
    assert rule["from"] == [{"podSelector": own}]  # no namespaceSelector: this namespace only
    embedded = m.spec.synchronizer.mode == "embedded"
    assert [p["port"] for p in rule["ports"]] == [DATA_PORT, HEALTH_PORT] + (
        [REDIS_PORT] if embedded else [])
    for _, tmpl in templates(objs):
        labels = tmpl["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        assert matches(own, labels), component  # every pod isolated by the internal policy
        assert matches(clients["podSelector"], labels) == (component == "gateway")
        ports = {p["containerPort"] for c in tmpl["spec"]["containers"] for p in c["ports"]}
        if component == "gateway":
            # gRPC and HTTP to allowFrom; a TLS gateway's plaintext health port (kubelet
            # probes) only through the internal rule, like every pod's
            public = {p["port"] for p in clients["ingress"][0]["ports"]}
            assert public <= ports and ports - public <= {HEALTH_PORT}
        else:  # links, health and Redis: only through the internal rule
            assert ports <= {p["port"] for p in rule["ports"]}
    # a pod of another pipeline, or without the labels, is not a source
    assert not matches(own, {"app.kubernetes.io/instance": "other",
                             "app.kubernetes.io/name": "treepipe"})
    assert not matches(own, {"app.kubernetes.io/instance": name})
    for o in pols.values():
        k8s_validate(o)


def test_gateway_clients_come_from_allow_from() -> None:
    [anyone] = next(o for o in objects_of() if o["metadata"]["name"].endswith(
        "gateway-clients"))["spec"]["ingress"]
    assert "from" not in anyone  # default: anyone may reach the gRPC and HTTP ports
    assert [p["port"] for p in anyone["ports"]] == [50151, 8000]
    peers = [{"cidr": "10.0.0.0/8"}, {"namespace": "monitoring"},
             {"namespace": "apps", "podLabels": {"app": "chat"}}, {"podLabels": {"app": "ui"}}]
    pol = next(o for o in objects_of(allowFrom=peers) if o["metadata"]["name"].endswith(
        "gateway-clients"))
    assert pol["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}},
         "podSelector": {"matchLabels": {"app": "chat"}}},  # one peer: both must hold
        {"podSelector": {"matchLabels": {"app": "ui"}}}]
    k8s_validate(pol)
    # the shipped example narrows it
    m = load_manifest(example("external"))
    pol = next(o for o in render(m) if o["metadata"]["name"].endswith("gateway-clients"))
    assert pol["spec"]["ingress"][0]["from"][0] == {"ipBlock": {"cidr": "10.0.0.0/8"}}


@pytest.mark.parametrize("peer, message", [
    ({"cidr": "10.0.0.1"}, "allowFrom[0].cidr: '10.0.0.1' has no prefix length"),
    ({"cidr": "10.0.0.300/8"}, "is not a CIDR"),
    ({}, "allowFrom[0]: an entry needs cidr, namespace or podLabels"),
    ({"cidr": "10.0.0.0/8", "namespace": "x"}, "either a cidr or pods"),
    ({"namespace": "Not_A_Label"}, "allowFrom[0].namespace"),
])
def test_bad_allow_from_gets_one_line(peer: Obj, message: str) -> None:
    data = yaml.safe_load(example("external").read_text())
    data["spec"]["gateway"]["allowFrom"] = [peer]
    with pytest.raises(ManifestError) as e:
        validate_manifest(data)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- client API: TLS and key


def gateway_container(objs: list[Obj]) -> tuple[Obj, Obj]:
    """(gateway Deployment, its container)."""
    gw = next(o for o in objs if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
    return gw, gw["spec"]["template"]["spec"]["containers"][0]


def test_gateway_tls_and_api_key_come_from_secrets(tmp_path: Path) -> None:
    """TLS from a mounted kubernetes.io/tls Secret, probes on a plaintext health-only port,
    the key from a Secret into the environment; without them --insecure is in writing."""
    from orchestrator.cli.gateway_commands import check_gateway_args
    from orchestrator.cli.main import build_parser
    from tests.pod_config import local_config_args

    objs = objects_of(tlsSecret="gw-tls", apiKeySecret={"name": "gw-key", "key": "api-key"})
    gw, c = gateway_container(objs)
    args = c["args"]
    for flag, value in (("--tls-cert-file", TLS_CERT_FILE), ("--tls-key-file", TLS_KEY_FILE),
                        ("--health-listen", f"0.0.0.0:{HEALTH_PORT}")):
        assert args[args.index(flag) + 1] == value
    assert "--insecure" not in args and "--api-key-file" not in args
    [key] = [e for e in c["env"] if e["name"] == "TREEPIPE_API_KEY"]
    assert key["valueFrom"] == {"secretKeyRef": {"name": "gw-key", "key": "api-key"}}
    pod = gw["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "gw-tls", "defaultMode": 0o440}} in \
        pod["volumes"]
    assert {"name": "tls", "mountPath": TLS_CERT_FILE.rpartition("/")[0],
            "readOnly": True} in c["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": HEALTH_PORT}  # kubelet's probe speaks no TLS
    assert c["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    assert {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"} in c["ports"]
    k8s_validate(gw)
    # key: from the env; the gateway's settings from its mounted config
    assert check_gateway_args(build_parser().parse_args(
        local_config_args(args, objs, tmp_path))) is None

    _, plain = gateway_container(objects_of())
    assert "--insecure" in plain["args"] and "--tls-cert-file" not in plain["args"]
    assert not [e for e in plain["env"] if e["name"] == "TREEPIPE_API_KEY"]
    assert plain["readinessProbe"]["grpc"] == {"port": 50151}


def test_gateway_secrets_are_for_kubernetes_only() -> None:
    data = yaml.safe_load(example("local").read_text())
    data["spec"]["gateway"] = {"tlsSecret": "gw-tls"}
    with pytest.raises(ManifestError) as e:
        validate_manifest(data)
    assert "$TREEPIPE_TLS_CERT_FILE" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the Redis Secret


def test_redis_secret_is_described_without_a_value() -> None:
    m = load_manifest(example("70b"))
    s = redis_secret(m, owner_uid=UID)
    assert s is not None
    assert s["metadata"]["name"] == "llama-70b-redis-auth" and s["immutable"] is True
    assert "data" not in s and "stringData" not in s
    assert s["metadata"]["ownerReferences"][0]["uid"] == UID  # collected with the pipeline
    k8s_validate(s)
    # the name and key the pods read
    redis = next(o for o in render(m) if o["metadata"]["name"] == "llama-70b-redis"
                 and o["kind"] == "Deployment")
    ref = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "llama-70b-redis-auth", "key": "password"}
    assert redis_secret_command(m) == (
        'kubectl -n treepipe create secret generic llama-70b-redis-auth '
        '--from-literal=password="$(openssl rand -hex 24)"')
    assert redis_secret(load_manifest(example("external"))) is None  # the user's own Secret


# ---------------------------------------------------------------- the link keys


def test_link_keys_secret_is_described_without_a_value() -> None:
    m = load_manifest(example("70b"))
    s = link_secret(m, owner_uid=UID)
    assert s["metadata"]["name"] == "llama-70b-link-keys" and s["immutable"] is True
    assert "data" not in s and "stringData" not in s
    assert s["metadata"]["ownerReferences"][0]["uid"] == UID  # collected with the pipeline
    k8s_validate(s)
    assert link_secret_command(m).startswith("d=$(mktemp -d) && treepipe link-keys $d/keys")
    assert ("kubectl -n treepipe create secret generic llama-70b-link-keys --from-file=$d/keys"
            in link_secret_command(m))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_stage_and_draft_pods_mount_the_link_keys_read_only(path: Path) -> None:
    m = load_manifest(path)
    objs = render(m)
    mounted = []
    for o, tmpl in templates(objs):
        pod = tmpl["spec"]
        c = pod["containers"][0]
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {v["name"]: v for v in c["volumeMounts"]}
        argv = " ".join(c.get("command", []) + c.get("args", []))
        # the keys only by file: no path to them, no key and no opt-out on a command line
        assert "treepipe-links" not in argv and "--insecure-links" not in argv
        if c["name"] not in ("stage", "draft"):  # the gateway and Redis open no links
            assert "link-keys" not in vols and "TREEPIPE_LINK_KEYS" not in container_env(c)
            continue
        mounted.append(o["metadata"]["name"])
        assert vols["link-keys"] == {"name": "link-keys", "secret": {
            "secretName": f"{m.metadata.name}-link-keys", "defaultMode": 0o440}}
        assert mounts["link-keys"] == {"name": "link-keys", "mountPath": "/etc/treepipe-links",
                                       "readOnly": True}
        assert container_env(c)["TREEPIPE_LINK_KEYS"] == "/etc/treepipe-links"
        # root owns the files, the worker reads them through its group (fsGroup)
        sec = pod["securityContext"]
        assert sec["fsGroup"] == sec["runAsGroup"] and sec["runAsUser"] != 0
    assert len(mounted) == sum(o["kind"] == "StatefulSet" for o in objs) + 1  # + the draft
