"""Adaptive tree width under load: Eq. (1) generalised to many requests in one pipeline.

For one request, Eq. (1) trades the step time t(w) against the hit rate P(w):
a hit costs one step per token, a miss m (the refill).  Per step a request with
width w therefore verifies, in expectation,

    g(w) = 1 / (1 + (1 - P(w)) (m - 1))          tokens (Eq. (2) inverted),

and with B requests packed into one step the step costs T(N), N = the nodes of
the busiest stage (:meth:`AdaptiveWidth.stage_nodes`): each speculating request
puts a level of its width on every stage, and requests without speculation share
the stages with their roots.  :class:`AdaptiveWidth`
chooses every request's width each step to maximise the goodput

    sum_r g_r(w_r) / T(N(w)),

from two online estimates:

* **T(N)**, the modelled pipelined step time against the busiest stage's nodes
  (:class:`StepCost`): the slowest of the front stages, whose time is their measured
  forward time against rows and requests (:mod:`stages.model.step_profile`; the
  runtime's front stages publish theirs) or else a line in their
  nodes (a least-squares slope per node within each stage and each count of requests it
  held, so neither stages with different fixed costs nor the fixed cost each request
  adds pass for a cost per node), the last stage, whose roots and LM head do not grow
  with the width, and the draft (its own line), plus the link's transfer per node.
  Nodes are thus free while the last stage is the slowest, as it often is under load.
  The steps measured near the priced node count and request count weigh most: the
  curve is measured on a short prefix, between steps of a drifting machine.
* **P_r(w)**, each request's level hit rate at width w: its own recent rate at
  width 1 (an EWMA of "the verified token was the first candidate of its level",
  :meth:`~stages.speculation.step.TreeOwner.rank_of`), and of its misses the share
  that width w recovers for all requests together.  A token found only at rank
  2..w is rare, so a per-request EWMA of it (a few verifications' memory) is mostly
  0: with ties going to the narrower width that would bias every request narrow.
  The pooled share
  has a long memory across requests; every verification updates every width, not
  only the one in use.  A new request starts from the pooled estimate of the
  requests before it.  The pooled share starts from a prior that the misses seen
  soon outweigh (:meth:`AdaptiveWidth.recovered`).

Requests whose own rates differ by no more than their estimates' noise
(:meth:`AdaptiveWidth.alike`) get one common width, priced at the pooled rates:
alike requests verify most at alike widths, since the hit rate is concave in the
width, and the test cannot tell their own rates apart, so the pooled estimate, with
the longer memory, is the better one for each.

Width 0 is no speculation (the request runs as pp: its root alone crosses the
stages, one stage at a time).  Pipelined time is the busiest stage's, so a
lone request gains nothing from dropping to width 0; under load, m such requests
share what one speculating request of width 1 costs.  Widths change only which
proposals enter the tree; the target verifies every token, so any choice is
lossless.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from protocol.errors import TreepipeError
from protocol.scheduling.records import LinkModel, StepRecord

CostModel = Callable[[float], float]  # the busiest stage's nodes -> seconds per step
# the front stages' seconds against their rows and the requests packed in them (None:
# any count), e.g. stages.model.step_profile.LoadCurve
FrontCurve = Callable[[float, int | None], float]
# a wider choice must promise this much more goodput, or as much more as the priced step
# grows if that is less: the cost model's error is of that order, and near a tie the
# narrower tree does less work for the same tokens
WIDEN_MARGIN = 0.05
PRIOR = 5.0  # verifications the pooled width-1 rate weighs in a request's own (see rate)
# width-1 misses the prior share of them each width recovers weighs (see recovered)
RECOVERY_PRIOR = 1.0
# how far (a factor, either way) a recent step's node count and request count may lie
# from the priced ones and still speak for them (StepCost.__call__'s log-normal weights)
NEAR_NODES = 1.5
NEAR_REQUESTS = 1.25
# every width up to this is a candidate (candidate_widths); beyond it, powers of two
FINE_WIDTHS = 16


def candidate_widths(cap: int) -> tuple[int, ...]:
    """0 (no speculation), every width up to ``FINE_WIDTHS``, the powers of two beyond
    it, and ``cap``.

    Every width, not only the powers of two: the best node count per stage often lies
    between two powers, and with powers alone the policy reached it only by giving
    alike requests unlike widths, which ran them at different speeds, so they ended,
    and their successors' prompts joined, at different steps.  Beyond ``FINE_WIDTHS``
    the powers keep a choice's cost (requests times candidates per round) bounded."""
    ws = {0, cap, *range(1, min(cap, FINE_WIDTHS) + 1)}
    w = FINE_WIDTHS
    while w < cap:
        ws.add(w)
        w *= 2
    return tuple(sorted(ws))


