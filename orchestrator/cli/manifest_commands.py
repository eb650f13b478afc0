"""``treepipe plan``, ``treepipe render``, ``treepipe crd`` and ``treepipe manifest-docs``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from orchestrator.deploy.manifest import ManifestError
from orchestrator.deploy.planner import Planned, format_plan, load_planned


def _manifest(path: str) -> Planned:
    """The manifest at ``path`` and its plan, computed once for the whole command."""
    # ConfigError, not orchestrator.cli.main.CliError: under `python -m orchestrator.cli.main` the
    # CLI module is __main__ and would not catch the class imported from orchestrator.cli.main.
    from stages.speculation.engine import ConfigError

    try:
        return load_planned(path)
    except ManifestError as e:
        raise ConfigError(str(e)) from None


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a ManifestError raised after loading (planning, rendering) into a one-line error."""
    def run(a: argparse.Namespace) -> int:
        from stages.speculation.engine import ConfigError

        try:
            return fn(a)
        except ManifestError as e:
            raise ConfigError(f"{getattr(a, 'file', 'manifest')}: {e}") from None
    return run


def cmd_plan(a: argparse.Namespace) -> int:
    """Print the plan of a manifest as a table (or JSON)."""
    p = _manifest(a.file).plan
    print(json.dumps(p.to_dict(), indent=2) if a.json else format_plan(p))
    return 0


def cmd_render(a: argparse.Namespace) -> int:
    """Print the Kubernetes objects of a manifest as multi-document YAML."""
    from orchestrator.deploy.render import render, to_yaml

    m, p = _manifest(a.file)
    print(to_yaml(render(m, the_plan=p)), end="")
    return 0


def cmd_crd(a: argparse.Namespace) -> int:
    """Print the TreePipeline CustomResourceDefinition."""
    from orchestrator.deploy.crd import crd_yaml

    print(crd_yaml(), end="")
    return 0


def cmd_manifest_docs(a: argparse.Namespace) -> int:
    """Print the manifest reference (Markdown) generated from the schema."""
    from orchestrator.deploy.crd import reference_markdown

    print(reference_markdown(), end="")
    return 0


def add_manifest_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the manifest subcommands on the ``treepipe`` parser."""
    p = sub.add_parser("plan", help="plan a TreePipeline manifest: layers, memory, racks")
    p.add_argument("-f", "--file", required=True, help="TreePipeline YAML file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_guard(cmd_plan))

    r = sub.add_parser("render", help="print the Kubernetes objects of a manifest")
    r.add_argument("-f", "--file", required=True, help="TreePipeline YAML file")
    r.set_defaults(func=_guard(cmd_render))

    c = sub.add_parser("crd", help="print the TreePipeline CustomResourceDefinition")
    c.set_defaults(func=_guard(cmd_crd))

    d = sub.add_parser("manifest-docs", help="print the manifest reference (Markdown)")
    d.set_defaults(func=_guard(cmd_manifest_docs))
