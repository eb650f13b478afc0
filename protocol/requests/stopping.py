"""When a request ends: the one stop rule of every executor and the runtime's last stage."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

EndReason = Literal["eos", "length"]


def end_reason(token: int, committed: int, max_new: int,
               stop_ids: Collection[int]) -> EndReason | None:
    """Why a request ends once ``token`` is committed as its ``committed``-th generated
    token: ``'eos'`` for one of its ``stop_ids``, ``'length'`` at ``max_new`` tokens;
    None while it goes on."""
    if token in stop_ids:
        return "eos"
    if committed >= max_new:
        return "length"
    return None
