"""Step-level simulator of the pipelined decoding methods (ar, pp, specinfer, specpipe).

Given a per-stage time profile t_i(tokens), link latency and bandwidth, the
draft's time per level and either a hit/miss *trace* or a *hit rate*, the
simulator replays each method's schedule step by step, exactly as
``stages/speculation/engine.py`` runs it (which stage holds how many tree nodes, when the
last stage verifies, what a miss flushes; pp and specpipe run the engine's own loop,
:func:`~stages.speculation.loop.pipeline_step`, over node counts), builds one
:class:`~protocol.scheduling.records.StepRecord` per simulated step and prices it with the
engine's own :meth:`StepRecord.pipelined_s`.  So the simulator and the engine
share one cost model and differ only in where the per-stage times come from:
measured in the engine, from the profile here.

Two uses:

* ``treepipe simulate RECORDS``: fit a profile and a trace to a recorded run
  (``treepipe bench --records``) and check the simulated pipelined time
  against the engine's own ``pipelined_s`` (validation).
* ``treepipe project``: the paper's testbed (Llama-3.1-70B on 8 RTX 3090, 10 GbE,
  Llama-3.2-1B draft on an L40, w = 64, k = 16), from the numbers the paper
  gives, beside the paper's measured TBT.  See :class:`PaperSetting`.  With
  ``--batch`` the same setting under load (§4.4): several requests share each
  step (:func:`simulate_batch`), priced by the same rule (:func:`price_step`).
  ``--calibrate FILE`` takes the per-layer time from a measured layer sweep.  With
  ``--recovery`` the same setting with miss recovery (:class:`RecoveryModel`): early
  exits at every stage and draft:K over κ, checked against the engine's SmolLM2 run, and
  the setting the model picks (orchestrator/lab/benchmarks/recovery_projection.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

from protocol.errors import TreepipeError
from protocol.scheduling.plan import Ticket
from protocol.scheduling.records import GenerationResult, LinkModel, StepRecord
from protocol.scheduling.scheduler import Scheduler
from protocol.scheduling.width import AdaptiveWidth
from stages.speculation.engine import NODE_HEADER_BYTES, SPECINFER_BRANCHING
from stages.speculation.loop import Checked, Lane, pipeline_step

# ---- records on disk -------------------------------------------------------------------


def result_to_dict(res: GenerationResult) -> dict[str, Any]:
    """A generation with its per-step records, as JSON-ready data (logits are left out)."""
    return {
        "method": res.method, "stages": res.stages, "width": res.width, "topk": res.topk,
        "source": res.source, "prompt_len": res.prompt_len, "tokens": list(res.tokens),
        "prefill_s": res.prefill_s, "wall_s": res.wall_s,
        "link": {"latency_s": res.link.latency_s, "bandwidth_bytes_s": res.link.bandwidth_bytes_s},
        "steps": [s.as_dict() for s in res.steps],
    }


def result_from_dict(d: dict[str, Any]) -> GenerationResult:
    """Inverse of :func:`result_to_dict` (unknown step fields are ignored)."""
    names = {f.name for f in dataclasses.fields(StepRecord)}
    steps = [StepRecord(**{k: v for k, v in s.items() if k in names}) for s in d["steps"]]
    return GenerationResult(
        method=d["method"], stages=d["stages"], width=d["width"], topk=d["topk"],
        source=d["source"], prompt_len=d["prompt_len"], tokens=list(d["tokens"]), steps=steps,
        prefill_s=d["prefill_s"], wall_s=d["wall_s"], link=LinkModel(**d["link"]))


def load_records(path: Path) -> list[GenerationResult]:
    """Generations from a records file written by ``treepipe bench --records``."""

    if not path.is_file():
        raise TreepipeError(f"records file {path} not found; write one with treepipe bench "
                            "--records --out DIR (DIR/records.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [result_from_dict(d) for d in data["results"]]
    except (ValueError, KeyError, TypeError) as e:
        raise TreepipeError(f"{path} is not a treepipe records file ({type(e).__name__}: {e}); "
                            "write one with treepipe bench --records") from None


# ---- profiles --------------------------------------------------------------------------


@dataclass
class TimeCurve:
    """Seconds as a piecewise-linear function of a token count.

    Flat below the first point; beyond the last the last segment's slope continues.
    """

    tokens: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a time curve needs as many seconds as token counts, at least one")
        order = sorted(range(len(self.tokens)), key=self.tokens.__getitem__)
        self.tokens = [self.tokens[i] for i in order]
        self.seconds = [self.seconds[i] for i in order]

    @classmethod
    def constant(cls, seconds: float) -> TimeCurve:
        return cls([1], [seconds])

    def __call__(self, n: float) -> float:
        """Time for ``n`` tokens (0 for no tokens)."""
        if n <= 0:
            return 0.0
        xs, ys = self.tokens, self.seconds
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            if len(xs) == 1:
                return ys[0]
            # beyond the measured range continue the last segment's slope: more tokens
            # never cost less
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            return ys[-1] + slope * (n - xs[-1])
        j = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def scaled(self, factor: float) -> TimeCurve:
        return TimeCurve(list(self.tokens), [s * factor for s in self.seconds])


@dataclass
class Profile:
    """What one pipeline costs: per-stage compute, LM head, pruning, draft and links."""

    stage_time: list[TimeCurve]  # stage i's compute for n nodes (seconds)
    head_s: float = 0.0  # LM head + token choice on the last stage, per verification
    prune_s: list[float] | None = None  # per stage, per step with a verification
    draft_time: TimeCurve = field(default_factory=lambda: TimeCurve.constant(0.0))
    draft_sync_s: float = 0.0  # the draft's own pruning, per verification
    link: LinkModel = field(default_factory=LinkModel)
    node_bytes: int = 2 * 576 + 8  # one hidden state + id per node between stages
    header_bytes: int = NODE_HEADER_BYTES  # per node from the draft to stage 1
    # per stage, for each further request packed into a step: reading its KV cache (the
    # curves hold one request's, so a single request never pays it)
    request_s: float = 0.0
    # miss recovery's early exit (``early-exit:J:K``): stage ``exit_stage`` (1-based; 0:
    # none) also runs the final norm and an LM head on every node it computes
    exit_stage: int = 0
    exit_time: TimeCurve = field(default_factory=lambda: TimeCurve.constant(0.0))
    # Measured samples, keyed like the curves.  With samples the simulator draws
    # each step's times from them instead of using the mean: a step costs the
    # *maximum* over stages, and the mean of a maximum of noisy times exceeds the
    # maximum of their means, so means alone underestimate pipelined time.
    stage_samples: list[dict[int, list[float]]] | None = None
    prune_samples: list[list[float]] | None = None
    draft_samples: dict[int, list[float]] | None = None
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    @property
    def m(self) -> int:
        return len(self.stage_time)

    def stage(self, i: int, n: int) -> float:
        """Compute time of stage i on n nodes (a measured sample when there is one)."""
        if self.stage_samples and self.stage_samples[i].get(n):
            return self._rng.choice(self.stage_samples[i][n])
        return self.stage_time[i](n)

    def draft(self, n: int) -> float:
        if self.draft_samples and self.draft_samples.get(n):
            return self._rng.choice(self.draft_samples[n])
        return self.draft_time(n)

    def prune(self, i: int) -> float:
        if self.prune_samples and self.prune_samples[i]:
            return self._rng.choice(self.prune_samples[i])
        return self.prune_s[i] if self.prune_s else 0.0


@dataclass
class LevelModel:
    """How many nodes a SpecPipe tree level holds.

    A new level under a bottom level of b nodes has ``min(cap, b * branching)``
    nodes (w when the source fills it; fewer for a source with few proposals).
    Each hit keeps ``survival`` of every deeper level in flight (the share of the
    level under the verified child).
    """

    cap: float
    branching: float
    survival: float = 1.0

    def new_level(self, bottom: float) -> float:
        return max(1.0, min(self.cap, bottom * self.branching))


# A SpecPipe verification outcome: None = miss; otherwise a hit that keeps that
# many of the levels in flight behind the new root (math.inf = all of them).
Outcome = float | None
HIT: Outcome = math.inf
MISS: Outcome = None


@dataclass
class SimResult:
    """Simulated steps of one request and their pipelined time."""

    method: str
    tokens: int
    steps: list[StepRecord]
    link: LinkModel

    @property
    def pipelined_s(self) -> float:
        return sum(s.pipelined_s(self.link) for s in self.steps)

    @property
    def decode_tokens(self) -> int:
        return max(self.tokens - 1, 0)

    @property
    def tbt_ms(self) -> float:
        return 1e3 * self.pipelined_s / self.decode_tokens if self.decode_tokens else 0.0


def _rec(m: int) -> StepRecord:
    return StepRecord([0] * m, [0.0] * m, [0.0] * m, [0] * m)


def _nodes(x: float) -> int:
    return max(1, round(x))


# ---- methods -------------------------------------------------------------------------
#
# Each method is a per-request *schedule* (which stage holds how many of the request's
# nodes in a step, when its root reaches the LM head, whether it prunes) and one pricing
# rule, :func:`price_step`, that turns the schedules of every request sharing a step into
# one priced StepRecord.  A single request is the one-request case of the same rule, so
# the single-request and the batched projections cannot drift apart.


@dataclass
class Share:
    """One request's part of a step: its schedule (times unset) and what it asks of it."""

    rec: StepRecord
    head: bool = False  # its root reached the last stage: the LM head runs for it
    prune: bool = False  # it verified and prunes its nodes on every stage


