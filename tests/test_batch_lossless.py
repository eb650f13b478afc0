"""SpecPipe-DB: every request in a batch produces exactly the tokens it produces alone with ar.

Requests differ in prompt, length, stop ids and sampling, arrive at different
steps and some are cancelled; the KV pool is empty again once all are done.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from protocol.scheduling.kv_blocks import blocks_for
from stages.model.model import shard_from_state
from stages.model.sampling import SamplingParams
from stages.speculation.batch import BatchRun, Request, generate_many
from stages.speculation.engine import ConfigError, PipelineEngine
from stages.speculation.token_sources import (
    DraftModelSource,
    HybridSource,
    NgramSource,
    TokenSource,
)
from tests.tiny_models import PROMPT, TARGET, other_draft, target_shards, target_whole

GREEDY = SamplingParams()


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed)


def layers_draft(n: int) -> DraftModelSource:
    """``layers:N``: the target's first N layers with its norm and head."""
    whole = target_whole()
    state = {hf: whole.state_dict()[name] for hf, name in whole.checkpoint_keys().items()}
    cut = shard_from_state(replace(TARGET, n_layers=n), 0, n, state, torch.float64)
    return DraftModelSource(cut, f"layers:{n}")


# (prompt, max new tokens, sampling, stop-id index into the reference or None)
SPECS = [
    (PROMPT, 24, GREEDY, None),
    (PROMPT[4:], 16, sampled(11), None),
    (PROMPT[:9] * 2, 20, GREEDY, 6),
    ([7, 7, 1, 2], 12, sampled(3), None),
    (PROMPT[::-1], 18, GREEDY, None),
    (PROMPT[2:14], 10, sampled(5), 4),
    ([1, 2, 3, 1, 2, 3, 1, 2], 22, GREEDY, None),
    (PROMPT[10:], 14, sampled(0), None),
]
ARRIVE = [0, 0, 2, 5, 5, 9, 14, 20]  # step at which request j is added
CANCEL = {4: 12}  # request 4 is cancelled at step 12

_ref: dict[tuple[int, str], list[int]] = {}


def reference(j: int, quantize: str = "none") -> list[int]:
    """Request j alone with ar (stopping at its stop id), the target's weights as
    ``quantize`` names (int8: ar with the same int8 weights is the reference)."""
    if (j, quantize) not in _ref:
        prompt, n, sp, _ = SPECS[j]
        _ref[j, quantize] = PipelineEngine([target_whole(quantize=quantize)]).generate(
            prompt, n, sp, "ar", stop_ids=stops(j, quantize)).tokens
    return _ref[j, quantize]


@functools.cache
def stops(j: int, quantize: str = "none") -> list[int]:
    prompt, n, sp, stop = SPECS[j]
    if stop is None:
        return []
    full = PipelineEngine([target_whole(quantize=quantize)]).generate(prompt, n, sp,
                                                                      "ar").tokens
    return [full[stop]]


def replay() -> TokenSource:
    """``replay:0.5-0.9`` over the tiny target (its continuations from plain ar)."""
    from orchestrator.models.loading import replay_source
    from stages.speculation.replay import ReplaySpec

    return replay_source(ReplaySpec(0.5, 64, 0.9), [target_whole()])


SOURCES = {"none": lambda: None, "ngram": NgramSource, "layers2": lambda: layers_draft(2),
           # a hybrid's draft model keeps its KV in the shared draft pool too
           "hybrid": lambda: HybridSource(layers_draft(2)), "replay": replay}
CASES = [("pp", "none", 2), ("pp", "none", 4), ("specpipe", "ngram", 2),
         ("specpipe", "ngram", 4), ("specpipe", "layers2", 3), ("specpipe", "layers2", 2),
         ("specpipe", "hybrid", 3), ("specpipe", "replay", 2),
         ("ar", "none", 3), ("specinfer", "ngram", 3), ("specinfer", "layers2", 2)]
