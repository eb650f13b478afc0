"""The measured stage curve T(rows) and the adaptive width's cost model built on it."""

from __future__ import annotations

import pytest

from protocol.scheduling.records import LinkModel, StepRecord
from protocol.scheduling.width import AdaptiveWidth, StepCost
from stages.model import step_profile
from stages.model.step_profile import Curve, forward_seconds, front_curve, profile_sizes
from tests.tiny_models import target_shards


def test_sizes_cover_every_small_count_then_grow() -> None:
    sizes = profile_sizes(72)
    assert sizes[:8] == list(range(1, 9)) and sizes[-1] == 72
    assert all(b > a for a, b in zip(sizes, sizes[1:], strict=False))
    assert all(b <= round(a * 1.25) + 1 for a, b in zip(sizes[8:], sizes[9:], strict=False))
    assert profile_sizes(1) == [1] and profile_sizes(3) == [1, 2, 3]


def test_curve_interpolates_and_never_falls() -> None:
    c = Curve([(1, 0.010), (2, 0.008), (4, 0.020), (8, 0.030)])
    assert c(1) == c(2) == pytest.approx(0.010)  # the dip at 2 rows is taken for noise
    assert c(3) == pytest.approx(0.015) and c(6) == pytest.approx(0.025)
    assert c(0.5) == pytest.approx(0.010) and c(12) == pytest.approx(0.040)  # past the end
    with pytest.raises(ValueError):
        Curve([])


def test_forward_times_are_measured_once_per_shard_and_size() -> None:
    shards = target_shards(3)
    first = forward_seconds(shards[1], [1, 2, 4])
    assert set(first) == {1, 2, 4} and all(s > 0 for s in first.values())
    assert forward_seconds(shards[1], [4, 1]) == {4: first[4], 1: first[1]}  # remembered
    # a new size has the asked ones timed again with it (one session: no seam in the
    # curve between two spells of the machine), the others kept
    again = forward_seconds(shards[1], [2, 4, 6])
    assert set(again) == {2, 4, 6} and all(s > 0 for s in again.values())
    assert step_profile._measured[shards[1]][1][1] == first[1]  # [requests][rows]
    assert set(step_profile._measured[shards[1]][1]) == {1, 2, 4, 6}
    curve = front_curve(shards, 10)  # stages 0 and 1: the slower at each size
    for n in profile_sizes(10):
        slowest = max(step_profile._measured[s][1][n] for s in shards[:2])
        assert curve(n) >= slowest - 1e-12
    assert shards[2] not in step_profile._measured  # the last stage is not profiled


def test_step_cost_follows_the_measured_curve_through_the_recent_steps() -> None:
    """Front stages measured at 9 ms up to 2 rows, 13 ms up to 4, 19 ms at 8; the real
    steps run 2 ms above the curve (other requests' prefixes): the predicted front is
    the curve moved up 2 ms, with its steps, not a line through the visited counts."""
    curve = Curve([(1, 0.009), (2, 0.009), (3, 0.013), (4, 0.013), (5, 0.019), (8, 0.019)])
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8, front=curve)
    for n in (2, 2, 2, 2):
        f = curve(n) + 0.002
        cost.observe(StepRecord([n, n, 1], [f, f, 0.005], [0.0] * 3, [0] * 3,
                                stage_requests=[2, 2, 2]))
    assert cost(2) == pytest.approx(0.011)
    assert cost(4) == pytest.approx(0.015) and cost(8) == pytest.approx(0.021)
    assert cost(1) == pytest.approx(0.011)  # the last stage (5 ms) stays below