def price_step(p: Profile, shares: Sequence[Share], source: bool = True) -> StepRecord:
    """One pipeline step from the shares of every request in it, as ``batch.py`` runs it.

    Each stage runs ONE packed forward over all requests' nodes: t_i(total nodes), plus
    ``request_s`` for each further request whose KV cache it reads.  One LM head serves
    every root that arrived; pruning and the draft's own pruning run per verifying
    request; a draft beside the stages expands every entering level in one forward, a
    serial (static-tree) draft runs its passes packed, as long as the longest.  Link
    bytes add up per link.
    """
    m = p.m
    rec = _rec(m)
    requests = [0] * m
    serial_draft = 0.0
    for s in shares:
        r = s.rec
        for i in range(m):
            rec.stage_tokens[i] += r.stage_tokens[i]
            rec.link_bytes[i] += r.link_bytes[i]
            requests[i] += 1 if r.stage_tokens[i] else 0
        rec.draft_tokens += r.draft_tokens
        rec.verified += r.verified
        rec.hits += r.hits
        rec.recovered += r.recovered
        rec.flushed += r.flushed
        if r.draft_serial:
            rec.draft_serial = True
            serial_draft = max(serial_draft, r.draft_s)
    for i, n in enumerate(rec.stage_tokens):
        if n:
            rec.stage_s[i] = p.stage(i, n) + (requests[i] - 1) * p.request_s
    if rec.draft_serial:
        rec.draft_s = serial_draft
    elif rec.draft_tokens:
        rec.draft_s = p.draft(rec.draft_tokens)
    if any(s.head for s in shares):
        rec.stage_s[m - 1] += p.head_s
    j = p.exit_stage - 1
    if 0 <= j < m and rec.stage_tokens[j]:
        # the exit head runs on every node stage J computed this step, packed
        rec.stage_s[j] += p.exit_time(rec.stage_tokens[j])
    pruners = sum(1 for s in shares if s.prune)
    if pruners:
        rec.prune_s = [sum(p.prune(i) for _ in range(pruners)) for i in range(m)]
        if source:
            rec.draft_s += pruners * p.draft_sync_s
    return rec


class RequestSchedule:
    """A request's schedule, one :class:`Share` per step until it has all its tokens."""

    method: str
    new_tokens: int
    committed: int
    source: bool = True  # a token source runs beside the stages (its pruning is priced)

    @property
    def done(self) -> bool:
        """True once the request holds all its tokens."""
        return self.committed >= self.new_tokens

    def step(self) -> Share:  # pragma: no cover - interface
        """The request's share of the next step; advances its state."""
        raise NotImplementedError


def simulate_ar(p: Profile, new_tokens: int) -> SimResult:
    """Plain autoregressive decoding: every stage in turn, one token per step."""
    steps = []
    for _ in range(max(new_tokens - 1, 0)):
        rec = _rec(p.m)
        rec.serial, rec.verified = True, 1
        for i in range(p.m):
            rec.stage_tokens[i], rec.stage_s[i] = 1, p.stage(i, 1)
        rec.stage_s[-1] += p.head_s
        steps.append(rec)
    return SimResult("ar", new_tokens, steps, p.link)


@dataclass(frozen=True)
class RecoveryModel:
    """Miss recovery (``--recovery``, docs/engine.md "Miss recovery") in node counts.

    The core's rule (``TreeOwner._budgeted``): each step the on-time level takes the
    width first; the slots it leaves (``budget`` less the level) go to *correction
    children*: each node computed by the exit stage J (``early-exit:J:K``; with
    ``draft:K`` the draft's own top-K, from the step after the node's on-time children)
    offers K tokens, issued d = i - 1 steps late when its level waits at stage i's input,
    while that saves a step (d <= m - 2).  A miss whose token one of the root's issued
    corrections carries (``catch``: the chance the K hold it) re-roots the tree there:
    the pipeline idles d steps instead of m - 1.

    What node counts cannot know is assumed and stated:

    * the verified path's node is served first within its level (the core ranks
      corrections by cumulative probability and the path is the likeliest: optimistic),
      the newest eligible level first (it saves the most steps, m - 1 - d);
    * a correction issued late (d >= 1) is extended by the draft one node a step (a
      branch-complete chain, Mirror-SD) until its parent is verified; those chain nodes
      are on-time children in the core, so they take the spare slots before new
      corrections, and a correction whose chain the budget cuts no longer counts;
    * after a late re-root the chain's levels hit at ``chain_hit`` (None: as any level),
      then the tree grows as usual under the chain's tip;
    * a catch at d = 0 (J = 1: the exit's tokens join the node's own level) is a hit.
    """

    exit_stage: int = 0  # J of early-exit:J:K; 0: draft:K
    kappa: int = 0  # K corrections per node; 0: no recovery
    catch: float = 0.0  # P(a miss's token is among the root's K corrections)
    budget: float = 0.0  # nodes a step may hold (the core's width); 0: the level's cap
    chain_hit: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.catch <= 1.0 or self.kappa < 0 or self.exit_stage < 0:
            raise ValueError(f"recovery model {self} needs catch in [0, 1], K, J >= 0")

    @property
    def name(self) -> str:
        """The ``--recovery`` spelling."""
        if not self.kappa:
            return "none"
        return (f"early-exit:{self.exit_stage}:{self.kappa}" if self.exit_stage
                else f"draft:{self.kappa}")

    @property
    def first_input(self) -> int:
        """The first stage input (0-based) whose nodes offer corrections: J (stage J has
        computed them), or 2 for draft:K (one step after their on-time children)."""
        return self.exit_stage if self.exit_stage else 2


NO_RECOVERY_MODEL = RecoveryModel()


class Flow(NamedTuple):
    """A simulated level in flight (its nodes include corrections issued with it), and
    what recovery has issued for its nodes so far."""

    depth: int  # below the root
    nodes: float
    fixes: tuple[tuple[int, float], ...] = ()  # the path node's corrections: (late d, share)
    asked: float = 0.0  # share of all its nodes' corrections issued
    issued: float = 0.0  # late (d >= 1) corrections issued: each grows a chain node a step


Nodes = Flow


class CountLane(Lane[Nodes, Outcome]):
    """A request's levels in flight as node counts; a verification's outcome prunes them.

    ``levels`` None: no token source (``pp``), nothing grows under the root.  With
    ``recovery`` a miss may re-root on a correction (:class:`RecoveryModel`).
    """

    def __init__(self, m: int, levels: LevelModel | None,
                 recovery: RecoveryModel = NO_RECOVERY_MODEL):
        super().__init__(m, Flow(0, 1.0))
        self.levels = levels
        self.recovery = recovery if recovery.kappa and levels is not None else None
        self.rng = random.Random(recovery.seed)  # catches and chain hits, apart from outcomes
        self.verified = False  # this step verified (until the lane grows)
        self.outcome: Outcome = MISS
        self.reroot = -1  # this step's re-root: the correction's lateness d (-1: none)
        self.chain = 0  # verifications left whose children are a re-rooted chain's levels

    def size(self, f: Nodes) -> int:
        """Nodes of the level (at least one)."""
        return _nodes(f[1])

    def is_root(self, f: Nodes) -> bool:
        """Only the root (depth 0) is verified."""
        return f[0] == 0

    def verify(self, found: Outcome, out: Sequence[Nodes | None]) -> Checked:
        """A miss drops every level in flight (or re-roots on a correction); a hit keeps
        ``found`` levels of them."""
        self.verified, self.outcome, self.reroot = True, found, -1
        rec = self.recovery
        if rec is not None and self.chain:
            self.chain -= 1
            if rec.chain_hit is not None:
                found = self.outcome = HIT if self.rng.random() < rec.chain_hit else MISS
        if found is MISS and rec is not None and (root := out[-1]) is not None:
            late = self._caught(root)
            if late == 0:  # an on-time correction: a plain hit
                self.outcome = HIT
                return Checked(True, 0)
            if late > 0:  # a hit on the late correction: no new root enters
                self.reroot, self.outcome = late, HIT
                chain = [lv for lv in out[:-1] if lv is not None and lv.depth > late + 1]
                self.chain = len(chain)
                flushed = sum(_nodes(lv[1]) for lv in out[:-1] if lv is not None)
                return Checked(True, max(flushed - 1 - len(chain), 0), late=late)
        if found is MISS:
            self.chain = 0  # the flush drops what is left of a chain too
            return Checked(False, sum(_nodes(lv[1]) for lv in out[:-1] if lv is not None))
        return Checked(True, 0)

    def _caught(self, root: Flow) -> int:
        """The lateness of the root's correction that carries the verified token, drawn
        from its issued shares (-1: none does, the miss flushes)."""
        assert self.recovery is not None
        u, acc = self.rng.random(), 0.0
        for late, share in root.fixes:
            acc += self.recovery.catch * share
            if u < acc:
                return late
        return -1

    def keep(self, f: Nodes) -> Nodes | None:
        """A level one step nearer the root, thinned to the verified child's subtree (a
        re-root keeps the correction and its chain: one node a level)."""
        if not self.verified:
            return f
        if self.reroot > 0:
            if f[0] <= self.reroot:
                return None
            return Flow(f[0] - 1 - self.reroot, 1.0)
        if self.outcome is MISS or f[0] - 1 > self.outcome:
            return None
        assert self.levels is not None
        depth = f[0] - 1
        s = self.levels.survival
        return f._replace(depth=depth, nodes=1.0 if depth == 0 else f.nodes * s,
                          issued=f.issued * s)

    def grow(self) -> Nodes | None:
        """A new root after a miss, else a level under the deepest one in flight (with
        recovery: and the corrections the spare slots take)."""
        miss, self.verified = self.verified and self.outcome is MISS, False
        self.reroot = -1
        if miss:
            return Flow(0, 1.0)
        if self.levels is None:
            return None
        bottom = max((lv for lv in self.inbox[1:] if lv is not None), key=lambda lv: lv[0],
                     default=None)
        if bottom is None:
            return Flow(0, 1.0)
        level = Flow(bottom[0] + 1, self.levels.new_level(bottom[1]))
        return level if self.recovery is None else self._corrections(level)

    def _corrections(self, level: Flow) -> Flow:
        """``level`` with the chain nodes and the corrections the spare slots take; books
        what each level in flight got (see :class:`RecoveryModel`)."""
        rec, levels = self.recovery, self.levels
        assert rec is not None and levels is not None
        spare = max((rec.budget or levels.cap) - level.nodes, 0.0)
        chain = sum(lv.issued for lv in self.inbox[1:] if lv is not None)
        if chain > spare:  # the budget cuts chains: their corrections no longer count
            cut = spare / chain
            for i, lv in enumerate(self.inbox):
                if lv is not None and lv.issued:
                    self.inbox[i] = lv._replace(
                        issued=lv.issued * cut,
                        fixes=tuple((d, s * cut if d else s) for d, s in lv.fixes))
            chain = spare
        spare -= chain
        added = 0.0
        for i in range(rec.first_input, len(self.inbox)):  # newest first: saves the most
            lv = self.inbox[i]
            if spare <= 0:
                break
            if lv is None:
                continue
            give = min((1.0 - lv.asked) * lv.nodes * rec.kappa, spare)
            if give <= 0:
                continue
            late = i - 1
            path = min(1.0 - sum(s for _, s in lv.fixes), give / rec.kappa)  # path first
            self.inbox[i] = lv._replace(
                fixes=lv.fixes + (((late, path),) if path > 0 else ()),
                asked=lv.asked + give / (lv.nodes * rec.kappa),
                issued=lv.issued + (give if late else 0.0))
            spare -= give
            added += give
        return level._replace(nodes=level.nodes + chain + added)


