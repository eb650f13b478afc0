"""Splitting a model's layers into pipeline stages."""

from __future__ import annotations


def even_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b) for ``stages`` stages, sizes differing by at most one.

    Earlier stages get the extra layers; the last stage already carries the LM head.
    """
    if stages < 1:
        raise ValueError(f"need at least one stage, got {stages}")
    if stages > n_layers:
        raise ValueError(f"{stages} stages for a model with {n_layers} layers; use at most "
                         f"{n_layers} stages")
    base, extra = divmod(n_layers, stages)
    bounds, a = [], 0
    for i in range(stages):
        b = a + base + (1 if i < extra else 0)
        bounds.append((a, b))
        a = b
    return bounds
