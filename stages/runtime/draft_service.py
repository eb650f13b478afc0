"""The draft service: owns the speculative trees and feeds stage 1 one level per request per step.

It runs the in-process engine's SpecPipe loop (stages/speculation/loop.py) over
the pipeline's remote stages, split by each step's barrier: at the barrier it
verifies (the last stage's tokens), prunes the tree, its own cache and the cached
proposals, lets the scheduler choose the widths, follows the survivors one stage
on and picks the next level from the proposals; then it sends every level and
expands them beside stage 1's compute.  With no token source it sends
only a new root after each verified token, which is plain pipeline
parallelism (``pp``).  At each barrier it tells the synchroniser the root's
children (token -> node id) so that every stage can prune its mirror of the
tree the same way, and reserves the id a new root takes on a miss.  A request with a
``response_format`` drafts under its grammar (stages.model.grammar.DraftMask, through its
tree owner as in the engine): the service reads the model's tokenizer for that.

It is also the pipeline's scheduler: it runs the scheduling core
(:mod:`stages.runtime.admission`), which makes each step's plan while the step runs:
the widths of the levels it grows, and the requests that join at the next step, which
its arrival hands to the barrier.

With ``--recovery early-exit:J:K`` it has an inbox: stage J sends the early exit's top-K
of every node it computed (miss recovery's token channel), which become those nodes'
correction candidates before the step's verdicts prune them, as in the engine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from protocol.config.recovery import NO_RECOVERY, Recovery
from protocol.links.messages import Nodes
from protocol.links.transport import Inbox, Outbox
from protocol.scheduling.records import LinkModel, StepRecord
from protocol.scheduling.width import AdaptiveWidth, StepCost
from protocol.sync.control import Start, Step, Verdict
from protocol.sync.heartbeat import KvUse
from protocol.sync.synchroniser import Join, Report, RequestState, Synchroniser
from stages.model.grammar import DraftMask, GrammarVocab
from stages.model.step_profile import slowest_load
from stages.model.tokenizer import TextTokenizer
from stages.runtime.admission import LineScheduler
from stages.runtime.kv_pool import kv_pool, kv_use
from stages.runtime.participant import Participant
from stages.speculation.batch import fresh_source
from stages.speculation.loop import Checked, Flight, Lane, TreeLane, begin_step, end_step
from stages.speculation.step import TreeOwner, expand_entering
from stages.speculation.token_sources import TokenSource, draft_model
from stages.speculation.tree import new_ids

log = logging.getLogger("treepipe.draft")


class DraftService(Participant):
    """Token source and tree owner of every request in the batch (one :class:`TreeOwner`
    and one copy of the token source each); a draft model expands every request's level
    in one packed forward."""

    def __init__(self, name: str, sync: Synchroniser, source: TokenSource | None,
                 outbox: Outbox, width: int, topk: int, adaptive: bool = False,
                 kv_blocks: int | None = None, tokenizer: TextTokenizer | None = None,
                 vocab: int | None = None, recovery: Recovery = NO_RECOVERY,
                 exits: Inbox | None = None, **kw: Any):
        """``kv_blocks``: the draft model's shared pool, allocated now (the stages'
        budget); None: a pool that grows with the requests.  ``tokenizer`` and ``vocab``
        (the target's logits row length): the model's, for drafting under a request's
        response_format (without them its proposals go unmasked).  ``recovery``: correction
        children (stages/speculation/step.py); ``exits``: the inbox of early-exit recovery's
        token channel (stage J's candidates), which it needs."""
        if bool(recovery.exit_stage) != (exits is not None):
            raise ValueError("early-exit recovery needs the exit stage's inbox, and only it")
        super().__init__(name, sync, exits, outbox, **kw)
        self.source = source
        self.tokenizer, self.vocab = tokenizer, vocab
        self._grammars: GrammarVocab | None = None  # built at the first response_format
        self.width, self.topk, self.recovery = width, topk, recovery
        self.owners: dict[str, TreeOwner] = {}
        # each decoding request's side of the schedule loop: what waits at each stage's
        # input (the stages hold the states), and what each stage computed in the open step
        self.lanes: dict[str, TreeLane] = {}
        self._out: dict[str, list[Flight | None]] = {}
        # adaptive width: built at the first step (it needs the stage count and curves)
        self.adaptive = adaptive and source is not None
        self.scheduler = LineScheduler(sync, width, self.adaptive)
        self.policy: AdaptiveWidth | None = None
        self._cycle: tuple[float, int, int, int, int, bool] | None = None
        self._sent: deque[int] = deque(maxlen=1)
        self._started: list[str] = []  # finished their prefill in this step
        # requests drafting with the draft model share one pool, so their levels are
        # expanded in one packed forward
        # expanded in one packed forward (a hybrid's draft model shares it too); with a
        # KV budget it is fixed at it, as a stage's pool is: it holds each request's
        # committed rows and tree as a stage does, so the gateway's admission bounds it
        drafter = draft_model(source)
        self.draft_pool = kv_pool(drafter.shard, kv_blocks, name) \
            if drafter is not None else None

    def handle(self, msg: Start | Step) -> None:
        """The scheduler learns each control message first: a new epoch starts a fresh
        one; a barrier's ends and joins update it."""
        if isinstance(msg, Start) and msg.epoch > self.epoch:
            self.scheduler.start(msg.epoch, self.policy)
            self._started = []
        elif isinstance(msg, Step) and (msg.epoch, msg.step) == (self.epoch, self.step):
            ended = [(rid, v) for rid, v in msg.verdicts if v.done]
            self.scheduler.barrier([rid for rid, _ in ended], msg.join, self._ranks(ended))
        super().handle(msg)

    def _ranks(self, ended: list[tuple[str, Verdict]]) -> list[tuple[str, int | None]]:
        """The ranks of the tokens the ended requests verified last (a cancel keeps one),
        before their trees go; a first token (step 0's) is not ranked, as in advance.  A
        decoding request whose last step verified nothing (its pipeline refilling after a
        miss) has no rank: None, so that a cancel landing then still counts in that step's
        width choice, as the engine's does (Scheduler.update)."""
        if self.policy is None:
            return []
        decoding = [(rid, v) for rid, v in ended if rid in self.owners
                    and rid in self.joined and self.local_step(rid) >= 1]
        rank = dict(self._ranked(decoding))
        return [(rid, rank.get(rid)) for rid, _ in decoding]

    def _ranked(self, verdicts: list[tuple[str, Verdict]]) -> list[tuple[str, int | None]]:
        """What the width policy learns of ``verdicts`` (before their trees are pruned):
        each verified token's rank in its request's last level (none without a policy)."""
        if self.policy is None:
            return []
        return [(rid, self.owners[rid].rank_of(v.token)) for rid, v in verdicts
                if v.token >= 0]

    def prefill(self, chunks: list[tuple[RequestState, int]], reports: dict[str, Report]) -> None:
        """A tree owner and a fresh token source per joining request, at its first prefill
        step; the source takes chunk t of the sequence in step t, as stage 1 does (a draft
        model's forward over the chunk); the root id at the last step."""
        for st, t in chunks:
            if t == 0:
                self.scheduler.resume(st, self.position[1])  # an epoch's start restarts it
            if t < st.prefill_chunks():
                committed = st.committed()
                if t == 0:
                    src = None
                    if self.source is not None:
                        src = fresh_source(self.source, self.draft_pool)
                    self.owners[st.rid] = TreeOwner(src, self.width, self.topk, committed,
                                                    track_ranks=self.adaptive,
                                                    mask=self.draft_mask(st),
                                                    recovery=self.recovery,
                                                    stages=self.position[1])
                src = self.owners[st.rid].source
                if src is not None:
                    with torch.inference_mode():
                        src.prefill(committed, st.prefill_rows(t)[1])
            if t == st.prefill_steps(self.position[1]) - 1:
                reports[st.rid] = Report(root_id=int(new_ids(1)[0]))
                self._started.append(st.rid)

    def advance(self, go: list[tuple[str, Verdict]], reports: dict[str, Report]) -> None:
        """One turn of the schedule loop (stages/speculation/loop.py) over every request's
        lane: the step the barrier ended is closed (verify, prune, choose the widths, shift,
        grow), every request's level goes to stage 1 in one frame, and the next step opens
        (the stages compute in their processes, the draft expands the levels beside them)."""
        started = time.perf_counter()
        policy = self._policy()  # built at the first step: the stages publish curves first
        if policy is not None:
            self.scheduler.use(policy)
            self._observe_cycle(policy, started)
        # a request's first step sends its root only: it grows no level to choose for
        firsts = [(rid, v) for rid, v in go if self.local_step(rid) == 1]
        later = [(rid, v) for rid, v in go if self.local_step(rid) != 1]
        if self.inbox is not None:
            self._take_exits(later)
        stages = _RemoteStages(self, dict(later))
        with torch.inference_mode():
            end_step([self.lanes[rid] for rid, _ in later], stages,
                     [self._out.pop(rid) for rid, _ in later])
            for rid, verdict in firsts:
                self.owners[rid].start(verdict.token, root_id=verdict.root)
                lane = self.lanes[rid] = TreeLane(self.owners[rid], self.position[1])
                stages.rid[id(lane)] = rid
                stages.sent(lane, 0, lane.inbox[0])  # type: ignore[arg-type]
        stages.check_verified()
        if policy is not None:
            policy.chosen.clear()  # a service runs for days: the heartbeat counts them
        self.scheduler.observe_levels([(rid, stages.offered[rid]) for rid, _ in go])
        # every request's level in one frame, before the expansion
        self.send([stages.levels[rid] for rid, _ in go])
        lanes = [self.lanes[rid] for rid, _ in go]
        with torch.inference_mode():
            out = begin_step(lanes, stages, self.position[1])
        self._out.update({rid: o for (rid, _), o in zip(go, out, strict=True)})
        for rid, _ in go:
            # the id a miss at this step's barrier gives the new root, reserved now
            self.lanes[rid].new_root = root = int(new_ids(1)[0])
            reports[rid] = Report(root_id=root,
                                  children=tuple(self.owners[rid].root_children()))
        if policy is not None:
            sent = sum(len(level.ids) for level in stages.levels.values())
            self._sent.append(sent)
            self._cycle = (started, self.epoch, self.step, max(self._sent),
                           len(go) + len(self.joining), bool(self.joining))

    def _take_exits(self, later: list[tuple[str, Verdict]]) -> None:
        """The exit stage's candidates for the nodes it computed in the last step, stored
        before that step's verdicts prune the trees (the engine notes them before it
        verifies).  A token outside the target's vocabulary, or one a request's grammar
        forbids, is no candidate (the stage's exit runs unmasked)."""
        for rid, _ in later:
            owner = self.owners[rid]
            nodes = self.expect(rid, "exit", self.local_step(rid) - 1)
            if owner.source is None or nodes.cand is None or nodes.cand_p is None or \
                    not len(nodes):
                continue
            assert owner.tree is not None
            # the nodes still in the tree (all of them, unless a peer sent stale ones)
            live = torch.isin(nodes.ids, owner.tree.ids)
            ids, cand, prob = nodes.ids[live], nodes.cand[live], nodes.cand_p[live]
            if self.vocab is not None:
                prob[cand >= self.vocab] = 0.0
            if owner.mask is not None and ids.numel():
                allowed = owner.allowed(owner.tree.index_of(ids))
                if allowed is not None:
                    rows = cand.clamp(max=allowed.shape[1] - 1)
                    prob *= allowed.gather(1, rows).to(prob.dtype)
            owner.store_exits(ids.tolist(), cand, prob)

    def draft_mask(self, st: RequestState) -> DraftMask | None:
        """The grammar over a request's proposals (None: free text, no token source, or
        no tokenizer).  A format that fails here drafts unmasked: the last stage, which
        checks it too, fails the request itself."""
        spec = st.params.response_format
        if spec is None or self.source is None:
            return None
        if self.tokenizer is None:
            log.warning("%s: request %s has a response_format, but the service has no "
                        "tokenizer: its proposals go unmasked", self.name, st.rid)
            return None
        try:
            if self._grammars is None:
                # the draft's logits row (a draft model's), else the target's
                vocab = getattr(self.source, "vocab_size", None) or self.vocab or \
                    self.tokenizer.vocab_size
                self._grammars = GrammarVocab(self.tokenizer, vocab)
            return DraftMask(self._grammars.constraint(spec), len(st.prompt))
        except (ValueError, RuntimeError) as e:  # GrammarError, or llguidance's own
            log.warning("%s: request %s drafts unmasked: %s", self.name, st.rid, e)
            return None

    def kv_use(self) -> KvUse | None:
        return kv_use(self.draft_pool) if self.draft_pool is not None else None

    def next_joins(self) -> list[Join]:
        """The step's plan; who joins at the next step."""
        names = self.plan_participants()
        started, self._started = self._started, []
        return self.scheduler.plan(self.more, names, self.layout_id, max(len(names) - 1, 1),
                               started)

    def _policy(self) -> AdaptiveWidth | None:
        """The adaptive width policy (None: fixed width), built at the first step: the
        refill of a miss takes one step per stage, and the front stages' published
        forward curves (the slowest at each row count and count of requests) price a
        level's nodes."""
        if not self.adaptive or self.policy is not None:
            return self.policy
        names = [n for n in self.plan_participants() if n != self.name]
        m = max(len(names), 1)
        curves = self.sync.curves(names, self.layout_id)
        front = [loads for last, loads in curves.values() if not last] or \
            [loads for _, loads in curves.values()]
        curve = slowest_load(front)
        if curve is None:
            log.warning("%s: no stage published its forward time at a count of requests "
                        "they all measured (start the stages with --profile-rows); the "
                        "adaptive width learns it from the steps alone", self.name)
        # the step times measured here already hold the links: no per-node transfer term
        self.policy = AdaptiveWidth(self.width, m, StepCost(LinkModel(0.0, 1e12), 0,
                                                            front=curve))
        self._sent = deque(maxlen=max(m - 1, 1))
        log.info("%s: adaptive width up to %d over %d stages (%s)", self.name, self.width, m,
                 f"curves of {len(front)} front stages" if curve is not None else "no curves")
        return self.policy

    def _observe_cycle(self, policy: AdaptiveWidth, now: float) -> None:
        """The last step as this service saw it, from one verdict to the next: the busiest
        front stage's nodes (the widest of the levels still crossing them) against the
        whole step's time. A step in which requests joined carried their prefill and
        teaches the tree's cost nothing (StepCost skips it)."""
        if self._cycle is None:
            return
        t, epoch, step, nodes, reqs, joined = self._cycle
        self._cycle = None
        if (epoch, step + 1) != (self.epoch, self.step) or not nodes:
            return
        policy.observe_step(StepRecord(stage_tokens=[nodes], stage_s=[now - t], prune_s=[0.0],
                                       link_bytes=[0], stage_requests=[reqs],
                                       prompt_rows=[int(joined)]))

    def finish(self, rid: str) -> None:
        owner = self.owners.pop(rid, None)
        self.lanes.pop(rid, None)
        self._out.pop(rid, None)
        # the width policy's estimates of it are the scheduler's to drop, when it leaves
        # the plan (LineScheduler): a cancelled request still counts, with its own
        # estimates, in the choice of the step its cancel lands in (Scheduler.update)
        drafter = draft_model(owner.source if owner is not None else None)
        if drafter is not None:
            drafter.release()  # its draft KV blocks go back to the pool at once


class _RemoteStages:
    """The stage workers under the schedule loop, as the draft service sees them: a stage
    computes, in its own process, what waits at its input (the service follows the node
    ids only); the last stage's verified tokens come with the barrier's verdicts; the new
    levels become link messages to stage 1."""

    def __init__(self, service: DraftService, verdicts: dict[str, Verdict]):
        self.service, self.verdicts = service, verdicts
        self.rid = {id(lane): rid for rid, lane in service.lanes.items()}
        self.ranks: list[tuple[str, int | None]] = []
        self.verified: set[str] = set()
        self.levels: dict[str, Nodes] = {}
        self.offered: dict[str, int] = {}

    def forward(self, i: int, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[Flight]:
        """Stage i computes its input in its process: the same nodes come out."""
        return [f for _, f in work]

    def propose(self, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> None:
        """The draft expands the levels that entered stage 1, while stage 1 computes them."""
        svc = self.service
        expand_entering([(svc.owners[self.rid[id(lane)]], f.ids) for lane, f in work],
                        svc.draft_pool)

    def verify(self, roots: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[int]:
        """The tokens the last stage verified at the roots that reached it (the barrier's);
        each ranked for the width policy before its tree is pruned."""
        rids = [self.rid[id(lane)] for lane, _ in roots]
        for rid in rids:
            if not self.verdicts[rid].verified:
                raise RuntimeError(f"{self.service.name}: request {rid}'s root reached the "
                                   f"last stage, but the barrier verified no token")
        self.verified.update(rids)
        self.ranks = self.service._ranked([(rid, self.verdicts[rid]) for rid in rids])
        return [self.verdicts[rid].token for rid in rids]

    def settle(self, lane: Lane[Flight, int], checked: Checked, found: int) -> bool:
        """The verdict the loop decided is the barrier's (the stages prune by that one);
        the request goes on (one that ended left before this step)."""
        rid = self.rid[id(lane)]
        mine, theirs = lane.verdict, self.verdicts[rid]  # type: ignore[attr-defined]
        if mine is None or (mine.child, mine.root if mine.miss else -1) != \
                (theirs.child, theirs.root if theirs.miss else -1):
            raise RuntimeError(f"{self.service.name}: request {rid}'s verdict {mine} differs "
                               f"from the barrier's {theirs}")
        return False

    def going(self, lanes: Sequence[Lane[Flight, int]]) -> None:
        """The scheduling core's width step for every going request's next level."""
        svc = self.service
        for rid, w in svc.scheduler.update(self.ranks, [self.rid[id(lane)] for lane in lanes]
                                           ).items():
            svc.owners[rid].width = w

    def sent(self, lane: Lane[Flight, int], i: int, f: Flight) -> None:
        """A new level for stage 1 becomes the request's link message; what passes between
        stages is theirs to send."""
        if i:
            return
        svc = self.service
        rid = self.rid[id(lane)]
        owner = svc.owners[rid]
        tree = owner.tree
        assert tree is not None
        idx = tree.index_of(f.ids)
        verdict = self.verdicts.get(rid)
        if verdict is not None and owner.source is not None and not verdict.miss:
            svc.stats.widths += owner.width
            svc.stats.levels += 1
        svc.stats.nodes += int(idx.numel())
        parents = tree.parent[idx]
        parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)],
                                 torch.full_like(parents, -1))
        self.levels[rid] = Nodes("level", rid, svc.epoch, svc.local_step(rid), f.ids,
                                 parent_ids, f.x)
        self.offered[rid] = owner.available

    def check_verified(self) -> None:
        """Every token the barrier verified reached a root the loop followed there: the
        loop's view of the stages and the stages' own agree."""
        extra = sorted(rid for rid, v in self.verdicts.items()
                       if v.verified and rid not in self.verified)
        if extra:
            raise RuntimeError(f"{self.service.name}: the barrier verified tokens of {extra}, "
                               f"whose roots the schedule loop had not at the last stage")