class PipeSchedule(RequestSchedule):
    """Algorithm 1 for one request: one level enters stage 1 per step, the last stage
    verifies the root.  The schedule is the engine's own loop
    (:func:`~stages.speculation.loop.pipeline_step`) over a :class:`CountLane`, with
    this class as its compute: it counts nodes, draws outcomes, and prices nothing
    itself (:func:`price_step` does).

    ``outcomes(v)`` gives the v-th verification's outcome; ``levels`` None means
    no token source (``pp``: every verification finds no child, a miss).  ``recovery``:
    a miss may re-root on a correction child (:class:`RecoveryModel`).
    """

    def __init__(self, p: Profile, outcomes: Callable[[int], Outcome], new_tokens: int,
                 levels: LevelModel | None, recovery: RecoveryModel = NO_RECOVERY_MODEL):
        self.m, self.outcomes, self.new_tokens, self.levels = p.m, outcomes, new_tokens, levels
        self.node_bytes, self.header_bytes = p.node_bytes, p.header_bytes
        self.method = "pp" if levels is None else "specpipe"
        self.source = levels is not None
        self.lane = CountLane(p.m, levels, recovery)
        self.share = Share(_rec(p.m))
        self.committed, self.v = 1, 0  # the prefill produced the first token

    @property
    def inbox(self) -> list[Nodes | None]:
        """In flight at each stage's input: (depth below the root, nodes) or None."""
        return self.lane.inbox

    def step(self) -> Share:
        """The request's share of the next step; advances its state."""
        self.share = Share(_rec(self.m))
        pipeline_step([self.lane], self, self.m)
        return self.share

    # ---- the loop's compute: node counts -------------------------------------------------
    def forward(self, i: int, work: Sequence[tuple[Lane[Nodes, Outcome], Nodes]]) -> list[Nodes]:
        """Stage i holds the level's nodes (priced later); the level itself moves on."""
        for _, lv in work:
            self.share.rec.stage_tokens[i] = _nodes(lv[1])
        return [lv for _, lv in work]

    def propose(self, work: Sequence[tuple[Lane[Nodes, Outcome], Nodes]]) -> None:
        """The draft expands the level entering stage 1."""
        if self.levels is not None and work:
            self.share.rec.draft_tokens = self.share.rec.stage_tokens[0]

    def verify(self, roots: Sequence[tuple[Lane[Nodes, Outcome], Nodes]]) -> list[Outcome]:
        """The LM head runs and the root prunes; the next outcome (pp: a miss)."""
        found: list[Outcome] = []
        for _ in roots:
            self.share.head = self.share.prune = True
            self.share.rec.verified = 1
            found.append(self.outcomes(self.v) if self.levels is not None else MISS)
            self.v += 1
        return found

    def settle(self, lane: Lane[Nodes, Outcome], checked: Checked, found: Outcome) -> bool:
        """Count a hit or what a miss flushed; one more token committed."""
        if checked.hit:
            self.share.rec.hits = 1
            self.share.rec.recovered = int(checked.late > 0)
        else:
            self.share.rec.flushed = checked.flushed
        self.committed += 1
        return self.done

    def going(self, lanes: Sequence[Lane[Nodes, Outcome]]) -> None:
        """A fixed level model: nothing to choose."""

    def sent(self, lane: Lane[Nodes, Outcome], i: int, f: Nodes) -> None:
        """Link bytes: hidden states between stages, node headers from the draft."""
        self.share.rec.link_bytes[i] = _nodes(f[1]) * (self.node_bytes if i
                                                       else self.header_bytes)


def simulate_specpipe(p: Profile, outcomes: Callable[[int], Outcome], new_tokens: int,
                      levels: LevelModel | None,
                      recovery: RecoveryModel = NO_RECOVERY_MODEL) -> SimResult:
    """Algorithm 1 for one request (``pp`` when ``levels`` is None); see :class:`PipeSchedule`."""
    return simulate_alone(p, PipeSchedule(p, outcomes, new_tokens, levels, recovery))


def simulate_alone(p: Profile, run: RequestSchedule) -> SimResult:
    """One request with the pipeline to itself, step by step until it is done."""
    steps = []
    while not run.done:
        steps.append(price_step(p, [run.step()], run.source))
    return SimResult(run.method, run.new_tokens, steps, p.link)


def specinfer_tree_nodes(branching: Sequence[int]) -> int:
    """Nodes of a full static tree (root included) with per-level branching."""
    total, width = 1, 1
    for b in branching:
        width *= b
        total += width
    return total


class SpecInferSchedule(RequestSchedule):
    """SpecInfer for one request: a static tree drafted first, then one pass through all
    stages, one stage per step.

    ``accepted(j)`` is how many tree tokens pass j accepts; the pass commits
    that many plus the target's own next token.
    """

    method = "specinfer"

    def __init__(self, p: Profile, accepted: Callable[[int], int], new_tokens: int,
                 tree_nodes: int, draft_pass_s: float):
        self.m, self.accepted, self.new_tokens = p.m, accepted, new_tokens
        self.tree_nodes, self.draft_pass_s = tree_nodes, draft_pass_s
        self.node_bytes, self.header_bytes = p.node_bytes, p.header_bytes
        self.committed, self.j, self.stage = 1, 0, 0

    def step(self) -> Share:
        """The request's share of the next step; advances its state."""
        i, nodes = self.stage, self.tree_nodes
        rec = _rec(self.m)
        share = Share(rec)
        if i == 0:
            rec.draft_s, rec.draft_serial, rec.draft_tokens = self.draft_pass_s, True, nodes
        rec.stage_tokens[i] = nodes
        rec.link_bytes[i] = nodes * (self.header_bytes if i == 0 else self.node_bytes)
        self.stage = (i + 1) % self.m
        if self.stage == 0:
            share.head = True
            n = min(self.accepted(self.j) + 1, self.new_tokens - self.committed)
            self.j += 1
            rec.verified, rec.hits = n, n - 1
            self.committed += n
        return share


def simulate_specinfer(p: Profile, accepted: Callable[[int], int], new_tokens: int,
                       tree_nodes: int, draft_pass_s: float) -> SimResult:
    """SpecInfer for one request; see :class:`SpecInferSchedule`."""
    return simulate_alone(p, SpecInferSchedule(p, accepted, new_tokens, tree_nodes,
                                               draft_pass_s))


@dataclass
class BatchSim:
    """Simulated steps of several requests sharing the pipeline, and what each saw."""

    method: str
    batch: int
    steps: list[StepRecord]
    clock_s: float  # pipelined time until the last request finished
    decode_tokens: int  # over all requests
    request_tbt_s: list[float]  # per request: its decode time / its decode tokens
    gaps_s: list[float]  # every time between two consecutive tokens of one request
    widths: list[int] = field(default_factory=list)  # each request's, where one was chosen

    @property
    def throughput(self) -> float:
        """Decode tokens per second over all requests."""
        return self.decode_tokens / self.clock_s if self.clock_s else 0.0

    @property
    def tbt_ms(self) -> float:
        """Mean over requests of each request's own time between tokens."""
        return 1e3 * sum(self.request_tbt_s) / len(self.request_tbt_s)

    def gap_percentile_ms(self, q: float) -> float:
        """The q-th percentile (0..100) of the times between a request's tokens."""
        gaps = sorted(self.gaps_s)
        return 1e3 * gaps[min(len(gaps) - 1, math.ceil(q / 100 * len(gaps)) - 1)]


def simulate_batch(p: Profile, runs: Sequence[RequestSchedule], concurrency: int,
                   start_steps: Sequence[int] | None = None) -> BatchSim:
    """Requests sharing the pipeline, every step priced by :func:`price_step`.

    At most ``concurrency`` requests are in the pipeline; the others wait and join at a
    step boundary when one finishes (iteration-level turns with ``concurrency`` 1).
    ``start_steps`` holds a request back until that step (micro-batches entering the
    pipeline one step apart).  A request's TBT runs from the step it joins to its last
    token: waiting for a turn is queueing, not time between tokens.
    """
    if not runs:
        raise ValueError("no requests to simulate")
    starts = list(start_steps) if start_steps is not None else [0] * len(runs)
    pending = list(range(len(runs)))
    # admission by the scheduling core (slots only: a simulated pipeline has no KV pool,
    # and a request's prefill is priced as its first pass)
    sched = Scheduler(concurrency, 1, pipelined=False)
    running: list[int] = []
    steps: list[StepRecord] = []
    joined: dict[int, float] = {}
    last: dict[int, float] = {}
    tbt: list[float] = []
    gaps: list[float] = []
    clock, step_no, decoded = 0.0, 0, 0
    while pending or not sched.idle:
        for r in [r for r in pending if starts[r] <= step_no]:
            pending.remove(r)
            sched.add(Ticket(r, 0))
        for a in sched.schedule().admit:
            r = cast(int, a.rid)
            running.append(r)
            joined[r] = last[r] = clock
        if not running:
            step_no += 1
            continue
        before = [runs[r].committed for r in running]
        rec = price_step(p, [runs[r].step() for r in running], runs[running[0]].source)
        steps.append(rec)
        clock += rec.pipelined_s(p.link)
        step_no += 1
        for r, b in zip(running, before, strict=True):
            new = runs[r].committed - b
            if new:
                # tokens a pass commits together arrive together: one gap, then none
                gaps += [clock - last[r]] + [0.0] * (new - 1)
                last[r] = clock
                decoded += new
        done = [r for r in running if runs[r].done]
        for r in done:
            running.remove(r)
            tbt.append((clock - joined[r]) / max(runs[r].new_tokens - 1, 1))
        sched.close([], done=done)
    return BatchSim(runs[0].method, len(runs), steps, clock, decoded, tbt, gaps)