def test_step_cost_prices_by_the_curve_until_a_step_without_prompt_chunks() -> None:
    """A batch's first steps all carry prompt chunks, which the model leaves out: until
    a step without them, the measured curve prices the tree (not 0 s, which made every
    width free and the policy take the widest for every request)."""
    curve = Curve([(1, 0.009), (8, 0.013), (32, 0.030), (64, 0.060)])
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8, front=curve)
    cost.observe(StepRecord([70, 70, 8], [0.05, 0.05, 0.01], [0.0] * 3, [0] * 3,
                            stage_requests=[8, 8, 8], prompt_rows=[64, 64, 0]))
    assert not cost.steps
    assert cost(8) == pytest.approx(0.013) and cost(32, 6) == pytest.approx(0.030)
    assert StepCost(link, node_bytes=8)(8) == 0.0  # no curve, no step: nothing known
    # six requests whose hit rate rises from 0.6 at width 1 to 0.9 at 8: one more token
    # per level is not worth a step 4.6x as long (8 nodes against 64 per stage)
    rids = list(range(6))
    chosen = []
    for model in (cost, StepCost(link, node_bytes=8)):
        policy = AdaptiveWidth(8, m=4, cost=model)
        for rank in [0] * 6 + [1, 2, 3, 5]:  # a finished request's verifications
            policy.observe(99, rank)
        chosen.append(set(policy.choose(rids).values()))
    assert max(chosen[0]) < 8
    # what the model did before: every width free, so the widest for every request
    # (the prior's share of ranks not yet seen grows with the width)
    assert chosen[1] == {8}


def test_step_cost_trusts_the_steps_measured_near_the_priced_load() -> None:
    """The curve (one request) runs 8 ms below the steps measured at 16 nodes with 8
    requests and 1 ms below those at 32: 16 nodes are priced as measured there, not by
    the window's mean error. Tail steps (2 requests, a 10 ms last stage) price a load of
    2 requests; the 8-request steps' 40 ms last stage does not."""
    curve = Curve([(1, 0.005), (8, 0.012), (16, 0.020), (32, 0.040), (64, 0.080)])
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8, front=curve)

    def step(n: int, front: float, last: float, reqs: int) -> StepRecord:
        return StepRecord([n, n, reqs], [front, front, last], [0.0] * 3, [0] * 3,
                          stage_requests=[reqs] * 3)

    for _ in range(6):
        cost.observe(step(16, curve(16) + 0.008, 0.004, 8))
        cost.observe(step(32, curve(32) + 0.001, 0.004, 8))
    # the window's mean error (4.5 ms) would miss each by 3.5 ms; the steps at the other
    # count, a factor 2 away, keep a weight of about a fifth
    assert cost(16, 8) == pytest.approx(0.028, abs=0.0015)
    assert cost(32, 8) == pytest.approx(0.041, abs=0.0015)
    assert cost(24, 8) > cost(16, 8)  # between the two, still rising
    for _ in range(6):
        cost.observe(step(2, 0.006, 0.010, 2))
    cost.observe(step(16, curve(16) + 0.008, 0.040, 8))
    assert cost(2, 2) == pytest.approx(0.010, abs=0.001)  # the tail's own last stage
    assert cost(4, 2) < cost(16, 8)


def test_profile_rounds_spread_a_slow_spell_over_every_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes are timed in rounds (one forward of each size per round) and the median
    taken: a slow spell that covers a whole round leaves every size's median alone,
    where timing one size after another would have bent the curve at the sizes it hit."""
    shards = target_shards(2)
    order: list[int] = []
    real = type(shards[0]).forward_packed

    def spy(self, x, pos, segs):  # type: ignore[no-untyped-def]
        order.append(int(x.shape[0]))
        return real(self, x, pos, segs)

    monkeypatch.setattr(type(shards[0]), "forward_packed", spy)
    forward_seconds(shards[0], [3, 5, 7], reps=2)
    # the prefix, then a warm-up round and two timed rounds over every size in turn
    assert order == [step_profile.PROFILE_PREFIX, 3, 5, 7, 3, 5, 7, 3, 5, 7]


def test_front_curve_is_measured_at_several_request_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to 4 requests: curves at 1, 2 and 4, each forward packing its rows over that
    many requests (sizes from the count up), read between the counts linearly."""
    shards = target_shards(2)
    packed: list[tuple[int, int]] = []
    real = type(shards[0]).forward_packed

    def spy(self, x, pos, segs):  # type: ignore[no-untyped-def]
        packed.append((int(x.shape[0]), len(segs)))
        return real(self, x, pos, segs)

    monkeypatch.setattr(type(shards[0]), "forward_packed", spy)
    curve = front_curve(shards, 6, max_requests=4)
    assert curve.counts == [1, 2, 4] and step_profile.profile_requests(8) == [1, 2, 4, 8]
    assert step_profile.profile_requests(6) == [1, 2, 4, 6]
    timed = {(n, r) for n, r in packed if n < r * step_profile.PROFILE_PREFIX}
    assert timed == {(n, r) for r in (1, 2, 4) for n in range(1, 7) if n >= r}
    assert set(step_profile._measured[shards[0]][4]) == {4, 5, 6}
    # each count's curve as measured; between counts, the line between them
    for r in (1, 2, 4):  # (never falling: the most of the counts up to 6)
        assert curve(6, r) == pytest.approx(max(step_profile._measured[shards[0]][r].values()))
    assert curve(6, 3) == pytest.approx((curve(6, 2) + curve(6, 4)) / 2)
    assert curve(6) == curve(6, 1) and curve(6, 9) == curve(6, 4)
    # a stage worker measures the same (remembered: no forward more) and publishes it
    packed.clear()
    loads = step_profile.forward_loads(shards[0], range(1, 7), [1, 2, 4])
    assert not packed and loads[4] == step_profile._measured[shards[0]][4]


