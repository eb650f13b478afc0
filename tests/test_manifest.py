"""TreePipeline manifests: defaults, round trips, and one-line errors naming field and fix."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deploy.manifest import (
    DEFAULT_GATEWAY_PORT,
    ManifestError,
    TreePipeline,
    load_manifest,
    parse_quantity,
    validate_manifest,
)
from orchestrator.deploy.planner import plan_manifest
from stages.model.execution_modes import host_has_bf16_units

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
LOCAL = EXAMPLES / "local.yaml"
BIG = EXAMPLES / "llama-70b-two-racks.yaml"


def raw(path: Path = LOCAL) -> dict:
    return yaml.safe_load(path.read_text())


def test_local_example_has_what_the_runtime_reads():
    m = load_manifest(LOCAL)
    assert m.metadata.name == "local"
    s = m.spec
    assert (s.model.source, s.model.dtype) == ("smollm2-135m", "float32")
    assert s.stages.stage_count == 3
    assert (s.draft.source, s.draft.width, s.draft.topk) == ("ngram", 16, 8)
    assert s.transport == "zmq" and s.synchronizer.mode == "embedded"
    assert s.gateway.port == DEFAULT_GATEWAY_PORT and s.backend == "local"
    assert (s.limits.context_length, s.limits.max_new_tokens, s.limits.concurrency) == (
        2048, 256, 4)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", "bfloat16" if host_has_bf16_units() else "float32"), ("cuda", "bfloat16")])
def test_the_default_dtype_is_what_measured_fastest_on_the_stages_device(device, dtype):
    data = raw()
    del data["spec"]["model"]["dtype"]
    data["spec"]["stages"]["device"] = {"type": device}
    assert validate_manifest(data).spec.model.dtype == dtype
    data["spec"]["model"]["dtype"] = "float64"  # a named dtype is kept
    assert validate_manifest(data).spec.model.dtype == "float64"


def test_kubernetes_cpu_stages_default_to_float32_whatever_this_machines_cpu(monkeypatch):
    """The operator validates on its own node, not the stages': auto stays float32 there."""
    import stages.model.execution_modes as modes

    monkeypatch.setattr(modes, "host_has_bf16_units", lambda: True)
    data = raw()
    del data["spec"]["model"]["dtype"]
    data["spec"]["stages"]["device"] = {"type": "cpu"}
    assert validate_manifest(data).spec.model.dtype == "bfloat16"  # local: this machine
    data["spec"]["backend"] = "kubernetes"
    assert validate_manifest(data).spec.model.dtype == "float32"


def test_minimal_manifest_gets_sane_defaults():
    m = validate_manifest({"apiVersion": "treepipe.io/v1alpha1", "kind": "TreePipeline",
                           "metadata": {"name": "tiny"}})
    assert m.spec.backend == "local" and m.spec.transport == "zmq"
    assert m.spec.model.source == "smollm2-135m" and m.spec.stages.stage_count == 3
    assert m.spec.stages.count == 3  # filled in: the runtime and `kubectl scale` read it
    assert m.spec.draft.width >= 1 and m.spec.draft.topk >= 1


def test_round_trip_through_yaml():
    for path in (LOCAL, BIG):
        m = load_manifest(path)
        again = TreePipeline.model_validate(yaml.safe_load(yaml.safe_dump(m.to_yaml_dict())))
        assert again == m


def test_snake_case_in_python_camel_case_in_yaml():
    m = load_manifest(BIG)
    assert m.spec.gateway.service_type == "LoadBalancer"
    assert m.spec.placement.racks[0].node_selector == {"topology.kubernetes.io/zone": "rack-a"}
    dumped = m.to_yaml_dict()["spec"]
    assert "serviceType" in dumped["gateway"] and "contextLength" in dumped["limits"]


def _set(path: str, value):
    """A mutation setting a dotted path (list indices as numbers) in the local example."""
    def mutate(d: dict) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in keys[:-1]:
            d = d[k]
        if value is _DELETE:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return mutate


_DELETE = object()
TWO_RACKS = [{"name": "a", "capacity": 2}, {"name": "b", "capacity": 2}]