# (method, source, stages, weights, batch): the cases above with the target's float weights
# at every batch size, and one with int8 weights (--quantize int8; its reference is ar with
# the same weights) at one
BATCH_RUNS = [pytest.param(*c, "none", b, id=f"{c[0]}-{c[1]}-m{c[2]}-{b}")
              for c in CASES for b in (1, 2, 4, 8)] + [
    pytest.param("specpipe", "layers2", 3, "int8", 4, id="specpipe-layers2-m3-int8-4")]


@pytest.mark.parametrize("method,source,m,quantize,batch", BATCH_RUNS)
def test_batch_matches_ar_alone(method: str, source: str, m: int, quantize: str,
                                batch: int) -> None:
    src: TokenSource | None = SOURCES[source]()
    run = BatchRun(PipelineEngine(target_shards(m, quantize=quantize), src, width=4, topk=2),
                   method, batch)
    reqs = [Request(p, n, sp, stops(j, quantize)) for j, (p, n, sp, _) in enumerate(SPECS)]
    arrivals: dict[int, list[Request]] = {}
    for j, step in enumerate(ARRIVE):
        arrivals.setdefault(step, []).append(reqs[j])
    cancels = {step: [reqs[j].rid] for j, step in CANCEL.items()}
    results = run.run(arrivals, cancels)
    for j, req in enumerate(reqs):
        got = results[req.rid].tokens
        ref = reference(j, quantize)
        if j in CANCEL:  # whatever it produced before leaving is still exact
            assert got == ref[: len(got)], (j, method, source, m, batch, quantize)
        else:
            assert got == ref, (j, method, source, m, batch, quantize)
    assert run.used_blocks() == [0] * m and run.reserved == 0
    if source in ("layers2", "hybrid"):  # the drafts shared one pool and gave it all back
        assert run.draft_pool is not None and run.draft_pool.used_blocks == 0
    # with one request at a time the batch is exactly the single-request schedule
    if batch == 1 and method == "pp":
        for j, req in enumerate(reqs):
            if j not in CANCEL:
                assert len(results[req.rid].steps) == m * (len(reference(j)) - 1)


def test_pp_requests_fill_the_pipeline_as_micro_batches() -> None:
    """pp with B = m requests joining together: their roots are staggered one step
    apart, so each step every stage holds one root instead of one stage holding all."""
    m = 4
    run = BatchRun(PipelineEngine(target_shards(m)), "pp", m)
    reqs = [Request(SPECS[j][0], 6, SPECS[j][2]) for j in range(m)]
    for r in reqs:
        run.add(r)
    results = run.run()
    # steps after the prompts crossed the stages (they flow through together)
    decode = [s for s in run.steps if not s.serial][m:]
    assert not any(s.prompt_rows for s in decode)
    assert max(max(s.stage_tokens) for s in decode) == 1
    assert sum(all(s.stage_tokens) for s in decode) >= len(decode) - 2 * (m - 1)
    assert [results[r.rid].tokens for r in reqs] == [reference(j)[:6] for j in range(m)]


def test_packing_really_batches() -> None:
    """With B=4 a stage's forward holds nodes of several requests in one step."""
    run = BatchRun(PipelineEngine(target_shards(2), NgramSource(), width=4, topk=2),
                   "specpipe", 4)
    for j in range(4):
        run.add(Request(*SPECS[j][:3]))
    results = run.run()
    assert max(max(s.stage_tokens) for s in run.steps if not s.serial) > 4  # > w: many requests
    for rid, res in results.items():  # every token stamped once, in step order
        times = run.token_times[rid]
        assert len(times) == len(res.tokens) and times == sorted(times) and times[0] > 0