def test_the_slowest_stage_at_the_counts_all_measured() -> None:
    """Two stages' published curves: per count of requests the slower at each row count;
    a count only one stage measured is left out; no count in common, no curve."""
    a = {1: [(1, 0.001), (4, 0.004)], 2: [(2, 0.003), (4, 0.005)], 4: [(4, 0.009)]}
    b = {1: [(1, 0.002), (4, 0.003)], 2: [(2, 0.002), (4, 0.006)]}
    curve = step_profile.slowest_load([a, b])
    assert curve is not None and curve.counts == [1, 2]
    assert curve(1, 1) == 0.002 and curve(4, 1) == 0.004
    assert curve(2, 2) == 0.003 and curve(4, 2) == 0.006 and curve(4, 8) == 0.006
    assert step_profile.slowest_load([{1: a[1]}, {2: b[2]}]) is None
    assert step_profile.slowest_load([]) is None


def test_step_cost_takes_the_slope_of_the_priced_request_count() -> None:
    """One request's curve rises 4 ms from 12 to 16 rows, four requests' 2 ms; steps at
    12 nodes with 4 requests run 1 ms above the four-request curve. 16 nodes with 4
    requests are priced along the four-request curve (+2 ms), not one request's (+4)."""
    from stages.model.step_profile import LoadCurve

    curve = LoadCurve({1: Curve([(1, 0.005), (12, 0.010), (16, 0.014)]),
                       4: Curve([(4, 0.008), (12, 0.012), (16, 0.014)])})
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8, front=curve)
    assert cost(16, 4) == pytest.approx(0.014)  # no step yet: the curve alone
    for _ in range(6):
        cost.observe(StepRecord([12, 12, 4], [0.013, 0.013, 0.004], [0.0] * 3, [0] * 3,
                                stage_requests=[4, 4, 4]))
    assert cost(12, 4) == pytest.approx(0.013)
    assert cost(16, 4) == pytest.approx(0.015)
    # a one-request curve (the runtime's stages publish one) moved through the same steps
    flat = StepCost(link, node_bytes=8, front=curve.curves[1])
    for _ in range(6):
        flat.observe(StepRecord([12, 12, 4], [0.013, 0.013, 0.004], [0.0] * 3, [0] * 3,
                                stage_requests=[4, 4, 4]))
    assert flat(16, 4) == pytest.approx(0.017)


def test_a_spike_of_the_machine_does_not_price_the_node_counts_near_it() -> None:
    """Steps at 12 and 20 nodes run 1 ms above the curve; the batch's first two steps, at
    28 nodes, took 15 ms more (a pool growing, another tenant). 16 nodes are priced 1 ms
    above the curve: the spikes are no cost of the nodes between (a weighted mean of the
    errors near 16 nodes priced them 2.3 ms above the curve)."""
    curve = Curve([(1, 0.005), (12, 0.008), (16, 0.009), (20, 0.010), (28, 0.012)])
    link = LinkModel(latency_s=0.0, bandwidth_bytes_s=1e18)
    cost = StepCost(link, node_bytes=8, front=curve)

    def step(n: int, extra: float) -> StepRecord:
        f = curve(n) + extra
        return StepRecord([n, n, 4], [f, f, 0.002], [0.0] * 3, [0] * 3, stage_requests=[4] * 3)

    for rec in [step(28, 0.016)] * 2 + [step(12, 0.001)] * 8 + [step(20, 0.001)] * 2:
        cost.observe(rec)
    assert cost._front_at(16, 4) == pytest.approx(curve(16) + 0.001, abs=1e-6)
