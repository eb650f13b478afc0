"""Miss recovery in the simulator: the node-count model of ``--recovery`` (re-roots,
correction slots, chains, the exit head), its projection to the paper's testbed, and the
measured numbers it is built from."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from orchestrator.cli.simulator_commands import add_simulator_parsers
from orchestrator.lab.benchmarks import simulator
from orchestrator.lab.benchmarks.recovery_projection import (
    ENGINE_RECOVERY,
    ENGINE_SETTING,
    EXIT_CATCH_SMOLLM2,
    draft_catch,
    exit_catch,
    project_recovery,
    recovery_markdown,
    simulate_recovery,
)
from orchestrator.lab.benchmarks.simulator import (
    HIT,
    MISS,
    LevelModel,
    Outcome,
    PaperSetting,
    PipeSchedule,
    Profile,
    RecoveryModel,
    TimeCurve,
    bernoulli_outcomes,
    project,
    simulate_paper_batch,
    simulate_specpipe,
)
from protocol.errors import TreepipeError

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench" / "recovery"


def _small() -> Profile:
    return Profile([TimeCurve([1, 8], [1e-3, 2e-3])] * 4, head_s=5e-4)


def test_no_recovery_equals_the_simulator_before_it() -> None:
    """Pinned from the simulator before the recovery model (same seeds): none is today's."""
    assert project(PaperSetting(new_tokens=400))["tbt_ms"] == {
        "pp": 303.5763979147941, "specinfer": 117.13518085297679,
        "specpipe": 59.5845350499772}
    for rec in (None, RecoveryModel(), RecoveryModel(exit_stage=2, catch=1.0, budget=99)):
        kw = {} if rec is None else {"recovery": rec}  # K = 0: no recovery at all
        r = simulate_specpipe(_small(), bernoulli_outcomes(0.6, 3), 80,
                              LevelModel(cap=6, branching=2, survival=0.5), **kw)
        assert (len(r.steps), r.pipelined_s) == (196, 0.3024794761142855)
        assert sum(s.hits for s in r.steps) == 40
        assert sum(s.flushed for s in r.steps) == 445
        assert sum(sum(s.stage_tokens) for s in r.steps) == 1416
    assert simulate_paper_batch(PaperSetting(), "specpipe-db", 2, 0, 60).throughput == \
        22.20294675093227


def _schedule(r: simulator.SimResult) -> list[tuple[int, int, int]]:
    return [(s.verified, s.hits, s.recovered) for s in r.steps]


def test_a_catch_probability_of_zero_changes_no_step() -> None:
    """Corrections that never carry the token take slots but change no verdict."""
    levels = LevelModel(cap=3, branching=2, survival=0.7)
    base = simulate_specpipe(_small(), bernoulli_outcomes(0.6, 5), 120, levels)
    for j in (0, 1, 2, 3):
        rec = RecoveryModel(j, 4, 0.0, budget=16, chain_hit=None, seed=9)
        r = simulate_specpipe(_small(), bernoulli_outcomes(0.6, 5), 120, levels, rec)
        assert _schedule(r) == _schedule(base)
        # the spare slots hold corrections: more nodes, same verdicts
        assert sum(s.stage_tokens[0] for s in r.steps) > sum(s.stage_tokens[0]
                                                               for s in base.steps)
    ps = PaperSetting(new_tokens=150)
    none = simulate_recovery(ps, 16, RecoveryModel())
    zero = simulate_recovery(ps, 16, RecoveryModel(4, 8, 0.0, budget=ps.width))
    assert (zero["steps_per_token"], zero["misses"]) == (none["steps_per_token"],
                                                         none["misses"])


@pytest.mark.parametrize(("rec", "steps", "re_roots"), [
    (RecoveryModel(), 18, 0),
    (RecoveryModel(1, 2, 1.0, budget=100), 12, 0),  # d = 0: a catch is a plain hit
    (RecoveryModel(2, 2, 1.0, budget=100), 14, 2),
    (RecoveryModel(3, 2, 1.0, budget=100), 16, 2),
    (RecoveryModel(0, 2, 1.0, budget=100), 14, 2),  # draft:K: d = 1
])
def test_a_sure_catch_with_free_slots_saves_m_minus_1_minus_d_per_miss(
        rec: RecoveryModel, steps: int, re_roots: int) -> None:
    """m = 4, 10 tokens, the 3rd and 6th verifications miss.  Without recovery: 3 fill
    steps, 9 verifying steps, 3 refill steps per miss = 18.  A catch issued d steps late
    idles d steps instead of m - 1 = 3: d = J - 1 for exit stage J, 1 for draft:K."""
    seq: list[Outcome] = [HIT, HIT, MISS, HIT, HIT, MISS]

    def outcome(v: int) -> Outcome:
        return seq[v] if v < len(seq) else HIT
    run = PipeSchedule(Profile([TimeCurve.constant(1e-3)] * 4), outcome, 10,
                       LevelModel(cap=4, branching=2), rec)
    n = recovered = 0
    while not run.done:
        recovered += run.step().rec.recovered
        n += 1
    assert (n, recovered) == (steps, re_roots)


