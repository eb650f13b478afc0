"""Adaptive tree width in SpecPipe-DB: lossless whatever the widths, and the widths follow load.

The lossless cases reuse test_batch_lossless's requests (staggered arrivals, a
cancel, stop ids, greedy and seeded sampling) and compare every request with
``ar`` alone.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable, Sequence

import pytest

from protocol.errors import TreepipeError
from protocol.scheduling.records import LinkModel, StepRecord
from protocol.scheduling.width import (
    WIDEN_MARGIN,
    AdaptiveWidth,
    StepCost,
    candidate_widths,
    parse_width,
)
from stages.speculation.batch import BatchRun, Request
from stages.speculation.engine import PipelineEngine
from stages.speculation.step import NOT_PROPOSED
from stages.speculation.token_sources import NgramSource
from tests.test_batch_lossless import ARRIVE, CANCEL, SOURCES, SPECS, reference, stops
from tests.tiny_models import PROMPT, target_shards


class RandomWidths(AdaptiveWidth):
    """Any width in any step (seeded): widths must never change what is committed."""

    def __init__(self, cap: int, m: int, seed: int):
        super().__init__(cap, m, lambda n: 1.0)
        self.rng = random.Random(seed)

    def choose(self, rids: Sequence[int]) -> dict[int, int]:
        w = {r: self.rng.choice(self.widths) for r in rids}
        self.chosen.extend(w.values())
        return w


def run_specs(m: int, source: str, batch: int,
              width: str | AdaptiveWidth) -> tuple[BatchRun, list[Request]]:
    run = BatchRun(PipelineEngine(target_shards(m), SOURCES[source](), width=4, topk=2),
                   "specpipe", batch, width=width)
    reqs = [Request(p, n, sp, stops(j)) for j, (p, n, sp, _) in enumerate(SPECS)]
    arrivals: dict[int, list[Request]] = {}
    for j, step in enumerate(ARRIVE):
        arrivals.setdefault(step, []).append(reqs[j])
    run.run(arrivals, {step: [reqs[j].rid] for j, step in CANCEL.items()})
    return run, reqs


def expensive(n: float) -> float:
    """A step whose cost is mostly its nodes."""
    return 1.0 + 0.5 * n


POLICIES: dict[str, Callable[[int], str | AdaptiveWidth]] = {
    "adaptive": lambda m: "adaptive",  # measured cost model
    "expensive": lambda m: AdaptiveWidth(4, m, expensive),
    "random": lambda m: RandomWidths(4, m, seed=m),
}
CASES = [("ngram", 2, "adaptive"), ("layers2", 3, "adaptive"), ("ngram", 3, "expensive"),
         ("layers2", 2, "random")]


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("source,m,policy", CASES, ids=[f"{a}-m{b}-{c}" for a, b, c in CASES])
def test_adaptive_width_is_lossless(source: str, m: int, policy: str, batch: int) -> None:
    run, reqs = run_specs(m, source, batch, POLICIES[policy](m))
    for j, req in enumerate(reqs):
        got = run.results[req.rid].tokens
        want = reference(j)[: len(got)] if j in CANCEL else reference(j)
        assert got == want, (j, source, m, policy, batch)
    assert run.used_blocks() == [0] * m and run.reserved == 0
    assert run.adaptive is not None and not run.adaptive.hit  # finished requests forgotten
    if policy == "random" or (policy == "expensive" and batch > 1):
        assert 0 in run.adaptive.chosen  # requests really ran without speculation at times
    if policy == "expensive" and batch == 1:
        # alone, a root costs its stage what a level of width 1 does: never width 0
        assert 0 not in run.adaptive.chosen
    if policy == "random":  # ... and with wider trees at others
        assert max(run.adaptive.chosen) > 1


def test_rank_says_which_widths_hit() -> None:
    """With one candidate width w, every verification hits exactly when its rank < w; the
    policy learns every rank but the one of the token that ends its request
    (Scheduler.update: the runtime's barrier ends the request before it is ranked)."""
    seen: list[tuple[int, int | None]] = []

    class Spy(AdaptiveWidth):
        def observe(self, rid: int, rank: int | None) -> None:
            seen.append((rid, rank))
            super().observe(rid, rank)

    for w in (1, 2):
        seen.clear()
        run = BatchRun(PipelineEngine(target_shards(3), NgramSource(), width=4, topk=3),
                       "specpipe", 3, width=Spy(w, 3, lambda n: 1.0, widths=(w,)))
        reqs = [Request(SPECS[j][0], 14, SPECS[j][2]) for j in (0, 2, 6)]
        for r in reqs:
            run.add(r)
        run.run()
        for r in reqs:
            hits = [s.hits for s in run.results[r.rid].steps if s.verified][:-1]
            ranks = [k for rid, k in seen if rid == r.rid]
            assert None not in ranks and len(ranks) == len(hits)
            assert [int(k < w) for k in ranks] == hits, w  # type: ignore[operator]
            assert any(k == NOT_PROPOSED for k in ranks) or all(hits)


def rates(policy: AdaptiveWidth, rid: int, ranks: list[int]) -> None:
    for k in ranks:
        policy.observe(rid, k)


def test_choice_is_the_best_combination_and_shrinks_with_load() -> None:
    """Coordinate ascent finds the exhaustive optimum here (with no margin for widening;
    with the default one it stays within that margin of it), and as B grows under a
    cost that charges per node the mean width falls, down to no speculation."""
    m = 4
    policy = AdaptiveWidth(16, m, lambda n: 1.0 + 0.08 * n, widen_margin=0.0)
    careful = AdaptiveWidth(16, m, lambda n: 1.0 + 0.08 * n)
    assert policy.widths == candidate_widths(16) == tuple(range(17))
    # rank sequences: request 0 a good guesser, 1 a mediocre one, 2 almost never hits
    good = [0, 0, 1, 0, 3, 0, 0, 2, 0, 0] * 5
    fair = [0, 5, 1, 9, NOT_PROPOSED, 0, 2, 7, 1, 12] * 5
    poor = [NOT_PROPOSED, NOT_PROPOSED, 14, NOT_PROPOSED, 0] * 10
    kinds = [good, fair, poor]
    mean_w = []
    for b in (1, 2, 3, 6, 12, 24):
        policy.current.clear()
        for r in range(b):
            policy.hit.pop(r, None)
            policy.hit_n.pop(r, None)
            rates(policy, r, kinds[r % 3])
        chosen = policy.choose(list(range(b)))
        if b <= 3:  # exhaustive check of the optimum
            def score(ws: tuple[int, ...]) -> float:
                t = 1.0 + 0.08 * policy.stage_nodes(dict(enumerate(ws)))
                return sum(policy.goodput(policy.rate(r, x)) for r, x in enumerate(ws)) / t
            best = max(score(ws) for ws in itertools.product(policy.widths, repeat=b))
            assert score(tuple(chosen[r] for r in range(b))) == pytest.approx(best)
            careful.hit, careful.hit_n = policy.hit, policy.hit_n
            careful.pooled, careful.pooled_n = policy.pooled, policy.pooled_n
            near = careful.choose(list(range(b)))
            assert score(tuple(near[r] for r in range(b))) >= best / (1 + careful.widen_margin)
        mean_w.append(sum(chosen.values()) / b)
        if b == 24:
            assert chosen[2] == 0  # the poor guesser stops speculating under load
    assert mean_w[0] > mean_w[-1] and mean_w == sorted(mean_w, reverse=True), mean_w
    assert mean_w[0] >= 2  # alone, the good guesser widens its tree


def test_a_width_beyond_what_the_source_offers_costs_nothing_more() -> None:
    """A level holds at most the candidates the source offered: the cost model charges
    min(w, offered), so a request whose source offers 2 pays for 2 nodes at w=8."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0 + 0.1 * n)
    assert policy.stage_nodes({0: 8, 1: 0, 2: 0}) == 8 + 1  # two idle roots share a stage
    for offered in (2, 2, 2):
        policy.observe_level(0, offered)
    assert policy.stage_nodes({0: 8}) == policy.stage_nodes({0: 2}) == 2
    rates(policy, 0, [0, 1, 0, NOT_PROPOSED, 1, 1])  # its second candidate often hits
    chosen = policy.choose([0])[0]  # any width that holds all it offers: the same tree
    assert chosen >= 2 and policy.stage_nodes({0: chosen}) == 2
    policy.forget(0)
    # a new request is priced at the levels of the requests before it until its own
    assert policy.stage_nodes({1: 8}) == 2
    assert AdaptiveWidth(8, 4, lambda n: 1.0).stage_nodes({1: 8}) == 8  # none seen yet


def test_batch_run_narrows_the_tree_as_requests_join() -> None:
    """End to end: the same requests, one at a time against eight at once."""
    def mean_width(batch: int) -> float:
        policy = AdaptiveWidth(8, 2, lambda n: 1.0 + 0.1 * n)
        run = BatchRun(PipelineEngine(target_shards(2), NgramSource(), width=8, topk=4),
                       "specpipe", batch, width=policy)
        for prompt, _, sp, _ in SPECS[:6]:
            run.add(Request(prompt, 12, sp))
        run.run()
        return sum(policy.chosen) / len(policy.chosen)

    alone, packed = mean_width(1), mean_width(6)
    assert packed < alone, (alone, packed)


def test_step_cost_learns_the_per_node_slope() -> None:
    """Stages with different fixed costs and 2 ms per node: slope 2 ms, line through
    the steps.  The last stage's LM head (10 ms per verified root) does not count;
    the draft's slope does when it is the steeper one."""
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8)
    assert cost(5) == 0.0  # nothing measured yet
    for n in (1, 4, 2, 8, 3, 6):
        roots = 1 + n % 3
        rec = StepRecord([n, max(n - 1, 1), roots],
                         [0.010 + 0.002 * n, 0.020 + 0.002 * max(n - 1, 1), 0.030 + 0.010 * roots],
                         [0.0] * 3, [0] * 3)
        cost.observe(rec)
    assert max(cost.slopes()) == pytest.approx(0.002)
    assert cost(8) > cost(1) > cost(0) > 0
    for n in (1, 2, 10):
        cost.observe(StepRecord([1, 1, 1], [0.01] * 3, [0.0] * 3, [0] * 3, draft_tokens=n,
                                draft_s=0.005 * n))
    assert max(cost.slopes()) == pytest.approx(0.005)
    # a step carrying a prompt chunk (64 rows, slow) teaches nothing about tree nodes
    chunk = StepRecord([64, 1, 1], [0.5] * 3, [0.0] * 3, [0] * 3, prompt_rows=[64, 0, 0])
    before = (max(cost.slopes()), cost(4), len(cost.steps))
    cost.observe(chunk)
    assert (max(cost.slopes()), cost(4), len(cost.steps)) == before


