"""A stage's measured forward time against the rows it computes (the paper's Figure 9).

On a CPU the curve is far from a line: up to a few rows the matmuls read the weights
in one cheap pass (:func:`~stages.model.model.linear`), then the time jumps to the
small-matrix kernels' level, stays nearly flat for a while and rises with the rows.
A cost model fitted as a line to the node counts it happens to visit cannot see such
steps; one measured curve can (:class:`~protocol.scheduling.width.StepCost`).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from stages.model.kv_cache import StageCache
from stages.model.model import Segment, StageShard

PROFILE_PREFIX = 64  # committed rows each profiled request holds (its attention's share)
# per shard: requests in the forward -> rows -> median seconds
_measured: weakref.WeakKeyDictionary[StageShard, dict[int, dict[int, float]]] = \
    weakref.WeakKeyDictionary()


def profile_sizes(max_rows: int) -> list[int]:
    """Row counts to measure up to ``max_rows``: every count up to 8 (the steps are
    there), then about 25 % apart."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n = n + 1 if n < 8 else max(n + 1, round(n * 1.25))
    return [*sizes, max(max_rows, 1)]


def profile_requests(max_requests: int) -> list[int]:
    """Request counts to measure up to ``max_requests``: 1, the powers of two, the most."""
    counts, r = [], 1
    while r < max_requests:
        counts.append(r)
        r *= 2
    return [*counts, max(max_requests, 1)]


def forward_seconds(shard: StageShard, sizes: Iterable[int], reps: int = 5) -> dict[int, float]:
    """Median seconds of one packed forward of ``n`` tree rows for each ``n`` in
    ``sizes`` (one request with a short committed prefix). Remembered per shard: asked
    again for sizes it already has, it measures nothing."""
    return forward_loads(shard, sizes, (1,), reps)[1]


def forward_loads(shard: StageShard, sizes: Iterable[int], requests: Sequence[int],
                  reps: int = 5) -> dict[int, dict[int, float]]:
    """:func:`forward_seconds` with the rows packed over each count in ``requests``:
    requests -> rows (from the count up) -> median seconds."""
    return _measure([shard], sizes, reps, requests)[0]


