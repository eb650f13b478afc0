"""Rack placement: put the pipeline chain draft → stage 0 → … → stage m-1 into racks.

The chain's links are the only traffic, so the fewest rack boundaries it crosses is
the fewest racks it touches with each rack holding one contiguous run of the chain.
``pack`` gets there by filling the largest racks first in chain order; pinned stages
(``stages.overrides[].rack``, ``draft.rack``) are honoured and the rest follow their
neighbours.  ``spread`` deals the chain round-robin over racks instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.deploy.manifest import ManifestError, PlacementSpec


@dataclass(frozen=True)
class Slot:
    """One unit to place: it takes a device slot of its rack when ``device`` is true."""

    name: str
    device: bool
    pinned: str | None = None


def place(p: PlacementSpec, stages: list[Slot],
          draft: Slot) -> tuple[list[str | None], str | None]:
    """Rack of every stage and of the draft (None everywhere when no racks are declared)."""
    if not p.racks:
        return [None] * len(stages), None
    chain = ([draft] if draft.device else []) + stages
    free = {r.name: r.capacity for r in p.racks}
    need = sum(s.device for s in chain)
    total = sum(free.values())
    if need > total:
        raise ManifestError(f"spec.placement.racks: the pipeline needs {need} device slots "
                            f"({len(stages)} stages{' + draft' if draft.device else ''}) but "
                            f"the racks hold {total} (short {need - total}); raise a rack's "
                            f"capacity, add a rack, or use fewer stages")
    where: list[str | None] = [None] * len(chain)
    for i, s in enumerate(chain):
        if s.pinned:
            if s.device and free[s.pinned] < 1:
                raise ManifestError(f"spec.placement.racks: rack {s.pinned!r} has capacity "
                                    f"for fewer units than are pinned to it ({s.name} does not "
                                    f"fit); raise its capacity or unpin a stage")
            where[i] = s.pinned
            free[s.pinned] -= s.device
    order = [r.name for r in sorted(p.racks, key=lambda r: -r.capacity)]  # stable: ties keep order
    if p.strategy == "spread":
        _spread(chain, where, free, [r.name for r in p.racks])
    else:
        _pack(chain, where, free, order)
    racks_of_stages = where[len(chain) - len(stages):]
    draft_rack = where[0] if draft.device else (draft.pinned or racks_of_stages[0])
    return racks_of_stages, draft_rack


def _pack(chain: list[Slot], where: list[str | None], free: dict[str, int],
          order: list[str]) -> None:
    """Fill in chain order, staying in the previous unit's rack while it has room."""
    for i, s in enumerate(chain):
        if where[i] is not None:
            continue
        prev = where[i - 1] if i else None
        nxt = next((where[j] for j in range(i + 1, len(chain)) if chain[j].pinned), None)
        candidates = [prev, nxt] + sorted(order, key=lambda r: -free[r])
        if not s.device:
            where[i] = next(c for c in candidates if c is not None)
            continue
        where[i] = next(c for c in candidates if c is not None and free[c] > 0)
        free[where[i]] -= 1


def _spread(chain: list[Slot], where: list[str | None], free: dict[str, int],
            order: list[str]) -> None:
    """Deal units round-robin over racks that still have room."""
    k = 0
    for i, s in enumerate(chain):
        if where[i] is not None:
            continue
        for _ in range(len(order)):
            r = order[k % len(order)]
            k += 1
            if free[r] > 0 or not s.device:
                where[i] = r
                free[r] -= s.device
                break