def test_bad_width_flags_are_one_line_errors() -> None:
    assert parse_width("adaptive") == "adaptive" and parse_width(" 4") == 4
    assert parse_width("adaptive:16") == "adaptive:16"
    for bad in ("0", "wide", "adaptive:0", "adaptive:x", "-2"):
        with pytest.raises(TreepipeError, match="adaptive") as e:
            parse_width(bad)
        assert "\n" not in str(e.value)
    eng = PipelineEngine(target_shards(2), NgramSource(), width=4)
    with pytest.raises(TreepipeError):
        BatchRun(eng, "specpipe", 2, width="sometimes")
    assert BatchRun(eng, "specpipe", 2, width="adaptive:8").width == 8
    assert BatchRun(eng, "specpipe", 2, width=2)._worst_blocks(Request(PROMPT, 8)) <= \
        BatchRun(eng, "specpipe", 2, width="adaptive")._worst_blocks(Request(PROMPT, 8))


def test_rare_deep_hits_are_learnt_across_requests() -> None:
    """A token found at rank 2..w is rare, so one request's short memory rarely holds
    one. The gain of width w over width 1 is pooled across requests: a request whose
    recent tokens were all first or missing still widens when width pays."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0 + 0.001 * n)
    rng = random.Random(5)
    for rid in range(20):  # earlier requests: rank 0 with 0.6, ranks 1..7 with 0.3
        rates(policy, rid, [0 if (u := rng.random()) < 0.6 else
                            (rng.randrange(1, 8) if u < 0.9 else NOT_PROPOSED)
                            for _ in range(20)])
        policy.forget(rid)
    rates(policy, 99, [0, 0, NOT_PROPOSED, 0, 0, NOT_PROPOSED, 0, 0])
    assert policy.rate(99, 8) > policy.rate(99, 1) + 0.15  # ~3/4 of its misses recovered
    assert policy.choose([99]) == {99: 8}


def test_a_requests_fixed_cost_is_not_taken_for_a_cost_per_node() -> None:
    """A stage step costs 10 ms + 20 ms per request it holds + 0.5 ms per node. Fitted
    within each request count, the slope is the 0.5 ms; across them it would be the
    requests' 20 ms spread over their nodes."""
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8)
    for reqs, w in itertools.product((1, 2, 3), (1, 2, 4, 1, 8, 2)):
        n = reqs * w
        s = 0.010 + 0.020 * reqs + 0.0005 * n
        cost.observe(StepRecord([n, n, reqs], [s, s, 0.01], [0.0] * 3, [0] * 3,
                                stage_requests=[reqs, reqs, reqs]))
    assert max(cost.slopes()) == pytest.approx(0.0005)


