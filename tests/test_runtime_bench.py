"""Structure of `treepipe runtime-bench` (numbers live in docs/benchmarks.md, not here)."""

from __future__ import annotations

import pytest

from orchestrator.benchmarks.runtime_bench import bench_sync, bench_transfer


def test_barrier_costs_two_round_trips_per_worker() -> None:
    s = bench_sync(stages=2, steps=40)  # Redis with a password, as pipelines run it
    assert s["participants"] == 3 and s["secure"] is True
    # arrive + blocking pop per step; admission adds a few calls in all
    assert s["redis_commands_per_step_per_worker"] == pytest.approx(2.0, abs=0.1)
    assert 0 < s["p50_us"] <= s["p99_us"]


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "plain"])
@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_transfer_reports_one_hop(transport: str, secure: bool) -> None:
    """Authenticated links (as pipelines run) and plain ones, for the side-by-side table."""
    t = bench_transfer(transport, width=4, dim=32, n=40, secure=secure)
    assert t["bytes"] == 4 * (32 * 4 + 24) and t["secure"] is secure
    assert 0 < t["p50_us"] <= t["p99_us"]
