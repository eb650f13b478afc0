"""Logging of the pipeline's processes (stage, draft service, gateway): INFO lines on
stderr, each naming its process, which the launcher collects in the run folder."""

from __future__ import annotations

import logging
import sys


def log_to_stderr(name: str) -> None:
    """Log INFO and above to stderr, each line naming the process."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