# ---- fitting a profile and a trace to recorded runs ------------------------------------


def fit_profile(results: Sequence[GenerationResult], node_bytes: int | None = None,
                samples: bool = True) -> Profile:
    """Compute per (stage, node count), pruning and draft time, from records.

    The curves hold means; with ``samples`` the profile also keeps every
    measurement so the simulator can draw from them.  The last stage's curve
    keeps the LM head inside (it verifies whenever it works), so ``head_s`` is 0.
    """
    if not results:
        raise ValueError("no recorded generations to fit a profile to")
    m = results[0].stages
    by: list[dict[int, list[float]]] = [defaultdict(list) for _ in range(m)]
    prune: list[list[float]] = [[] for _ in range(m)]
    draft: dict[int, list[float]] = defaultdict(list)
    sync: list[float] = []
    bytes_per_node: list[float] = []
    for res in results:
        for s in res.steps:
            for i in range(m):
                if s.stage_tokens[i]:
                    by[i][s.stage_tokens[i]].append(s.stage_s[i])
                if s.verified:
                    prune[i].append(s.prune_s[i])
                if i and s.link_bytes[i] and s.stage_tokens[i - 1] and not s.draft_serial:
                    # pruning only removes nodes, so the largest ratio is the per-node size
                    bytes_per_node.append(s.link_bytes[i] / s.stage_tokens[i - 1])
            if s.draft_tokens and not s.draft_serial:
                draft[s.draft_tokens].append(s.draft_s)
    curves = []
    for i in range(m):
        pts = sorted(by[i].items())
        curves.append(TimeCurve([n for n, _ in pts], [sum(v) / len(v) for _, v in pts])
                      if pts else TimeCurve.constant(0.0))
    dpts = sorted(draft.items())
    return Profile(
        stage_time=curves,
        prune_s=[sum(v) / len(v) if v else 0.0 for v in prune],
        draft_time=(TimeCurve([n for n, _ in dpts], [sum(v) / len(v) for _, v in dpts])
                    if dpts else TimeCurve.constant(0.0)),
        draft_sync_s=sum(sync) / len(sync) if sync else 0.0,
        link=results[0].link,
        node_bytes=node_bytes or (round(max(bytes_per_node)) if bytes_per_node else 0),
        stage_samples=[dict(b) for b in by] if samples else None,
        prune_samples=prune if samples else None,
        draft_samples=dict(draft) if samples else None)


def specpipe_outcomes(res: GenerationResult) -> list[Outcome]:
    """The hit/miss trace of a recorded specpipe/pp run.

    A hit records how many in-flight levels behind the new root survived the
    pruning: the busy stages between stage 2 and stage m-1 in the next step.
    """
    m, out = res.stages, []
    for t, s in enumerate(res.steps):
        if not s.verified:
            continue
        if not s.hits:
            out.append(MISS)
            continue
        nxt = res.steps[t + 1] if t + 1 < len(res.steps) else None
        kept = 0
        if nxt is not None:
            for i in range(m - 2, 0, -1):  # stage m-1 holds depth 1, stage m-2 depth 2, ...
                if not nxt.stage_tokens[i]:
                    break
                kept += 1
            kept = kept if kept < m - 2 else math.inf
        else:
            kept = math.inf
        out.append(kept)
    return out


def fit_levels(results: Sequence[GenerationResult]) -> LevelModel:
    """Level sizes of recorded specpipe runs: entering size and survival per hit."""
    entering: list[float] = []
    before, after = 0.0, 0.0
    for res in results:
        m, steps = res.stages, res.steps
        for t, s in enumerate(steps):
            prev_miss = t > 0 and steps[t - 1].verified and not steps[t - 1].hits
            if s.stage_tokens[0] and not prev_miss and t > 0:
                entering.append(s.stage_tokens[0])
            if not (s.verified and s.hits) or t + 1 >= len(steps):
                continue
            # a level at stage i (not the root's child) moves to stage i+1, pruned once
            for i in range(m - 2):
                a, b = s.stage_tokens[i], steps[t + 1].stage_tokens[i + 1]
                if a and b:
                    before += a
                    after += b
    width, topk = results[0].width, results[0].topk
    cap = sum(entering) / len(entering) if entering else float(width)
    return LevelModel(cap=min(cap, width), branching=float(topk),
                      survival=after / before if before else 1.0)


def specinfer_accepted(res: GenerationResult) -> list[int]:
    """Tree tokens accepted per pass of a recorded specinfer run."""
    return [s.verified - 1 for s in res.steps if s.verified]


def simulate_like(res: GenerationResult, profile: Profile,
                  levels: LevelModel | None = None) -> SimResult:
    """Simulate a recorded request from its own trace with a (fitted) profile."""
    n = len(res.tokens)
    if res.method == "ar":
        return simulate_ar(profile, n)
    if res.method in ("pp", "specpipe"):
        trace = specpipe_outcomes(res)
        lv = None if res.method == "pp" else (levels or fit_levels([res]))
        return simulate_specpipe(profile, lambda v: trace[v] if v < len(trace) else HIT,
                                 n, lv)
    if res.method == "specinfer":
        acc = specinfer_accepted(res)
        passes = [s for s in res.steps if s.draft_serial]
        nodes = round(sum(s.draft_tokens for s in passes) / len(passes)) if passes else 1
        draft = sum(s.draft_s for s in passes) / len(passes) if passes else 0.0
        return simulate_specinfer(profile, lambda j: acc[j] if j < len(acc) else 0, n,
                                  nodes, draft)
    raise ValueError(f"cannot simulate method {res.method!r}")


def validate(results: Sequence[GenerationResult]) -> list[dict[str, Any]]:
    """Per (method, source): the engine's pipelined time vs the simulator's, same traces.

    The profile is fitted once per (method, source) over all its prompts, so it
    is an average, not each step's own measurement.
    """
    groups: dict[tuple[str, str], list[GenerationResult]] = defaultdict(list)
    for r in results:
        groups[(r.method, r.source)].append(r)
    rows = []
    for (method, source), rs in groups.items():
        prof = fit_profile(rs)
        levels = fit_levels(rs) if method == "specpipe" else None
        sims = [simulate_like(r, prof, levels) for r in rs]
        eng = sum(r.pipelined_s for r in rs)
        sim = sum(s.pipelined_s for s in sims)
        dec = sum(r.decode_tokens for r in rs)
        rows.append({
            "method": method, "source": source, "prompts": len(rs), "decode_tokens": dec,
            "engine_steps": sum(len(r.steps) for r in rs),
            "sim_steps": sum(len(s.steps) for s in sims),
            "engine_pipelined_s": eng, "sim_pipelined_s": sim,
            "engine_tbt_ms": 1e3 * eng / dec if dec else None,
            "sim_tbt_ms": 1e3 * sim / dec if dec else None,
            "rel_err": (sim - eng) / eng if eng else None,
            "levels": dataclasses.asdict(levels) if levels else None,
        })
    return rows


# ---- rate mode: a hit-rate curve instead of a trace ------------------------------------


def bernoulli_outcomes(hit_rate: float, seed: int = 0) -> Callable[[int], Outcome]:
    """Independent hits with probability ``hit_rate`` (each hit keeps every level)."""
    rng = random.Random(seed)
    memo: list[Outcome] = []

    def draw(v: int) -> Outcome:
        while len(memo) <= v:
            memo.append(HIT if rng.random() < hit_rate else MISS)
        return memo[v]
    return draw


def specinfer_expected_accepted(branching: Sequence[int], topk_hit: Callable[[int], float]
                                ) -> float:
    """E[accepted tokens] of a static tree: level d accepts with P(target in draft top-b_d)."""
    total, alive = 0.0, 1.0
    for b in branching:
        alive *= topk_hit(b)
        total += alive
    return total


def specinfer_accept_sampler(branching: Sequence[int], topk_hit: Callable[[int], float],
                             seed: int = 0) -> Callable[[int], int]:
    """Accepted tokens per pass, drawn level by level from the top-k hit curve."""
    rng = random.Random(seed)
    memo: list[int] = []

    def draw(j: int) -> int:
        while len(memo) <= j:
            n = 0
            for b in branching:
                if rng.random() >= topk_hit(b):
                    break
                n += 1
            memo.append(n)
        return memo[j]
    return draw


def eq1_tbt(stage_s: Sequence[float], hit_rate: float, refill: int | None = None) -> float:
    """Eq. (1): max_i t_i + (1 - P) * sum_{i <= refill} t_i.

    As printed, the refill sums all m stages; in our schedule a miss costs the
    m-1 steps in which the new root crosses stages 1..m-1 (its verification on
    stage m is the next token's own step), so callers pass ``refill = m - 1``.
    """
    n = len(stage_s) if refill is None else refill
    return max(stage_s) + (1.0 - hit_rate) * sum(stage_s[:n])


# ---- the paper's testbed ---------------------------------------------------------------

NAMED_CALIBRATIONS = ("fig11", "l40")
LAYER_PARAMS_70B = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672  # §4.5, GQA


@dataclass
class LayerTimeFile:
    """One decoder layer's time against tokens, measured by ``treepipe sweep layer-time``."""

    path: str
    model: str
    device: str
    dtype: str
    layer: Any
    context: Any
    curve: TimeCurve  # seconds per layer for n tokens

    def describe(self) -> str:
        """Which measurement this is, in one line."""
        xs = self.curve.tokens
        return (f"{self.path} (model {self.model}, device {self.device}, dtype {self.dtype}, "
                f"layer {self.layer}, context {self.context}; {len(xs)} points, "
                f"{xs[0]}..{xs[-1]} tokens)")


