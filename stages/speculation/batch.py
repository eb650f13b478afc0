"""SpecPipe-DB in the in-process engine: many requests in flight on the same stage shards.

A :class:`BatchRun` keeps up to ``max_batch`` requests running.  Every step each
stage runs ONE packed forward over the nodes of every request it holds (a ragged
batch in which each request sees only its own rows,
:meth:`~stages.model.model.StageShard.forward_packed`),
and each request then verifies, prunes, misses and refills on its own, with its
own :class:`~stages.speculation.step.TreeOwner`, token source and sampling
index: a miss flushes only its own tree.  Requests join at step boundaries and
leave as soon as they finish or are cancelled, giving their KV blocks back.
With pp and specpipe a joining prompt flows through the stages one per step, in
chunks, packed with the running requests' levels, so a join never stalls them.

KV lives in one :class:`~stages.model.kv_cache.BlockPool` per stage.  With a
fixed pool (``kv_blocks``) a request is admitted only when its worst case
(prompt + max new tokens + in-flight tree rows) fits next to the worst cases of
those running, so no running request can ever run out of blocks; blocks are
still taken lazily, so the pool's use follows the tokens actually held.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from protocol.requests.stopping import end_reason
from protocol.scheduling.kv_blocks import request_blocks
from protocol.scheduling.plan import StepPlan, Ticket
from protocol.scheduling.records import GenerationResult, StepRecord
from protocol.scheduling.scheduler import Scheduler, StepOutputs
from protocol.scheduling.width import AdaptiveWidth, StepCost, adaptive_cap, parse_width
from stages.model.kv_cache import BlockPool, StageCache
from stages.model.model import Segment
from stages.model.sampling import SamplingParams, choose_token
from stages.model.step_profile import front_curve
from stages.speculation.engine import (
    NODE_HEADER_BYTES,
    ConfigError,
    PipelineEngine,
    settle_static,
    static_tree,
    verify_static,
)
from stages.speculation.loop import Checked, Flight, Lane, TreeLane, pipeline_step
from stages.speculation.step import TreeOwner, expand_entering
from stages.speculation.token_sources import (
    DraftClock,
    HybridSource,
    TokenSource,
    draft_model,
)
from stages.speculation.tree import SpecTree

BATCH_METHODS = ("ar", "pp", "specinfer", "specpipe")
SPEC = ("specinfer", "specpipe")  # the methods with a token source
PIPELINED = ("pp", "specpipe")  # methods whose prompts flow through the stages with the steps
DEFAULT_PREFILL_CHUNK = 64  # prompt tokens entering stage 1 per step (see BatchRun)
_rids = itertools.count()


@dataclass
class Request:
    """One generation request for a :class:`BatchRun`.

    ``source`` overrides the engine's token source for this request (it must be
    a fresh instance: sources keep per-request state).
    """

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: Sequence[int] = ()
    source: TokenSource | None = None
    rid: int = field(default_factory=lambda: next(_rids))
    # its own prefill chunk (prompt rows per step; 0: the whole prompt in one step), as a
    # distributed request carries its gateway's; None: the run's
    chunk: int | None = None


def fresh_source(source: TokenSource, pool: BlockPool | None = None) -> TokenSource:
    """A per-request copy of a token source (shares weights, not per-request state); its
    draft model, if it has one, keeps its KV cache in ``pool`` when given."""
    s = copy.copy(source)
    if isinstance(s, HybridSource):
        s.draft, s.ngram = copy.copy(s.draft), copy.copy(s.ngram)
    drafter = draft_model(s)
    if drafter is not None:
        drafter.cache = None  # the copy must not release or reuse the original's cache
        if pool is not None:
            drafter.pool = pool
    return s


def width_policy(width: int | str | AdaptiveWidth | None, engine: PipelineEngine,
                 max_batch: int, hidden_bytes: int) -> tuple[AdaptiveWidth | None, int | None]:
    """(the adaptive policy ``width`` names, None): ``"adaptive[:CAP]"`` priced by the front
    stages' forward time, or a ready one; else (None, the fixed width; None: the engine's)."""
    if isinstance(width, str):
        width = parse_width(width)
    if isinstance(width, str):  # adaptive[:CAP]
        cap = adaptive_cap(width, engine.width)
        # the front stages' forward time, measured up to the most rows a stage can hold
        # (a level of the cap per request, and its root) and the most requests
        curve = front_curve(engine.shards, (cap + 1) * max_batch, max_batch)
        width = AdaptiveWidth(cap, engine.m, StepCost(engine.link, hidden_bytes + 8,
                                                      front=curve))
    if isinstance(width, AdaptiveWidth):
        return width, None
    return None, width


@dataclass(eq=False)  # one per request in flight: compared by identity
class _Held:
    """What every request in flight holds: its result and caches (one per stage)."""

    req: Request
    res: GenerationResult
    caches: list[StageCache]
    token_times: list[float] = field(default_factory=list)  # modelled time of each token
    unstamped: int = 0  # tokens published in the step now closing

    @property
    def rid(self) -> int:
        return self.req.rid


@dataclass(eq=False)
class _Prefilling(_Held):
    """A request whose prompt is still crossing the stages (pp and specpipe: in chunks)."""

    # per stage, the prompt chunks (input, positions) waiting for it
    chunks: list[deque[tuple[Tensor, Tensor]]] = field(default_factory=list)


@dataclass(eq=False, kw_only=True)
class _Decoding(_Held):
    """A request with its first token: its tree owner and what waits at each stage."""

    lane: TreeLane  # its tree owner and what waits at each stage, in the schedule loop
    hold: int = 0  # pp: steps its root waits before entering stage 1 (micro-batch phase)

    @property
    def owner(self) -> TreeOwner:
        """The request's tree owner (its committed tokens too: ar grows them, no tree)."""
        return self.lane.owner

    @property
    def inbox(self) -> list[Flight | None]:
        """What waits at each stage's input."""
        return self.lane.inbox

    @property
    def tree(self) -> SpecTree:
        """The request's tree (the owner's, always rooted once decoding)."""
        assert self.owner.tree is not None
        return self.owner.tree