BAD = [
    # (mutation, substrings the one-line message must contain)
    (_set("spec.trnsport", "zmq"), ["spec.trnsport", "unknown field", "did you mean 'transport'"]),
    (_set("spec.stages.cuont", 3), ["spec.stages.cuont", "unknown field", "'count'"]),
    (_set("spec.stages.count", 31), ["spec.stages.count", "30 layers", "at most 30"]),
    (_set("spec.draft.width", 0), ["spec.draft.width", ">= 1", "got 0"]),
    (_set("spec.draft.topk", -2), ["spec.draft.topk", ">= 1"]),
    (_set("spec.transport", "tcp"), ["spec.transport", "'tcp'", "'zmq'", "'grpc'"]),
    (_set("spec.stages.overrides", [{"stage": 1, "rack": "c"}]),
     ["spec.stages.overrides[0].rack", "unknown rack 'c'", "placement.racks"]),
    (_set("spec.draft.rack", "nowhere"), ["spec.draft.rack", "unknown rack"]),
    (_set("spec.stages.device", {"type": "cpu", "memory": "100Mi"}),
     ["spec.stages.device.memory", "stage 0", "needs", "short", "100Mi"]),
    (_set("spec.stages", {"layers": [{"start": 0, "end": 10}, {"start": 12, "end": 30}]}),
     ["spec.stages.layers[1].start", "contiguous"]),
    (_set("spec.stages", {"layers": [{"start": 0, "end": 10}, {"start": 10, "end": 29}]}),
     ["spec.stages.layers[1].end", "30 layers"]),
    (_set("spec.stages", {"layers": [{"start": 5, "end": 3}]}), ["spec.stages.layers[0].end"]),
    (_set("spec.stages.overrides", [{"stage": 3}]), ["spec.stages.overrides[0].stage", "3 stages"]),
    (_set("spec.synchronizer", {"mode": "external"}), ["spec.synchronizer.url", "redis://"]),
    (_set("spec.synchronizer", {"url": "redis://r:6379"}), ["spec.synchronizer.mode", "external"]),
    (_set("spec.backend", "slurm"), ["spec.backend", "'local'", "'kubernetes'"]),
    (_set("spec.gateway.port", 70000), ["spec.gateway.port", "<= 65535"]),
    (_set("spec.model.dtype", "int4"), ["spec.model.dtype", "bfloat16"]),
    (_set("spec.model.quantize", "int4"), ["spec.model.quantize", "'none'", "'int8'"]),
    (_set("spec.draft.source", "layers:0"), ["spec.draft.source", "layers:N"]),
    (_set("spec.draft.source", "layers:30"), ["spec.draft.source", "1 <= N < 30"]),
    (_set("spec.draft.source", "replay:0.9-0.5"), ["spec.draft.source", "replay:P-Q", "P < Q"]),
    (_set("spec.limits.maxNewTokens", 4096), ["spec.limits.maxNewTokens", "contextLength"]),
    (_set("spec.stages.device.memory", "24GB"), ["spec.stages.device.memory", "24GB"]),
    (_set("metadata.name", "Bad_Name"), ["metadata.name", "Bad_Name"]),
    (_set("metadata", _DELETE), ["metadata", "missing"]),
    (_set("kind", "Deployment"), ["kind", "TreePipeline"]),
    (_set("apiVersion", "treepipe.io/v2"), ["apiVersion", "treepipe.io/v1alpha1"]),
    (_set("spec.model.architecture", {"name": "gpt-5"}),
     ["spec.model.architecture.name", "gpt-5", "llama-3.1-70b"]),
    # a wrong type is what the CRD refuses too: named with what the field takes
    (_set("spec.stages.count", True), ["spec.stages.count must be an integer, got True"]),
    (_set("spec.stages.count", 3.5), ["spec.stages.count must be an integer, got 3.5"]),
    (_set("spec.draft.topk", "8"), ["spec.draft.topk must be an integer, got '8'",
                                    "without quotes"]),
    (_set("spec.draft.adaptive", "true"), ["spec.draft.adaptive must be true or false",
                                           "without quotes"]),
    (_set("spec.memory", {"runtimeMib": "256"}), ["spec.memory.runtimeMib must be a number"]),
    (_set("spec.model.source", 5), ["spec.model.source must be a string, got 5; quote it"]),
    (_set("metadata.name", "a" * 53), ["metadata.name has 53 characters; use at most 40"]),
    (_set("spec.model.source", ""), ["spec.model.source is empty; give a value"]),
]


@pytest.mark.parametrize("mutate,needles", BAD, ids=[n[0] for _, n in BAD])
def test_bad_manifest_names_field_and_fix(mutate, needles):
    d = raw()
    mutate(d)
    with pytest.raises(ManifestError) as e:
        plan_manifest(d)  # schema check, then the plan
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_rack_capacity_shortfall_and_duplicates():
    d = raw()
    d["spec"]["stages"]["device"] = {"type": "cuda"}
    d["spec"]["placement"] = {"racks": [{"name": "a", "capacity": 1}, {"name": "b",
                                                                        "capacity": 1}]}
    with pytest.raises(ManifestError, match=r"spec.placement.racks: .*needs 3 .*short 1"):
        plan_manifest(d)  # schema check, then the plan
    d["spec"]["placement"]["racks"][1]["name"] = "a"
    with pytest.raises(ManifestError, match=r"spec.placement.racks: 'a' is listed twice"):
        validate_manifest(d)


def test_kubernetes_backend_needs_a_fixed_gateway_port():
    d = raw(BIG)
    d["spec"]["gateway"]["port"] = 0
    with pytest.raises(ManifestError, match="spec.gateway.port: 0"):
        validate_manifest(d)
    d = raw()
    d["spec"]["gateway"]["port"] = 0  # fine locally: the launcher picks a free port
    assert validate_manifest(d).spec.gateway.port == 0