_LAYER_FILES: dict[tuple[str, int, int], LayerTimeFile] = {}


def load_layer_time(path: str) -> LayerTimeFile:
    """The ``sweep_layer_time.json`` at ``path``; a TreepipeError names what is wrong."""
    fix = "give the sweep_layer_time.json that treepipe sweep layer-time --out DIR writes"
    f = Path(path)
    if not f.is_file():
        raise TreepipeError(f"--calibrate {path}: neither {' nor '.join(NAMED_CALIBRATIONS)} "
                            f"nor a file; {fix}")
    st = f.stat()
    key = (str(f.resolve()), st.st_mtime_ns, st.st_size)
    if key in _LAYER_FILES:  # the projection asks for the curve once per simulated setting
        return _LAYER_FILES[key]
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise TreepipeError(f"--calibrate {path}: unreadable ({type(e).__name__}: {msg}); "
                            f"{fix}") from None
    if not isinstance(data, dict) or str(data.get("figure")) != "9":
        fig = data.get("figure") if isinstance(data, dict) else None
        raise TreepipeError(f"--calibrate {path}: not a Figure 9 layer-time sweep (figure "
                            f"{fig!r}); {fix}")
    points = data.get("points")
    if not isinstance(points, list) or not points:
        raise TreepipeError(f"--calibrate {path}: no points (need [{{\"tokens\": n, \"ms\": "
                            f"x}}, ...]); re-run treepipe sweep layer-time")
    tokens: list[int] = []
    ms: list[float] = []
    for k, pt in enumerate(points):
        try:
            n, t = pt["tokens"], float(pt["ms"])
            ok = isinstance(n, int) and n >= 1 and math.isfinite(t) and t > 0
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise TreepipeError(f"--calibrate {path}: point {k} ({json.dumps(pt)[:60]}) needs "
                                "integer tokens >= 1 and ms > 0; re-run treepipe sweep "
                                "layer-time")
        if n in tokens:
            raise TreepipeError(f"--calibrate {path}: {n} tokens measured twice; keep one "
                                "point per token count")
        tokens.append(n)
        ms.append(t)
    cfg = data.get("config") if isinstance(data.get("config"), dict) else {}
    out = LayerTimeFile(path, str(cfg.get("model", "unknown")), str(cfg.get("device", "unknown")),
                        str(cfg.get("dtype", "unknown")), cfg.get("layer", "unknown"),
                        cfg.get("context", "unknown"),
                        TimeCurve(tokens, [t * 1e-3 for t in ms]))
    _LAYER_FILES[key] = out
    return out