def test_nodes_are_free_while_the_last_stage_is_the_slowest() -> None:
    """Front stages cost 10 ms + 1 ms per node, the last stage (roots and LM head) 40 ms
    whatever the width: T(N) is flat up to 30 nodes, then rises 1 ms a node. A single
    line through the steps (all 40 ms) would call nodes free everywhere or nowhere."""
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8)
    for n in (8, 16, 12, 24, 8, 16, 20):
        front = 0.010 + 0.001 * n
        cost.observe(StepRecord([n, n, 8], [front, front, 0.040], [0.0] * 3, [0] * 3,
                                stage_requests=[8, 8, 8]))
    assert cost(8) == pytest.approx(0.040) and cost(24) == pytest.approx(0.040)
    assert cost(40) == pytest.approx(0.050)
    assert cost(64) == pytest.approx(0.074)


def test_a_step_in_the_cost_does_not_trap_the_choice() -> None:
    """Four rows cost 1, five or more 2 + 0.01 per node (a CPU stage's jump). From all
    at width 4, moving one request to width 1 still pays for the jump and looks worse;
    all at width 1 is best, and the uniform start points find it."""
    policy = AdaptiveWidth(4, 4, lambda n: 1.0 if n <= 4 else 2.0 + 0.01 * n,
                           widths=(0, 1, 2, 4))
    policy.pooled = {0: 0.0, 1: 0.6, 2: 0.7, 4: 0.8}
    policy.current = dict.fromkeys(range(4), 4)
    assert policy.choose(list(range(4))) == dict.fromkeys(range(4), 1)


