"""The architecture in the import graph: no cycles, and device and wire code never reach up.

Every import counts, including those inside functions: a deferred import still ties
the modules together, and a cycle among them is a design knot however it is spelled.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "stages", "protocol")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an import names (``a.b.c`` may be module ``a.b``'s attribute c)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports, anywhere in its body."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path}: relative import; write the absolute module path")
            else:
                continue
            deps.update(r for n in names if (r := _resolve(n, mods)) and r != mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_cycle_and_function_level_imports(tmp_path: Path) -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    # cli.main imports the command modules; a module's function-level imports count too
    assert "orchestrator.cli.pipeline_commands" in graph["orchestrator.cli.main"]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("layer", ["stages", "protocol"])
def test_device_and_wire_code_never_import_the_control_plane(layer: str) -> None:
    bad = {m: sorted(d for d in deps if d.startswith("orchestrator"))
           for m, deps in import_graph().items() if m.split(".")[0] == layer}
    assert not {m: d for m, d in bad.items() if d}


def test_protocol_imports_no_device_code() -> None:
    """Wire formats sit below the device code: stages import protocol, never the reverse."""
    bad = {m: sorted(d for d in deps if d.startswith("stages"))
           for m, deps in import_graph().items() if m.startswith("protocol")}
    assert not {m: d for m, d in bad.items() if d}


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _package(mod: str) -> str:
    """The orchestrator subpackage a module belongs to (``orchestrator.lab``), or the
    module itself for a top-level one (``orchestrator.__main__``)."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def package_graph(root: str = "orchestrator") -> dict[str, set[str]]:
    """``root``'s subpackage -> the other subpackages its modules import (top-level
    modules such as ``__main__``, the console entry point, are no subpackage)."""
    graph: dict[str, set[str]] = {}
    for mod, deps in import_graph().items():
        if mod.count(".") < 1 or not mod.startswith(root + ".") or _is_top_module(mod):
            continue
        pkg = _package(mod)
        graph.setdefault(pkg, set()).update(
            _package(d) for d in deps
            if d.startswith(root + ".") and not _is_top_module(d) and _package(d) != pkg)
    return graph


def _is_top_module(mod: str) -> bool:
    return mod.count(".") == 1 and (ROOT / (mod.replace(".", "/") + ".py")).is_file()


def test_no_import_runs_back_up_between_orchestrator_subpackages() -> None:
    """The subpackages stack: cli on top (it imports everything, nothing imports it), then
    the lab, deploy, serving and models.  No two of them import each other."""
    graph = package_graph()
    assert {"orchestrator.cli", "orchestrator.lab", "orchestrator.deploy"} <= graph.keys()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, set())})
    assert not pairs, "two-way package imports: " + "; ".join(" <-> ".join(p) for p in pairs)
    found = cycles({p: deps & graph.keys() for p, deps in graph.items()})
    assert not found, "package cycles: " + "; ".join(" -> ".join(c) for c in found)
    assert not {p for p, deps in graph.items() if "orchestrator.cli" in deps}


def test_the_device_subpackages_stack() -> None:
    """stages/: the runtime over speculation over the model; none imports one above it."""
    graph = package_graph("stages")
    assert {"stages.model", "stages.speculation", "stages.runtime"} <= graph.keys()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, set())})
    assert not pairs, "two-way package imports: " + "; ".join(" <-> ".join(p) for p in pairs)
    assert not graph["stages.model"] and graph["stages.speculation"] == {"stages.model"}


def test_the_serving_path_never_imports_the_lab() -> None:
    """What serves requests (gateway, workers, deploy, the serve/up/gateway/worker
    commands, stages, protocol) stands without benchmarks or draft training."""
    serving_cli = {"orchestrator.cli.serve", "orchestrator.cli.pipeline_commands",
                   "orchestrator.cli.gateway_commands", "orchestrator.cli.worker_commands"}
    graph = import_graph()
    roots = serving_cli | {m for m in graph if m.split(".")[0] in ("stages", "protocol")
                           or m.startswith(("orchestrator.serving", "orchestrator.deploy"))}
    # everything the serving path reaches, directly or not
    seen, todo = set(roots), list(roots)
    while todo:
        for d in graph[todo.pop()]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    lab = sorted(m for m in seen if m.startswith("orchestrator.lab"))
    assert not lab, f"the serving path reaches the lab: {lab}"
    assert all(m in graph for m in serving_cli)  # a rename here must not pass vacuously


def test_argparse_lives_only_in_the_cli() -> None:
    """Libraries take typed arguments; only orchestrator/cli parses a command line."""
    bad = []
    for mod, path in _modules().items():
        if mod == "orchestrator.cli" or mod.startswith("orchestrator.cli."):
            continue
        for node in ast.walk(_parsed(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "argparse" for n in names):
                bad.append(mod)
    assert not bad, f"argparse outside orchestrator/cli: {sorted(set(bad))}"
