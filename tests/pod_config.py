"""A rendered pod's ``--config`` on this machine: the ConfigMap's file, where the pod
would have it mounted, written to a test folder instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.deploy.render import CONFIG_FILE, CONFIG_KEY


def local_config_args(args: list[str], objs: list[dict[str, Any]], folder: Path) -> list[str]:
    """``args`` of a rendered container with ``--config`` naming the plan ConfigMap's
    config.json, written into ``folder`` (what the mount gives the pod)."""
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    local = folder / CONFIG_KEY
    local.write_text(cm["data"][CONFIG_KEY])
    return [str(local) if a == CONFIG_FILE else a for a in args]
