"""Rendered Kubernetes objects: valid for Kubernetes 1.37 (strict), labelled, owned, placed."""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from orchestrator.deploy.manifest import ManifestError, load_manifest, validate_manifest
from orchestrator.deploy.planner import plan
from orchestrator.deploy.render import HASH_ANNOTATION, HEALTH_PORT, object_hash, render, to_yaml

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "manifests" / "examples")
                  .glob("*.yaml"))
UID = "0b6f3c1e-6f0e-4c56-9d1a-2f4a8e9b7c10"
K8S = "1.37.0"


@functools.cache
def _validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict 1.37 schema for one kind, loaded once.

    kubernetes_validate.validate re-reads the 5 MB definitions file on every call; this
    builds the same Draft 2020-12 validator from the same files once per kind.
    """
    d = f"kubernetes-json-schema/v{K8S}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv_utils.schema_contents(f"{d}/{kind.lower()}-{group}.json", K8S)
    defs = kv_utils.schema_contents(f"{d}/_definitions.json", K8S)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def k8s_validate(obj: dict) -> None:
    """Raise jsonschema.ValidationError unless ``obj`` is valid for Kubernetes 1.37 (strict)."""
    _validator(obj["kind"], obj["apiVersion"]).validate(obj)


def test_fast_validator_agrees_with_kubernetes_validate():
    m = load_manifest(EXAMPLES[0])
    obj = render(m, owner_uid=UID)[-1]
    kubernetes_validate.validate(obj, K8S, strict=True)
    k8s_validate(obj)
    obj["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        kubernetes_validate.validate(obj, K8S, strict=True)
    with pytest.raises(jsonschema.ValidationError):
        k8s_validate(obj)


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_to_strictly_valid_objects(path):
    m = load_manifest(path)
    for uid in (UID, None):  # as the operator writes them, and as `treepipe render` prints
        for obj in render(m, owner_uid=uid):
            k8s_validate(obj)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_objects_are_labelled_owned_and_unique(path):
    m = load_manifest(path)
    objs = render(m, owner_uid=UID)
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys))
    for o in objs:
        md = o["metadata"]
        assert md["labels"]["app.kubernetes.io/instance"] == m.metadata.name
        assert md["labels"]["app.kubernetes.io/managed-by"] == "treepipe-operator"
        assert md["ownerReferences"][0]["uid"] == UID
        assert md["ownerReferences"][0]["kind"] == "TreePipeline"
        assert md["annotations"][HASH_ANNOTATION] == object_hash(o)
    assert all("ownerReferences" not in o["metadata"] for o in render(m))


def test_stages_follow_the_plan():
    m = load_manifest([p for p in EXAMPLES if "70b" in p.name][0])
    p = plan(m)
    objs = render(m, owner_uid=UID)
    sts = by_kind(objs, "StatefulSet")
    assert len(sts) == len(p.stages) == 8
    for st, s in zip(sts, p.stages, strict=True):
        pod = st["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TREEPIPE_LAYERS"] == f"{s.layers[0]}-{s.layers[1]}"
        assert pod["nodeSelector"]["topology.kubernetes.io/zone"] == s.rack
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == HEALTH_PORT
        assert st["spec"]["serviceName"] == st["metadata"]["name"]
    headless = [s for s in by_kind(objs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 8 + 1  # one per stage, one for the draft
    draft = next(d for d in by_kind(objs, "Deployment") if d["metadata"]["name"].endswith("draft"))
    dpod = draft["spec"]["template"]["spec"]
    assert dpod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L40"
    assert dpod["nodeSelector"]["topology.kubernetes.io/zone"] == p.stages[0].rack
    gw = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"].endswith("gateway"))
    assert gw["spec"]["type"] == "LoadBalancer" and gw["spec"]["ports"][0]["port"] == 50151
    # the gateway is probed as a process (liveness) and as a Redis client (readiness), not
    # on the pipeline: a re-plan that reloads shards for minutes must not restart it
    gwc = next(d for d in by_kind(objs, "Deployment")
               if d["metadata"]["name"].endswith("gateway"))["spec"]["template"]["spec"][
        "containers"][0]
    assert gwc["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    # service "": Redis reachable; on the plaintext health port, as gRPC is TLS here
    assert gwc["readinessProbe"]["grpc"] == {"port": HEALTH_PORT}
    assert any(d["metadata"]["name"].endswith("redis") for d in by_kind(objs, "Deployment"))


def test_plan_configmap_carries_spec_plan_and_endpoints():
    m = load_manifest(EXAMPLES[0])
    cm = by_kind(render(m), "ConfigMap")[0]
    cfg = json.loads(cm["data"]["pipeline.json"])
    assert cfg["plan"]["stages"][0]["layers"][0] == 0
    assert len(cfg["endpoints"]["stages"]) == len(cfg["plan"]["stages"])
    assert cfg["spec"]["draft"]["width"] == m.spec.draft.width


def test_external_redis_is_not_rendered_and_password_comes_from_the_secret():
    m = load_manifest([p for p in EXAMPLES if "external" in p.name][0])
    objs = render(m)
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]
    c = by_kind(objs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    names = [e["name"] for e in c["env"]]
    # the password is spliced into the URL by Kubernetes' $(VAR) expansion: defined first
    assert names.index("TREEPIPE_REDIS_PASSWORD") < names.index("TREEPIPE_REDIS_URL")
    assert env["TREEPIPE_REDIS_URL"]["value"] == (
        "redis://:$(TREEPIPE_REDIS_PASSWORD)@redis.shared.svc:6379/3")
    assert env["TREEPIPE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-auth", "key": "password"}
    draft = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"].endswith("draft")]
    assert "nvidia.com/gpu" not in json.dumps(draft[0]["spec"]["template"]["spec"]["containers"])


def test_cpu_pipeline_asks_for_no_gpu():
    objs = render(load_manifest([p for p in EXAMPLES if p.name == "local.yaml"][0]))
    assert "nvidia.com/gpu" not in to_yaml(objs)


def test_hash_changes_with_the_spec():
    d = yaml.safe_load(EXAMPLES[0].read_text())
    a = {o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION]
         for o in render(validate_manifest(d))}
    d["spec"]["image"] = "ghcr.io/treepipe/treepipe:0.2.0"
    b = {o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION]
         for o in render(validate_manifest(d))}
    changed = {n for n in a if a[n] != b[n]}
    assert changed and all("redis" not in n for n in changed)  # redis has its own image


def test_port_zero_cannot_be_rendered():
    d = yaml.safe_load([p for p in EXAMPLES if p.name == "local.yaml"][0].read_text())
    d["spec"]["gateway"]["port"] = 0
    with pytest.raises(ManifestError, match="spec.gateway.port"):
        render(validate_manifest(d))


def test_cli_render_prints_multi_document_yaml():
    path = [p for p in EXAMPLES if "70b" in p.name][0]
    cp = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "render", "-f", str(path)],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    docs = list(yaml.safe_load_all(cp.stdout))
    assert len(docs) == len(render(load_manifest(path)))
    assert "&id" not in cp.stdout  # no YAML anchors
    # no Secret in the output (it is for review and git); stderr says how to make each
    assert not [d for d in docs if d["kind"] == "Secret"]
    redis, links = cp.stderr.splitlines()
    assert ("kubectl -n treepipe create secret generic llama-70b-redis-auth "
            "--from-literal=password=") in redis
    assert "treepipe link-keys" in links and "llama-70b-link-keys --from-file=" in links


def test_container_command_lines_parse_with_the_runtime_cli():
    # the pods run the runtime's own subcommands: every rendered argv must parse
    from orchestrator.cli.main import build_parser

    parser = build_parser()
    for path in EXAMPLES:
        m = load_manifest(path)
        p = plan(m)
        for o in render(m):
            tmpl = o.get("spec", {}).get("template")
            if not tmpl or o["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
                continue
            c = tmpl["spec"]["containers"][0]
            assert c["command"] == ["treepipe"]
            ns = parser.parse_args(c["args"])
            assert callable(ns.func)
            if c["name"] == "stage":
                i = int(o["metadata"]["labels"]["treepipe.io/stage"])
                assert c["args"][c["args"].index("--layers") + 1] == "{}:{}".format(
                    *p.stages[i].layers)
                assert ("--next" in c["args"]) == (i + 1 < len(p.stages))
            if c["name"] == "draft":
                assert "-stage-0-0." in c["args"][c["args"].index("--next") + 1]


def test_adaptive_width_has_the_front_stages_measure_their_forward_time(tmp_path: Path):
    # the draft's adaptive width prices levels by the front stages' published curves: only
    # they measure, up to the rows they can hold; the draft gets adaptive (in its config,
    # the plan ConfigMap's config.json); both parse
    from orchestrator.cli.main import build_parser
    from orchestrator.cli.pipeline_config import resolve_pipeline
    from tests.pod_config import local_config_args

    d = yaml.safe_load([p for p in EXAMPLES if p.name == "local.yaml"][0].read_text())
    d["spec"]["draft"]["adaptive"] = True
    m = validate_manifest(d)
    rows = (m.spec.draft.width + 1) * m.spec.limits.concurrency
    objs = render(m)

    def with_config(args: list[str]) -> argparse.Namespace:
        """The pod's parsed arguments with its mounted config applied, as at its start."""
        ns = build_parser().parse_args(local_config_args(args, objs, tmp_path))
        resolve_pipeline(ns)
        return ns

    args = {o["metadata"]["name"]: c["args"] for o in objs
            if o.get("spec", {}).get("template")
            and "args" in (c := o["spec"]["template"]["spec"]["containers"][0])}
    stages = sorted((n, a) for n, a in args.items() if a[0] == "stage")
    assert len(stages) == len(plan(m).stages) > 1
    for i, (_, a) in enumerate(stages):
        last = i == len(stages) - 1
        assert ("--profile-rows" in a) != last
        if not last:
            assert a[a.index("--profile-rows") + 1] == str(rows)
            assert a[a.index("--profile-requests") + 1] == str(m.spec.limits.concurrency)
            assert build_parser().parse_args(a).profile_requests == m.spec.limits.concurrency
        assert callable(build_parser().parse_args(a).func)
    (draft,) = [a for a in args.values() if a[:2] == ["draft", "serve"]]
    assert with_config(draft).adaptive
    d["spec"]["draft"]["adaptive"] = False
    fixed = [c.get("args", []) for o in render(validate_manifest(d))
             if o.get("spec", {}).get("template")
             for c in o["spec"]["template"]["spec"]["containers"]]
    assert not any("--profile-rows" in a or "--profile-requests" in a or "--adaptive" in a
                   for a in fixed)