def test_miss_in_one_request_does_not_flush_another() -> None:
    """A self-drafting request (always hits) keeps its own schedule next to one that misses."""
    m = 3
    eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=2)

    def hitter() -> Request:
        return Request(PROMPT, 20, GREEDY, source=DraftModelSource(target_whole()))

    alone = generate_many(eng, [hitter()], "specpipe", 1)[0]
    a = hitter()
    b = Request(PROMPT[4:], 20, GREEDY, source=DraftModelSource(other_draft()))
    both = generate_many(eng, [a, b], "specpipe", 2)
    assert both[0].tokens == alone.tokens == reference(0)[:20]
    assert sum(s.flushed for s in both[1].steps) > 0  # the other request did miss
    assert sum(s.flushed for s in both[0].steps) == 0  # ... and never flushed this one
    assert len(both[0].steps) == len(alone.steps)  # same schedule as alone
    assert [s.stage_tokens for s in both[0].steps] == [s.stage_tokens for s in alone.steps]


def test_fixed_pool_admits_by_blocks_and_memory_follows_tokens() -> None:
    """A request that does not fit waits (others are unaffected); blocks in use follow the
    tokens held, not max_new_tokens; the pool is empty at the end."""
    m = 2
    eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=2)
    probe = BatchRun(eng, "specpipe", 8, kv_blocks=1000)
    worst = probe._worst_blocks(Request(PROMPT, 24))
    run = BatchRun(eng, "specpipe", 8, kv_blocks=2 * worst + 1)  # room for two worst cases
    reqs = [Request(PROMPT, 24), Request(PROMPT[4:], 16, sampled(11)), Request(PROMPT, 24),
            Request([7, 7, 1, 2], 12, sampled(3))]
    for r in reqs:
        run.add(r)
    waited, peak = False, 0
    run.step()
    # right after the prefill only the prompt (and a root) is held, not the worst case
    assert run.used_blocks()[0] <= 2 * blocks_for(len(PROMPT) + 2, 16)
    while not run.idle:
        waited |= bool(run.queue) and len(run.running) < 8
        peak = max(peak, len(run.running))
        assert max(run.used_blocks()) <= run.reserved <= 2 * worst + 1
        run.step()
    assert waited and peak == 2
    expect = [reference(0), reference(1), reference(0), reference(3)]
    assert [run.results[r.rid].tokens for r in reqs] == expect
    assert run.used_blocks() == [0] * m and run.reserved == 0


@pytest.mark.parametrize("method,width,source", [
    ("specpipe", 4, "layers2"), ("specpipe", 1, "layers2"), ("specpipe", "adaptive", "layers2"),
    ("specinfer", None, "layers2"), ("specpipe", 4, "hybrid")])
def test_a_fixed_budget_bounds_the_draft_models_pool_too(method: str, width,
                                                         source: str) -> None:
    """With a fixed budget the draft model's shared pool is fixed at it as well: the
    admission rule that bounds a stage's rows bounds the draft's (its cache holds the
    same committed rows and tree), so a pool of two worst cases never runs out, and
    every request still equals ar alone."""
    m = 3
    eng = PipelineEngine(target_shards(m), SOURCES[source](), width=4, topk=2)
    probe = BatchRun(eng, method, 8, kv_blocks=1000, width=width)
    worst = max(probe._worst_blocks(Request(p, n)) for p, n, _, _ in SPECS)
    run = BatchRun(eng, method, 8, kv_blocks=2 * worst, width=width)
    assert run.draft_pool is not None and not run.draft_pool.growable
    assert run.draft_pool.n_blocks == 2 * worst
    reqs = [Request(p, n, sp, stops(j)) for j, (p, n, sp, _) in enumerate(SPECS)]
    results = run.run({0: reqs})  # PoolExhausted, were the draft's rows unbounded
    assert [results[r.rid].tokens for r in reqs] == [reference(j) for j in range(len(SPECS))]
    assert 0 < run.draft_pool.peak_used <= 2 * worst
    assert run.draft_pool.used_blocks == 0


