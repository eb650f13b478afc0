"""One schema: the CRD and the manifest reference are generated from it and stay in sync."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.deploy.crd import crd, crd_yaml, openapi_schema, reference_markdown
from orchestrator.deploy.manifest import load_manifest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
K8S = "1.37.0"


def test_crd_file_in_sync_with_schema():
    assert (ROOT / "manifests" / "crd.yaml").read_text() == crd_yaml(), (
        "manifests/crd.yaml is stale; run: treepipe crd > manifests/crd.yaml")


def test_reference_doc_in_sync_with_schema():
    assert (ROOT / "docs" / "manifest-reference.md").read_text() == reference_markdown(), (
        "docs/manifest-reference.md is stale; run: treepipe manifest-docs > "
        "docs/manifest-reference.md")


def test_crd_passes_kubernetes_validate_strict():
    kubernetes_validate.validate(crd(), K8S, strict=True)


def _walk(node: dict, path: str = ""):
    yield path, node
    for k, v in node.get("properties", {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], path + "{}")


def test_crd_schema_is_structural():
    # structural: every node has a type, no refs/unions, properties xor additionalProperties
    for path, node in _walk(openapi_schema()):
        assert "type" in node, path
        for bad in ("$ref", "anyOf", "oneOf", "allOf", "const", "default", "title"):
            assert bad not in node, (path, bad)
        assert not ("properties" in node and "additionalProperties" in node), path
    meta = openapi_schema()["properties"]["metadata"]
    assert meta == {"type": "object"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate_against_crd_schema(path):
    # what the API server checks: the file as written, and with every default filled in
    schema = openapi_schema()
    jsonschema.Draft4Validator(schema).validate(yaml.safe_load(path.read_text()))
    jsonschema.Draft4Validator(schema).validate(load_manifest(path).to_yaml_dict())


def test_crd_schema_rejects_what_pydantic_rejects():
    schema = openapi_schema()
    bad = yaml.safe_load(EXAMPLES[0].read_text())
    bad["spec"]["draft"]["width"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(bad)
    bad["spec"]["draft"]["width"] = 4
    bad["spec"]["transport"] = "tcp"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(bad)


def test_scale_subresource_targets_stage_count():
    v = crd()["spec"]["versions"][0]
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.stages.count"
    assert "count" in v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "stages"]["properties"]
