"""Seeded fuzzing of manifests: any value in any field plans or is refused as a
ManifestError (one line), never another exception (a traceback under `treepipe plan`).

Each case takes an example manifest and replaces one to three leaves (or adds a key)
with a value of a random kind: huge, negative, NaN, the wrong type, a nested structure,
odd text.  The seed is fixed, so a failure reproduces; raise FUZZ_CASES for a longer run.
"""

from __future__ import annotations

import copy
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.deploy.host_fit import check_host_fit
from orchestrator.deploy.manifest import ManifestError
from orchestrator.deploy.planner import GIB, plan_manifest

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