@pytest.mark.parametrize("source", ["ngram", "layers2"])
def test_presized_pools_never_grow_while_the_queued_requests_run(source: str) -> None:
    """presize (bench --concurrency's pools) holds the max_batch largest queued worst
    cases, so no pool, the draft's included, is replaced mid-run (a compiled GPU stage
    would record its CUDA graphs again); the tokens stay ar's."""
    eng = PipelineEngine(target_shards(3), SOURCES[source](), width=4, topk=2)
    run = BatchRun(eng, "specpipe", 3)
    reqs = [Request(p, n, sp, stops(j)) for j, (p, n, sp, _) in enumerate(SPECS)]
    for r in reqs:
        run.add(r)
    worst = sorted((run._worst_blocks(r) for r in reqs), reverse=True)
    assert run.presize() == run.pools[0].n_blocks >= sum(worst[:3])
    pools = [*run.pools, run.draft_pool] if run.draft_pool is not None else run.pools
    tensors = [(p.k, p.v) for p in pools]
    while not run.idle:
        run.step()
    assert all(p.k is k and p.v is v for p, (k, v) in zip(pools, tensors, strict=True))
    assert [run.results[r.rid].tokens for r in reqs] == [reference(j) for j in range(len(SPECS))]


def test_pool_too_small_is_refused_and_bad_method() -> None:
    eng = PipelineEngine(target_shards(2), NgramSource())
    with pytest.raises(ConfigError):
        BatchRun(eng, "specpipe", 2, kv_blocks=2).add(Request(PROMPT, 24))
    with pytest.raises(ConfigError):
        BatchRun(eng, "beam", 2)
    with pytest.raises(ConfigError):
        BatchRun(PipelineEngine(target_shards(2)), "specpipe", 2)
    with pytest.raises(ConfigError):
        BatchRun(PipelineEngine(target_shards(2)), "specinfer", 2)


def test_draft_levels_of_many_requests_run_as_one_forward(monkeypatch) -> None:
    """With a draft model, one draft forward per step holds several requests' levels."""
    src = layers_draft(2)
    seen: list[int] = []
    packed = src.shard.forward_packed

    def spy(x, pos, segs):
        seen.append(len(segs))
        return packed(x, pos, segs)

    monkeypatch.setattr(src.shard, "forward_packed", spy)
    eng = PipelineEngine(target_shards(2), src, width=4, topk=2)
    out = generate_many(eng, [Request(*SPECS[j][:3]) for j in (0, 1, 3)], "specpipe", 3)
    assert max(seen) == 3
    assert [o.tokens for o in out] == [reference(0), reference(1), reference(3)]


@pytest.mark.parametrize("pooled", [False, True])
def test_a_draft_model_prefilled_in_chunks_proposes_what_it_does_prefilled_whole(
        pooled: bool) -> None:
    """The draft service feeds a draft model a long prompt a chunk a step (prefill);
    its cache, and so its proposals, are those of one forward over the whole prompt."""
    from stages.speculation.step import TreeOwner

    whole, chunked = layers_draft(2), layers_draft(2)
    if pooled:
        chunked.pool = chunked.shard.new_pool(2, growable=True)
    whole.reset(PROMPT)
    for upto in (7, 14, 14, len(PROMPT)):  # a repeated call adds nothing
        chunked.prefill(PROMPT, upto)
    assert chunked.filled == len(PROMPT)
    proposals = []
    for src in (whole, chunked):
        owner = TreeOwner(src, 4, 2, list(PROMPT))
        owner.start(9)
        tree = owner.tree
        assert tree is not None
        root = torch.zeros(1, dtype=torch.long)  # the tree index of its root
        proposals.append(src.expand(tree, root, list(PROMPT) + [9], 4))
    (t0, p0), (t1, p1) = proposals
    assert [t.tolist() for t in t0] == [t.tolist() for t in t1]
    assert all(torch.allclose(a, b) for a, b in zip(p0, p1, strict=True))