_Req = _Prefilling | _Decoding


@dataclass
class _Step:
    """What the phases of one pipeline step hand on to each other."""

    rec: StepRecord
    own: dict[int, StepRecord]  # each decoding request's own share (its nodes, hit or miss)
    active: list[_Req]  # the running requests not held back this step
    plan: StepPlan  # the scheduler's decisions for it
    # prompt chunks to the next stage: (request, stage, input, positions)
    moves: list[tuple[_Prefilling, int, Tensor, Tensor]] = field(default_factory=list)
    # the last stage's output of a whole prompt (its last row)
    prompts_done: list[tuple[_Prefilling, Tensor]] = field(default_factory=list)
    # each verified request's token rank among its proposals (the width policy learns it)
    ranks: list[tuple[int, int | None]] = field(default_factory=list)
    started: list[_Decoding] = field(default_factory=list)  # prefills that finished this step
    done: list[_Decoding] = field(default_factory=list)  # requests that finished this step

    @property
    def decoding(self) -> list[_Decoding]:
        """The active requests whose trees are in flight."""
        return [r for r in self.active if isinstance(r, _Decoding)]


@dataclass
class _StageRows:
    """One stage's packed forward input: a segment per request, and whose rows they are."""

    segs: list[Segment] = field(default_factory=list)
    xs: list[Tensor] = field(default_factory=list)
    pos: list[Tensor] = field(default_factory=list)
    who: list[tuple[_Decoding, Tensor]] = field(default_factory=list)  # (request, node ids)
    # prompt chunks: (request, positions, segment index)
    chunked: list[tuple[_Prefilling, Tensor, int]] = field(default_factory=list)