def test_the_margin_is_against_the_choice_left_not_a_ratchet_along_the_scan() -> None:
    """Nodes cost nothing here and the hit rate grows with the width, but each width
    beyond 3 promises less than 5 % over the one before: the widest is best by far over
    where the requests are (width 1), so they go there, and stay once there."""
    import math

    policy = AdaptiveWidth(16, 4, lambda n: 1.0)
    policy.pooled = {w: 0.75 + 0.2 * math.log(w) / math.log(16) if w else 0.0
                     for w in policy.widths}
    gains = [policy.goodput(policy.pooled[w + 1]) / policy.goodput(policy.pooled[w])
             for w in range(3, 16)]
    assert max(gains) < 1 + WIDEN_MARGIN  # a scan taking each step against the last stalls
    policy.current = dict.fromkeys(range(3), 1)
    assert policy.choose(list(range(3))) == dict.fromkeys(range(3), 16)
    assert policy.choose(list(range(3))) == dict.fromkeys(range(3), 16)


def test_alike_requests_get_one_width_unlike_ones_their_own(monkeypatch) -> None:
    """Requests drawn from one source differ in their own rates only by noise, which
    chosen for one by one gives them unlike widths (4 and 6 here); tested alike, they
    all get one. A request that really hits less makes them unlike, and each is chosen
    for on its own again."""
    rng = random.Random(12)

    def draws(p0: float, n: int) -> list[int]:  # rank 0 with p0, else ranks 1-5 or none
        return [0 if rng.random() < p0 else rng.choice([1, 2, 3, 5, NOT_PROPOSED])
                for _ in range(n)]

    policy = AdaptiveWidth(8, 4, lambda n: 1.0 + 0.04 * n)
    for r in range(4):
        rates(policy, r, draws(0.6, 40))
    assert policy.alike(range(4))
    with monkeypatch.context() as mp:
        mp.setattr(policy, "alike", lambda rids: False)
        assert len(set(policy.choose(list(range(4))).values())) > 1  # the noise's widths
    policy.current.clear()
    chosen = policy.choose(list(range(4)))
    assert len(set(chosen.values())) == 1, chosen
    rates(policy, 9, [NOT_PROPOSED] * 40)  # a request the source cannot guess
    assert not policy.alike([0, 1, 2, 9])
    assert policy.choose([0, 1, 2, 9])[9] < chosen[0]


