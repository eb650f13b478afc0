"""In-process pipeline executor: SpecPipe (Algorithm 1) and the ar / pp / specinfer baselines.

All methods run on the same stage shards.  Stages are stepped in lockstep; within
a step they run one after another on this machine, and each one's compute time
is recorded so that :class:`~protocol.scheduling.records.GenerationResult` can report the
time the schedule takes with one device per stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from protocol.config.recovery import NO_RECOVERY, Recovery
from protocol.errors import TreepipeError
from protocol.requests.stopping import end_reason
from protocol.scheduling.records import METHODS, GenerationResult, LinkModel, StepRecord
from stages.model.grammar import Constraint, DraftMask
from stages.model.kv_cache import StageCache
from stages.model.model import StageShard
from stages.model.sampling import SamplingParams, choose_token, constrained_logits, pick_token
from stages.speculation.loop import Checked, Flight, Lane, TreeLane, pipeline_step
from stages.speculation.step import TreeOwner, grammar_rows
from stages.speculation.token_sources import DraftClock, TokenSource, sync_cache, tree_forward
from stages.speculation.tree import Level, SpecTree

SPECINFER_BRANCHING = (1, 1, 3, 1, 1, 1, 1, 1)
NODE_HEADER_BYTES = 16  # node id + token + parent per tree node on the wire


class ConfigError(TreepipeError, ValueError):
    """A bad engine configuration; the message names the problem and the fix."""


def check_tree_shape(width: int, topk: int) -> None:
    """Refuse a tree width or top-k below 1 (callers check before loading weights)."""
    if width < 1:
        raise ConfigError(f"tree width w must be >= 1, got {width}; pass --width 1 or more")
    if topk < 1:
        raise ConfigError(f"top-k must be >= 1, got {topk}; pass --topk 1 or more")


class PipelineEngine:
    """Decodes one request at a time over ``shards`` with a chosen method."""

    mask_drafts = True  # a grammar masks the draft's proposals too (off: to measure it)

    def __init__(self, shards: Sequence[StageShard], source: TokenSource | None = None,
                 width: int = 16, topk: int = 8, link: LinkModel | None = None,
                 branching: Sequence[int] = SPECINFER_BRANCHING,
                 recovery: Recovery = NO_RECOVERY):
        if not shards:
            raise ConfigError("no stages given; use at least one stage")
        check_tree_shape(width, topk)
        try:
            recovery.check_stages(len(shards))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not shards[0].is_first or not shards[-1].is_last or any(
                a.end != b.start for a, b in zip(shards, shards[1:], strict=False)):
            raise ConfigError("stage shards must cover the model's layers contiguously")
        vocab = shards[0].args.vocab_size
        draft_vocab = getattr(source, "vocab_size", vocab)
        if draft_vocab != vocab:
            raise ConfigError(f"draft vocabulary has {draft_vocab} tokens but the target has "
                              f"{vocab}; use a draft trained with the target's tokenizer")
        self.shards = list(shards)
        self.source = source
        self.width, self.topk = width, topk
        self.link = link or LinkModel()
        self.branching = tuple(branching)
        self.recovery = recovery  # correction children (TreeOwner), protocol.config.recovery
        self.args = shards[0].args

    @property
    def m(self) -> int:
        return len(self.shards)

    # ---- public ------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int,
                 sampling: SamplingParams | None = None, method: str = "specpipe",
                 stop_ids: Sequence[int] = (),
                 on_token: Callable[[int], None] | None = None,
                 keep_logits: bool = False,
                 constraint: Constraint | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt`` (stops after a stop id).

        ``constraint``: the grammar state of ``sampling.response_format``
        (stages.model.grammar), fresh for this request; it masks every verified token (and,
        from a copy, the draft's proposals) and ends the request where the text is complete.

        ``keep_logits`` stores the target logits behind every committed token in
        ``result.logits`` (for checking near-ties when comparing methods).
        """
        sampling = sampling or SamplingParams()
        sampling.check_vocab(self.args.vocab_size)
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if not prompt:
            raise ConfigError("the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.args.max_seq_len:
            raise ConfigError(
                f"prompt ({len(prompt)} tokens) + max new tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.args.max_seq_len}; shorten the prompt or lower "
                "--max-new-tokens")
        if method in ("specinfer", "specpipe") and self.source is None:
            raise ConfigError(f"method {method} needs a token source (--draft)")
        source_name = self.source.name if self.source and method in ("specinfer", "specpipe") \
            else "none"
        res = GenerationResult(method=method, stages=self.m, width=self.width, topk=self.topk,
                               source=source_name, prompt_len=len(prompt), link=self.link)
        run = _Run(self, res, sampling, max_new_tokens, set(stop_ids), on_token, keep_logits)
        run.constraint = constraint
        t0 = time.perf_counter()
        first = run.prefill(prompt, with_source=method in ("specinfer", "specpipe"))
        res.prefill_s = time.perf_counter() - t0
        if not run.emit(first):
            if method == "ar":
                run.ar()
            elif method == "specinfer":
                run.specinfer()
            else:
                run.specpipe(use_source=method == "specpipe")
        res.wall_s = time.perf_counter() - t0
        return res


class _Run:
    """State of one request on one engine."""

    def __init__(self, eng: PipelineEngine, res: GenerationResult, sampling: SamplingParams,
                 max_new: int, stop: set[int], on_token: Callable[[int], None] | None,
                 keep_logits: bool):
        self.eng, self.res, self.sampling = eng, res, sampling
        self.max_new, self.stop, self.on_token = max_new, stop, on_token
        self.stop_ids = sorted(stop)  # what min_tokens masks, in a fixed order
        self.keep_logits = keep_logits
        self.constraint: Constraint | None = None
        self.prompt: list[int] = []
        self.committed: list[int] = []
        self.caches: list[StageCache] = []
        self.hidden_bytes = eng.args.dim * torch.finfo(
            next(eng.shards[0].parameters()).dtype).bits // 8

    # ---- shared pieces ---------------------------------------------------------------
    def emit(self, token: int) -> bool:
        """Commit a verified token; True when generation is finished."""
        self.committed.append(token)
        return self.publish(token)

    def publish(self, token: int) -> bool:
        """Output a token already committed; True when generation is finished."""
        self.res.tokens.append(token)
        if self.on_token:
            self.on_token(token)
        return end_reason(token, len(self.res.tokens), self.max_new, self.stop) is not None \
            or (self.constraint is not None and self.constraint.finished(self.res.tokens))

    def choose(self, logits: Tensor) -> int:
        """The token at the next generated position: the request's sampling over the
        prompt and the tokens published so far (exactly the committed ones there)."""
        if not self.keep_logits:
            return choose_token(logits, self.sampling, self.prompt, self.res.tokens,
                                self.stop_ids, self.constraint)
        adjusted = constrained_logits(logits, self.sampling, self.prompt, self.res.tokens,
                                      self.stop_ids, self.constraint)
        self.res.logits.append(adjusted.to(torch.float32).clone())
        return pick_token(adjusted, self.sampling, len(self.res.tokens))

    def draft_mask(self) -> DraftMask | None:
        """The request's grammar over the draft's proposals (None: free text)."""
        if self.constraint is None or not self.eng.mask_drafts:
            return None
        return DraftMask(self.constraint, len(self.prompt))

    def prefill(self, prompt: list[int], with_source: bool) -> int:
        """Fill every stage's committed prefix with the prompt; return the first token."""
        # each cache's own pool starts at the prompt and grows block by block with use
        self.caches = [s.new_cache(len(prompt) + 1) for s in self.eng.shards]
        self.prompt = list(prompt)
        self.committed = list(prompt)
        x: Tensor = torch.tensor(prompt, dtype=torch.long)
        pos = torch.arange(len(prompt))
        for shard, cache in zip(self.eng.shards, self.caches, strict=True):
            x = shard(x, pos, cache)
        if with_source and self.eng.source is not None:
            self.eng.source.reset(list(prompt))
        return self.choose(self.eng.shards[-1].logits(x[-1]))

    def _timed_forward(self, i: int, tree: SpecTree, idx: Tensor, x: Tensor) -> tuple[Tensor,
                                                                                       float]:
        t = time.perf_counter()
        h = tree_forward(self.eng.shards[i], self.caches[i], tree, idx, x)
        return h, time.perf_counter() - t

    def _record(self) -> StepRecord:
        m = self.eng.m
        return StepRecord([0] * m, [0.0] * m, [0.0] * m, [0] * m)

    # ---- ar: whole model per token, no pipeline ---------------------------------------
    def ar(self) -> None:
        while True:
            rec = self._record()
            rec.serial = True
            x: Tensor = torch.tensor([self.committed[-1]], dtype=torch.long)
            pos = torch.tensor([len(self.committed) - 1])
            for i, (shard, cache) in enumerate(zip(self.eng.shards, self.caches, strict=True)):
                t = time.perf_counter()
                x = shard(x, pos, cache)
                if shard.is_last:
                    x = shard.logits(x[0])
                rec.stage_s[i] = time.perf_counter() - t
                rec.stage_tokens[i] = 1
            rec.verified = 1
            self.res.steps.append(rec)
            if self.emit(self.choose(x)):
                return

    # ---- specpipe (and pp: the same schedule with no token source) -----------------------
    def specpipe(self, use_source: bool) -> None:
        eng = self.eng
        source = eng.source if use_source else None
        # the committed list moves to the tree owner, which commits each verified token
        owner = TreeOwner(source, eng.width, eng.topk, self.committed[:-1],
                          mask=self.draft_mask(), recovery=eng.recovery, stages=eng.m)
        owner.start(self.committed[-1])
        self.committed = owner.committed
        lane = TreeLane(owner, eng.m, self.caches)
        compute = _StagesCompute(self, lane)
        while True:
            compute.rec = self._record()
            done = pipeline_step([lane], compute, eng.m)
            self.res.steps.append(compute.rec)
            if done:
                return

    # ---- specinfer: a static tree through the whole pipeline per pass --------------------
    def specinfer(self) -> None:
        eng, m = self.eng, self.eng.m
        source = eng.source
        assert source is not None
        tree = SpecTree(self.committed[-1], len(self.committed) - 1)
        mask = self.draft_mask()
        while True:
            clock = DraftClock([source])
            tree = static_tree(source, tree, self.committed, eng.branching, mask)
            draft_s = clock.seconds()
            idx = torch.arange(len(tree))
            x: Tensor = tree.tokens
            for i in range(m):
                rec = self._record()
                if i == 0:
                    rec.draft_s, rec.draft_serial = draft_s, True
                    rec.draft_tokens = len(tree)
                x, dt = self._timed_forward(i, tree, idx, x)
                rec.stage_tokens[i], rec.stage_s[i] = len(tree), dt
                rec.link_bytes[i] = len(tree) * (NODE_HEADER_BYTES if i == 0
                                                 else self.hidden_bytes + 8)
                self.res.steps.append(rec)
            t = time.perf_counter()
            logits = eng.shards[-1].logits(x)
            rec.stage_s[m - 1] += time.perf_counter() - t
            path, token, done = verify_static(tree, logits, self.choose, self.emit, rec)
            if done:
                return
            tree = settle_static(tree, path, token, self.caches, source)


class _StagesCompute:
    """The engine's torch stages under the schedule loop: one request, stage by stage,
    each stage's compute timed into the step's record."""

    def __init__(self, run: _Run, lane: TreeLane):
        self.run, self.lane, self.m = run, lane, run.eng.m
        self.use_source = lane.owner.source is not None
        self.rec = run._record()

    def forward(self, i: int, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[Flight]:
        """Stage i on the request's nodes waiting there."""
        tree = self.lane.owner.tree
        assert tree is not None
        out = []
        for _, fl in work:
            idx = tree.index_of(fl.ids)
            h, dt = self.run._timed_forward(i, tree, idx, fl.x)
            self.rec.stage_tokens[i], self.rec.stage_s[i] = int(idx.numel()), dt
            if i == self.run.eng.recovery.exit_stage - 1:
                t = time.perf_counter()
                self.lane.owner.note_exit(self.run.eng.shards[-1], h, self.run.eng.shards[i].end,
                                          idx)
                self.rec.stage_s[i] += time.perf_counter() - t  # the exit stage's work
            out.append(Flight(fl.ids, h))
        return out

    def propose(self, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> None:
        """The draft expands the level entering stage 1."""
        if not self.use_source:
            return
        for _, fl in work:
            idx = self.lane.index(fl)
            clock = DraftClock([self.lane.owner.source])
            self.lane.owner.propose(idx)
            self.rec.draft_s, self.rec.draft_tokens = clock.seconds(), int(idx.numel())

    def verify(self, roots: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[int]:
        """The last stage's LM head on the root, and the request's choice of token."""
        tree = self.lane.owner.tree
        assert tree is not None
        tokens = []
        for _, last in roots:
            assert last.ids.tolist() == [tree.root_id], "last stage must hold only the root"
            t = time.perf_counter()
            tokens.append(self.run.choose(self.run.eng.shards[-1].logits(last.x[0])))
            self.rec.stage_s[self.m - 1] += time.perf_counter() - t
        return tokens

    def settle(self, lane: Lane[Flight, int], checked: Checked, found: int) -> bool:
        """Count the verdict and its pruning; publish the token."""
        rec = self.rec
        rec.verified = 1
        if checked.hit:
            rec.hits = 1
            rec.recovered = int(checked.late > 0)
        else:
            rec.flushed = checked.flushed
        if self.use_source:
            rec.draft_s += checked.owner_s
        for i, dt in enumerate(checked.prune_s):
            rec.prune_s[i] = dt
        return self.run.publish(found)

    def going(self, lanes: Sequence[Lane[Flight, int]]) -> None:
        """A fixed width: nothing to choose."""

    def sent(self, lane: Lane[Flight, int], i: int, f: Flight) -> None:
        """Link bytes: hidden states between stages, node headers from the draft."""
        per_node = NODE_HEADER_BYTES if i == 0 else self.run.hidden_bytes + 8
        self.rec.link_bytes[i] = int(f.ids.numel()) * per_node


def static_tree(source: TokenSource, tree: SpecTree, committed: list[int],
                branching: Sequence[int], mask: DraftMask | None = None) -> SpecTree:
    """SpecInfer's static tree under ``tree``'s root (the last committed token): the
    top-b children of every node, level by level, b from ``branching`` (only tokens
    ``mask``'s grammar allows, with one)."""
    tree = SpecTree(tree.root_token, tree.root_pos)
    for b in branching:
        idx = tree.level(tree.height)
        toks, probs = source.expand(tree, idx, committed, max(b, 1),
                                    grammar_rows(mask, tree, idx, committed))
        counts = torch.tensor([min(b, x.numel()) for x in toks], dtype=torch.long)
        level = Level(torch.repeat_interleave(idx, counts),
                      torch.cat([x[:b] for x in toks]).to(torch.long),
                      torch.cat([p[:b] for p in probs]).to(torch.float64))
        if not len(level):
            return tree
        tree.append_level(level)
    # the draft computes every node it proposed, so its cache stays complete
    source.expand(tree, tree.level(tree.height), committed, 1)
    return tree


def verify_static(tree: SpecTree, logits: Tensor, choose: Callable[[Tensor], int],
                  emit: Callable[[int], bool], rec: StepRecord) -> tuple[list[int], int, bool]:
    """Verify along a static tree whose every node's target logits are ``logits``.

    Each committed token is the target's own choice (``choose``) after the accepted
    path; ``emit`` commits it and says when the request is finished.  Returns the
    accepted node ids (root first), the last committed token and whether finished.
    """
    node, path = 0, [tree.root_id]
    while True:
        token = choose(logits[node])
        child = tree.child_with_token(node, token)
        rec.verified += 1
        rec.hits += child is not None
        if emit(token):
            return path, token, True
        if child is None:
            rec.flushed += len(tree) - len(path)
            return path, token, False
        node = child
        path.append(int(tree.ids[child]))


def settle_static(tree: SpecTree, path: list[int], token: int, caches: Sequence[StageCache],
                  source: TokenSource) -> SpecTree:
    """Keep the accepted path in every cache and the source; the next root is ``token``."""
    new = SpecTree(token, tree.root_pos + len(path))
    for cache in caches:
        sync_cache(cache, new, path)
    source.sync(new, path)
    return new