def test_file_errors_are_one_line(tmp_path):
    cases = {
        "missing.yaml": None,
        "broken.yaml": "spec:\n  a: 1\n b: 2\n",
        "two.yaml": "metadata: {name: a}\n---\nmetadata: {name: b}\n",
        "list.yaml": "- 1\n- 2\n",
    }
    for name, text in cases.items():
        p = tmp_path / name
        if text is not None:
            p.write_text(text)
        with pytest.raises(ManifestError) as e:
            load_manifest(p)
        assert "\n" not in str(e.value) and name in str(e.value)
    with pytest.raises(ManifestError, match="line 3"):
        load_manifest(tmp_path / "broken.yaml")


def test_quantities():
    assert parse_quantity("24Gi") == 24 * 2**30
    assert parse_quantity("500m") == 0.5
    with pytest.raises(ManifestError):
        parse_quantity("24 GB")


def test_explicit_layers_and_count_must_agree():
    d = raw()
    d["spec"]["stages"] = {"layers": [{"start": 0, "end": 12}, {"start": 12, "end": 30}]}
    assert validate_manifest(d).spec.stages.count == 2
    d["spec"]["stages"] = {"count": 2, "layers": [{"start": 0, "end": 30}]}
    with pytest.raises(ManifestError, match="spec.stages.count: is 2 but layers lists 1"):
        validate_manifest(d)


def test_cli_plan_bad_file_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    d = raw()
    d["spec"]["draft"]["width"] = 0
    bad.write_text(yaml.safe_dump(d))
    cp = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "plan", "-f", str(bad)],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2, cp.stderr
    assert "Traceback" not in cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "spec.draft.width" in lines[0], cp.stderr
    assert lines[0].count(str(bad)) == 1, cp.stderr  # the file is named once, not twice
    missing = tmp_path / "missing.yaml"
    cp = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "plan", "-f",
                         str(missing)], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2 and cp.stderr.count(str(missing)) == 1, cp.stderr


def test_cli_names_the_file_once_however_it_is_spelled(tmp_path, monkeypatch, capsys):
    # loading names the file itself (normalised); a rendering error gets the -f argument,
    # even when that text happens to occur in the message ("e" in "spec")
    from orchestrator.cli.main import main

    monkeypatch.chdir(tmp_path)
    d = raw()
    d["spec"]["draft"]["width"] = 0
    Path("bad.yaml").write_text(yaml.safe_dump(d))
    d = raw()
    d["spec"]["gateway"]["port"] = 0  # fine locally, not for Kubernetes
    Path("e").write_text(yaml.safe_dump(d))
    capsys.readouterr()
    for argv, err in [
        (["plan", "-f", "./bad.yaml"], "bad.yaml: spec.draft.width: must be >= 1"),
        (["render", "-f", "./missing.yaml"], "cannot read manifest missing.yaml: "),
        (["render", "-f", "e"], "e: spec.gateway.port: 0 (pick a free port)"),
    ]:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith(f"treepipe: error: {err}"), argv


def test_deepcopy_independent():
    # the models are plain data: a copy can be edited without touching the original
    m = load_manifest(LOCAL)
    c = copy.deepcopy(m)
    c.spec.draft.width = 4
    assert m.spec.draft.width == 16


WRONG_TYPES = [("stages", "count", True), ("stages", "count", 3.5), ("draft", "topk", "8"),
               ("draft", "adaptive", "yes"), ("limits", "concurrency", "2"),
               ("memory", "runtimeMib", "256"), ("gateway", "insecure", 0)]


@pytest.mark.parametrize("section,field,value", WRONG_TYPES,
                         ids=[f"{s}.{f}={v!r}" for s, f, v in WRONG_TYPES])
def test_what_the_crd_refuses_the_schema_refuses(section, field, value):
    """`plan` accepts nothing `kubectl apply` would refuse: no value of another type."""
    import jsonschema

    from orchestrator.deploy.crd import openapi_schema

    d = raw()
    d["spec"].setdefault(section, {})[field] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(openapi_schema()).validate(d)
    with pytest.raises(ManifestError, match=f"spec.{section}.{field} must be "):
        validate_manifest(d)


def test_yamls_own_types_still_load(tmp_path):
    """Numbers, booleans and text as YAML writes them (YAML 1.2's 1e3 a number, as kubectl
    reads it) load into the strict schema; a quoted number is text, refused."""
    p = tmp_path / "m.yaml"
    p.write_text(LOCAL.read_text() + "  memory:\n    runtimeMib: 1e3\n"
                 "  placement:\n    links:\n      withinRack: {latencyUs: 20, "
                 "bandwidthGbps: 6.4e1}\n")
    m = load_manifest(p)
    assert m.spec.memory.runtime_mib == 1000.0
    assert m.spec.placement.links.within_rack.latency_us == 20.0
    assert m.spec.placement.links.within_rack.bandwidth_gbps == 64.0
    assert m.spec.stages.count == 3 and m.spec.draft.adaptive is False
    p.write_text(p.read_text().replace("runtimeMib: 1e3", 'runtimeMib: "1e3"'))
    with pytest.raises(ManifestError, match="runtimeMib must be a number, got '1e3'"):
        load_manifest(p)  # text, as the CRD's type: number refuses it