def test_alike_requests_are_priced_at_the_pooled_rates() -> None:
    """Alike requests' own rates differ from the pooled one by noise, so their width
    follows the pooled estimate, not that noise: the same four requests a little luckier
    or unluckier (and still alike) get the same width (priced at their own rates they
    got 1 and 4)."""
    rng = random.Random(6)

    def draws(p0: float, n: int) -> list[int]:
        return [0 if rng.random() < p0 else rng.choice([1, 2, 3, 5, NOT_PROPOSED])
                for _ in range(n)]

    policy = AdaptiveWidth(8, 4, lambda n: 1.0 + 0.04 * n)
    for r in range(20, 40):  # earlier requests teach the pooled rates
        rates(policy, r, draws(0.6, 20))
        policy.forget(r)
    for r in range(4):
        rates(policy, r, draws(0.6, 30))
    chosen = []
    for shift in (0.08, -0.08):
        twin = copy.deepcopy(policy)
        for r in range(4):
            twin.hit[r] = {w: min(max(p + shift, 0.0), 1.0) for w, p in twin.hit[r].items()}
        assert twin.alike(range(4))
        chosen.append(twin.choose(list(range(4))))
    assert chosen[0] == chosen[1], chosen
    assert len(set(chosen[0].values())) == 1


def test_a_short_run_of_misses_does_not_make_a_hard_request() -> None:
    """Three misses in a row move a new request's width-1 rate only part of the way
    from the pooled rate; a long run moves it most of the way."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0)
    for rid in range(10):
        rates(policy, rid, [0, 0, 5, 0, 0, 0, 9, 0, 0])  # width 1 hits 7 of 9
        policy.forget(rid)
    pooled = policy.pooled[1]
    rates(policy, 99, [50] * 3)
    assert pooled * 0.6 < policy.rate(99, 1) < pooled
    rates(policy, 99, [50] * 40)
    assert policy.rate(99, 1) < pooled * 0.4


def test_leaving_width_0_for_a_node_it_already_costs_needs_no_margin() -> None:
    """A request at width 0 has its root cross the stages; at width 1 that root is a
    level of one node, so the move adds no node and the cost model's error (what the
    widening margin covers) does not come into it. A request that rarely hits gains
    less than the margin from width 1, and used to stay at 0 for nothing."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0 if n <= 5 else 100.0)  # a jump past 5 rows
    rates(policy, 0, [0, 0, 1, 0, 0, 2, 0, 0, 3, 0] * 6)
    rates(policy, 1, [NOT_PROPOSED] * 30)
    gain = policy.goodput(policy.rate(1, 1)) / policy.goodput(0.0) - 1.0
    total = policy.goodput(policy.rate(0, 4)) + policy.goodput(0.0)
    # width 1 beats width 0 for it, but by less than the margin of the whole step's goodput
    assert 0 < gain * policy.goodput(0.0) / total < WIDEN_MARGIN
    policy.current = {0: 4, 1: 0}
    assert policy.choose([0, 1]) == {0: 4, 1: 1}
    assert policy.stage_nodes({0: 4, 1: 1}) == policy.stage_nodes({0: 4, 1: 0}) == 5


# hits at rank 0 six times in ten, at rank 1 once in fifty, misses the rest
NP = NOT_PROPOSED
RARE_SECOND = ([0, 0, 0, NP, 0, 0, NP, 0, NP, NP] * 4 + [0, 0, 0, NP, 0, 1, NP, 0, NP, NP]) * 2


