"""``treepipe up``, ``down``, ``scale`` and ``status``: the argv side of running a pipeline.

A local pipeline is the launcher's (orchestrator/deploy/launcher.py); ``scale`` and
``status`` address a TreePipeline in a cluster too (orchestrator/deploy/cluster.py),
imported only when a command goes there, since it loads the kubernetes client.
"""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import positive_int, positive_seconds
from orchestrator.deploy.launcher import (
    choose_backend,
    down_local,
    read_state,
    scale_local,
    status_local,
    supervisor_alive,
    up_local,
)
from protocol.errors import TreepipeError


def cmd_up(a: argparse.Namespace) -> int:
    """``treepipe up -f FILE [--detach]``."""
    return up_local(a.file, a.detach, a.timeout)


def cmd_down(a: argparse.Namespace) -> int:
    """``treepipe down NAME`` / ``down -f FILE``."""
    return down_local(a.name, a.file)


def cmd_scale(a: argparse.Namespace) -> int:
    """``treepipe scale NAME --stages N`` on the backend that runs NAME."""
    if _backend(a) == "kubernetes":
        return cmd_scale_cluster(a)
    return scale_local(a.name, a.stages, a.timeout, wait=not a.no_wait)


def cmd_status(a: argparse.Namespace) -> int:
    """``treepipe status NAME`` on the backend that runs NAME."""
    if _backend(a) == "kubernetes":
        return cmd_status_cluster(a)
    return status_local(a.name, as_json=a.json)


def cmd_scale_cluster(a: argparse.Namespace) -> int:
    """``treepipe scale NAME --stages N --backend kubernetes [-n NS] [--context C] [--no-wait]``."""
    from orchestrator.deploy.cluster import scale_cluster

    return scale_cluster(a.name, a.stages, float(a.timeout), a.context, a.namespace,
                         wait=not a.no_wait)


def cmd_status_cluster(a: argparse.Namespace) -> int:
    """``treepipe status NAME --backend kubernetes [-n NS] [--context C] [--json]``."""
    from orchestrator.deploy.cluster import status_cluster

    return status_cluster(a.name, a.context, a.namespace, as_json=a.json)


def _backend(a: argparse.Namespace) -> str:
    """``--backend``, else the one that runs NAME; refuses cluster flags for a local one."""
    from orchestrator.deploy.cluster import kube_credentials_available

    st = read_state(a.name)
    local_running = bool(st) and supervisor_alive(st)
    backend = choose_backend(a.backend, local_running, kube_credentials_available())
    if backend == "local" and (a.namespace or a.context):
        raise TreepipeError("-n/--namespace and --context address a cluster; the local "
                            f"pipeline {a.name!r} takes neither (or pass --backend kubernetes)")
    return backend


def add_launcher_parsers(sub: Any) -> None:
    """Register ``treepipe up``, ``down``, ``scale`` and ``status``."""
    u = sub.add_parser("up", help=COMMANDS["up"])
    u.add_argument("-f", "--file", required=True, help="TreePipeline manifest (YAML)")
    u.add_argument("--detach", action="store_true",
                   help="return once the gateway is healthy; print its HOST:PORT")
    u.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds --detach waits for the pipeline to become healthy")
    u.set_defaults(func=cmd_up)
    d = sub.add_parser("down", help=COMMANDS["down"])
    d.add_argument("name", nargs="?", help="metadata.name of the pipeline")
    d.add_argument("-f", "--file", help="TreePipeline manifest (YAML), instead of NAME")
    d.set_defaults(func=cmd_down)
    s = sub.add_parser("scale", help=COMMANDS["scale"])
    s.add_argument("name", help="metadata.name of the pipeline")
    s.add_argument("--stages", type=positive_int, required=True, help="new stage count")
    s.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds to wait for the new stages to be up")
    _backend_args(s, scale=True)
    s.set_defaults(func=cmd_scale)
    t = sub.add_parser("status", help=COMMANDS["status"])
    t.add_argument("name", help="metadata.name of the pipeline")
    t.add_argument("--json", action="store_true")
    _backend_args(t, scale=False)
    t.set_defaults(func=cmd_status)


def _backend_args(p: argparse.ArgumentParser, scale: bool) -> None:
    p.add_argument("--backend", choices=("local", "kubernetes"), default=None,
                   help="where the pipeline runs (default: local when `treepipe up` runs "
                        "NAME on this machine, else kubernetes when credentials exist)")
    add_cluster_args(p, scale=scale)


def add_cluster_args(p: argparse.ArgumentParser, scale: bool = False) -> None:
    """Flags of the kubernetes backend: -n/--namespace, --context, and --no-wait for scale."""
    # resolved when the command runs, not here: reading kubeconfig while building the
    # parser would slow every treepipe command and fail those that never use a cluster
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace of the TreePipeline (default: the kubeconfig context's "
                        "namespace, else default)")
    p.add_argument("--context", default=None,
                   help="kubeconfig context (default: the current context)")
    if scale:
        p.add_argument("--no-wait", dest="no_wait", action="store_true",
                       help="return once the change is requested instead of waiting (up "
                            "to --timeout) for the new stages to be ready")