def test_kv_follows_tokens_held_not_max_new_tokens() -> None:
    """A request asking for 400 tokens and cancelled after a few steps never held more
    blocks than its tokens so far need: nothing is allocated by max_new_tokens."""
    m = 2
    run = BatchRun(PipelineEngine(target_shards(m), NgramSource(), width=4, topk=2),
                   "specpipe", 2)
    req = Request(PROMPT, 400)
    run.run(arrivals={0: [req]}, cancels={6: [req.rid]})
    kv = run.kv_report()
    held = len(PROMPT) + len(run.results[req.rid].tokens) + (m + 1) * 4  # + tree rows
    for peak, bs in zip(kv["peak_blocks"], kv["block_size"], strict=True):
        assert 0 < peak * bs <= held + bs < len(PROMPT) + 400
    assert run.used_blocks() == [0] * m  # all given back


@pytest.mark.parametrize("method,source", [("pp", "none"), ("specpipe", "ngram"),
                                           ("specpipe", "layers2")])
def test_prefill_flows_through_the_stages_in_chunks(method: str, source: str) -> None:
    """pp and specpipe: a joining prompt crosses the stages one per step, in chunks,
    packed with the running requests' levels (no serial prefill stalls them), and
    every request still equals ar alone."""
    m, chunk = 3, 5
    run = BatchRun(PipelineEngine(target_shards(m), SOURCES[source](), width=4, topk=2),
                   method, 4, prefill_chunk=chunk)
    reqs = [Request(p, n, sp, stops(j)) for j, (p, n, sp, _) in enumerate(SPECS)]
    arrivals: dict[int, list[Request]] = {}
    for j, step in enumerate(ARRIVE):
        arrivals.setdefault(step, []).append(reqs[j])
    results = run.run(arrivals, {step: [reqs[j].rid] for j, step in CANCEL.items()})
    for j, req in enumerate(reqs):
        got = results[req.rid].tokens
        assert got == (reference(j)[: len(got)] if j in CANCEL else reference(j)), j
    assert not any(s.serial for s in run.steps)  # no step ran the stages one by one
    rows = [s.prompt_rows for s in run.steps if s.prompt_rows]
    assert max(max(r) for r in rows) <= chunk  # the budget: prompt rows per stage and step
    assert any(sum(1 for x in r if x) >= 2 for r in rows)  # chunks on several stages at once
    # a stage computed prompt rows and other requests' nodes in one forward
    assert any(t > p > 0 for s in run.steps if s.prompt_rows
               for t, p in zip(s.stage_tokens, s.prompt_rows, strict=True))
    assert run.used_blocks() == [0] * m


def test_the_engine_lays_prefill_out_as_the_runtime_does() -> None:
    """The engine follows protocol/scheduling/prefill.py, as the synchroniser does: the
    scenario of test_sync's budget test (7, 5 and 1 prompt rows, chunk 3, 2 stages) puts
    the same rows into stage 1 step by step: b starts in the 2 rows a's last chunk
    leaves, c waits behind b, and each request equals ar alone."""
    prompts = [PROMPT[:7], PROMPT[7:12], PROMPT[12:13]]
    run = BatchRun(PipelineEngine(target_shards(2)), "pp", 3, prefill_chunk=3)
    reqs = [Request(p, 4, GREEDY) for p in prompts]
    results = run.run({0: reqs}, {})
    stage1 = [s.prompt_rows[0] for s in run.steps if s.prompt_rows and s.prompt_rows[0]]
    assert stage1 == [3, 3, 1 + 2, 3, 1]
    for p, req in zip(prompts, reqs, strict=True):
        alone = PipelineEngine([target_whole()]).generate(p, 4, GREEDY, "ar").tokens
        assert results[req.rid].tokens == alone


def test_bad_prefill_chunk_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefill chunk"):
        BatchRun(PipelineEngine(target_shards(2)), "pp", 2, prefill_chunk=0)