def parse_width(text: str) -> int | str:
    """``"4"`` -> 4, ``"adaptive"`` -> ``"adaptive"``, ``"adaptive:16"`` kept as is."""
    t = text.strip()
    if t == "adaptive" or (t.startswith("adaptive:") and t[9:].isdigit() and int(t[9:]) >= 1):
        return t
    if t.isdigit() and int(t) >= 1:
        return int(t)
    raise TreepipeError(f"width {text!r} is neither a width >= 1 nor adaptive[:CAP]; "
                        "pass e.g. --widths 1,4,16,adaptive")


def adaptive_cap(policy: str, default: int) -> int:
    """The cap of a parsed ``adaptive[:CAP]`` (:func:`parse_width`): CAP, else ``default``."""
    return int(policy[9:]) if ":" in policy else default


class StepCost:
    """Online T(N): modelled step seconds against the busiest stage's nodes.

    A pipelined step lasts as long as its slowest participant. The stages before the
    last grow with the nodes; the last stage holds only the
    roots that arrived and runs the LM head on them, so its time follows the requests,
    not the width: T(N) = max(front(N), last, draft(N)) + links, with front(N) a measured
    curve when one is given and a fitted line otherwise. Under load the last
    stage is often the slowest, and nodes are then free up to where the front stages
    reach it; a single line through the steps cannot see that kink.
    """

    def __init__(self, link: LinkModel, node_bytes: int, window: int = 64,
                 front: FrontCurve | None = None):
        """``front``: the front stages' measured time against their rows and requests
        (:func:`~stages.model.step_profile.front_curve`), moved up or down to pass through
        the recent steps; without it, a line fitted to them."""
        self.link, self.node_bytes, self.front = link, node_bytes, front
        # predictions and fitted slopes since the last observation
        self._memo: dict[tuple[float, int | None], float] = {}
        self._fronts: dict[tuple[float, int | None], float] = {}
        self._slopes: tuple[float, float] | None = None
        self._capped: tuple[float, float] | None = None
        # once per observation: the recent steps as arrays with the front's error against
        # the curve (_Window); per request count, each step's log-weight for it and the
        # corrected front at its nodes (a choice prices dozens of node counts against
        # every step, so this work is done once per observation, not once per price)
        self._win: _Window | None = None
        self._req_logw: dict[int | None, np.ndarray] = {}
        self._front_steps: dict[int | None, np.ndarray] = {}
        # (front nodes, front busy s, last busy s, draft s, draft serial, step s, requests)
        self.steps: deque[tuple[int, float, float, float, bool, float, int]] = deque(
            maxlen=window)
        # per (stage index or -1 for the draft, requests it held): recent (nodes, busy
        # seconds); a slope within a group sees nodes change at a fixed request count
        self.pairs: dict[tuple[int, int], deque[tuple[int, float]]] = {}
        self.window = window

    def observe(self, rec: StepRecord) -> None:
        """Add one pipeline step's measurements."""
        if rec.serial or any(rec.prompt_rows):
            # a step carrying prompt chunks: their rows (and time) are the prefill's,
            # not the tree's, and would bias the per-node slope whatever the widths
            return
        self._memo.clear()
        self._fronts.clear()
        self._req_logw.clear()
        self._front_steps.clear()
        self._slopes = self._capped = self._win = None
        busy = [s + p for s, p in zip(rec.stage_s, rec.prune_s, strict=True)]
        front = slice(0, -1) if len(busy) > 1 else slice(0, 1)
        last = busy[-1] if len(busy) > 1 else 0.0
        reqs = rec.stage_requests or [0] * len(rec.stage_tokens)
        self.steps.append((max(rec.stage_tokens[front]), max(busy[front]), last, rec.draft_s,
                           rec.draft_serial, rec.pipelined_s(self.link), max(reqs)))
        for i, (n, b) in enumerate(zip(rec.stage_tokens, busy, strict=True)):
            if n:
                self.pairs.setdefault((i, reqs[i]), deque(maxlen=self.window)).append((n, b))
        if rec.draft_tokens:
            self.pairs.setdefault((-1, 0), deque(maxlen=self.window)).append(
                (rec.draft_tokens, rec.draft_s))

    @staticmethod
    def _slope(groups: Iterable[Sequence[tuple[int, float]]]) -> float:
        """Least-squares slope with one intercept per group, less two standard errors
        (0 without spread in n): on a noisy machine a slope the data do not support
        must not switch speculation off."""
        sxy = sxx = 0.0
        centred: list[tuple[float, float]] = []
        for g in groups:
            if len(g) < 2:
                continue
            mn = sum(n for n, _ in g) / len(g)
            ms = sum(s for _, s in g) / len(g)
            centred += [(n - mn, s - ms) for n, s in g]
        sxx = sum(x * x for x, _ in centred)
        if sxx <= 0 or len(centred) < 3:
            return 0.0
        sxy = sum(x * y for x, y in centred)
        b = sxy / sxx
        var = sum((y - b * x) ** 2 for x, y in centred) / (len(centred) - 2)
        return max(b - 2.0 * (var / sxx) ** 0.5, 0.0)

    def slopes(self) -> tuple[float, float]:
        """Seconds one more node adds to (the busiest front stage, the draft); fitted once
        per observation, however many node counts a choice prices."""
        if self._slopes is None:
            # the last stage holds only the roots that arrived: its cost follows the
            # verified tokens, not the width, so it stays out of the slope
            last = max((i for i, _ in self.pairs if i >= 0), default=0)
            stages = self._slope(q for (i, _), q in self.pairs.items()
                                 if 0 <= i < last or last == 0)
            self._slopes = (stages, self._slope([self.pairs.get((-1, 0), ())]))
        return self._slopes

    def __call__(self, n: float, requests: int | None = None) -> float:
        """Predicted step seconds with ``n`` nodes on the busiest front stage and
        ``requests`` in flight (0.0 before any step): each recent step replayed with its
        front stages (and draft) moved to ``n`` nodes and its last stage as it was, and
        the replays averaged. The max is taken per step, not of the means: when the
        front and the last stage run close, a step lasts the longer of two noisy times,
        which a max of means underrates.

        The front moves along the curve corrected by the steps measured near each
        count (:meth:`_front_at`), and steps with about ``requests`` in flight weigh
        most: the last stage's time follows the requests whose roots it holds.

        Before any step without prompt chunks, the measured curve alone (plus the link),
        or 0.0 without a curve: a batch's first steps all carry its prompts' chunks, and
        a model that priced every width at 0 s there would choose the widest for every
        request, trees the prefill's steps then pay for."""
        if not self.steps:
            if self.front is None:
                return 0.0
            return self.front(n, requests) + self.node_bytes / self.link.bandwidth_bytes_s * n
        key = (n, requests)
        if key in self._memo:
            return self._memo[key]
        b_draft = self._capped_slopes()[1]
        link = self.node_bytes / self.link.bandwidth_bytes_s
        x = self._window()
        # every step at once (numpy: a choice prices up to B x 16 node counts per step)
        if requests not in self._front_steps:
            self._front_steps[requests] = np.array(
                [self._front_at(float(v), requests) for v in x.nodes])
        f = x.front + self._front_at(n, requests) - self._front_steps[requests]
        d = x.draft + b_draft * (n - x.nodes)
        ran = np.maximum(f, x.last)
        now = np.where(x.serial, ran + d, np.maximum(ran, d))
        # what the compute leaves out of the step (links, the broadcast) stays
        preds = x.step - x.was + now + link * (n - x.nodes)
        self._memo[key] = _weighted_mean(preds, self._requests_logw(requests))
        return self._memo[key]

    def _window(self) -> _Window:
        """The recent steps as arrays, once per observation."""
        if self._win is None:
            self._win = _Window(self.steps, self._curve())
        return self._win

    def _requests_logw(self, requests: int | None) -> np.ndarray:
        """Each recent step's log-weight for a prediction at ``requests`` in flight (all
        alike without a count); once per observation and count."""
        if requests not in self._req_logw:
            x = self._window()
            self._req_logw[requests] = (np.zeros(len(x.nodes)) if requests is None
                                        else _near(requests, x.requests, NEAR_REQUESTS))
        return self._req_logw[requests]

    def _capped_slopes(self) -> tuple[float, float]:
        """:meth:`slopes`, each at most its part's mean busy time per mean node (fixed
        costs >= 0: a noisy slope must not make a bare step free); once per observation."""
        if self._capped is None:
            k = len(self.steps)
            mean_n = sum(x[0] for x in self.steps) / k
            stage, draft = self.slopes()
            if mean_n > 0:
                stage = min(stage, sum(x[1] for x in self.steps) / k / mean_n)
                draft = min(draft, sum(x[3] for x in self.steps) / k / mean_n)
            self._capped = (stage, draft)
        return self._capped

    def _curve(self) -> FrontCurve:
        """The front stages' time against nodes (and requests) before correction: the
        measured curve, or the fitted slope (no fixed cost: the steps' own times carry it)."""
        if self.front is not None:
            return self.front
        b = self._capped_slopes()[0]
        return lambda x, _requests: b * x

    def _front_at(self, n: float, requests: int | None) -> float:
        """The curve at ``n`` plus its error there: the recent steps' front time less the
        curve at their nodes (and requests), their median weighted toward nodes near
        ``n`` (and requests near ``requests``; a median, since a spike of the machine in
        a few steps is no cost of their node count, test_step_profile). A curve measured
        on one request misses the cost each request adds, one measured on short
        prefixes the longer attention, and the machine's speed drifts; an error taken
        near ``n`` follows those, where one mean error over the whole window does not."""
        key = (n, requests)
        if key not in self._fronts:
            x = self._window()
            logw = _near(n, x.nodes, NEAR_NODES) + self._requests_logw(requests)
            self._fronts[key] = self._curve()(n, requests) + _weighted_median(x.errs, logw)
        return self._fronts[key]


