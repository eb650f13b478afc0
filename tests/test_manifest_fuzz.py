"""Seeded fuzzing of manifests: any value in any field plans or is refused as a
ManifestError (one line), never another exception (a traceback under `treepipe plan`).

Each case takes an example manifest and replaces one to three leaves (or adds a key)
with a value of a random kind: huge, negative, NaN, the wrong type, a nested structure,
odd text.  The seed is fixed, so a failure reproduces; raise FUZZ_CASES for a longer run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli.main import main
from orchestrator.deploy.host_fit import check_host_fit
from orchestrator.deploy.manifest import ManifestError, TreePipeline
from orchestrator.deploy.planner import GIB, plan_manifest
from tests.schema_strategies import from_schema, json_values

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "manifests" / "examples").glob("*.yaml"))
CASES = int(os.environ.get("FUZZ_CASES", "150"))


def leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every value in a parsed YAML tree (mappings and lists)."""
    out = [path] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += leaves(v, (*path, i))
    return out


def odd_value(rng: random.Random) -> Any:
    """A value of a random kind, often one no field accepts."""
    return rng.choice([
        lambda: rng.randint(-2**63, 2**63),
        lambda: rng.choice([0, -1, 1, 2**31, 2**64, 100000]),
        lambda: rng.choice([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5]),
        lambda: rng.choice(["", " ", "x" * 5000, "\u202e", "\ud800", "cuda", "cpu",
                            "layers:0", "replay:2", "../..", "24Gi", "-1Gi", "1e999"]),
        lambda: rng.choice([None, True, False]),
        lambda: [rng.randint(-5, 5) for _ in range(rng.randint(0, 3))],
        lambda: {"x": rng.randint(0, 9)},
        lambda: {"start": rng.randint(-3, 40), "end": rng.randint(-3, 40)},
    ])()


def mutate(data: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    d = copy.deepcopy(data)
    for _ in range(rng.randint(1, 3)):
        paths = leaves(d["spec"])  # again: a mutation may have replaced a subtree
        if not paths:
            break
        path = rng.choice(paths)
        node = d["spec"]
        for k in path[:-1]:
            node = node[k]
        if rng.random() < 0.15 and isinstance(node, dict):
            node[rng.choice(["bogus", "widht", path[-1]])] = odd_value(rng)
        else:
            node[path[-1]] = odd_value(rng)
    return d


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_any_value_plans_or_is_a_manifest_error(example: Path) -> None:
    base = yaml.safe_load(example.read_text())
    rng = random.Random(f"{example.stem}-7")
    refused = 0
    for i in range(CASES):
        d = mutate(base, rng)
        try:
            m, p = plan_manifest(d, "fuzz")
            check_host_fit(m, p, host_bytes=lambda: 64 * GIB, gpu_bytes=lambda: 80 * GIB)
        except ManifestError as e:
            refused += 1
            assert "\n" not in str(e), (i, d["spec"], str(e))
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            pytest.fail(f"case {i}: {type(e).__name__}: {e}\n{d['spec']}")
    assert refused > CASES // 4  # the mutations do reach the checks


# ---- hypothesis: manifests drawn from the schema, and broken manifest files, through the
# command itself (`treepipe plan -f`): it prints a plan (rc 0) or one line (rc 2), never
# a traceback.  TREEPIPE_FUZZ_EXAMPLES sets the examples per test (docs/reliability.md).
HYPOTHESIS = settings(max_examples=int(os.environ.get("TREEPIPE_FUZZ_EXAMPLES", "60")),
                      deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCHEMA = TreePipeline.model_json_schema()
TEXTS = {p.stem: p.read_text() for p in EXAMPLES}


def plan_file(path: Path, text: bytes) -> tuple[int, str, str]:
    """``treepipe plan -f path`` run in process on ``text``: rc, stdout, stderr.  An
    exception out of main() is what the console script would print as a traceback."""
    path.write_bytes(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["plan", "-f", str(path)])
        except SystemExit as e:  # argparse's usage errors
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def check_plan(path: Path, text: bytes) -> bool:
    """A plan, or one line naming the problem with rc 2; True when refused."""
    rc, out, err = plan_file(path, text)
    if rc == 0:
        assert out.startswith("pipeline ") and not err, (out, err)
        return False
    assert rc == 2 and err.startswith("treepipe: error: ") and err.count("\n") == 1, (rc, err)
    assert "Traceback" not in err and not out, err
    return True


SPEC = SCHEMA["$defs"]["TreePipelineSpec"]["properties"]


ODD = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, math.nan, math.inf, -math.inf, 1e308, -0.0,
                     "", "x" * 300, "\ud800", "1e999", None, True, [], {}]),
    json_values())


@st.composite
def schema_manifests(draw: st.DrawFn) -> dict[str, Any]:
    """An example manifest with one to three spec sections drawn from the schema (the
    rest as the example has them, so that the plan gets past the model's source), and
    half the time one value in it, drawn or not, set to an odd one (huge, NaN, inf,
    a wrong type)."""
    base = yaml.safe_load(TEXTS[draw(st.sampled_from(sorted(TEXTS)))])
    keys = draw(st.lists(st.sampled_from(sorted(SPEC)), min_size=1, max_size=3, unique=True))
    spec = {**base["spec"], **{k: draw(from_schema(SPEC[k], SCHEMA["$defs"])) for k in keys}}
    if draw(st.booleans()):
        paths = [p for p in leaves(spec) if isinstance(p[-1], str)]
        path = draw(st.sampled_from(paths))
        node = spec
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = draw(ODD)
    return {**base, "spec": spec}


