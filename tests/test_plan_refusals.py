"""`plan` and `up` refuse what cannot run, in one line naming the field and the fix.

Before these checks a manifest with ``draft.width: 100000`` planned fine and then had
its stages OOM-killed under ``up``; ``kvTokens: 1``, an unknown draft source and
``device: cuda`` without a GPU only showed up as "crash looping"; a duplicate YAML
key was silently dropped and a non-UTF-8 file gave a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deploy.host_fit import MARGIN, check_host_fit, host_memory_bytes
from orchestrator.deploy.manifest import ManifestError, load_manifest
from orchestrator.deploy.planner import GIB, budget_tokens, load_planned, plan_manifest

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
LOCAL = EXAMPLES / "local.yaml"


def local(**changes: object) -> dict:
    """manifests/examples/local.yaml with ``changes`` ("draft.width": 4) applied."""
    d = yaml.safe_load(LOCAL.read_text())
    for path, value in changes.items():
        node = d["spec"]
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return d


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TREEPIPE_CACHE=os.environ.get("TREEPIPE_CACHE", ""))
    if not env["TREEPIPE_CACHE"]:
        env.pop("TREEPIPE_CACHE")
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def one_line_error(cp: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "Traceback" not in cp.stderr and not cp.stdout, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, cp.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def write(tmp_path: Path, d: dict, name: str = "m.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(d))
    return f


# ---- the device's memory -------------------------------------------------------------------

def test_a_huge_width_is_refused_by_plan_and_up(tmp_path: Path) -> None:
    f = write(tmp_path, local(**{"draft.width": 100000}))
    one_line_error(cli("plan", "-f", str(f)), "spec.draft.width", "host RAM", "lower draft.width")
    one_line_error(cli("up", "-f", str(f)), "spec.draft.width", "host RAM")


def test_the_host_check_adds_up_every_process_with_a_margin() -> None:
    m, p = load_planned(LOCAL)
    need = sum(s.memory.total for s in p.stages) + p.draft.memory.total
    check_host_fit(m, p, host_bytes=lambda: 100 * GIB)
    with pytest.raises(ManifestError, match=r"GiB of host RAM .* usable; "):
        # the estimate itself fits, but not with the margin and the processes' own memory
        check_host_fit(m, p, host_bytes=lambda: int(need / (1 - MARGIN / 2)))
    assert 0 < host_memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_estimate_counts_activations() -> None:
    small = plan_manifest(local()).plan.stages[0].memory
    wide = plan_manifest(local(**{"draft.width": 64})).plan.stages[0].memory
    assert small.activations > 0 and wide.activations > 1.5 * small.activations
    # a GPU's memory-efficient attention holds no scores: less than a CPU's math path
    gpu = plan_manifest(local(**{"stages.device": {"type": "cuda"}})).plan.stages[0].memory
    assert 0 < gpu.activations < small.activations
    assert small.total == small.weights + small.kv + small.tree + small.runtime + small.activations


def test_cuda_without_a_gpu_names_the_device_field() -> None:
    m, p = plan_manifest(local(**{"stages.device": {"type": "cuda"}}))
    with pytest.raises(ManifestError, match=r"^spec.stages.device.type: cuda, but this machine "
                                            r"has no CUDA GPU.*set it to cpu"):
        check_host_fit(m, p, gpu_bytes=lambda: None)
    d = local(**{"stages.overrides": [{"stage": 1, "device": {"type": "cuda"}}]})
    m, p = plan_manifest(d)
    with pytest.raises(ManifestError, match=r"^spec.stages.overrides\[0\].device.type: cuda"):
        check_host_fit(m, p, gpu_bytes=lambda: None)
    # a GPU too small for the stages on it
    with pytest.raises(ManifestError, match="GiB of GPU 0"):
        check_host_fit(m, p, gpu_bytes=lambda: 2**20)
    check_host_fit(m, p, gpu_bytes=lambda: 80 * GIB)


def test_a_cluster_manifest_is_not_checked_against_this_machine() -> None:
    d = local(**{"stages.device": {"type": "cuda"}, "draft.width": 100000})
    d["spec"]["backend"] = "kubernetes"
    d["spec"]["gateway"]["httpPort"] = 8000
    m, p = plan_manifest(d)
    check_host_fit(m, p, host_bytes=lambda: 1, gpu_bytes=lambda: None)


# ---- the KV budget and the draft source ---------------------------------------------------

def test_kv_tokens_below_one_request_is_refused(tmp_path: Path) -> None:
    one_line_error(cli("plan", "-f", str(write(tmp_path, local(**{"memory.kvTokens": 1})))),
                   "spec.memory.kvTokens: 1", "raise it to at least")
    d = local()
    need = budget_tokens(1, d["spec"]["limits"]["contextLength"], d["spec"]["stages"]["count"],
                         d["spec"]["draft"]["width"])
    plan_manifest(local(**{"memory.kvTokens": need}))  # exactly one request: fine


@pytest.mark.parametrize("source", ["ngramm", "Ngram", "layers", "meta-llama"])
def test_an_unknown_draft_source_is_refused(tmp_path: Path, source: str) -> None:
    one_line_error(cli("plan", "-f", str(write(tmp_path, local(**{"draft.source": source})))),
                   f"spec.draft.source: unknown draft source {source!r}", "ngram, hybrid")


def test_a_hybrid_needs_a_draft_model() -> None:
    with pytest.raises(ManifestError, match="spec.draft.model: 'ngram' is a source"):
        plan_manifest(local(**{"draft.source": "hybrid", "draft.model": "ngram"}))


@pytest.mark.parametrize("source", ["ngram", "none", "layers:4", "replay:0.8",
                                    "replay:0.5-0.9:64", "smollm2-135m"])
def test_known_draft_sources_plan(source: str) -> None:
    plan_manifest(local(**{"draft.source": source}))


def test_a_local_draft_path_must_exist(tmp_path: Path) -> None:
    m, p = plan_manifest(local(**{"draft.source": str(tmp_path / "nope")}))
    with pytest.raises(ManifestError, match=r"spec.draft.source: .* does not exist on this"):
        check_host_fit(m, p)
    (tmp_path / "nope").mkdir()
    check_host_fit(m, p)


# ---- the file itself -----------------------------------------------------------------------

def test_duplicate_keys_are_an_error_with_the_line(tmp_path: Path) -> None:
    text = LOCAL.read_text().replace("    width: 16\n", "    width: 16\n    width: 100000\n")
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    line = text.splitlines().index("    width: 100000") + 1
    with pytest.raises(ManifestError, match=rf"line {line}: duplicate key 'width' \(first at "
                                            rf"line {line - 1}\); keep one"):
        load_manifest(f)
    one_line_error(cli("plan", "-f", str(f)), "duplicate key 'width'")
    # the same key in two different mappings is fine
    yaml_ok = tmp_path / "ok.yaml"
    yaml_ok.write_text(LOCAL.read_text())
    load_manifest(yaml_ok)


@pytest.mark.parametrize("command", ["plan", "up", "render"])
def test_invalid_utf8_is_one_line(tmp_path: Path, command: str) -> None:
    f = tmp_path / "latin1.yaml"
    f.write_bytes(LOCAL.read_bytes().replace(b"# A tiny", b"# A t\xefny"))
    one_line_error(cli(command, "-f", str(f)), "latin1.yaml: line 1: not UTF-8", "save the "
                   "manifest as UTF-8")


def test_every_example_still_plans() -> None:
    for f in sorted(EXAMPLES.glob("*.yaml")):
        cp = cli("plan", "-f", str(f))
        assert cp.returncode == 0, (f, cp.stderr)


@pytest.mark.parametrize("name,content,needle", [
    ("deep.yaml", b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ("nul.yaml", b"a\x00b", "nul.yaml: not valid YAML (unacceptable character"),
])
def test_hostile_files_are_one_line(tmp_path: Path, name: str, content: bytes,
                                    needle: str) -> None:
    f = tmp_path / name
    f.write_bytes(content)
    one_line_error(cli("plan", "-f", str(f)), needle)