def test_early_exit_recovery_renders_its_token_channel(tmp_path: Path):
    # draft.recovery early-exit:J:K: stage J (stage{J-1}) sends its exit candidates to the
    # draft service, which binds the data port behind its Service; both parse with their
    # mounted config, and an exit stage at or past the stage count is refused in one line
    from orchestrator.cli.main import build_parser
    from orchestrator.cli.pipeline_config import resolve_pipeline
    from orchestrator.cli.worker_commands import check_exit_stage
    from protocol.errors import TreepipeError
    from tests.pod_config import local_config_args

    d = yaml.safe_load([p for p in EXAMPLES if p.name == "local.yaml"][0].read_text())
    d["spec"]["draft"]["recovery"] = "early-exit:2:8"
    m = validate_manifest(d)
    objs = render(m)
    args = {o["metadata"]["name"]: c["args"] for o in objs
            if o.get("spec", {}).get("template")
            and "args" in (c := o["spec"]["template"]["spec"]["containers"][0])}
    name = m.metadata.name
    draft = args[f"{name}-draft"]
    listen = draft[draft.index("--listen") + 1]
    (svc,) = [o for o in objs
              if o["kind"] == "Service" and o["metadata"]["name"] == f"{name}-draft"]
    assert listen.endswith(f":{svc['spec']['ports'][-1]['port']}")
    assert svc["spec"]["ports"][-1]["name"] == "data"
    stages = {n: a for n, a in args.items() if a[0] == "stage"}
    senders = [a for a in stages.values() if "--exit-to" in a]
    assert len(senders) == 1 and senders[0][senders[0].index("--name") + 1] == "stage1"
    assert senders[0][senders[0].index("--exit-to") + 1].startswith(f"{name}-draft.")
    for a in [draft, *stages.values()]:
        ns = build_parser().parse_args(local_config_args(a, objs, tmp_path))
        resolve_pipeline(ns)
        assert ns.recovery == "early-exit:2:8"
        if a[0] == "stage":
            check_exit_stage(ns)
    d["spec"]["draft"]["recovery"] = "early-exit:3:8"
    d["spec"]["stages"] = {"count": 3}
    with pytest.raises(TreepipeError, match="spec.draft.recovery early-exit:3:8: the exit "
                                            "stage must be 1..2 with 3 stages"):
        render(validate_manifest(d))
    # by hand: --exit-to on another stage, or without early-exit, is one line naming it
    for rec, who, to, why in [("early-exit:2:8", "stage0", "h:1", "stage1 .* and only it"),
                              ("early-exit:2:8", "stage1", None, "stage1 .*takes --exit-to"),
                              ("draft:8", "stage1", "h:1", "drop --exit-to")]:
        with pytest.raises(TreepipeError, match=why):
            check_exit_stage(argparse.Namespace(recovery=rec, name=who, exit_to=to))
    # the exit stage reads its vocabulary file before any weights: a missing one is one
    # line; +draft (the draft's proposals) cannot run there, which the manifest refuses
    with pytest.raises(TreepipeError, match="--recovery early-exit:2:8\\+vocab=/nonexistent"):
        check_exit_stage(argparse.Namespace(recovery="early-exit:2:8+vocab=/nonexistent",
                                            name="stage1", exit_to="h:1"))
    d["spec"]["draft"]["recovery"] = "early-exit:1:8+draft"
    with pytest.raises(ManifestError, match="\\+draft runs in process only"):
        validate_manifest(d)
