"""A stage's measured forward time against the rows it computes (the paper's Figure 9).

On a CPU the curve is far from a line: up to a few rows the matmuls read the weights
in one cheap pass (:func:`~stages.model.model.linear`), then the time jumps to the
small-matrix kernels' level, stays nearly flat for a while and rises with the rows.
A cost model fitted as a line to the node counts it happens to visit cannot see such
steps; one measured curve can (:class:`~stages.speculation.width.StepCost`).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterable, Sequence

import torch

from stages.model.model import Segment, StageShard

PROFILE_PREFIX = 64  # committed rows each profiled request holds (its attention's share)
_measured: weakref.WeakKeyDictionary[StageShard, dict[int, float]] = weakref.WeakKeyDictionary()


def profile_sizes(max_rows: int) -> list[int]:
    """Row counts to measure up to ``max_rows``: every count up to 8 (the steps are
    there), then about 25 % apart."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n = n + 1 if n < 8 else max(n + 1, round(n * 1.25))
    return [*sizes, max(max_rows, 1)]


def forward_seconds(shard: StageShard, sizes: Iterable[int], reps: int = 5) -> dict[int, float]:
    """Median seconds of one packed forward of ``n`` tree rows for each ``n`` in
    ``sizes`` (one request with a short committed prefix). Remembered per shard: asked
    again for sizes it already has, it measures nothing."""
    return _measure([shard], sizes, reps)[0]


def _measure(shards: Sequence[StageShard], sizes: Iterable[int],
             reps: int) -> list[dict[int, float]]:
    """:func:`forward_seconds` for several shards. The sizes are timed
    in rounds, each round one forward of every (shard, size), and the median taken per
    size: a slow spell of the machine (another tenant) then lands in one round of all
    sizes alike instead of bending the curve where it fell."""
    sizes = sorted(set(sizes))
    done = [_measured.setdefault(s, {}) for s in shards]
    # a shard missing any size has every size timed again, in the same rounds: sizes
    # from two sessions would join a fast spell's times to a slow one's (a B = 1 run's
    # curve up to 9 rows, then B = 8's beyond) and bend the curve where they meet
    stale = [k for k, d in enumerate(done) if any(n not in d for n in sizes)]
    if stale:
        caches = {k: shards[k].new_cache(PROFILE_PREFIX + sizes[-1]) for k in stale}
        for k, c in caches.items():
            shards[k].forward_packed(_rows(shards[k], PROFILE_PREFIX),
                                     torch.arange(PROFILE_PREFIX), [Segment(c, PROFILE_PREFIX)])
        none = torch.zeros(0, dtype=torch.long)
        times: dict[tuple[int, int], list[float]] = {(k, n): [] for k in stale for n in sizes}
        for rnd in range(reps + 1):  # the first round a warm-up (cold weights)
            for k, n in times:
                shard, cache = shards[k], caches[k]
                seg = Segment(cache, n, torch.ones(n, n, dtype=torch.bool).tril(),
                              torch.arange(n))
                x, pos = _rows(shard, n), torch.arange(PROFILE_PREFIX, PROFILE_PREFIX + n)
                t = time.perf_counter()
                shard.forward_packed(x, pos, [seg])
                if x.device.type == "cuda":
                    torch.cuda.synchronize(x.device)
                if rnd:
                    times[k, n].append(time.perf_counter() - t)
                cache.keep(none)
        for (k, n), ts in times.items():
            done[k][n] = statistics.median(ts)
        for c in caches.values():
            c.release()
    return [{n: d[n] for n in sizes} for d in done]


def _rows(shard: StageShard, n: int) -> torch.Tensor:
    """``n`` input rows for ``shard``: token ids for the first stage, hidden rows after."""
    p = next(shard.parameters())
    if shard.embed_tokens is not None:
        return torch.zeros(n, dtype=torch.long, device=p.device)
    return torch.zeros(n, shard.args.dim, dtype=p.dtype, device=p.device)


class Curve:
    """A measured, non-decreasing T(rows): linear between the measured counts, and past
    the last one along its last segment."""

    def __init__(self, points: Sequence[tuple[int, float]]):
        if not points:
            raise ValueError("a curve needs at least one measured point")
        xs, ys, top = [], [], 0.0
        for n, s in sorted(points):
            top = max(top, s)  # more rows never cost less: a dip is noise
            xs.append(float(n))
            ys.append(top)
        self.xs, self.ys = xs, ys

    def __call__(self, n: float) -> float:
        xs, ys = self.xs, self.ys
        if n <= xs[0] or len(xs) == 1:
            return ys[0]
        i = next((j for j in range(1, len(xs)) if n <= xs[j]), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


def slowest(curves: Sequence[Sequence[tuple[int, float]]]) -> Curve:
    """The slowest of several stages' measured (rows, seconds) at every row count any of
    them measured (each read along its own curve between its points)."""
    fns = [Curve(pts) for pts in curves]
    return Curve([(n, max(f(n) for f in fns)) for n in sorted({n for c in curves for n, _ in c})])


def front_curve(shards: Sequence[StageShard], max_rows: int) -> Curve:
    """T(rows) of the slowest stage before the last, measured (one stage: that stage)."""
    front = shards[:-1] or shards
    sizes = profile_sizes(max_rows)
    per = _measure(front, sizes, reps=5)
    return slowest([[(n, p[n]) for n in sizes] for p in per])