def _measure(shards: Sequence[StageShard], sizes: Iterable[int], reps: int,
             requests: Sequence[int] = (1,)) -> list[dict[int, dict[int, float]]]:
    """Per shard and request count r in ``requests``, the median seconds of one packed
    forward of ``n`` rows split evenly over r requests (each with a short committed
    prefix), for every ``n`` in ``sizes`` from r up. The sizes are timed
    in rounds, each round one forward of every (shard, r, size), and the median taken
    per size: a slow spell of the machine (another tenant) then lands in one round of
    all sizes alike instead of bending the curve where it fell."""
    sizes = sorted(set(sizes))
    done = [_measured.setdefault(s, {}) for s in shards]
    want = {r: [n for n in sizes if n >= r] or [r] for r in requests}
    # a (shard, r) missing any size has every size timed again, in the same rounds:
    # sizes from two sessions would join a fast spell's times to a slow one's (a B = 1
    # run's curve up to 9 rows, then B = 8's beyond) and bend the curve where they meet
    stale = [(k, r) for k, d in enumerate(done) for r in requests
             if any(n not in d.get(r, {}) for n in want[r])]
    if stale:
        caches = {(k, r): _prefixed(shards[k], r) for k, r in stale}
        none = torch.zeros(0, dtype=torch.long)
        times: dict[tuple[int, int, int], list[float]] = {
            (k, r, n): [] for k, r in stale for n in want[r]}
        for rnd in range(reps + 1):  # the first round a warm-up (cold weights)
            for k, r, n in times:
                shard, cache = shards[k], caches[k, r]
                per = [n // r + (i < n % r) for i in range(r)]
                segs = [Segment(c, e, torch.ones(e, e, dtype=torch.bool).tril(),
                                torch.arange(e)) for c, e in zip(cache, per, strict=True)]
                pos = torch.cat([torch.arange(PROFILE_PREFIX, PROFILE_PREFIX + e) for e in per])
                x = _rows(shard, n)
                t = time.perf_counter()
                shard.forward_packed(x, pos, segs)
                if x.device.type == "cuda":
                    torch.cuda.synchronize(x.device)
                if rnd:
                    times[k, r, n].append(time.perf_counter() - t)
                for c in cache:
                    c.keep(none)
        for (k, r, n), ts in times.items():
            done[k].setdefault(r, {})[n] = statistics.median(ts)
        for cache in caches.values():
            for c in cache:
                c.release()
    return [{r: {n: d[r][n] for n in want[r]} for r in requests} for d in done]


def _prefixed(shard: StageShard, r: int) -> list[StageCache]:
    """``r`` caches in one pool, each holding a committed prefix of ``PROFILE_PREFIX``."""
    pool = shard.new_pool(8, growable=True)
    caches = [StageCache.in_pool(pool) for _ in range(r)]
    shard.forward_packed(_rows(shard, r * PROFILE_PREFIX),
                         torch.arange(PROFILE_PREFIX).repeat(r),
                         [Segment(c, PROFILE_PREFIX) for c in caches])
    return caches


def _rows(shard: StageShard, n: int) -> torch.Tensor:
    """``n`` input rows for ``shard``: token ids for the first stage, hidden rows after."""
    p = next(shard.parameters())
    if shard.embed_tokens is not None:
        return torch.zeros(n, dtype=torch.long, device=p.device)
    return torch.zeros(n, shard.args.dim, dtype=p.dtype, device=p.device)


class Curve:
    """A measured, non-decreasing T(rows): linear between the measured counts, and past
    the last one along its last segment. Measured at one request count, it prices every
    count alike (``requests`` is ignored)."""

    def __init__(self, points: Sequence[tuple[int, float]]):
        if not points:
            raise ValueError("a curve needs at least one measured point")
        xs, ys, top = [], [], 0.0
        for n, s in sorted(points):
            top = max(top, s)  # more rows never cost less: a dip is noise
            xs.append(float(n))
            ys.append(top)
        self.xs, self.ys = xs, ys

    def __call__(self, n: float, requests: int | None = None) -> float:
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


class LoadCurve:
    """T(rows, requests): a :class:`Curve` per measured request count, linear between two
    counts, the nearest one outside them (and the one-request curve without a count)."""

    def __init__(self, curves: Mapping[int, Curve]):
        if not curves:
            raise ValueError("a load curve needs at least one request count")
        self.counts = sorted(curves)
        self.curves = dict(curves)

    def __call__(self, n: float, requests: int | None = None) -> float:
        counts = self.counts
        r = counts[0] if requests is None else min(max(requests, counts[0]), counts[-1])
        hi = next(c for c in counts if c >= r)
        if hi == r:
            return self.curves[hi](n)
        lo = max(c for c in counts if c < r)
        f = (r - lo) / (hi - lo)
        return (1 - f) * self.curves[lo](n) + f * self.curves[hi](n)


def front_curve(shards: Sequence[StageShard], max_rows: int,
                max_requests: int = 1) -> LoadCurve:
    """T(rows, requests) of the slowest stage before the last, measured up to
    ``max_rows`` rows and ``max_requests`` requests (one stage: that stage).

    Measured at several request counts, not one: a packed forward's attention runs per
    request, padded to the request with the most rows, so its time grows with the rows
    otherwise than one request's (SmolLM2, a front stage, 12 to 16 rows: +1.0-1.2 ms for
    one request, +0.85 ms for four), and a curve measured on one request priced wider
    trees under load dearer than they ran."""
    front = shards[:-1] or shards
    per = _measure(front, profile_sizes(max_rows), 5, profile_requests(max_requests))
    curve = slowest_load([{r: sorted(d.items()) for r, d in p.items()} for p in per])
    assert curve is not None  # every shard measured every count
    return curve


def slowest_load(loads: Sequence[Mapping[int, Sequence[tuple[int, float]]]]) -> LoadCurve | None:
    """The slowest of several stages' measured (rows, seconds) per count of requests
    (:func:`slowest`), at the counts every stage measured (None: no count in common)."""
    counts = set.intersection(*(set(d) for d in loads)) if loads else set()
    if not counts:
        return None
    return LoadCurve({r: slowest([d[r] for d in loads]) for r in sorted(counts)})