class BatchRun:
    """Up to ``max_batch`` requests decoded together with ``method`` on ``engine``'s shards."""

    def __init__(self, engine: PipelineEngine, method: str = "specpipe", max_batch: int = 4,
                 kv_blocks: int | None = None, block_size: int = 16,
                 width: int | str | AdaptiveWidth | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        """``width``: the tree width of every specpipe request (default the engine's),
        ``"adaptive"`` (:class:`~protocol.scheduling.width.AdaptiveWidth` up to the
        engine's width), ``"adaptive:CAP"``, or a ready :class:`AdaptiveWidth`.
        ``prefill_chunk``: prompt tokens that enter stage 1 per step, over all joining
        requests (pp and specpipe; a chunked-prefill budget)."""
        if method not in BATCH_METHODS:
            raise ConfigError(f"batched method must be one of {', '.join(BATCH_METHODS)}, "
                              f"got {method!r}")
        if max_batch < 1:
            raise ConfigError(f"max batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        if method in SPEC and engine.source is None:
            raise ConfigError(f"method {method} needs a token source (--draft)")
        self.eng, self.method = engine, method
        self.hidden_bytes = engine.args.dim * torch.finfo(
            next(engine.shards[0].parameters()).dtype).bits // 8
        self.adaptive, fixed = width_policy(width, engine, max_batch, self.hidden_bytes)
        self.width = self.adaptive.cap if self.adaptive is not None else \
            engine.width if fixed is None else fixed
        if self.width < 1:
            raise ConfigError(f"tree width must be >= 1, got {self.width}")
        self.fixed = kv_blocks is not None
        self.pools: list[BlockPool] = [s.new_pool(kv_blocks or 8, block_size,
                                                  growable=not self.fixed)
                                       for s in engine.shards]
        self.peak_blocks = [0] * len(self.pools)  # most blocks in use at a step's end
        # every scheduling decision (admission, KV and prefill budgets, widths)
        self.sched = Scheduler(max_batch, self.width,
                               kv_budget=self.pools[0].n_blocks if self.fixed else None,
                               prefill_chunk=prefill_chunk, pipelined=method in PIPELINED,
                               policy=self.adaptive)
        self.pending: dict[int, Request] = {}  # queued, by id
        self.plans: list[StepPlan] = []  # every step's plan, in order (one small tuple each)
        self.running: list[_Req] = []
        self.results: dict[int, GenerationResult] = {}
        self.token_times: dict[int, list[float]] = {}
        self.steps: list[StepRecord] = []
        self.clock = 0.0  # modelled (pipelined) time so far
        self.ticks = 0  # pipeline steps so far (pp's micro-batch phases count them)
        # requests drafting with the engine's draft model share one draft pool, so the
        # draft expands every request's level in one packed forward; it holds each
        # request's committed rows and tree as a stage does, so the stages' budget bounds it
        drafter = draft_model(engine.source)
        self.draft_pool = drafter.shard.new_pool(kv_blocks or 8, block_size,
                                                 growable=not self.fixed) \
            if drafter is not None and method in SPEC else None

    # ---- public ------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """True when nothing is queued or running."""
        return self.sched.idle

    @property
    def queue(self) -> list[Request]:
        """The requests waiting to join, in order."""
        return [self.pending[t.rid] for t in self.sched.queue]

    @property
    def reserved(self) -> int:
        """KV blocks per stage the running requests' worst cases hold (fixed pools)."""
        return self.sched.reserved

    def used_blocks(self) -> list[int]:
        """KV blocks in use per stage."""
        return [p.used_blocks for p in self.pools]

    def kv_report(self) -> dict[str, list[int]]:
        """Per stage: bytes per held token row, block size and peak blocks in use so far."""
        return {"bytes_per_token": [p.bytes_per_row for p in self.pools],
                "block_size": [p.block_size for p in self.pools],
                "peak_blocks": list(self.peak_blocks)}

    def presize(self) -> int:
        """Grow the growable pools to the blocks the ``max_batch`` largest queued requests
        can hold at once, so they do not grow while those requests run: on a GPU a
        compiled stage records its CUDA graphs again for every new pool (a growing pool is
        one per doubling; ``treepipe bench --concurrency`` met hundreds of recordings).
        Returns the blocks per stage pool."""
        worst = sorted((self._worst_blocks(r) for r in self.pending.values()), reverse=True)
        need = sum(worst[:self.sched.max_batch])
        for pool in [*self.pools, *([self.draft_pool] if self.draft_pool is not None else [])]:
            pool.reserve(need)
        return self.pools[0].n_blocks

    def add(self, request: Request) -> int:
        """Queue a request; it joins at the next step boundary with room. Returns its id."""
        if not request.prompt:
            raise ConfigError("the prompt is empty; give at least one token")
        if request.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt) + request.max_new_tokens > self.eng.args.max_seq_len:
            raise ConfigError("prompt + max new tokens exceeds the model's context")
        request.sampling.check_vocab(self.eng.args.vocab_size)
        ticket = Ticket(request.rid, len(request.prompt),
                        self._worst_blocks(request) if self.fixed else 0, chunk=request.chunk)
        if not self.sched.fits_alone(ticket):
            raise ConfigError(f"request {request.rid} can never fit the KV pool of "
                              f"{self.pools[0].n_blocks} blocks; give more blocks")
        self.sched.add(ticket)
        self.pending[request.rid] = request
        return request.rid

    def cancel(self, rid: int) -> None:
        """Cancel a queued or running request; it leaves at the next step boundary."""
        if self.sched.cancel(rid):
            self.results[rid] = self._new_result(self.pending.pop(rid))

    def step(self) -> None:
        """One step boundary (leave, admit and prefill) and one pipeline step."""
        plan = self.sched.schedule()
        self.plans.append(plan)
        for r in [r for r in self.running if r.rid in plan.leave]:
            self._finish(r)
        for rid in plan.leave:  # decided to join, cancelled before it did
            if rid in self.pending:
                self.results[rid] = self._new_result(self.pending.pop(rid))
        self._admit(plan)
        if not self.running:
            return
        if self.method == "specinfer":
            recs, done = self._specinfer_pass()
            self._note_peak()
            self._close(recs, done)
            return
        rec = self._record()
        started: list[_Decoding] = []
        if self.method == "ar":
            done = self._ar_step(rec)
        else:
            st = self._pipeline_step(rec, plan)
            done, started = st.done, st.started
        self.ticks += 1
        self._note_peak()  # before _close releases the finished requests' blocks
        self._close([rec], done, started)

    def _note_peak(self) -> None:
        self.peak_blocks = [max(a, p.used_blocks) for a, p in zip(self.peak_blocks, self.pools,
                                                                   strict=True)]

    def run(self, arrivals: dict[int, list[Request]] | None = None,
            cancels: dict[int, list[int]] | None = None) -> dict[int, GenerationResult]:
        """Step until idle; ``arrivals``/``cancels`` map a step number to requests to add /
        ids to cancel before that step.  Returns every request's result by id."""
        arrivals, cancels = dict(arrivals or {}), dict(cancels or {})
        n = 0
        while not self.idle or any(k >= n for k in arrivals):
            for req in arrivals.pop(n, []):
                self.add(req)
            for rid in cancels.pop(n, []):
                self.cancel(rid)
            self.step()
            n += 1
        return self.results

    # ---- admission and prefill -------------------------------------------------------
    def _worst_blocks(self, req: Request) -> int:
        tokens = len(req.prompt) + req.max_new_tokens
        if self.method == "specinfer":  # a whole static tree is held next to the prefix
            return request_blocks(tokens + self._static_nodes(), self.eng.m, 0,
                                  self.pools[0].block_size)
        # an adaptive policy never exceeds its cap, so the cap bounds the tree rows
        width = self.width if self.method == "specpipe" else 1
        return request_blocks(tokens, self.eng.m, width, self.pools[0].block_size)

    def _static_nodes(self) -> int:
        """Nodes of a full static tree with the engine's branching."""
        total, level = 1, 1
        for b in self.eng.branching:
            level *= max(b, 1)
            total += level
        return total

    def _new_result(self, req: Request) -> GenerationResult:
        src = req.source or self.eng.source
        return GenerationResult(method=self.method, stages=self.eng.m, width=self.width,
                                topk=self.eng.topk,
                                source=src.name if src and self.method in SPEC
                                else "none", prompt_len=len(req.prompt), link=self.eng.link)

    def _admit(self, plan: StepPlan) -> None:
        joining: list[_Prefilling] = []
        for a in plan.admit:
            req = self.pending.pop(a.rid)
            joining.append(_Prefilling(req, self._new_result(req),
                                       [StageCache.in_pool(p) for p in self.pools]))
        if joining and self.method in PIPELINED:
            for r in joining:
                # the prompt enters stage 1 now, in chunks, one stage per step, packed
                # with the other requests' levels: a join never stalls the pipeline
                r.chunks = [deque() for _ in self.pools]
                self.running.append(r)
        elif joining:
            self._prefill(joining)

    def _prefill(self, joining: list[_Prefilling]) -> None:
        """Prompts of every joining request, packed, through every stage at once (ar and
        specinfer: nothing else runs beside it); first tokens."""
        m = self.eng.m
        rec = self._record()
        rec.serial = True  # a prompt crosses the stages one after another
        x: Tensor = torch.cat([torch.tensor(r.req.prompt, dtype=torch.long) for r in joining])
        pos = torch.cat([torch.arange(len(r.req.prompt)) for r in joining])
        for i, shard in enumerate(self.eng.shards):
            segs = [Segment(r.caches[i], len(r.req.prompt)) for r in joining]
            t = time.perf_counter()
            x = shard.forward_packed(x, pos, segs)
            rec.stage_s[i], rec.stage_tokens[i] = time.perf_counter() - t, int(x.shape[0])
        last = torch.cumsum(torch.tensor([len(r.req.prompt) for r in joining]), 0) - 1
        t = time.perf_counter()
        logits = self.eng.shards[-1].logits(x[last])
        rec.stage_s[m - 1] += time.perf_counter() - t  # the source's reset is not (above)
        done: list[_Decoding] = []
        for r, lg in zip(joining, logits, strict=True):
            d, finished = self._first_token(r, lg)
            self.running.append(d)
            if finished:
                done.append(d)
        self._close([rec], done)

    def _first_token(self, r: _Prefilling, logits: Tensor) -> tuple[_Decoding, bool]:
        """The prompt has crossed every stage: sample the first token, start the request's
        tree (its root enters stage 1 next step).  Returns the decoding request, which the
        caller puts in ``running``, and whether that token ends it."""
        src = None
        if self.method in SPEC:
            src = r.req.source
            if src is None:
                src = fresh_source(self.eng.source, self.draft_pool)  # type: ignore[arg-type]
            src.reset(list(r.req.prompt))
        token = self._choose(r, logits)
        owner = TreeOwner(src, 1 if self.adaptive else self.width, self.eng.topk,
                          list(r.req.prompt), track_ranks=self.adaptive is not None,
                          recovery=self.eng.recovery, stages=self.eng.m)
        owner.start(token)
        d = _Decoding(r.req, r.res, r.caches, r.token_times, r.unstamped,
                      lane=TreeLane(owner, self.eng.m, r.caches),
                      hold=self._pp_phase() if self.method == "pp" else 0)
        return d, self._publish(d, token)

    def _pp_phase(self) -> int:
        """Steps a joining pp request's root waits, so that it enters stage 1 in the
        step phase (mod m) that the fewest running roots use: the requests form m
        micro-batches that fill the pipeline instead of one that crosses it alone."""
        m = self.eng.m
        load = [0] * m
        for r in self.running:
            if not isinstance(r, _Decoding):
                continue  # still prefilling (the request being placed among them)
            # a root waiting h steps enters stage 1 at tick + h; one at stage i entered
            # it i steps ago
            at = next((i for i, f in enumerate(r.inbox) if f is not None and f.ids.numel()),
                      0)
            load[(self.ticks + r.hold - at) % m] += 1
        return min(range(m), key=lambda h: (load[(self.ticks + h) % m], h))

    # ---- decode steps -------------------------------------------------------------------
    def _record(self) -> StepRecord:
        m = self.eng.m
        return StepRecord([0] * m, [0.0] * m, [0.0] * m, [0] * m)

    @staticmethod
    def _segment(cache: StageCache, tree: SpecTree, idx: Tensor) -> Segment:
        """One request's part of a packed stage forward: nodes ``idx`` over the cache's
        committed prefix and tree rows, with the tree mask."""
        key_idx = torch.cat([tree.index_of(cache.tree_ids), idx])
        return Segment(cache, int(idx.numel()), tree.attention_mask(idx, key_idx),
                       tree.ids[idx])

    def _choose(self, r: _Held, logits: Tensor) -> int:
        # the tokens published so far are exactly the ones committed before this position
        return choose_token(logits, r.req.sampling, r.req.prompt, r.res.tokens,
                            r.req.stop_ids)

    def _publish(self, r: _Held, token: int) -> bool:
        r.res.tokens.append(token)
        r.unstamped += 1  # stamped with the clock when the step closes
        return end_reason(token, len(r.res.tokens), r.req.max_new_tokens,
                          r.req.stop_ids) is not None

    def _decoding(self) -> list[_Decoding]:
        """The running requests past their prefill (ar and specinfer: all of them)."""
        return [r for r in self.running if isinstance(r, _Decoding)]

    def _ar_step(self, rec: StepRecord) -> list[_Decoding]:
        """Every running request's next token through the whole model, packed."""
        rec.serial = True
        rs = self._decoding()
        x: Tensor = torch.tensor([r.owner.committed[-1] for r in rs], dtype=torch.long)
        pos = torch.tensor([len(r.owner.committed) - 1 for r in rs])
        for i, shard in enumerate(self.eng.shards):
            t = time.perf_counter()
            x = shard.forward_packed(x, pos, [Segment(r.caches[i], 1) for r in rs])
            if shard.is_last:
                x = shard.logits(x)
            rec.stage_s[i], rec.stage_tokens[i] = time.perf_counter() - t, len(rs)
        done = []
        for r, lg in zip(rs, x, strict=True):
            token = self._choose(r, lg)
            r.owner.committed.append(token)
            rec.verified += 1
            if self._publish(r, token):
                done.append(r)
        return done

    def _pipeline_step(self, rec: StepRecord, plan: StepPlan) -> _Step:
        """Algorithm 1 for every running request at once (pp when there is no source)."""
        st = self._start_step(rec, plan)
        self._feed_prompts(st)
        # the schedule loop over every decoding request; each stage's packed forward also
        # carries the prompt chunk of each request being prefilled, as committed rows
        lanes = st.decoding
        done = pipeline_step([r.lane for r in lanes], _PackedStages(self, st), self.eng.m)
        st.done += [lanes[k] for k in done]
        self._record_shares(st)
        self._move_prompts(st)
        return st

    def _start_step(self, rec: StepRecord, plan: StepPlan) -> _Step:
        """The step's state, with pp roots waiting for their micro-batch phase held out."""
        own = {r.rid: self._record() for r in self._decoding()}
        held = [r for r in self._decoding() if r.hold]
        for r in held:
            r.hold -= 1
        return _Step(rec, own, [r for r in self.running if r not in held], plan)

    def _feed_prompts(self, st: _Step) -> None:
        """The plan's prompt chunks into stage 1 (the scheduler's prefill budget)."""
        by_id = {r.rid: r for r in st.active if isinstance(r, _Prefilling)}
        for c in st.plan.chunks:
            r = by_id[c.rid]
            r.chunks[0].append((torch.tensor(r.req.prompt[c.start:c.stop], dtype=torch.long),
                                torch.arange(c.start, c.stop)))

    def _record_shares(self, st: _Step) -> None:
        """Each decoding request's own share of the step, onto its result."""
        for r in self.running:
            if r.rid in st.own:
                r.res.steps.append(st.own[r.rid])

    def _move_prompts(self, st: _Step) -> None:
        """Prompt chunks move on one stage; a prompt that crossed them all gives its first token."""
        rec = st.rec
        for r, i, x_c, p_c in st.moves:
            r.chunks[i].append((x_c, p_c))
            rec.link_bytes[i] += int(p_c.numel()) * self.hidden_bytes
        if not st.prompts_done:
            return
        t = time.perf_counter()
        logits = self.eng.shards[-1].logits(torch.cat([x for _, x in st.prompts_done]))
        # the source's reset (a draft's prefill, replay's continuation) runs beside the
        # stages, as in the single-request engine: it is not the last stage's time
        rec.stage_s[self.eng.m - 1] += time.perf_counter() - t
        for (r, _), lg in zip(st.prompts_done, logits, strict=True):
            d, finished = self._first_token(r, lg)  # its tree starts next step
            self.running[self.running.index(r)] = d
            st.started.append(d)
            if finished:
                st.done.append(d)

    def _specinfer_pass(self) -> tuple[list[StepRecord], list[_Decoding]]:
        """One SpecInfer iteration for every running request: each builds its static
        tree, the trees cross the m stages packed (one stage busy per step, m records),
        and each request verifies along its own tree (iteration-level scheduling:
        requests join and leave between passes)."""
        recs = [self._record() for _ in range(self.eng.m)]
        rs = self._decoding()
        trees = self._static_trees(rs, recs[0])
        logits = self._static_forward(rs, trees, recs)
        done: list[_Decoding] = []
        for r, tree, lg in zip(rs, trees, logits.split([len(t) for t in trees]), strict=True):
            if self._static_verify(r, tree, lg, recs[-1]):
                done.append(r)
        return recs, done

    def _static_trees(self, rs: list[_Decoding], rec: StepRecord) -> list[SpecTree]:
        """Each request's static tree, drafted before the pass (the draft runs serially)."""
        clock = DraftClock(r.owner.source for r in rs)
        for r in rs:
            owner = r.owner
            assert owner.source is not None
            owner.tree = static_tree(owner.source, r.tree, owner.committed, self.eng.branching)
            rec.draft_tokens += len(owner.tree)
        rec.draft_s, rec.draft_serial = clock.seconds(), True
        return [r.tree for r in rs]

    def _static_forward(self, rs: list[_Decoding], trees: list[SpecTree],
                        recs: list[StepRecord]) -> Tensor:
        """Every static tree across the stages, packed (stage i in step i); their logits."""
        x: Tensor = torch.cat([tree.tokens for tree in trees])
        pos = torch.cat([tree.positions(torch.arange(len(tree))) for tree in trees])
        for i, shard in enumerate(self.eng.shards):
            segs = [self._segment(r.caches[i], tree, torch.arange(len(tree)))
                    for r, tree in zip(rs, trees, strict=True)]
            t = time.perf_counter()
            x = shard.forward_packed(x, pos, segs)
            recs[i].stage_s[i], recs[i].stage_tokens[i] = time.perf_counter() - t, len(x)
            recs[i].link_bytes[i] = len(x) * (NODE_HEADER_BYTES if i == 0
                                              else self.hidden_bytes + 8)
        t = time.perf_counter()
        logits = self.eng.shards[-1].logits(x)
        recs[-1].stage_s[-1] += time.perf_counter() - t
        return logits

    def _static_verify(self, r: _Decoding, tree: SpecTree, logits: Tensor,
                       rec: StepRecord) -> bool:
        """One request verifies along its static tree; True when it is finished."""
        m, owner = self.eng.m, r.owner
        assert owner.source is not None
        mine = self._record()

        def emit(token: int) -> bool:
            owner.committed.append(token)
            return self._publish(r, token)

        path, token, finished = verify_static(tree, logits, lambda lg: self._choose(r, lg),
                                              emit, mine)
        for k in ("verified", "hits", "flushed"):
            setattr(rec, k, getattr(rec, k) + getattr(mine, k))
        # the request's own records: its tree on stage i in step i, verified in the last
        for i in range(m - 1):
            r.res.steps.append(self._record())
            r.res.steps[-1].stage_tokens[i] = len(tree)
        mine.stage_tokens[m - 1] = len(tree)
        r.res.steps.append(mine)
        if not finished:
            owner.tree = settle_static(tree, path, token, r.caches, owner.source)
        return finished

    # ---- bookkeeping ---------------------------------------------------------------------
    def _close(self, recs: list[StepRecord], done: Sequence[_Decoding],
               started: Sequence[_Decoding] = ()) -> None:
        """Append step records, stamp the tokens they published, retire finished requests."""
        for rec in recs:
            self.steps.append(rec)
            self.clock += rec.pipelined_s(self.eng.link)
        self.sched.close(recs, [r.rid for r in started], [r.rid for r in done])
        for r in self.running:
            r.token_times += [self.clock] * r.unstamped
            r.unstamped = 0
        for r in done:
            self._finish(r)

    def _finish(self, r: _Req) -> None:
        for c in r.caches:
            c.release()
        drafter = draft_model(r.owner.source if isinstance(r, _Decoding) else None)
        if drafter is not None and drafter.pool is self.draft_pool:
            drafter.release()
        self.running.remove(r)
        self.results[r.rid] = r.res
        self.token_times[r.rid] = r.token_times


class _PackedStages:
    """BatchRun's torch stages under the schedule loop, for one step: one packed forward
    per stage over every request's nodes and prompt chunk, one LM head over every root,
    and the step's record, each request's own share and the width policy kept up."""

    def __init__(self, run: BatchRun, st: _Step):
        self.run, self.st, self.m = run, st, run.eng.m
        self.by_lane = {id(r.lane): r for r in st.decoding}

    def _req(self, lane: Lane[Flight, int]) -> _Decoding:
        return self.by_lane[id(lane)]

    def forward(self, i: int, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[Flight]:
        """Stage i's packed forward over its rows; each request's part goes where it is due."""
        rows = self._stage_rows(i, {id(lane): f for lane, f in work})
        if not rows.segs:
            return []
        rec = self.st.rec
        t = time.perf_counter()
        h = self.run.eng.shards[i].forward_packed(torch.cat(rows.xs), torch.cat(rows.pos),
                                                  rows.segs)
        rec.stage_s[i], rec.stage_tokens[i] = time.perf_counter() - t, int(h.shape[0])
        rec.stage_requests = rec.stage_requests or [0] * self.m
        rec.stage_requests[i] = len(rows.segs)
        parts = h.split([s.n for s in rows.segs])
        self._route_prompt_parts(i, rows, parts)
        prompt_segs = {k for _, _, k in rows.chunked}
        tree_parts = [p for k, p in enumerate(parts) if k not in prompt_segs]
        out = []
        for (r, ids), part in zip(rows.who, tree_parts, strict=True):
            out.append(Flight(ids, part))
            self.st.own[r.rid].stage_tokens[i] = int(ids.numel())
        if i == self.run.eng.recovery.exit_stage - 1:
            rec.stage_s[i] += self._exits(i, rows.who, tree_parts)
        return out

    def _exits(self, i: int, who: Sequence[tuple[_Decoding, Tensor]],
               parts: Sequence[Tensor]) -> float:
        """Recovery's token channel: stage i's early exit proposes each tree node's
        correction candidates to its request's owner; returns its time (the stage's)."""
        eng = self.run.eng
        t = time.perf_counter()
        for (r, ids), h in zip(who, parts, strict=True):
            r.owner.note_exit(eng.shards[-1], h, eng.shards[i].end, r.tree.index_of(ids))
        return time.perf_counter() - t

    def _stage_rows(self, i: int, work: dict[int, Flight]) -> _StageRows:
        """Stage i's input this step: each active request's prompt chunk or tree nodes
        (in the order the requests joined)."""
        rows = _StageRows()
        for r in self.st.active:
            if isinstance(r, _Prefilling):
                if r.chunks and r.chunks[i]:
                    x_c, p_c = r.chunks[i].popleft()
                    rows.chunked.append((r, p_c, len(rows.segs)))
                    rows.segs.append(Segment(r.caches[i], int(p_c.numel())))
                    rows.xs.append(x_c)
                    rows.pos.append(p_c)
                continue
            fl = work.get(id(r.lane))
            if fl is None:
                continue
            idx = r.tree.index_of(fl.ids)
            rows.segs.append(self.run._segment(r.caches[i], r.tree, idx))
            rows.xs.append(fl.x)
            rows.pos.append(r.tree.positions(idx))
            rows.who.append((r, fl.ids))
        return rows

    def _route_prompt_parts(self, i: int, rows: _StageRows, parts: Sequence[Tensor]) -> None:
        """Stage i's prompt-chunk outputs: to the next stage, or a finished prompt's last row."""
        st, m = self.st, self.m
        if rows.chunked:
            st.rec.prompt_rows = st.rec.prompt_rows or [0] * m
            st.rec.prompt_rows[i] = sum(int(p_c.numel()) for _, p_c, _ in rows.chunked)
        for r, p_c, k in rows.chunked:
            if i < m - 1 and r.req.chunk == 0:
                # unchunked (PrefillLayout.steps: one step): the next stage takes it now,
                # the stages one after another, as a distributed pipeline runs it
                r.chunks[i + 1].append((parts[k], p_c))
                st.rec.link_bytes[i] += int(p_c.numel()) * self.run.hidden_bytes
                st.rec.serial = True
            elif i < m - 1:
                st.moves.append((r, i + 1, parts[k], p_c))
            elif int(p_c[-1]) == len(r.req.prompt) - 1:
                st.prompts_done.append((r, parts[k][-1:]))

    def propose(self, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> None:
        """The draft expands the nodes that entered stage 1 this step: requests on the
        shared draft pool in one packed forward, any other source request by request."""
        owners = [(self._req(lane).owner, fl.ids) for lane, fl in work]
        clock = DraftClock(o.source for o, _ in owners)
        self.st.rec.draft_tokens += expand_entering(owners, self.run.draft_pool)
        self.st.rec.draft_s = clock.seconds()

    def verify(self, roots: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[int]:
        """The last stage verifies every request whose root arrived, in one LM head; each
        request's token is its own sampling's choice (ranked for the width policy)."""
        if not roots:
            return []
        t = time.perf_counter()
        logits = self.run.eng.shards[-1].logits(torch.cat([f.x for _, f in roots]))
        self.st.rec.stage_s[self.m - 1] += time.perf_counter() - t
        tokens = []
        for (lane, _), lg in zip(roots, logits, strict=True):
            r = self._req(lane)
            token = self.run._choose(r, lg)
            if self.run.adaptive is not None:
                self.st.ranks.append((r.rid, r.owner.rank_of(token)))  # before the pruning
            tokens.append(token)
        return tokens

    def settle(self, lane: Lane[Flight, int], checked: Checked, found: int) -> bool:
        """One request's verdict counted (the step's and its own), its token published."""
        r, rec = self._req(lane), self.st.rec
        mine = self.st.own[r.rid]
        rec.verified += 1
        mine.verified = 1
        if checked.hit:
            rec.hits += 1
            mine.hits = 1
            rec.recovered += checked.late > 0
            mine.recovered = int(checked.late > 0)
        else:
            rec.flushed += checked.flushed
            mine.flushed = checked.flushed
        for i, dt in enumerate(checked.prune_s):
            rec.prune_s[i] += dt
        return self.run._publish(r, found)

    def going(self, lanes: Sequence[Lane[Flight, int]]) -> None:
        """The widths the policy chose for this load, for every going request's next level."""
        going = [self._req(lane) for lane in lanes]
        widths = self.run.sched.update(StepOutputs(tuple(self.st.ranks),
                                                   tuple(r.rid for r in going)))
        for r in going:
            r.owner.width = widths[r.rid]

    def sent(self, lane: Lane[Flight, int], i: int, f: Flight) -> None:
        """Link bytes; a new level also tells the policy how many proposals it drew from."""
        n = int(f.ids.numel())
        if i:
            self.st.rec.link_bytes[i] += n * (self.run.hidden_bytes + 8)
            return
        r = self._req(lane)
        self.run.sched.observe_level(r.rid, r.owner.available)
        self.st.rec.link_bytes[0] += n * NODE_HEADER_BYTES


def generate_many(engine: PipelineEngine, requests: Sequence[Request], method: str = "specpipe",
                  max_batch: int = 4, kv_blocks: int | None = None,
                  width: int | str | AdaptiveWidth | None = None) -> list[GenerationResult]:
    """Decode ``requests`` with up to ``max_batch`` in flight; results in request order."""
    run = BatchRun(engine, method, max_batch, kv_blocks, width=width)
    for req in requests:
        run.add(req)
    results = run.run()
    return [results[r.rid] for r in requests]