def test_nodes_priced_free_need_no_widening_margin() -> None:
    """The margin covers the cost model's error, so a wider tree pays it only as far as
    the priced step grows. Where the extra nodes are priced free (the busiest stage
    computes them in the shadow of the last stage's work: n-gram at B = 2 priced widths
    1-8 at 9.6 ms a step, and the fixed widths measured alike), a gain below the margin
    is still a gain: before, the policy stayed at width 1 there while width 3 promised
    2.8 % more, and ran 3 % behind w = 4."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0)  # flat: every node in the last stage's shadow
    for rid in (0, 1):
        rates(policy, rid, RARE_SECOND)
    good = {w: policy.goodput(policy.pooled_rate(w)) for w in (1, 2, 8)}
    assert 0 < good[2] / good[1] - 1 < good[8] / good[1] - 1 < WIDEN_MARGIN
    policy.current = {0: 1, 1: 1}
    # every width priced alike, and a wider one holds more (the prior's share, of ranks
    # not yet seen, grows with the width): the widest
    assert policy.choose([0, 1]) == {0: 8, 1: 8}
    # a step that does grow pays the margin as far as it grows: at 1.2 % a node, width 2
    # gains a little net of its cost, less than the cost's own growth, and stays out;
    # at 0.4 % a node it gains more than that, and is taken
    for per_node, moves in ((0.012, False), (0.004, True)):
        policy = AdaptiveWidth(8, 4, lambda n, k=per_node: 1.0 + k * n)
        for rid in (0, 1):
            rates(policy, rid, RARE_SECOND)
        grown = policy.cost(4) / policy.cost(2) - 1
        net = good[2] / policy.cost(4) / (good[1] / policy.cost(2)) - 1
        assert 0 < net and (net > grown) == moves, (net, grown)
        policy.current = {0: 1, 1: 1}
        assert policy.choose([0, 1]) == ({0: 2, 1: 2} if moves else {0: 1, 1: 1})


def test_ranks_not_yet_seen_are_priced_by_a_prior_that_fades() -> None:
    """An n-gram source often offers at most one candidate a level, so every width
    costs one node, and its rank-1 and rank-2 tokens are rare: a run's first verifications
    often hold none. As a plain share, no width recovered anything there, all tied with
    width 1, and a tie went narrower (n-gram, B = 1: width 1 lost the first such tokens,
    which w = 4 kept). The prior makes the free wider tree the choice; where wider costs,
    it is taken early, and once many misses held no such rank, width 1 is back."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0)
    for offered in (0, 1, 0, 1):  # at most one candidate a level: any width, one node
        policy.observe_level(0, offered)
    assert {policy.level_nodes(0, w) for w in range(1, 9)} == {1}
    rates(policy, 0, [0, NP, 0, NP, NP, 0] * 3)  # no rank past the first yet
    assert policy.pooled[8] == policy.pooled[1]
    assert policy.choose([0]) == {0: 8}
    for per_node in (0.01, 0.03):
        policy = AdaptiveWidth(8, 4, lambda n, k=per_node: 1.0 + k * n)
        rates(policy, 0, [0, NP] * 3)
        assert policy.choose([0])[0] > 1
        rates(policy, 0, [0, NP] * 100)
        policy.current.clear()
        assert policy.choose([0]) == {0: 1}


def test_a_level_is_priced_at_the_nodes_each_width_held() -> None:
    """A source that offers no candidate half the time and three the other half offers
    1.5 a level on average. Beyond the one node a level costs as a root does alone,
    width 2 takes one more candidate half the time and widths 3 and up two: 1.5 and 2
    nodes (the mean of min(w, offered)), where min(w, mean offered) priced every width
    from 2 up at 1.5 alike."""
    policy = AdaptiveWidth(8, 4, lambda n: 1.0 + 0.1 * n)
    for offered in [0, 3] * 40:
        policy.observe_level(0, offered)
    nodes = {w: policy.level_nodes(0, w) for w in (1, 2, 3, 8)}
    assert nodes[1] == 1.0
    assert nodes[2] == pytest.approx(1.5, abs=0.1)  # an EWMA: the last few weigh most
    assert nodes[3] == nodes[8] == pytest.approx(2.0, abs=0.1)
    few = AdaptiveWidth(8, 4, lambda n: 1.0, widths=(0, 1, 2, 4))
    for offered in [0, 3] * 40:
        few.observe_level(0, offered)
    assert few.level_nodes(0, 3) == few.level_nodes(0, 2) == nodes[2]  # not a candidate
