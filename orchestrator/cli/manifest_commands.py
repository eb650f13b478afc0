"""``treepipe plan``, ``treepipe render``, ``treepipe crd`` and ``treepipe manifest-docs``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from orchestrator.cli.command_help import COMMANDS
from orchestrator.deploy.crd import crd_yaml, reference_markdown
from orchestrator.deploy.host_fit import check_host_fit
from orchestrator.deploy.manifest import ManifestError
from orchestrator.deploy.planner import Planned, format_plan, load_planned
from orchestrator.deploy.render import (
    link_secret,
    link_secret_command,
    redis_secret,
    redis_secret_command,
    render,
    to_yaml,
)


def _manifest(path: str) -> Planned:
    """The manifest at ``path`` and its plan, computed once for the whole command."""
    return load_planned(path)


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Name the file in a ManifestError that names none (rendering's, after loading)."""
    def run(a: argparse.Namespace) -> int:
        try:
            return fn(a)
        except ManifestError as e:
            if e.origin is not None:  # loading and planning name the file already
                raise
            where = str(getattr(a, "file", "manifest"))
            raise ManifestError(f"{where}: {e}", origin=where) from None
    return run


def cmd_plan(a: argparse.Namespace) -> int:
    """Print the plan of a manifest as a table (or JSON)."""
    m, p = _manifest(a.file)
    check_host_fit(m, p)  # a local pipeline runs here: what would only OOM under up
    print(json.dumps(p.to_dict(), indent=2) if a.json else format_plan(p))
    return 0


def cmd_render(a: argparse.Namespace) -> int:
    """Print the Kubernetes objects of a manifest as multi-document YAML.

    The embedded Redis's Secret is never printed: the output is meant for review and
    version control, and re-applying a generated password would change it under a
    running Redis.  The operator creates it; stderr says how to create it by hand.
    """

    m, p = _manifest(a.file)
    print(to_yaml(render(m, the_plan=p)), end="")
    secret = redis_secret(m)
    if secret is not None:
        print(f"treepipe: note: Secret {secret['metadata']['name']} (the Redis password) is not "
              f"in this output; the operator creates it when missing; without the operator "
              f"create it once: {redis_secret_command(m)}", file=sys.stderr)
    print(f"treepipe: note: Secret {link_secret(m)['metadata']['name']} (the stage links' "
          f"keys) is not in this output; the operator creates it when missing; without the "
          f"operator create it once: {link_secret_command(m)}", file=sys.stderr)
    return 0


def cmd_crd(a: argparse.Namespace) -> int:
    """Print the TreePipeline CustomResourceDefinition."""

    print(crd_yaml(), end="")
    return 0


def cmd_manifest_docs(a: argparse.Namespace) -> int:
    """Print the manifest reference (Markdown) generated from the schema."""

    print(reference_markdown(), end="")
    return 0


def add_manifest_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the manifest subcommands on the ``treepipe`` parser."""
    p = sub.add_parser("plan", help=COMMANDS["plan"])
    p.add_argument("-f", "--file", required=True, help="TreePipeline YAML file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_guard(cmd_plan))

    r = sub.add_parser("render", help=COMMANDS["render"])
    r.add_argument("-f", "--file", required=True, help="TreePipeline YAML file")
    r.set_defaults(func=_guard(cmd_render))

    c = sub.add_parser("crd", help=COMMANDS["crd"])
    c.set_defaults(func=_guard(cmd_crd))

    d = sub.add_parser("manifest-docs", help=COMMANDS["manifest-docs"])
    d.set_defaults(func=_guard(cmd_manifest_docs))