class _Window:
    """:attr:`StepCost.steps` as arrays, with each step's front error against the curve."""

    def __init__(self, steps: Iterable[tuple[int, float, float, float, bool, float, int]],
                 curve: FrontCurve):
        cols = list(zip(*steps, strict=True))
        self.nodes, self.front, self.last, self.draft = (np.array(c, dtype=float)
                                                         for c in cols[:4])
        self.serial = np.array(cols[4], dtype=bool)
        self.step, self.requests = np.array(cols[5]), np.array(cols[6], dtype=float)
        # the steps' compute as it was (the draft after the stages when serial)
        ran = np.maximum(self.front, self.last)
        self.was = np.where(self.serial, ran + self.draft, np.maximum(ran, self.draft))
        # against the curve at each step's own request count
        self.errs = self.front - np.array([curve(float(v), int(r) or None)
                                           for v, r in zip(self.nodes, self.requests,
                                                           strict=True)])


def _chi2_95(dof: int) -> float:
    """The 95th percentile of a chi-square with ``dof`` degrees of freedom
    (Wilson-Hilferty)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + 1.6449 * math.sqrt(h)) ** 3


def _weighted_mean(values: np.ndarray, logw: np.ndarray) -> float:
    """Mean of ``values`` weighted by exp(``logw``), stable for very negative weights."""
    weights = np.exp(logw - logw.max())
    return float(weights @ values / weights.sum())


def _weighted_median(values: np.ndarray, logw: np.ndarray) -> float:
    """The value at which ``values``' weights (exp(``logw``)) reach half their sum."""
    order = np.argsort(values)
    cum = np.cumsum(np.exp(logw[order] - logw.max()))
    return float(values[order[np.searchsorted(cum, 0.5 * cum[-1])]])


