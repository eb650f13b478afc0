"""What every benchmark plot shares: a headless pyplot, and one way to save a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed); imported on first use,
    since only the plotting commands need matplotlib and it is slow to import."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig: Any, path: Path | str) -> None:
    """Lay ``fig`` out, write it to ``path`` at 110 dpi and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
