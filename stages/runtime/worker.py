"""A stage worker: one layer shard, its KV cache and a mirror of the speculative tree.

The draft service owns the tree; a stage learns its nodes from the messages it
receives (ids, parent ids, tokens) and keeps a mirror with the same node ids,
which gives it the tree mask and positions for its rows.  After every step the
synchroniser's verdict (verified token, the root's child that carries it, or
the id of a new root on a miss) prunes the mirror and the KV cache exactly as
the in-process engine prunes them.  The last stage verifies: it computes the
root's logits and picks the token with the request's sampling parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from protocol.links.messages import Nodes
from protocol.links.transport import Inbox, Outbox
from protocol.sync.control import Start, Verdict
from protocol.sync.synchroniser import Synchroniser
from stages.model.model import StageShard
from stages.model.sampling import SamplingParams, choose_token
from stages.runtime.participant import Participant
from stages.speculation.step import Mirror
from stages.speculation.token_sources import tree_forward

log = logging.getLogger("treepipe.stage")
_EMPTY = torch.zeros(0, dtype=torch.long)


def sampling_from(params: dict[str, Any]) -> SamplingParams:
    """Sampling parameters as the gateway stored them."""
    return SamplingParams(float(params.get("temperature", 0.0)), float(params.get("top_p", 1.0)),
                          int(params.get("top_k", 0)), int(params.get("seed", 0)))


@dataclass
class _Request:
    mirror: Mirror  # the tree (owner's ids) and this stage's KV cache
    sampling: SamplingParams
    generated: int  # tokens committed so far (the sampling index of the next one)
    seq_len: int


class StageWorker(Participant):
    """Runs one shard of the target model in the step barrier."""

    def __init__(self, name: str, sync: Synchroniser, shard: StageShard, inbox: Inbox,
                 outbox: Outbox | None, **kw: Any):
        super().__init__(name, sync, inbox, outbox, **kw)
        self.shard = shard
        self.dim = shard.args.dim
        self.dtype = next(shard.parameters()).dtype
        self.device = next(shard.parameters()).device
        self.vocab = shard.args.vocab_size
        self.req: _Request | None = None
        if shard.is_last != (outbox is None):
            raise ValueError("exactly the last stage has no next stage")

    def begin(self, msg: Start) -> None:
        st = self.current_request(msg.req)
        if st is None:
            return
        seq = st.prompt + st.log[:-1] if st.log else st.prompt
        # sampling index of the next token: prefill commits token 0 unless the log has it
        self.req = _Request(Mirror(self.shard.new_cache(len(seq) + st.max_new + 64)),
                            sampling_from(st.params), max(len(st.log), 1), len(seq))
        # prefill: stage 1 embeds the committed sequence, the others take hidden states
        if self.shard.is_first:
            x = torch.tensor(seq, dtype=torch.long, device=self.device)
        else:
            x = self.expect("prefill", 0).x
            assert x is not None
            if x.shape[0] != len(seq):
                log.error("%s: prefill of %d rows for a %d-token sequence", self.name,
                          x.shape[0], len(seq))
                self.rid = None
                return
        with torch.inference_mode():
            h = self.shard(x.to(self.device), torch.arange(len(seq)), self.req.mirror.cache)
            token = -1
            if self.shard.is_last and not st.log:
                token = choose_token(self.shard.logits(h[-1]), self.req.sampling, 0)
        if self.outbox is not None:
            assert self.rid is not None
            self.send(Nodes("prefill", self.rid, self.epoch, 0, _EMPTY, _EMPTY,
                                         _EMPTY, h.cpu()))
        self.arrive(token)

    def advance(self, verdict: Verdict) -> None:
        req = self.req
        assert req is not None
        mirror = req.mirror
        if self.step == 0:
            mirror.start(verdict.token, req.seq_len, verdict.root)
        elif mirror.apply(verdict) is not None:
            req.generated += 1
        tree = mirror.tree
        assert tree is not None
        self.step += 1
        assert self.rid is not None
        if self.shard.is_first:
            nodes = self.expect("level", self.step)  # the level the draft sent this step
        elif self.step > 1:
            # pipelined (Algorithm 1): stage i works on what stage i-1 computed in the
            # previous step, so every stage computes a different level in the same step
            nodes = self.expect("hidden", self.step - 1)
        else:
            nodes = Nodes("hidden", self.rid, self.epoch, 0, _EMPTY, _EMPTY, _EMPTY,
                          torch.zeros(0, self.dim, dtype=self.dtype))  # nothing in flight yet
        # keep what is still in the tree: the root itself, or children of mirror nodes
        keep = mirror.alive(nodes.ids, nodes.parents)
        if self.shard.is_first and bool(((nodes.tokens < 0) | (nodes.tokens >= self.vocab)).any()):
            log.error("%s: level with token ids outside [0, %d); dropped", self.name, self.vocab)
            keep = torch.zeros_like(keep)
        ids, parents, tokens = nodes.ids[keep], nodes.parents[keep], nodes.tokens[keep]
        x = tokens if nodes.x is None else nodes.x[keep]
        mirror.append(ids, parents, tokens)
        self.stats.nodes += int(ids.numel())
        token = -1
        if ids.numel():
            with torch.inference_mode():
                h = tree_forward(self.shard, mirror.cache, tree, tree.index_of(ids),
                                 x.to(self.device))
                if self.shard.is_last and int(ids[0]) == tree.root_id:
                    token = choose_token(self.shard.logits(h[0]), req.sampling, req.generated)
        else:
            h = torch.zeros(0, self.dim, dtype=self.dtype)
        if self.outbox is not None:
            self.send(Nodes("hidden", self.rid, self.epoch, self.step, ids, parents, tokens,
                            h.cpu()))
        self.arrive(token)

    def finish(self) -> None:
        self.req = None