def test_a_re_root_keeps_the_chain_and_its_hit_rate_applies() -> None:
    """After a late re-root the chain's levels hit at ``chain_hit``: 0 turns the catch into
    a string of misses (each chain level flushes), 1 costs nothing more."""
    def steps(chain_hit: float) -> int:
        seq: list[Outcome] = [HIT, HIT, MISS]
        run = PipeSchedule(Profile([TimeCurve.constant(1e-3)] * 5),
                           lambda v: seq[v] if v < len(seq) else HIT, 12,
                           LevelModel(cap=4, branching=2),
                           RecoveryModel(2, 2, 1.0, budget=100, chain_hit=chain_hit))
        n = 0
        while not run.done:
            run.step()
            n += 1
        return n
    # m = 5, J = 2: d = 1 saves 3 of the 4 refill steps; 11 decode tokens, 4 fill steps
    assert steps(1.0) == 4 + 11 + 1
    assert steps(0.0) > steps(1.0)


def test_slots_bound_the_corrections_and_the_exit_head_is_priced() -> None:
    """No spare slot (budget = the level): no catch after the first levels fill; the exit
    head adds the LM head's time on stage J's nodes."""
    ps = PaperSetting(new_tokens=300)
    full = simulate_recovery(ps, 0, RecoveryModel(4, 8, 1.0, budget=ps.width))
    none = simulate_recovery(ps, 0, RecoveryModel())
    assert full["re_roots"] == 0 and full["steps_per_token"] == none["steps_per_token"]
    assert full["exit_head_ms"] > 0 and full["tbt_ms"] > none["tbt_ms"]
    free = simulate_recovery(ps, 0, RecoveryModel(4, 8, 1.0, budget=ps.width),
                             exit_head=False)
    assert free["tbt_ms"] == pytest.approx(none["tbt_ms"], rel=1e-3)
    spare = simulate_recovery(ps, 16, RecoveryModel(7, 8, 1.0, budget=ps.width))
    assert spare["re_roots"] > 0


def test_catch_shares() -> None:
    """Measured values at measured points; more κ and a deeper exit hold more; Figure 7's
    top-K for draft:K."""
    assert exit_catch(27 / 30, 8) == pytest.approx(0.651)
    assert exit_catch(20 / 30, 4) == pytest.approx(0.121)
    for j in range(1, 8):
        ks = [exit_catch(j / 8, k) for k in (1, 2, 4, 8, 16, 32)]
        assert ks == sorted(ks) and 0 <= ks[0] and ks[-1] <= 1
    assert exit_catch(7 / 8, 8) > exit_catch(1 / 8, 8)
    ps = PaperSetting()
    assert draft_catch(ps, 64, 1) == 0.0  # the top-1 is already in the level
    assert draft_catch(ps, 64, 32) == pytest.approx((0.99 - 0.95) / 0.05)


@pytest.mark.skipif(not (BENCH / "recovery.json").is_file(), reason="no measured data")
def test_the_embedded_measurements_match_the_files() -> None:
    data = json.loads((BENCH / "recovery.json").read_text())
    for r in data["rows"]:
        if (r["source"], r["stages"], r["lag"], r["budget"], r["normal_width"]) == \
                ("hybrid", 8, 0, "free", 16):
            assert EXIT_CATCH_SMOLLM2[r["exit_layer"]][r["kappa"]] == \
                pytest.approx(r["exit_holds"], abs=6e-4)
    for m, e in ENGINE_RECOVERY.items():
        for tag, hits, steps in (("none", "hits_none", "steps_none"),
                                 ("early-exit-1-8", "hits_rec", "steps_rec")):
            row = json.loads((BENCH / f"bench-m{m}-ngram-{tag}.json").read_text())["rows"][0]
            assert (row["hits"], row["steps"], row["verified"], row["w"]) == \
                (e[hits], e[steps], ENGINE_SETTING["verified"], ENGINE_SETTING["width"])


def test_the_projection_picks_the_argmin_of_its_own_table() -> None:
    ps = PaperSetting(new_tokens=120)
    rep = project_recovery(ps, tokens=120, reserves=(0, 16), kappas=(2, 8), variants=False,
                           engine_requests=4)
    rows = rep["rows"]
    assert len(rows) == 2 * (1 + 8 * 2)  # none, J = 1..7 and draft:K, per κ and reserve
    tbt = [r["tbt_ms"] for r in rows]
    assert rep["choice"] == tbt.index(min(tbt))
    best = rep["best_recovery"]
    assert best["kappa"] and best["tbt_ms"] == min(r["tbt_ms"] for r in rows
                                                   if r["kappa"] and r["fewer_misses"] > 0)
    assert rep["best_exit"]["exit_stage"] and not rep["best_draft"]["exit_stage"]
    md = recovery_markdown(rep, [])
    assert f"**The model picks {rows[rep['choice']]['recovery']} at reserve" in md
    assert "| exit J = 7 |" in md and "| draft:K |" in md


def _cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_simulator_parsers(ap.add_subparsers(dest="command"))
    a = ap.parse_args(argv)
    return a.func(a)


def test_cli_refuses_what_it_cannot_project() -> None:
    with pytest.raises(TreepipeError, match="separate projections"):
        _cli(["project", "--recovery", "--batch", "1"])
    with pytest.raises(TreepipeError, match="3 or more stages"):
        _cli(["project", "--recovery", "--set", "stages=2"])
    with pytest.raises(ValueError, match="catch"):
        RecoveryModel(1, 8, 1.5)