@dataclass
class PaperSetting:
    """Llama-3.1-70B on 8 RTX 3090 (10 layers each), 10 GbE, Llama-3.2-1B draft on an L40.

    Every number is either read from the paper (section given) or an assumption,
    and :func:`paper_assumptions` lists them all.
    """

    stages: int = 8
    layers_per_stage: int = 10
    width: int = 64  # §4.1
    topk: int = 16  # §4.1
    # Per-layer decode time of one 70B layer on an RTX 3090 (1 token, context 2048).
    # "fig11": from PP's HumanEval-X TBT (302.39 ms, Figure 11): PP runs 80 layers +
    # the LM head + 8 link hops per token.  "l40": §3.3.1's 374 ms per token on 4
    # pipelined L40s, scaled by memory bandwidth (L40 864 GB/s, 3090 936 GB/s).
    # Anything else is the path of a `treepipe sweep layer-time` JSON: the measured
    # curve replaces the calibrated constant and the Figure 9 shape below.
    calibrate: str = "fig11"
    pp_tbt_ms: float = 302.39  # Figure 11, HumanEval-X
    l40_tbt_ms: float = 374.0  # §3.3.1
    l40_bw_gbs: float = 864.0
    rtx3090_bw_gbs: float = 936.0
    # LM head 8192 x 128256 vs one layer (GQA): 1.05 G vs 0.86 G weights, same bytes/FLOP
    head_layers: float = 8192 * 128256 / LAYER_PARAMS_70B
    # Figure 9: layer time is flat within a 64-token block and leaps at each multiple of
    # 64, growing linearly overall.  Assumed: +5 % across a block, each leap adds 60 % of
    # the 1-token time (the figure gives no numbers).
    block_slope: float = 0.05
    block_leap: float = 0.60
    draft_level_ms: float = 17.0  # §3.3.1: Llama-3.2-1B TBT on an L40, per tree level
    prune_ms: float = 1.0  # assumed residue: ~5 ms pruning (§4.2) mostly overlapped
    link_latency_us: float = 200.0  # assumed 10 GbE TCP round
    link_gbps: float = 10.0  # 10 GbE (§4.2)
    hidden_bytes: int = 8192 * 2  # bf16 hidden state, 16 KiB (§4.2)
    # Figure 10 / §1: SpecPipe's level accuracy "beyond 95%" at w = 64, k = 16.
    hit_rate: float = 0.95
    # Figure 7: Llama-3.2-1B top-k hit ratio against Llama-3.1-70B.  The text gives
    # 0.99 at k = 32; top-1 and top-3 are assumptions read off the curve's shape.
    topk_hit: dict[int, float] = field(default_factory=lambda: {1: 0.75, 3: 0.90, 8: 0.96,
                                                                32: 0.99})
    branching: tuple[int, ...] = SPECINFER_BRANCHING  # §4 baselines
    new_tokens: int = 4096  # long enough that the pipeline fill does not matter
    # Batching: every request packed beside the first makes a stage read its KV cache
    # too (the per-layer time holds one request's).  K and V of 8 KV heads × 128 dims in
    # bf16 per layer and token (§4.5), a context of 2048 (Figure 9), 3090 bandwidth.
    context: int = 2048
    kv_bytes_per_token: int = 2 * 8 * 128 * 2
    kv_bw_gbs: float = 936.0

    @property
    def layer_file(self) -> LayerTimeFile | None:
        """The measured layer-time file when ``calibrate`` names one."""
        return None if self.calibrate in NAMED_CALIBRATIONS else load_layer_time(self.calibrate)

    def layer_ms(self) -> float:
        """Per-layer time at one token under the chosen calibration."""
        if self.calibrate == "fig11":
            # PP per token: 80 layers + head, plus a hop per stage (8 x latency + 16 KiB)
            link = self.stages * self._link().cost(self.hidden_bytes + 8) * 1e3
            return (self.pp_tbt_ms - link) / (self.stages * self.layers_per_stage
                                              + self.head_layers)
        if self.calibrate == "l40":
            per_layer_l40 = self.l40_tbt_ms / (self.stages * self.layers_per_stage
                                               + self.head_layers)
            return per_layer_l40 * self.l40_bw_gbs / self.rtx3090_bw_gbs
        lf = self.layer_file
        assert lf is not None
        return lf.curve(1) * 1e3

    def layer_factor(self, n: int) -> float:
        """Figure 9's shape: flat-ish within a 64-token block, a leap per block.

        The leaps add up (time linear in tokens overall, as Figure 9 shows), so a
        packed batch of many levels costs in proportion to its nodes.
        """
        block = (max(n, 1) - 1) // 64
        return (1 + self.block_leap * block) * (1 + self.block_slope * ((n - 1) % 64) / 63)

    def layer_curve(self, max_nodes: int = 192) -> TimeCurve:
        """Seconds per layer against nodes, up to ``max_nodes`` (linear beyond)."""
        lf = self.layer_file
        if lf is not None:
            return lf.curve
        t1 = self.layer_ms() * 1e-3
        # both ends of every 64-token block, so the staircase is exact up to max_nodes
        blocks = max(3, -(-max_nodes // 64))
        pts = sorted({1, 2, 8, 21, 32, 63, 64}
                     | {64 * b + e for b in range(1, blocks) for e in (1, 64)})
        return TimeCurve(pts, [t1 * self.layer_factor(n) for n in pts])

    def _link(self) -> LinkModel:
        return LinkModel(self.link_latency_us * 1e-6, self.link_gbps * 1e9 / 8)

    def profile(self, max_nodes: int = 192) -> Profile:
        """The setting as a simulator profile, with stage curves exact up to ``max_nodes``."""
        layer = self.layer_curve(max_nodes)
        stage = layer.scaled(self.layers_per_stage)
        return Profile(
            stage_time=[stage] * self.stages,
            head_s=self.head_layers * layer(1),
            prune_s=[self.prune_ms * 1e-3] * self.stages,
            draft_time=TimeCurve.constant(self.draft_level_ms * 1e-3),
            link=self._link(), node_bytes=self.hidden_bytes + 8,
            request_s=self.layers_per_stage * self.context * self.kv_bytes_per_token
            / (self.kv_bw_gbs * 1e9))

    def topk_curve(self, k: int) -> float:
        xs = sorted(self.topk_hit)
        return TimeCurve(xs, [self.topk_hit[x] for x in xs])(k)

    def level_accuracy(self, w: int) -> float:
        """A tree level's hit rate at width ``w`` (the adaptive width prices widths by it):
        a chain holds the draft's top-1 (Figure 7, ``topk_hit[1]``), a level of
        ``width`` the paper's ``hit_rate`` (Figure 10), linear in log w between (Figure
        10: the gain diminishes quickly), ``hit_rate`` beyond; 0 without speculation."""
        if w <= 0:
            return 0.0
        lo, hi = self.topk_curve(1), self.hit_rate
        if w >= self.width or self.width <= 1:
            return hi
        return lo + (hi - lo) * math.log(w) / math.log(self.width)


def paper_request(ps: PaperSetting, prof: Profile, method: str, seed: int = 0,
                  tokens: int | None = None, width: int | None = None) -> RequestSchedule:
    """One request of ``method`` (pp, specinfer or specpipe) in the paper's setting;
    ``width``: a specpipe tree of that width, hitting at :meth:`PaperSetting.level_accuracy`
    (0: no speculation, as pp), instead of ``ps.width`` at ``ps.hit_rate``."""
    n = ps.new_tokens if tokens is None else tokens
    if method == "pp" or (method == "specpipe" and width == 0):
        return PipeSchedule(prof, lambda v: MISS, n, None)
    if method == "specpipe":
        w, hit = (ps.width, ps.hit_rate) if width is None else (width, ps.level_accuracy(width))
        return PipeSchedule(prof, bernoulli_outcomes(hit, seed), n,
                            LevelModel(cap=w, branching=ps.topk, survival=1.0))
    if method == "specinfer":
        # the static tree is drafted one level per draft forward before the pass (serial)
        return SpecInferSchedule(
            prof, specinfer_accept_sampler(ps.branching, ps.topk_curve, seed), n,
            specinfer_tree_nodes(ps.branching), len(ps.branching) * ps.draft_level_ms * 1e-3)
    raise ValueError(f"no paper request for method {method!r}")


def project(ps: PaperSetting, seed: int = 0) -> dict[str, Any]:
    """Simulated TBT of PP, SpecInfer and SpecPipe in the paper's setting."""
    prof = ps.profile()
    pp, si, sp = (simulate_alone(prof, paper_request(ps, prof, m, seed))
                  for m in ("pp", "specinfer", "specpipe"))
    nodes = specinfer_tree_nodes(ps.branching)
    step = prof.stage_time[0](ps.width)
    eq2 = (max(step, prof.stage_time[-1](1) + prof.head_s)) * (
        1 + (1 - ps.hit_rate) * (ps.stages - 1))
    lf = ps.layer_file
    return {
        "setting": {k: v for k, v in dataclasses.asdict(ps).items()},
        "calibration": lf.describe() if lf else ps.calibrate,
        "layer_ms": ps.layer_ms(),
        "tree_nodes_specinfer": nodes,
        "specinfer_expected_tokens_per_pass":
            1 + specinfer_expected_accepted(ps.branching, ps.topk_curve),
        "tbt_ms": {"pp": pp.tbt_ms, "specinfer": si.tbt_ms, "specpipe": sp.tbt_ms},
        "paper_ms": dict(PAPER_HUMANEVAL_X),
        "eq2_specpipe_ms": 1e3 * eq2,
    }


PAPER_HUMANEVAL_X = {"pp": 302.39, "specinfer": 117.92, "specpipe": 54.67}  # Figure 11 / §4.2

# Assumptions the projection depends on, each with an alternative value, for the
# sensitivity table: (field, alternative, why).
SENSITIVITY: list[tuple[str, Any, str]] = [
    ("calibrate", "l40", "per-layer time from §3.3.1's 4×L40 374 ms instead of Figure 11's PP"),
    ("hit_rate", 0.93, "SpecPipe level accuracy 0.93 instead of 0.95"),
    ("hit_rate", 0.97, "SpecPipe level accuracy 0.97 instead of 0.95"),
    ("topk_hit", {1: 0.70, 3: 0.87, 8: 0.95, 32: 0.99}, "1B top-1 0.70 / top-3 0.87"),
    ("topk_hit", {1: 0.80, 3: 0.93, 8: 0.97, 32: 0.99}, "1B top-1 0.80 / top-3 0.93"),
    ("draft_level_ms", 0.0, "SpecInfer's draft fully hidden (0 ms serial draft)"),
    ("block_slope", 0.20, "layer time +20 % from 1 to 64 tokens (Figure 9) instead of +5 %"),
    ("prune_ms", 5.0, "pruning not overlapped (5 ms per step, §4.2)"),
    ("link_latency_us", 1000.0, "1 ms link latency instead of 200 µs"),
]


def sensitivity_rows(ps: PaperSetting) -> list[tuple[str, Any, str]]:
    """The sensitivity rows that apply to ``ps``'s calibration.

    With a measured layer-time file the Figure 9 shape is not assumed (no block_slope
    row) and the calibration row compares the file with Figure 11's PP.
    """
    if ps.layer_file is None:
        return list(SENSITIVITY)
    rows = [r for r in SENSITIVITY if r[0] not in ("calibrate", "block_slope")]
    return [("calibrate", "fig11", "per-layer time from Figure 11's PP (fig11) instead of "
             "the measured file")] + rows


def paper_assumptions(ps: PaperSetting) -> list[str]:
    """The projection's inputs, one line each, with where they come from."""
    lf = ps.layer_file
    if lf is None:
        layer = [
            f"per-layer time at 1 token: {ps.layer_ms():.2f} ms ({ps.calibrate}: "
            + ("from PP's 302.39 ms HumanEval-X TBT, Figure 11, minus 8 link hops)"
               if ps.calibrate == "fig11" else
               "§3.3.1's 374 ms on 4 pipelined L40s / 81.2 layer-equivalents × 864/936 GB/s)"),
            f"layer time vs tokens (Figure 9 shape): +{100 * ps.block_slope:.0f} % across a "
            f"64-token block, +{100 * ps.block_leap:.0f} % of the 1-token time per 64-token "
            "leap (assumed magnitudes)"]
    else:
        layer = [
            f"per-layer time vs tokens measured: {lf.describe()}; {ps.layer_ms():.2f} ms at "
            "1 token, interpolated between points, linear beyond the last"]
    return [
        f"m = {ps.stages} stages × {ps.layers_per_stage} layers (§4 testbed), the last stage "
        f"also runs the LM head = {ps.head_layers:.2f} layer-equivalents (8192×128256 weights "
        "vs a GQA layer's 0.86 G)",
        *layer,
        f"w = {ps.width}, k = {ps.topk} (§4.1); SpecPipe level hit rate P = {ps.hit_rate} "
        "(§1/§3.3.1: 'beyond 95%'), independent per step; every level holds w nodes",
        f"draft: Llama-3.2-1B on an L40, {ps.draft_level_ms:g} ms per tree level (§3.3.1); "
        "SpecPipe overlaps it with the stages, SpecInfer drafts its 8 levels before each pass",
        "SpecInfer tree: branching ⟨1,1,3,1,1,1,1,1⟩ (§4) = "
        f"{specinfer_tree_nodes(ps.branching)} nodes; level d accepts with the draft's "
        f"top-b_d hit ratio {ps.topk_hit} (Figure 7: 0.99 at k = 32 from the text; top-1/3 "
        "assumed)",
        f"links: {ps.link_latency_us:g} µs latency, {ps.link_gbps:g} Gbit/s (10 GbE), "
        f"{ps.hidden_bytes + 8} bytes per node (bf16 hidden state, §4.2: 16 KiB)",
        f"pruning: {ps.prune_ms:g} ms per step not hidden by the transfer (§4.2: ~5 ms, "
        "overlapped with the transfer)",
        f"TBT over {ps.new_tokens} decode tokens (the pipeline fill is negligible)",
    ]


def sensitivity(ps: PaperSetting, seed: int = 0) -> list[dict[str, Any]]:
    """The projection with one assumption changed at a time."""
    base = project(ps, seed)["tbt_ms"]
    rows = []
    for name, value, why in sensitivity_rows(ps):
        alt = project(dataclasses.replace(ps, **{name: value}), seed)["tbt_ms"]
        rows.append({"assumption": name, "value": value, "why": why, "tbt_ms": alt,
                     "delta_pct": {k: 100 * (alt[k] - base[k]) / base[k] for k in base}})
    return rows


# ---- the paper's multi-request setting (§4.4, Figures 16 and 17) ------------------------

BATCH_METHODS = ("pp-continuous", "specinfer", "specpipe", "specpipe-db",
                 "specpipe-db-adaptive")
BATCH_TOKENS = 1024  # decode tokens per request under load: B of them per method and B
BATCH_NAMES = {"pp-continuous": "PP (continuous)", "specinfer": "SpecInfer",
               "specpipe": "SpecPipe", "specpipe-db": "SpecPipe-DB",
               "specpipe-db-adaptive": "SpecPipe-DB, adaptive w"}
# §4.4 / abstract: for B >= 2 SpecPipe-DB has 1.64-2.08x PP-vLLM's throughput and
# 1.61-2.06x lower TBT.  The paper gives no per-B numbers for Figures 16 and 17.
PAPER_FIG16 = {"from_batch": 2, "throughput_ratio": (1.64, 2.08), "tbt_ratio": (1.61, 2.06)}


def simulate_paper_batch(ps: PaperSetting, method: str, batch: int, seed: int = 0,
                         tokens: int | None = None) -> BatchSim:
    """``batch`` requests of ``method`` under load in the paper's setting (§4.4).

    * ``pp-continuous``: pp requests in micro-batches entering one step apart (request
      j starts at step j mod m), so every stage holds ~B/m of them each step, one token
      per request per pass: what vLLM's pipeline parallelism does.
    * ``specinfer``: iteration-level scheduling, every running request's static tree in
      each pass, packed.
    * ``specpipe``: iteration-level turns: one request in the pipeline at a time.
    * ``specpipe-db``: every request's level packed per stage per step (``batch.py``).
    * ``specpipe-db-adaptive``: the same, each request at the width the adaptive policy
      chooses for B requests (:func:`adaptive_widths`).

    Request j draws its hits with seed ``seed + j``, so request 0 is :func:`project`'s.
    """
    if method not in BATCH_METHODS:
        raise ValueError(f"unknown batched method {method!r}; use one of {BATCH_METHODS}")
    base = {"pp-continuous": "pp", "specpipe-db": "specpipe",
            "specpipe-db-adaptive": "specpipe"}.get(method, method)
    widths: list[int | None] = [None] * batch
    if method == "specpipe-db-adaptive":
        widths = list(adaptive_widths(ps, batch).values())
    per_step = {"pp-continuous": -(-batch // ps.stages), "specinfer": batch, "specpipe": 1,
                "specpipe-db": batch, "specpipe-db-adaptive": batch}[method]
    nodes = {"pp": 1, "specinfer": specinfer_tree_nodes(ps.branching),
             "specpipe": ps.width}[base]
    prof = ps.profile(max_nodes=per_step * nodes)
    runs = [paper_request(ps, prof, base, seed + j, tokens, widths[j]) for j in range(batch)]
    starts = [j % ps.stages for j in range(batch)] if method == "pp-continuous" else None
    sim = simulate_batch(prof, runs, 1 if method == "specpipe" else batch, starts)
    sim.method = method
    sim.widths = [w for w in widths if w is not None]
    return sim


def decode_step_s(p: Profile, nodes: float, batch: int) -> float:
    """Pipelined seconds of a decode step of ``batch`` requests with ``nodes`` nodes on
    every front stage (split evenly over the requests), each verifying its root on the
    last stage: the adaptive width's T(N), priced by :func:`price_step`."""
    total, m = max(_nodes(nodes), 1), p.m
    shares = []
    for j in range(batch):
        k = total // batch + (1 if j < total % batch else 0)
        rec = _rec(m)
        rec.stage_tokens = [k] * (m - 1) + [1] if m > 1 else [max(k, 1)]
        rec.draft_tokens, rec.verified = k, 1
        rec.link_bytes = [k * p.header_bytes] + [k * p.node_bytes] * (m - 2) + (
            [p.node_bytes] if m > 1 else [])
        shares.append(Share(rec, head=True, prune=True))
    return price_step(p, shares).pipelined_s(p.link)


def adaptive_widths(ps: PaperSetting, batch: int) -> dict[int, int]:
    """The widths :class:`~protocol.scheduling.width.AdaptiveWidth` (the engine's and the
    draft service's policy, up to ``ps.width``) chooses for ``batch`` alike requests in
    the paper's setting: its rates are the level accuracies (as its pooled rates would
    learn them), its step cost the profile's decode step."""
    prof = ps.profile(max_nodes=batch * ps.width)
    policy = AdaptiveWidth(ps.width, ps.stages, lambda n: decode_step_s(prof, n, batch))
    policy.pooled = {w: ps.level_accuracy(w) for w in policy.widths}
    policy.pooled_n = 1 << 30  # learnt long ago
    return {int(r): w for r, w in policy.choose(list(range(batch))).items()}


def project_batch(ps: PaperSetting, batches: Sequence[int], seed: int = 0,
                  tokens: int | None = None) -> dict[str, Any]:
    """Throughput and TBT of every batched method at each B, beside Figure 16's ratios."""
    rows = []
    for b in batches:
        sims = {m: simulate_paper_batch(ps, m, b, seed, tokens) for m in BATCH_METHODS}
        db, pp = sims["specpipe-db"], sims["pp-continuous"]
        ad = sims["specpipe-db-adaptive"]
        rows.append({
            "batch": b,
            "throughput_tok_s": {m: s.throughput for m, s in sims.items()},
            "tbt_ms": {m: s.tbt_ms for m, s in sims.items()},
            "p99_tbt_ms": {m: s.gap_percentile_ms(99) for m, s in sims.items()},
            "db_over_pp_throughput": db.throughput / pp.throughput,
            "pp_over_db_tbt": pp.tbt_ms / db.tbt_ms,
            "adaptive_widths": sorted(ad.widths),
            "adaptive_over_pp_throughput": ad.throughput / pp.throughput,
            "pp_over_adaptive_tbt": pp.tbt_ms / ad.tbt_ms,
        })
    lf = ps.layer_file
    return {"setting": dataclasses.asdict(ps),
            "calibration": lf.describe() if lf else ps.calibrate,
            "tokens_per_request": ps.new_tokens if tokens is None else tokens,
            "rows": rows, "paper_fig16": dict(PAPER_FIG16)}


def batch_assumptions(ps: PaperSetting) -> list[str]:
    """What the batched projection adds to :func:`paper_assumptions`, one line each."""
    prof = ps.profile()
    t1 = ps.layer_ms()
    flops = 2e-9 * LAYER_PARAMS_70B  # GFLOP per token per layer
    lines = [
        "each stage runs one packed forward per step over every request's nodes: "
        "t_i(total nodes) from the per-layer curve; one LM head per step for all roots; "
        "pruning per verifying request (as stages/speculation/batch.py records it)",
        f"every request beside the first adds its KV read per stage: context {ps.context} × "
        f"{ps.kv_bytes_per_token} B per layer at {ps.kv_bw_gbs:g} GB/s = "
        f"{1e3 * prof.request_s:.3f} ms per stage",
        "the draft expands every request's level in one forward; its time per level stays "
        f"{ps.draft_level_ms:g} ms (it is far below a packed stage step)",
        "PP (continuous): micro-batches enter one step apart (request j at step j mod m), "
        "one token per request per pass, as vLLM's PP; SpecInfer: all running requests' "
        "trees in each pass; SpecPipe: requests take turns, one in the pipeline at a time; "
        "SpecPipe-DB: all B requests' levels in every step",
        "closed loop: B requests start together and run to the end; TBT is per request from "
        "its first step to its last token (queueing for a turn is not TBT); prefill is not "
        "simulated",
        "SpecPipe-DB, adaptive w: each request at the width protocol/scheduling/width.py's "
        "AdaptiveWidth chooses for B alike requests, priced by this profile's decode step; "
        "a level of width w hits at "
        + ", ".join(f"{ps.level_accuracy(w):.3f} (w = {w})" for w in (1, 4, 16, ps.width))
        + f": the draft's top-1 at w = 1 (Figure 7), {ps.hit_rate:g} at w = {ps.width} "
        "(Figure 10), linear in log w between (assumed; Figure 10 gives no numbers); the "
        "policy chooses once, for the steady state (the engine re-chooses every step)",
    ]
    if ps.layer_file is None:
        lines.insert(1, f"a 64-token leap adds {ps.block_leap * t1:.2f} ms per layer: "
                        f"{64 * flops / (ps.block_leap * t1):.0f} TFLOPS effective at "
                        f"{flops:.2f} GFLOP per token and 70B layer")
    return lines


# Assumptions the batched comparison depends on, for its sensitivity table:
# (fields changed together, why).
BATCH_SENSITIVITY: list[tuple[dict[str, Any], str]] = [
    ({"block_leap": 0.30}, "a 64-token leap adds 30 % of the 1-token time (2× the FLOPS) "
                           "instead of 60 %"),
    ({"width": 16, "hit_rate": 0.90}, "w = 16 under load, level hit rate 0.90 (assumed)"),
    ({"width": 16}, "w = 16 under load, hit rate kept at 0.95 (optimistic)"),
    ({"hit_rate": 0.97}, "SpecPipe level accuracy 0.97 instead of 0.95"),
    # the adaptive width's level accuracies below w = 64 (PaperSetting.level_accuracy)
    ({"topk_hit": {1: 0.60, 3: 0.80, 8: 0.92, 32: 0.99}},
     "the draft's top-1 0.60 instead of 0.75 (a chain hits less)"),
    ({"hit_rate": 0.90}, "level accuracy 0.90 at w = 64 instead of 0.95"),
]


def batch_sensitivity(ps: PaperSetting, batches: Sequence[int], seed: int = 0,
                      tokens: int | None = None) -> list[dict[str, Any]]:
    """SpecPipe-DB / continuous PP throughput at each B with one assumption changed, at
    the fixed width and at the adaptive one."""
    rows = []
    for change, why in BATCH_SENSITIVITY:
        alt = dataclasses.replace(ps, **change)
        ratio, adaptive = {}, {}
        for b in batches:
            pp = simulate_paper_batch(alt, "pp-continuous", b, seed, tokens).throughput
            ratio[b] = simulate_paper_batch(alt, "specpipe-db", b, seed, tokens).throughput / pp
            adaptive[b] = simulate_paper_batch(alt, "specpipe-db-adaptive", b, seed,
                                               tokens).throughput / pp
        rows.append({"change": change, "why": why, "db_over_pp_throughput": ratio,
                     "adaptive_over_pp_throughput": adaptive})
    return rows


def batch_markdown(rep: dict[str, Any], sens: Sequence[dict[str, Any]],
                   assumptions: Sequence[str], goal: float = 1.6) -> str:
    """Figure 16/17 tables: throughput and TBT per method and B, ratios, tails, sensitivity."""
    paper = rep["paper_fig16"]
    lo, hi = paper["throughput_ratio"]
    tlo, thi = paper["tbt_ratio"]
    head = "| B | " + " | ".join(BATCH_NAMES[m] for m in BATCH_METHODS)
    lines = [f"Calibration: {rep['calibration']}; {rep['tokens_per_request']} decode tokens "
             "per request.", "", "Throughput (tokens/s) and mean TBT (ms) per method:", "",
             head + " | adaptive widths | DB / PP throughput, fixed w; adaptive "
             "| PP / DB TBT, fixed w; adaptive | paper, DB / PP-vLLM (Fig. 16) |",
             "|--:|" + "--:|" * (len(BATCH_METHODS) + 4)]
    met: dict[str, list[str]] = {"specpipe-db": [], "specpipe-db-adaptive": []}
    missed: dict[str, list[str]] = {"specpipe-db": [], "specpipe-db-adaptive": []}
    for r in rep["rows"]:
        b = r["batch"]
        cells = [f"{r['throughput_tok_s'][m]:.1f} tok/s, {r['tbt_ms'][m]:.1f} ms"
                 for m in BATCH_METHODS]
        ref = (f"{lo:.2f}–{hi:.2f}× / {tlo:.2f}–{thi:.2f}×" if b >= paper["from_batch"]
               else "—")
        ws = sorted(set(r["adaptive_widths"]))
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {', '.join(map(str, ws))} "
                     f"| {r['db_over_pp_throughput']:.2f}×; "
                     f"{r['adaptive_over_pp_throughput']:.2f}× | {r['pp_over_db_tbt']:.2f}×; "
                     f"{r['pp_over_adaptive_tbt']:.2f}× | {ref} |")
        if b >= paper["from_batch"]:
            for m, key in (("specpipe-db", "db_over_pp_throughput"),
                           ("specpipe-db-adaptive", "adaptive_over_pp_throughput")):
                (met if r[key] >= goal else missed)[m].append(str(b))
    lines.append("")
    for m in met:
        lines.append(f"{BATCH_NAMES[m]} ≥ {goal:g}× continuous PP's throughput (issue 14; the "
                     f"paper's lower bound is {lo:.2f}×): met at B = "
                     f"{', '.join(met[m]) or 'none'}; not met at B = "
                     f"{', '.join(missed[m]) or 'none'}.")
    tails = ("pp-continuous", "specpipe-db", "specpipe-db-adaptive", "specpipe")
    lines += ["", "Tail (Figure 17 gives no numbers; the paper: SpecPipe-DB's P99 stays below "
              "vLLM's at every B). Mean / P99 time between a request's tokens (ms):", "",
              "| B | " + " | ".join(BATCH_NAMES[m] for m in tails) + " |",
              "|--:|" + "--:|" * len(tails)]
    for r in rep["rows"]:
        lines.append(f"| {r['batch']} | " + " | ".join(
            f"{r['tbt_ms'][m]:.1f} / {r['p99_tbt_ms'][m]:.1f}" for m in tails) + " |")
    lines += ["", "Assumptions:", ""] + [f"* {a}" for a in assumptions]
    if sens:
        bs = list(sens[0]["db_over_pp_throughput"])
        lines += ["", "SpecPipe-DB / continuous PP throughput with one assumption changed "
                  "(fixed w; adaptive):", "",
                  "| changed assumption | " + " | ".join(f"B={b}" for b in bs) + " |",
                  "|---|" + "--:|" * len(bs)]
        for s in sens:
            lines.append(f"| {s['why']} | " + " | ".join(
                f"{s['db_over_pp_throughput'][b]:.2f}×; "
                f"{s['adaptive_over_pp_throughput'][b]:.2f}×" for b in bs) + " |")
    return "\n".join(lines) + "\n"


# ---- output ----------------------------------------------------------------------------


def validation_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Table: engine pipelined TBT vs simulated TBT per row."""
    lines = ["| method | source | prompts | steps engine / sim | TBT pipelined engine (ms) | "
             "TBT simulated (ms) | error |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['source']} | {r['prompts']} | "
                     f"{r['engine_steps']} / {r['sim_steps']} | {r['engine_tbt_ms']:.2f} | "
                     f"{r['sim_tbt_ms']:.2f} | {100 * r['rel_err']:+.1f}% |")
    return "\n".join(lines) + "\n"


def projection_markdown(proj: dict[str, Any], sens: Sequence[dict[str, Any]],
                        assumptions: Sequence[str]) -> str:
    """Projection table, assumptions and sensitivity."""
    t, paper = proj["tbt_ms"], proj["paper_ms"]
    lines = ["| method | simulated TBT (ms) | paper TBT, HumanEval-X (ms) | difference |",
             "|---|--:|--:|--:|"]
    for k, name in (("pp", "PP"), ("specinfer", "SpecInfer"), ("specpipe", "SpecPipe")):
        lines.append(f"| {name} | {t[k]:.2f} | {paper[k]:.2f} | "
                     f"{100 * (t[k] - paper[k]) / paper[k]:+.1f}% |")
    lines += ["", f"Eq. (2) for SpecPipe with the same numbers: {proj['eq2_specpipe_ms']:.2f} ms; "
              f"SpecInfer commits {proj['specinfer_expected_tokens_per_pass']:.2f} tokens per "
              "pass in expectation.", "", "Assumptions:", ""]
    lines += [f"* {a}" for a in assumptions]
    lines += ["", "| changed assumption | PP (ms) | SpecInfer (ms) | SpecPipe (ms) |",
              "|---|--:|--:|--:|"]
    for r in sens:
        d, a = r["delta_pct"], r["tbt_ms"]
        lines.append(f"| {r['why']} | {a['pp']:.1f} ({d['pp']:+.1f}%) | "
                     f"{a['specinfer']:.1f} ({d['specinfer']:+.1f}%) | "
                     f"{a['specpipe']:.1f} ({d['specpipe']:+.1f}%) |")
    return "\n".join(lines) + "\n"


# ---- commands --------------------------------------------------------------------------




@dataclass(frozen=True)
class SimulateOptions:
    """``treepipe simulate``'s options, one field per flag."""

    records: Path
    out: Path | None
    json: bool


def simulate_records(o: SimulateOptions) -> int:
    """Validate the simulator on a recorded run."""
    results = load_records(o.records)
    rows = validate(results)
    md = validation_markdown(rows)
    emit_report({"records": str(o.records), "rows": rows}, md, o.out, "simulate", o.json)
    return 0


@dataclass(frozen=True)
class ProjectOptions:
    """``treepipe project``'s options, one field per flag."""

    calibrate: str
    hit_rate: float
    seed: int
    tokens: int | None
    batch: str | None
    set: list[str]
    out: Path | None
    json: bool
    recovery: bool = False


def paper_setting(o: ProjectOptions, default_tokens: int) -> PaperSetting:
    """The paper's setting with ``o``'s calibration, hit rate, tokens (``default_tokens``
    unless given) and ``--set`` overrides, each checked in one line."""
    if not 0.0 <= o.hit_rate <= 1.0:
        raise TreepipeError(f"--hit-rate must be within 0..1, got {o.hit_rate}")
    tokens = o.tokens if o.tokens is not None else default_tokens
    if tokens < 2:
        raise TreepipeError(f"--tokens must be 2 or more, got {tokens}")
    ps = PaperSetting(**{"calibrate": o.calibrate, "hit_rate": o.hit_rate,
                         "new_tokens": tokens, **parse_overrides(o.set)})
    ps.layer_file  # noqa: B018 -- a bad calibration file fails here, in one line
    return ps


def project_paper(o: ProjectOptions) -> int:
    """Print the projection to the paper's testbed (single request, or --batch; --recovery
    is :func:`~orchestrator.lab.benchmarks.recovery_projection.project_paper_recovery`)."""
    batches = parse_batches(o.batch) if o.batch is not None else None
    ps = paper_setting(o, BATCH_TOKENS if batches else PaperSetting.new_tokens)
    assumptions = paper_assumptions(ps)
    if batches:
        rep = project_batch(ps, batches, o.seed)
        sens = batch_sensitivity(ps, batches, o.seed)
        assumptions += batch_assumptions(ps)
        md = batch_markdown(rep, sens, assumptions)
        emit_report({**rep, "assumptions": assumptions, "sensitivity": sens}, md, o.out,
                    "project_batch", o.json)
        return 0
    proj = project(ps, o.seed)
    sens = sensitivity(ps, o.seed)
    md = projection_markdown(proj, sens, assumptions)
    emit_report({**proj, "assumptions": assumptions, "sensitivity": sens}, md, o.out,
                "project", o.json)
    return 0


def parse_batches(text: str) -> list[int]:
    """``--batch 1,2,4``: batch sizes, each 1 or more."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise TreepipeError(f"bad --batch {text!r}; give batch sizes >= 1 separated by commas, "
                            "e.g. --batch 1,2,4,8,16,32")
    return out


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=JSON`` pairs for :class:`PaperSetting` (a bare word is taken as a string)."""

    names = {f.name: f for f in dataclasses.fields(PaperSetting)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in names:
            raise TreepipeError(f"bad --set {item!r}; write FIELD=VALUE with FIELD one of "
                                f"{', '.join(names)}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        out[key] = _checked_override(key, value, names[key].default)
    return out


def _checked_override(key: str, value: Any, default: Any) -> Any:
    """``--set key=value`` as the field's type, in its domain (TreepipeError: one line)."""
    def number(v: Any, whole: bool) -> bool:
        ok = isinstance(v, int) if whole else isinstance(v, int | float)
        return ok and not isinstance(v, bool) and math.isfinite(v)

    if key == "topk_hit":
        if not isinstance(value, dict) or not value or not all(
                str(k).isdigit() and int(k) >= 1 and number(v, False) and 0 <= v <= 1
                for k, v in value.items()):
            raise TreepipeError("--set topk_hit needs a JSON object {\"k\": ratio, ...} with "
                                "k >= 1 and ratios in [0, 1]")
        return {int(k): float(v) for k, v in value.items()}
    if key == "branching":
        if not isinstance(value, list) or not value or not all(
                number(b, True) and b >= 1 for b in value):
            raise TreepipeError("--set branching needs a JSON list of integers >= 1, "
                                "e.g. [4, 2, 1]")
        return tuple(value)
    if isinstance(default, str):
        return str(value)
    whole = isinstance(default, int)
    top = 1.0 if key == "hit_rate" else float("inf")
    low_ok = key in MAY_BE_ZERO  # the others divide or scale: 0 means nothing
    if not number(value, whole) or not (value >= 0 if low_ok else value > 0) or value > top:
        want = "an integer >= 1" if whole else ("a number in (0, 1]" if key == "hit_rate" else
                                                 f"a finite number {'>=' if low_ok else '>'} 0")
        raise TreepipeError(f"bad --set {key}={value!r}; {key} must be {want}")
    return float(value) if not whole else value


# PaperSetting fields that --set may set to 0 (an assumed cost left out)
MAY_BE_ZERO = frozenset({"block_slope", "block_leap", "prune_ms", "link_latency_us",
                         "draft_level_ms", "head_layers"})


def emit_report(report: dict[str, Any], md: str, out: Path | None, stem: str,
                as_json: bool) -> None:
    """Write ``report`` (JSON) and ``md`` under ``out`` if given; print one of them."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n",
                                          encoding="utf-8")
        (out / f"{stem}.md").write_text(md, encoding="utf-8")
    if as_json:
        print(json.dumps(report, default=str))
    else:
        sys.stdout.write(md)


__all__ = ["BatchSim", "Flow", "LayerTimeFile", "LevelModel", "PaperSetting", "PipeSchedule",
           "Profile", "RecoveryModel", "RequestSchedule", "Share", "SimResult",
           "SpecInferSchedule", "TimeCurve", "emit_report", "paper_setting",
           "eq1_tbt", "fit_levels", "fit_profile", "load_layer_time", "paper_request",
           "price_step", "project", "project_batch", "project_paper", "ProjectOptions",
           "SimulateOptions", "simulate_records", "result_from_dict", "result_to_dict",
           "simulate_alone", "simulate_ar", "simulate_batch", "simulate_like",
           "simulate_paper_batch", "simulate_specinfer", "simulate_specpipe",
           "specpipe_outcomes", "validate"]
