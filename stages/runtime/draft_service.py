"""The draft service: owns the speculative trees and feeds stage 1 one level per request per step.

It runs the token-source half of the in-process engine's SpecPipe loop: expand
the level that enters stage 1 (beside stage 1's compute), and after each
verdict prune the tree, its own cache and the cached proposals, then pick the
next fixed-width level from those proposals.  With no token source it sends
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
from stages.speculation.step import TreeOwner
from stages.speculation.token_sources import (
    DraftModelSource,
    TokenSource,
    draft_model,
    expand_packed,
)
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
        before their trees go; a first token (step 0's) is not ranked, as in advance."""
        return self._ranked([(rid, v) for rid, v in ended if rid in self.owners
                             and rid in self.joined and self.local_step(rid) >= 1])

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
        """Prune and grow every request's tree, send each level, then expand them all."""
        entering: list[tuple[TreeOwner, torch.Tensor]] = []
        started = time.perf_counter()
        policy = self._policy()  # built at the first step: the stages publish curves first
        if policy is not None:
            self.scheduler.use(policy)
            self._observe_cycle(policy, started)
        firsts = {rid for rid, _ in go if self.local_step(rid) == 1}
        later = [(rid, verdict) for rid, verdict in go if rid not in firsts]
        ranks = self._ranked(later)
        if self.inbox is not None:
            self._take_exits(later)
        with torch.inference_mode():
            for rid, verdict in later:
                self.owners[rid].apply(verdict)
        # a request's first step sends its root only: it grows no level to choose for
        growing = [rid for rid, _ in later]
        # the scheduling core's width step (fixed widths: each request's own)
        for rid, w in self.scheduler.update(ranks, growing).items():
            self.owners[rid].width = w
        if policy is not None:
            policy.chosen.clear()  # a service runs for days: the heartbeat counts them
        sent = 0
        levels: list[Nodes] = []
        offered: list[tuple[str, int]] = []  # proposals each new level could draw from
        for rid, verdict in go:
            owner = self.owners[rid]
            step = self.local_step(rid)
            with torch.inference_mode():
                if rid in firsts:
                    new_idx = owner.start(verdict.token, root_id=verdict.root)
                else:
                    new_idx = owner.grow(verdict)
                    if owner.source is not None and not verdict.miss:  # a miss: a new root
                        self.stats.widths += owner.width
                        self.stats.levels += 1
            offered.append((rid, owner.available))
            sent += int(new_idx.numel())
            tree = owner.tree
            assert tree is not None
            parents = tree.parent[new_idx]
            parent_ids = torch.where(parents >= 0, tree.ids[parents.clamp(min=0)],
                                     torch.full_like(parents, -1))
            levels.append(Nodes("level", rid, self.epoch, step, tree.ids[new_idx], parent_ids,
                                tree.tokens[new_idx]))
            self.stats.nodes += int(new_idx.numel())
            entering.append((owner, new_idx))
        self.scheduler.observe_levels(offered)
        self.send(levels)  # every request's level in one frame, before the expansion
        # the source expands the levels beside stage 1's compute of them
        with torch.inference_mode():
            packed = [(o, i) for o, i in entering if i.numel() and o.source is not None
                      and isinstance(o.source, DraftModelSource)
                      and o.source.pool is self.draft_pool]
            for owner, idx in entering:
                if all(owner is not o for o, _ in packed):
                    owner.propose(idx)
            if packed:
                props = expand_packed([o.source for o, _ in packed],  # type: ignore[misc]
                                      [o.tree for o, _ in packed],  # type: ignore[misc]
                                      [i for _, i in packed], packed[0][0].draft_k,
                                      [o.allowed(i) for o, i in packed])
                for (owner, idx), (toks, probs) in zip(packed, props, strict=True):
                    owner.store(idx, toks, probs)
        for rid, _ in go:
            reports[rid] = Report(root_id=int(new_ids(1)[0]),
                                  children=tuple(self.owners[rid].root_children()))
        if policy is not None:
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
        # the width policy's estimates of it are the scheduler's to drop, when it leaves
        # the plan (LineScheduler): a cancelled request still counts, with its own
        # estimates, in the choice of the step its cancel lands in (Scheduler.update)
        drafter = draft_model(owner.source if owner is not None else None)
        if drafter is not None:
            drafter.release()  # its draft KV blocks go back to the pool at once