def _near(x: float, y: np.ndarray, factor: float) -> np.ndarray:
    """Log-weights of measurements at ``y`` for a prediction at ``x``: a log-normal kernel,
    one standard deviation a ratio of ``factor``."""
    z = np.log(max(x, 1.0) / np.maximum(y, 1.0)) / math.log(factor)
    return -0.5 * z * z


class AdaptiveWidth:
    """Chooses each request's width every step (see the module docstring)."""

    def __init__(self, cap: int, m: int, cost: CostModel, alpha: float = 0.1,
                 pooled_alpha: float = 0.01, widths: Sequence[int] | None = None,
                 widen_margin: float = WIDEN_MARGIN):
        if cap < 1:
            raise TreepipeError(f"adaptive width cap must be >= 1, got {cap}")
        self.cap, self.m, self.cost = cap, m, cost
        self.widen_margin = widen_margin
        self.widths = tuple(widths) if widths is not None else candidate_widths(cap)
        self._level_widths = sorted({1, *self.widths} - {0})  # observe_level's widths
        self.alpha, self.pooled_alpha = alpha, pooled_alpha
        # optimistic until the first verification (every width hits: the first steps
        # speculate, and their ranks teach the real rates); the first observations
        # are plain means (weight 1/n) until the EWMA's own weight is larger
        self.pooled = {w: 1.0 if w else 0.0 for w in self.widths}
        self.pooled_n = 0
        self.hit: dict[Hashable, dict[int, float]] = {}  # request id -> width -> EWMA
        self.hit_n: dict[Hashable, int] = {}
        self.current: dict[Hashable, int] = {}
        # request id -> width -> nodes a level of that width held (EWMA of min(w, offered))
        self.offered: dict[Hashable, dict[int, float]] = {}
        # the same over every request (long memory): a new request's until it has its own
        self.pooled_offered: dict[int, float] = {}
        self.pooled_levels = 0
        self.chosen: list[int] = []  # every (request, step) width chosen, for the stats
        # the step prices (nodes -> seconds) the last choice asked for: a trace records
        # them, so a replay can make the same choices where step times differ
        self.priced: dict[float, float] = {}
        # the estimates the last choice read (:meth:`estimates`): a trace records them
        # too, so a replay checks that it chose from the same ones
        self.read: dict[str, list] = {}

    def stage_nodes(self, widths: Mapping[Hashable, int]) -> float:
        """Nodes the busiest stage computes per step under these widths (request id ->
        width): every speculating request's level (each stage holds one level of it;
        a level holds at most the candidates its source offered lately, so a width
        beyond them costs nothing more), plus the roots of the requests that do not
        speculate, which cross the stages one at a time and so share them: ceil(count
        / m) per stage, and at least one while any does (alone, a root costs its stage
        as much as a level of width 1)."""
        return self.nodes_of(sum(self.level_nodes(r, w) for r, w in widths.items()),
                             sum(1 for w in widths.values() if not w))

    def nodes_of(self, level: float, idle: int) -> float:
        """:meth:`stage_nodes` from its parts: the speculating requests' level nodes and
        the count of requests at width 0, whose roots share the stages."""
        return float(level) + float(math.ceil(idle / self.m))

    def level_nodes(self, rid: Hashable, w: int) -> float:
        """Nodes a level of width ``w`` of request ``rid`` holds (0 for no speculation:
        its root is counted with the others', :meth:`stage_nodes`): one, as a root costs
        alone, and the candidates beyond the first that its source offered lately and a
        level of ``w`` takes (``w`` before any was seen).

        The mean of min(w, offered), not min(w, mean offered): a source that offers
        about one candidate a level on average and sometimes three would have every
        width priced alike by the latter, though wider levels do hold more nodes."""
        if not w:
            return 0.0
        seen = self.offered.get(rid) or self.pooled_offered
        if not seen:
            return float(w)
        # a width no candidate list holds (only a caller's own) at the widest one below it
        x = w if w in seen else max(v for v in seen if v <= w)
        return 1.0 + seen[x] - seen[1]

    def observe_level(self, rid: Hashable, offered: int) -> None:
        """How many candidates request ``rid``'s source offered for its last level: per
        width, an EWMA of the nodes a level of that width would have held, the request's
        own and pooled over requests (a new request is priced at the pooled one until
        its first level: at its own width's nodes, its first levels went narrow)."""
        held = {w: float(min(w, offered)) for w in self._level_widths}
        self.pooled_levels += 1
        # the pooled one a plain mean until the EWMA's own weight is larger, as the rates
        for mine, a in ((self.offered.setdefault(rid, {}), self.alpha),
                        (self.pooled_offered, max(self.pooled_alpha, 1 / self.pooled_levels))):
            for w, x in held.items():
                mine[w] = mine[w] + a * (x - mine[w]) if w in mine else x  # the first sets it

    def rate(self, rid: Hashable, w: int) -> float:
        """Request ``rid``'s estimated level hit rate at width ``w`` (module docstring)."""
        mine = self.hit.get(rid, self.pooled)
        if w == 0 or 1 not in self.widths:
            return mine[w]
        # its own width-1 rate rests on the few verifications its EWMA remembers: shrunk
        # toward the pooled rate by PRIOR of them, a short run of misses does not pass
        # for a hard request (it would drop to width 0 and fall behind for nothing)
        seen = min(self.hit_n.get(rid, 1) - 1, 1.0 / self.alpha)
        own = (seen * mine[1] + PRIOR * self.pooled[1]) / (seen + PRIOR)
        # the pooled share of width-1 misses that width w recovers, applied to this
        # request's own misses (an additive gain would vanish on a short hit streak)
        return own + (1.0 - own) * self.recovered(w)

    def pooled_rate(self, w: int) -> float:
        """The pooled level hit rate at width ``w``: the pooled width-1 rate and, of its
        misses, the share width ``w`` recovers (:meth:`recovered`)."""
        if w == 0 or 1 not in self.widths:
            return self.pooled[w]
        p1 = self.pooled[1]
        return p1 + (1.0 - p1) * self.recovered(w)

    def recovered(self, w: int) -> float:
        """The share of width-1 misses that width ``w`` recovers, pooled over requests:
        the share seen, with ``RECOVERY_PRIOR`` misses of a prior share 1 - (1 - p)^(w-1)
        (p the pooled width-1 rate: ranks past the first fall off as the first one hits).

        A token found only at rank 2..w is rare, and a short run of misses often holds
        none: as a plain share, every width then recovered nothing, tied with width 1 in
        goodput, and a tie goes narrower, so a run's first requests stayed narrow and
        lost the rank-1 and rank-2 tokens a wider tree would have kept.  The prior
        weighs less with every miss seen, so the ranks soon decide."""
        if w <= 1:
            return 0.0
        p1 = self.pooled[1]
        misses = self.pooled_n * (1.0 - p1)  # width-1 misses seen (the EWMA's share of all)
        seen = (self.pooled[w] - p1) * self.pooled_n
        prior = 1.0 - (1.0 - p1) ** (w - 1)
        weight = misses + RECOVERY_PRIOR
        share = (seen + RECOVERY_PRIOR * prior) / weight if weight > 0 else 0.0
        return min(max(share, 0.0), 1.0)

    def alike(self, rids: Sequence[Hashable]) -> bool:
        """Whether the requests' own width-1 rates differ by no more than the noise of
        their estimates: their spread around the pooled rate within a chi-square test's
        95 % range (each EWMA's variance from its verifications so far)."""
        if 1 not in self.widths:
            return False
        own = [(self.hit[r][1], self.hit_n[r]) for r in rids if r in self.hit]
        if len(own) < 2:
            return True
        p = self.pooled[1]
        stat = 0.0
        for rate, n in own:
            a = max(self.alpha, 1.0 / n)
            # a running mean while 1/n > alpha, then an EWMA of weight alpha
            var = p * (1 - p) * (1.0 / n if a > self.alpha else a / (2 - a))
            stat += (rate - p) ** 2 / max(var, 1e-9)
        return stat <= _chi2_95(len(own))

    def goodput(self, p: float) -> float:
        """Expected tokens per step of a request whose level hits with probability p."""
        return 1.0 / (1.0 + (1.0 - p) * (self.m - 1))

    def observe(self, rid: Hashable, rank: int | None) -> None:
        """One verification of request ``rid``: its token's rank in its level (None: no
        proposals to rank against, nothing learnt)."""
        if rank is None:
            return
        mine = self.hit.setdefault(rid, dict(self.pooled))
        # the pooled prior counts as one observation of a new request
        n = self.hit_n[rid] = self.hit_n.get(rid, 1) + 1
        self.pooled_n += 1
        a, pa = max(self.alpha, 1.0 / n), max(self.pooled_alpha, 1.0 / self.pooled_n)
        for w in self.widths:
            x = 1.0 if rank < w else 0.0
            mine[w] += a * (x - mine[w])
            self.pooled[w] += pa * (x - self.pooled[w])

    def observe_step(self, rec: StepRecord) -> None:
        """One step's measurements, for a cost model that learns online."""
        if isinstance(self.cost, StepCost):
            self.cost.observe(rec)

    def forget(self, rid: Hashable) -> None:
        """Drop a finished request's estimates."""
        self.hit.pop(rid, None)
        self.hit_n.pop(rid, None)
        self.current.pop(rid, None)
        self.offered.pop(rid, None)

    def estimates(self, rids: Sequence[Hashable]) -> dict[str, list]:
        """What a choice for ``rids`` reads besides the step prices, as JSON's lists: each
        request's current width, level nodes offered, own rates and verifications (in
        ``rids``' order: two executors name the requests differently), and the pooled
        ones.  Two executors that learn alike hold the same; where they do not, the
        first choice that differs shows it, before a price it asks for is missing."""
        def items(d: Mapping[int, float] | None) -> list | None:
            return None if d is None else [[w, x] for w, x in sorted(d.items())]

        return {"requests": [[self.current.get(r), items(self.offered.get(r)),
                              items(self.hit.get(r)), self.hit_n.get(r)] for r in rids],
                "pooled": [items(self.pooled), self.pooled_n, items(self.pooled_offered),
                           self.pooled_levels]}

    def choose(self, rids: Sequence[Hashable]) -> dict[Hashable, int]:
        """Widths for ``rids`` maximising sum_r g_r(w_r) / T(N(w)).

        Coordinate ascent from the best of the previous choice and every uniform
        width: each request in turn takes the width that is best with the others
        fixed (a wider one only when it gains ``widen_margin``, or as much as it makes
        the priced step grow if that is less; a narrower one on a tie), and
        the k requests that gain least from speculating drop to width 0 together
        when that is better: m of them share a stage's worth of roots, so one alone
        saves nothing.  Until nothing changes.
        """
        self.read = self.estimates(rids)
        alike = len(rids) > 1 and self.alike(rids)
        # alike requests are priced at the pooled rates: the test cannot tell their own
        # apart, and the pooled estimate remembers more verifications than any one's
        pooled = ({x: self.goodput(self.pooled_rate(x)) for x in self.widths} if alike
                  else None)  # once, not once per request: the same for each
        g = {r: pooled or {x: self.goodput(self.rate(r, x)) for x in self.widths}
             for r in rids}
        lv = {r: {x: self.level_nodes(r, x) for x in self.widths} for r in rids}
        w = {r: self.current.get(r, 1 if 1 in self.widths else self.widths[0]) for r in rids}
        self.priced = {}

        def step_s(nodes: float) -> float:
            if nodes not in self.priced:
                self.priced[nodes] = (self.cost(nodes, len(rids)) if isinstance(self.cost, StepCost)
                                      else self.cost(nodes))
            return self.priced[nodes]

        def value(nodes: float, good: float) -> float:
            t = step_s(nodes)
            return good / t if t > 0 else good

        def parts(ws: dict[Hashable, int]) -> tuple[float, int, float]:
            return (sum(lv[r][x] for r, x in ws.items()), sum(1 for x in ws.values() if not x),
                    sum(g[r][x] for r, x in ws.items()))

        def score(ws: dict[Hashable, int]) -> float:
            level, idle, good = parts(ws)
            return value(self.nodes_of(level, idle), good)

        def admissible(s: float, n: float, wider: bool, best: float, here: float) -> bool:
            # the margin is for the cost model's error, so a move pays it only as far as
            # the priced step grows: a move that adds no priced time (width 0 to 1, where
            # a lone root becomes a level of one node, or nodes the busiest stage computes
            # in the shadow of the last stage's work) has no error to cover and need only
            # be better, else a request would stay narrow while a free wider tree promised
            # more goodput; a narrower move needs a tie
            if wider:
                now = step_s(here) if n > here else 0.0
                grown = step_s(n) / now - 1 if now > 0 else 0.0
                return s > best * (1 + max(min(self.widen_margin, grown), 1e-9))
            return s >= best * (1 - 1e-9)

        def best_uniform(best: float, here: float, wider: Callable[[int, float], bool]
                         ) -> tuple[float, float, int] | None:
            """(score, nodes, width) of the best width for every request at once among
            those admissible against a choice scoring ``best`` on ``here`` nodes
            (``wider(x, n)``: whether width x on n nodes is a widening move); None: none."""
            pick: tuple[float, float, int] | None = None
            for x in self.widths:
                level, idle, good = parts(dict.fromkeys(rids, x))
                n = self.nodes_of(level, idle)
                s = value(n, good)
                if admissible(s, n, wider(x, n), best, here) and (pick is None or s > pick[0]):
                    pick = (s, n, x)
            return pick

        if alike:
            # their own rates differ by no more than their noise: unlike widths would
            # follow that noise, and alike requests verify most at alike widths (the hit
            # rate is concave in the width); the common width moves as a choice would,
            # and stays on a tie
            common = max(set(w.values()), key=list(w.values()).count)
            base = dict.fromkeys(rids, common)
            best = score(base)
            pick = best_uniform(best, self.nodes_of(*parts(base)[:2]),
                                lambda x, n: x > common)
            w = dict.fromkeys(rids, pick[2] if pick is not None and pick[0] > best else common)
            self.current.update(w)
            self.chosen.extend(w.values())
            return w
        best = score(w)
        # T(N) has steps (a CPU stage: flat over the few-row product, then a jump to the
        # packed kernel), so single moves from the previous choice can stall on the wrong
        # side of one: every request at the same width is a start point too. Each move
        # is the best of those that pass the margin against the choice it leaves: a
        # margin applied along the scan instead (each wider candidate against the last
        # one taken) stops short of the best wherever the goodput grows by less than the
        # margin from one candidate to the next
        here = self.nodes_of(*parts(w)[:2])
        start = best_uniform(best, here, lambda x, n: n > here)
        if start is not None:
            best, here, x = start
            w = dict.fromkeys(rids, x)
        for _ in range(4):
            changed = False
            for r in rids:
                level, idle, good = parts(w)
                here, a = self.nodes_of(level, idle), w[r]
                move: tuple[float, int] | None = None
                for cand in self.widths:
                    if cand == a:
                        continue
                    # one request moves: the totals change by its own terms only
                    n = self.nodes_of(level - lv[r][a] + lv[r][cand],
                                      idle - (not a) + (not cand))
                    s = value(n, good - g[r][a] + g[r][cand])
                    if admissible(s, n, cand > a, best, here) and (move is None
                                                                   or s > move[0]):
                        move = (s, cand)
                if move is not None:
                    best, w, changed = move[0], {**w, r: move[1]}, True
            if 0 in self.widths:
                gain = sorted((r for r in rids if w[r]), key=lambda r: g[r][w[r]] - g[r][0])
                for k in range(2, len(gain) + 1):
                    trial = {**w, **dict.fromkeys(gain[:k], 0)}
                    s = score(trial)
                    if s > best * (1 + 1e-9):
                        w, best, changed = trial, s, True
            if not changed:
                break
        self.current.update(w)
        self.chosen.extend(w.values())
        return w
