"""A stage worker: one layer shard, its KV cache and a mirror of the speculative tree.

The draft service owns the tree; a stage learns its nodes from the messages it
receives (ids, parent ids, tokens) and keeps a mirror with the same node ids,
which gives it the tree mask and positions for its rows.  After every step the
synchroniser's verdict (verified token, the root's child that carries it, or
the id of a new root on a miss) prunes the mirror and the KV cache exactly as
the in-process engine prunes them.  The last stage verifies: it computes the
root's logits and picks the token with the request's sampling parameters, and for a
request that asks for logprobs reports the token's (and the top alternatives') from the
same logits row with it.  A request with a ``response_format`` keeps a grammar state
(stages.model.grammar) that follows its committed tokens (replayed from the log on a
resume); it masks the root's logits before the choice and ends the request where the JSON
is complete.  With ``--recovery early-exit:J:K`` stage J also runs the early exit (the
final norm and LM head) on every node it computes and sends their top-K to the draft
service: miss recovery's token channel (:class:`ExitChannel`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import TreepipeError
from protocol.links.messages import Nodes
from protocol.links.transport import Inbox, Outbox
from protocol.requests.stopping import end_reason
from protocol.sync.control import Verdict
from protocol.sync.heartbeat import KvUse
from protocol.sync.synchroniser import Report, RequestState, Synchroniser
from stages.model.early_exit import ExitHead
from stages.model.grammar import Constraint, GrammarError, GrammarVocab
from stages.model.kv_cache import StageCache
from stages.model.model import Segment, StageShard
from stages.model.sampling import SamplingParams, choose_token, token_logprobs
from stages.model.step_profile import forward_loads, profile_requests, profile_sizes
from stages.model.tokenizer import TextTokenizer
from stages.runtime.kv_pool import kv_pool, kv_use
from stages.runtime.participant import Participant
from stages.speculation.step import Mirror

log = logging.getLogger("treepipe.stage")
PROFILE_MAX_ROWS = 512  # rows a stage times at start at most (treepipe stage --profile-rows)
_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass
class _Request:
    mirror: Mirror  # the tree (owner's ids) and this stage's KV cache, in the stage's pool
    sampling: SamplingParams
    generated: int  # tokens committed so far (the sampling index of the next one)
    seq_len: int
    prompt: list[int]
    stop_ids: list[int]
    max_new: int
    # the tokens committed so far (the last stage's penalties read them): the log on a
    # resume, else the first token once its verdict roots the first tree
    tokens: list[int]
    constraint: Constraint | None = None  # its response_format's grammar state

    def end(self, token: int, count: int) -> str:
        """Why the request ends once ``token``, its generated token number ``count``, is
        committed after ``tokens`` ("" if it goes on): a stop id, max_new, or its grammar
        allowing nothing more."""
        reason = end_reason(token, count, self.max_new, self.stop_ids) or ""
        if not reason and self.constraint is not None \
                and self.constraint.finished([*self.tokens, token]):
            reason = "eos"  # the JSON is complete: the text ends as at EOS
        return reason


@dataclass
class ExitChannel:
    """Miss recovery's token channel out of an exit stage: where its candidates go (the
    draft service's inbox), the exit that computes them (its adapter, the final norm and
    the LM head or a reduced vocabulary's rows of it,
    :func:`~stages.model.early_exit.exit_head` on
    :func:`~stages.model.checkpoint.load_head`) and how many per node."""

    outbox: Outbox
    head: ExitHead
    k: int


class StageWorker(Participant):
    """Runs one shard of the target model for every request of the batch, one packed
    forward per step (SpecPipe-DB): each request's nodes are a segment with its own
    tree mask and KV cache, all caches in one block pool."""

    def __init__(self, name: str, sync: Synchroniser, shard: StageShard, inbox: Inbox,
                 outbox: Outbox | None, kv_blocks: int | None = None,
                 tokenizer: TextTokenizer | None = None, exits: ExitChannel | None = None,
                 **kw: Any):
        """``kv_blocks``: a pool of that many blocks, allocated now (the gateway admits
        requests within it); None: a pool that grows with the requests.  ``tokenizer``:
        the model's, which the last stage needs for requests with a response_format.
        ``exits``: this is the early-exit stage of miss recovery (never the last)."""
        super().__init__(name, sync, inbox, outbox, **kw)
        self.shard = shard
        self.dim = shard.args.dim
        self.dtype = next(shard.parameters()).dtype
        self.device = next(shard.parameters()).device
        self.vocab = shard.args.vocab_size
        self.pool = kv_pool(shard, kv_blocks, name)
        self.reqs: dict[str, _Request] = {}
        self.tokenizer = tokenizer
        self._grammars: GrammarVocab | None = None  # built at the first response_format
        if shard.is_last != (outbox is None):
            raise ValueError("exactly the last stage has no next stage")
        if exits is not None and shard.is_last:
            raise ValueError("the last stage verifies: an early exit there saves no step")
        self.exits = exits

    def kv_use(self) -> KvUse | None:
        return kv_use(self.pool)

    def profile(self, max_rows: int | None, max_requests: int = 1) -> None:
        """Measure this stage's forward time up to ``max_rows`` rows (at most
        :data:`PROFILE_MAX_ROWS`; beyond, the curve goes on along its last segment) packed
        over 1, 2, 4 ... ``max_requests`` requests, and publish it for this plan: the draft
        service's adaptive width prices a level by it, as the engine's does. None: remove
        any curve an earlier run left. Run before joining, so the curve is there before
        any request steps."""
        if max_rows is None:
            self.sync.drop_curve(self.name)
            return
        rows = min(max_rows, PROFILE_MAX_ROWS)
        t = time.perf_counter()
        loads = forward_loads(self.shard, profile_sizes(rows), profile_requests(max_requests))
        self.sync.publish_curve(self.name, loads, self.shard.is_last, self.layout_id)
        secs = loads[1]
        log.info("%s: forward time measured for 1-%d rows and 1-%d requests in %.1f s "
                 "(%.1f ms at 1 row, %.1f ms at %d)", self.name, rows, max(loads),
                 time.perf_counter() - t, secs[min(secs)] * 1e3, secs[max(secs)] * 1e3,
                 max(secs))

    def stage_position(self) -> tuple[int, int]:
        """:meth:`Participant.stage_position`, checked against this stage's shard: a
        participant list in another order would pipeline the chunks wrongly."""
        index, stages = super().stage_position()
        if (index == 0) != self.shard.is_first or (index == stages - 1) != self.shard.is_last:
            raise TreepipeError(f"{self.name} is stage {index} of {stages} in the participant "
                                "list, which its layers contradict; register the participants "
                                "as the draft service, then every stage in order")
        return index, stages

    def prefill(self, chunks: list[tuple[RequestState, int]], reports: dict[str, Report]) -> None:
        """This stage's chunk of each prefilling request (pipelined: chunk j in prefill step
        j + this stage's index), all in one packed forward; the last stage chooses a
        request's first token after its last chunk unless its log has it."""
        ok: list[tuple[RequestState, int, torch.Tensor]] = []
        for st, t in chunks:
            index = st.prefill_chunk(t, self.position[0])
            if index is None:
                reports[st.rid] = Report()  # its chunks are at other stages in this step
                continue
            a, b = st.prefill_rows(index)
            if index == 0:
                try:
                    sampling = st.params
                    sampling.check_vocab(self.vocab)
                    constraint = self.constraint(sampling)
                except (ValueError, TypeError) as e:
                    log.error("%s: request %s cannot run: %s", self.name, st.rid, e)
                    self.sync.fail(st.rid, str(e))
                    self._finish(st.rid)
                    continue
                # sampling index of the next token: prefill commits token 0 unless the log
                # has it
                self.reqs[st.rid] = _Request(Mirror(StageCache.in_pool(self.pool)), sampling,
                                             max(len(st.log), 1), st.prefill_rows_total(),
                                             list(st.prompt), list(st.stop_ids), st.max_new,
                                             list(st.log), constraint)
            # stage 1 embeds the committed sequence, the others take hidden states
            if self.shard.is_first:
                x = torch.tensor(st.committed()[a:b], dtype=torch.long)
            else:
                got = self.expect(st.rid, "prefill", index).x
                assert got is not None
                if got.shape[0] != b - a:
                    log.error("%s: prefill chunk %d of %d rows for rows %d-%d of %s", self.name,
                              index, got.shape[0], a, b, st.rid)
                    self._finish(st.rid)
                    continue
                x = got
            ok.append((st, index, x))
        if not ok:
            return
        segs = [Segment(self.reqs[st.rid].mirror.cache, int(x.shape[0])) for st, _, x in ok]
        pos = torch.cat([torch.arange(*st.prefill_rows(index)) for st, index, _ in ok])
        out: list[Nodes] = []
        with torch.inference_mode():
            h = self.shard.forward_packed(torch.cat([x for _, _, x in ok]).to(self.device), pos,
                                          segs)
            for (st, index, _), part in zip(ok, h.split([g.n for g in segs]), strict=True):
                token, end = -1, ""
                if self.shard.is_last and not st.log and index == st.prefill_chunks() - 1:
                    reports[st.rid] = self.verify(st.rid, self.shard.logits(part[-1]), 1)
                else:
                    reports[st.rid] = Report(token, end=end)
                out.append(Nodes("prefill", st.rid, self.epoch, index, _EMPTY, _EMPTY, _EMPTY,
                                 part.cpu()))
        if self.outbox is not None:
            self.send(out)  # every request's chunk in one frame

    def advance(self, go: list[tuple[str, Verdict]], reports: dict[str, Report]) -> None:
        """Prune every request's mirror and cache by its verdict, then one packed forward
        over every request's nodes of this step."""
        segs, xs, pos, sends = [], [], [], []
        for rid, verdict in go:
            req = self.reqs[rid]
            mirror = req.mirror
            step = self.local_step(rid)  # this step's number for the request
            if step == 1:
                mirror.start(verdict.token, req.seq_len, verdict.root)
                if not req.tokens:
                    req.tokens.append(verdict.token)  # the first token, the tree's root
            elif mirror.apply(verdict) is not None:
                req.generated += 1
                req.tokens.append(verdict.token)
            tree = mirror.tree
            assert tree is not None
            if self.shard.is_first:
                nodes = self.expect(rid, "level", step)  # the level the draft sent this step
            elif step > 1:
                # pipelined (Algorithm 1): stage i works on what stage i-1 computed in the
                # previous step, so every stage computes a different level in the same step
                nodes = self.expect(rid, "hidden", step - 1)
            else:
                nodes = Nodes("hidden", rid, self.epoch, 0, _EMPTY, _EMPTY, _EMPTY,
                              torch.zeros(0, self.dim, dtype=self.dtype))  # nothing in flight
            # keep what is still in the tree: the root itself, or children of mirror nodes
            keep = mirror.alive(nodes.ids, nodes.parents)
            if self.shard.is_first and bool(((nodes.tokens < 0)
                                             | (nodes.tokens >= self.vocab)).any()):
                log.error("%s: level with token ids outside [0, %d); dropped", self.name,
                          self.vocab)
                keep = torch.zeros_like(keep)
            ids, parents, tokens = nodes.ids[keep], nodes.parents[keep], nodes.tokens[keep]
            x = tokens if nodes.x is None else nodes.x[keep]
            mirror.append(ids, parents, tokens)
            self.stats.nodes += int(ids.numel())
            sends.append((rid, step, ids, parents, tokens))
            if ids.numel():
                idx = tree.index_of(ids)
                key_idx = torch.cat([tree.index_of(mirror.cache.tree_ids), idx])
                segs.append(Segment(mirror.cache, int(idx.numel()),
                                    tree.attention_mask(idx, key_idx), tree.ids[idx]))
                xs.append(x)
                pos.append(tree.positions(idx))
        outs: dict[str, torch.Tensor] = {}
        if segs:
            with torch.inference_mode():
                h = self.shard.forward_packed(torch.cat(xs).to(self.device), torch.cat(pos),
                                              segs)
            computed = [s for s in sends if s[2].numel()]
            outs = {s[0]: part for s, part in zip(computed, h.split([g.n for g in segs]),
                                                  strict=True)}
        if self.exits is not None:
            self._send_exits(self.exits, sends, h if segs else None)
        if self.shard.is_last:
            # every request whose root arrived is verified: one LM head for all of them
            roots = [s[0] for s in sends if s[2].numel()
                     and int(s[2][0]) == self.reqs[s[0]].mirror.tree.root_id]  # type: ignore[union-attr]
            if roots:
                rows = torch.stack([outs[r][0] for r in roots])
                with torch.inference_mode():
                    # one root alone takes the vector path, exactly as a lone request did
                    logits = self.shard.logits(rows) if len(roots) > 1 else \
                        self.shard.logits(rows[0])[None]
                for rid, lg in zip(roots, logits, strict=True):
                    req = self.reqs[rid]
                    if req.sampling.adjusts or req.constraint is not None:
                        # the penalties and the grammar read exactly the committed tokens
                        assert len(req.tokens) == req.generated, (rid, req.generated)
                    # it is the request's token number generated + 1 once committed
                    reports[rid] = self.verify(rid, lg, req.generated + 1)
        for rid, _, _, _, _ in sends:
            reports.setdefault(rid, Report())
        if self.outbox is not None:
            # every request's nodes of this hop in one frame
            self.send([Nodes("hidden", rid, self.epoch, step, ids, parents, tokens,
                             outs.get(rid, torch.zeros(0, self.dim, dtype=self.dtype)).cpu())
                       for rid, step, ids, parents, tokens in sends])

    def _send_exits(self, ch: ExitChannel, sends: list[tuple[str, int, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]],
                    h: torch.Tensor | None) -> None:
        """The early exit's top-K of every node this step computed (``h``, in ``sends``
        order; None: none), one exit part per request (empty ones too: the draft service
        waits for each), in one frame to the draft service; the exit's time is this
        stage's."""
        if h is None:
            toks = torch.zeros(0, ch.k, dtype=torch.long)
            probs = torch.zeros(0, ch.k)
        else:
            toks, probs = ch.head.top(h, ch.k)
        sizes = [int(ids.numel()) for _, _, ids, _, _ in sends]
        parts = [Nodes("exit", rid, self.epoch, step, ids, parents, tokens, None, tk, pr)
                 for (rid, step, ids, parents, tokens), tk, pr in zip(
                     sends, toks.split(sizes), probs.to(torch.float32).split(sizes),
                     strict=True)]
        t = time.perf_counter()
        ch.outbox.send_nodes(parts)
        dt = time.perf_counter() - t
        self.stats.send_s += dt
        self._not_compute += dt

    def verify(self, rid: str, logits: torch.Tensor, count: int) -> Report:
        """The report of request ``rid``'s token number ``count``, chosen from the root's
        ``logits`` after its committed tokens; a grammar that allows no token fails the
        request (its client gets the error) instead of the stage."""
        req = self.reqs[rid]
        try:
            token = choose_token(logits, req.sampling, req.prompt, req.tokens, req.stop_ids,
                                 req.constraint)
            end = req.end(token, count)
        except GrammarError as e:
            log.error("%s: request %s cannot go on: %s", self.name, rid, e)
            self.sync.fail(rid, str(e))
            self._finish(rid)
            return Report()
        return _verified(logits, token, end, req.sampling)

    def constraint(self, sampling: SamplingParams) -> Constraint | None:
        """A fresh grammar state for a request's response_format (None without one) on
        the last stage, which alone chooses tokens; ValueError if it cannot be built."""
        if sampling.response_format is None or not self.shard.is_last:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("response_format needs the model's tokenizer, and this "
                                 "stage was started without one")
            self._grammars = GrammarVocab(self.tokenizer, self.vocab)
        return self._grammars.constraint(sampling.response_format)

    def finish(self, rid: str) -> None:
        req = self.reqs.pop(rid, None)
        if req is not None:
            req.mirror.cache.release()  # its blocks go back to the pool at once


def _verified(logits: torch.Tensor, token: int, end: str, sampling: SamplingParams) -> Report:
    """The last stage's report of the token it verified from ``logits``, with its
    logprobs when the request asked for them (only those requests pay for them)."""
    lp = None if sampling.logprobs is None else token_logprobs(logits, token,
                                                               sampling.logprobs)
    return Report(token, end=end, logprobs=lp)