YAML_EDITS = st.sampled_from([
    "dup-line", "cut", "bytes", "tab", "alias-bomb", "deep", "python-tag", "two-docs",
    "huge-number", "surrogate", "not-a-mapping"])


def edit(text: str, kind: str, at: int, junk: bytes) -> bytes:
    """``text`` broken by one kind of edit near line ``at``."""
    lines = text.splitlines(keepends=True)
    i = at % len(lines)
    if kind == "dup-line":  # a key twice (or a list item twice)
        lines.insert(i, lines[i])
    elif kind == "cut":
        return text[:at % (len(text) + 1)].encode()
    elif kind == "bytes":  # invalid UTF-8 among others
        return "".join(lines[:i]).encode() + junk + "".join(lines[i:]).encode()
    elif kind == "tab":
        lines[i] = "\t" + lines[i]
    elif kind == "alias-bomb":
        lines.append("x0: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
            f"x{n}: &{chr(98 + n)} [*{chr(97 + n)}, *{chr(97 + n)}, *{chr(97 + n)}, "
            f"*{chr(97 + n)}, *{chr(97 + n)}, *{chr(97 + n)}, *{chr(97 + n)}]\n"
            for n in range(9)))
    elif kind == "deep":
        depth = (300, 1000)[at % 2]  # within PyYAML's recursion, and past it
        lines.insert(i, "  deep: " + "[" * depth + "]" * depth + "\n")
    elif kind == "python-tag":
        lines.insert(i, "  x: !!python/object/apply:os.system ['true']\n")
    elif kind == "two-docs":
        lines.append("---\n" + text)
    elif kind == "huge-number":  # past 2^64, past float, past int()'s 4300 digits
        lines[i] = lines[i].rstrip("\n") + "9" * (20, 400, 5000)[at % 3] + "\n"
    elif kind == "surrogate":
        lines[i] = lines[i].replace(": ", ': "\\ud800"  # ', 1)
    elif kind == "not-a-mapping":
        return b"- " + text.encode()
    return "".join(lines).encode()


def test_plan_command_on_schema_manifests(tmp_path: Path) -> None:
    """Manifests whose spec sections come from the manifest's JSON schema."""
    refused = Counter[bool]()

    @HYPOTHESIS
    @given(data=schema_manifests())
    def one(data: dict[str, Any]) -> None:
        refused[check_plan(tmp_path / "m.yaml", yaml.safe_dump(data).encode())] += 1

    one()
    assert refused[True] and refused[False], refused  # both ends are reached


def test_plan_command_on_broken_manifest_files(tmp_path: Path) -> None:
    """Example files broken as text: duplicate keys, cuts, stray bytes, tabs, alias
    bombs, deep nesting, Python tags, two documents, huge numbers, lone surrogates."""
    refused = Counter[bool]()

    @HYPOTHESIS
    @given(name=st.sampled_from(sorted(TEXTS)), kind=YAML_EDITS,
           at=st.integers(0, 10_000), junk=st.binary(min_size=1, max_size=8))
    def one(name: str, kind: str, at: int, junk: bytes) -> None:
        refused[check_plan(tmp_path / "m.yaml", edit(TEXTS[name], kind, at, junk))] += 1

    one()
    assert refused[True] > refused[False], refused  # most breaks are refused


LOCAL = TEXTS["local"]


@pytest.mark.parametrize("text, words", [
    # found by the fuzz above; each was a traceback under `treepipe plan`
    (LOCAL.replace("contextLength: 2048", "contextLength: 2048" + "9" * 400),  # OverflowError
     "spec.limits.contextLength: must be <= 2147483647, got 20489999999"),
    (LOCAL.replace("    count: 3\n", "    count: 3\n    layers: []\n"),  # IndexError
     "spec.stages.layers: is empty; list one range per stage"),
    (LOCAL.replace("concurrency: 4", "concurrency: 4" + "0" * 5000),  # ValueError of int()
     "line 29: an integer of 5001 digits; no field takes one that long"),
    (LOCAL.replace("source: ngram", "source: layers:" + "9" * 5000),  # ValueError of int()
     "spec.draft.source: 'layers:999999999999999999999999999999999'... is not layers:N"),
    (LOCAL.replace("source: smollm2-135m", "source: " + "x" * 300),  # OSError of is_dir
     "spec.model.source: cannot look at 'xxxxxxxxxx"),
    (LOCAL.replace("source: ngram", "source: /" + "x" * 300),  # the same, for the draft
     "spec.draft.source: cannot look at '/xxxxxxxxx"),
    (LOCAL.replace("  model:\n", '  model:\n    "bad\\nkey": 1\n'),  # a two-line error
     "spec.model['bad\\nkey']: unknown field"),
    (LOCAL + "  memory:\n    runtimeMib: .inf\n",  # OverflowError (inf MiB in bytes)
     "spec.memory.runtimeMib: must be a finite number, got inf; set a number"),
    (LOCAL + "  memory:\n    runtimeMib: 1.7e302\n",  # a 300-digit GiB figure
     "spec.memory.runtimeMib: must be <= 1048576"),
])
def test_what_the_fuzz_found_is_one_line(tmp_path: Path, text: str, words: str) -> None:
    rc, out, err = plan_file(tmp_path / "m.yaml", text.encode())
    assert rc == 2 and words in err and err.count("\n") == 1 and len(err) < 400, err
