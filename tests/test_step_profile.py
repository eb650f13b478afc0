"""The measured stage curve T(rows) and the adaptive width's cost model built on it."""

from __future__ import annotations

import pytest

from stages.model import step_profile
from stages.model.step_profile import Curve, forward_seconds, front_curve, profile_sizes
from stages.speculation.records import LinkModel, StepRecord
from stages.speculation.width import AdaptiveWidth, StepCost
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
    assert step_profile._measured[shards[1]][1] == first[1]
    assert set(step_profile._measured[shards[1]]) == {1, 2, 4, 6}
    curve = front_curve(shards, 10)  # stages 0 and 1: the slower at each size
    for n in profile_sizes(10):
        slowest = max(step_profile._measured[s][n] for s in shards[:2])
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
    # what the model did before: every width free, so the narrowest that holds every
    # rank seen (up to 5) for every request
    assert chosen[1] == {6}


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
