"""The simulator against the engine's own records (tiny model), rate mode, projection."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pytest
from tiny_models import PROMPT, other_draft, target_shards, target_whole

from orchestrator.cli.simulator_commands import add_simulator_parsers
from orchestrator.lab.benchmarks.simulator import (
    HIT,
    MISS,
    PAPER_HUMANEVAL_X,
    BatchSim,
    LevelModel,
    PaperSetting,
    PipeSchedule,
    Profile,
    TimeCurve,
    bernoulli_outcomes,
    paper_request,
    price_step,
    project,
    result_from_dict,
    result_to_dict,
    simulate_alone,
    simulate_paper_batch,
    simulate_specpipe,
    specinfer_expected_accepted,
    validate,
)
from orchestrator.lab.drafting import draft_eval
from protocol.errors import TreepipeError
from protocol.scheduling.records import GenerationResult
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import DraftModelSource, NgramSource

M = 4
NEW = 12


def _synthetic_times(res: GenerationResult) -> GenerationResult:
    """Replace measured times by a fixed function of the work, so the check is exact.

    Stage i costs (1 + i/2) ms + 0.3 ms per node, the draft 0.8 ms + 0.5 ms per
    node, pruning 0.1 ms: the schedule (who works on how many nodes, when)
    decides the pipelined time, not timer noise on a shared machine.
    """
    for s in res.steps:
        s.stage_s = [(1 + i / 2 + 0.3 * n) * 1e-3 if n else 0.0
                     for i, n in enumerate(s.stage_tokens)]
        s.prune_s = [1e-4 if s.verified else 0.0 for _ in s.prune_s]
        if s.draft_tokens:
            s.draft_s = (0.8 + 0.5 * s.draft_tokens) * 1e-3
    return res


@pytest.fixture(scope="module")
def runs() -> list[GenerationResult]:
    shards = target_shards(M)
    out = []
    for source in (None, NgramSource(), DraftModelSource(other_draft(), "other"),
                   DraftModelSource(target_whole(), "self")):
        eng = PipelineEngine(shards, source, width=4, topk=2)
        methods = ("ar", "pp") if source is None else ("specinfer", "specpipe")
        for method in methods:
            for start in (0, 5):
                out.append(_synthetic_times(eng.generate(PROMPT[start:], NEW, method=method)))
    return out


def test_simulator_reproduces_engine_pipelined_time(runs: list[GenerationResult]) -> None:
    rows = validate(runs)
    assert {(r["method"], r["source"]) for r in rows} == {
        ("ar", "none"), ("pp", "none"), ("specinfer", "ngram"), ("specpipe", "ngram"),
        ("specinfer", "other"), ("specpipe", "other"), ("specinfer", "self"),
        ("specpipe", "self")}
    for r in rows:
        # the schedule itself (fill, refills after misses, bubbles) is replayed step for step
        assert r["sim_steps"] == r["engine_steps"], r
        assert abs(r["rel_err"]) < 0.10, r
    # the draft that is the target itself always hits: one verification per step
    self_pipe = next(r for r in rows if r["method"] == "specpipe" and r["source"] == "self")
    assert self_pipe["engine_steps"] == 2 * (NEW - 1 + M - 1)


def test_records_round_trip(runs: list[GenerationResult]) -> None:
    for res in runs[:4]:
        back = result_from_dict(json.loads(json.dumps(result_to_dict(res))))
        assert back.pipelined_s == pytest.approx(res.pipelined_s)
        assert back.stats() == res.stats()


def _flat_profile(m: int) -> Profile:
    return Profile(stage_time=[TimeCurve.constant(1e-3)] * m, node_bytes=0)


@pytest.mark.parametrize("p", [0.0, 0.5, 0.9, 1.0])
def test_rate_mode_follows_eq2(p: float) -> None:
    """With independent hits, steps per token approach 1 + (1 - P)(m - 1)."""
    m, n = 6, 3000
    sim = simulate_specpipe(_flat_profile(m), bernoulli_outcomes(p, seed=1), n,
                            LevelModel(cap=8, branching=4))
    steps_per_token = len(sim.steps) / (n - 1)
    assert steps_per_token == pytest.approx(1 + (1 - p) * (m - 1), rel=0.03)


def test_pp_is_all_misses_and_specpipe_all_hits_one_step() -> None:
    m = 5
    pp = simulate_specpipe(_flat_profile(m), lambda v: HIT, 11, None)
    assert len(pp.steps) == m * 10 + 0  # first token from the prefill, then m steps each
    hits = simulate_specpipe(_flat_profile(m), lambda v: HIT, 11, LevelModel(8, 4))
    assert len(hits.steps) == (m - 1) + 10
    assert sum(s.flushed for s in hits.steps) == 0
    misses = simulate_specpipe(_flat_profile(m), lambda v: MISS, 11, LevelModel(8, 4))
    assert len(misses.steps) == len(pp.steps)
    assert sum(1 for s in misses.steps if s.flushed) > 0


def test_time_curve() -> None:
    c = TimeCurve([4, 1, 8], [2.0, 1.0, 3.0])
    assert c(0) == 0.0 and c(1) == 1.0 and c(2) == pytest.approx(4 / 3)
    assert c(8) == 3.0 and c(12) == pytest.approx(4.0)  # last slope continues


def test_specinfer_acceptance_chain() -> None:
    assert specinfer_expected_accepted((1, 1), lambda k: 0.5) == pytest.approx(0.5 + 0.25)
    assert specinfer_expected_accepted((1, 3), lambda k: {1: 0.5, 3: 1.0}[k]) == 1.0


def test_projection_close_to_paper_and_calibration_checks() -> None:
    proj = project(PaperSetting(new_tokens=2000))
    for k, paper in PAPER_HUMANEVAL_X.items():
        assert proj["tbt_ms"][k] == pytest.approx(paper, rel=0.20), k
    # the "fig11" calibration is built so that PP lands on Figure 11's number
    assert proj["tbt_ms"]["pp"] == pytest.approx(302.39, rel=0.01)
    # a lower hit rate must cost SpecPipe time, and never PP
    worse = project(PaperSetting(new_tokens=2000, hit_rate=0.8))
    assert worse["tbt_ms"]["specpipe"] > proj["tbt_ms"]["specpipe"]
    assert worse["tbt_ms"]["pp"] == pytest.approx(proj["tbt_ms"]["pp"])


def _cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_simulator_parsers(ap.add_subparsers(dest="command"))
    a = ap.parse_args(argv)
    return a.func(a)


def test_cli_errors_and_outputs(tmp_path: Path, runs: list[GenerationResult],
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TreepipeError, match="not found"):
        _cli(["simulate", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):  # the parser's: --hit-rate must be at most 1
        _cli(["project", "--hit-rate", "1.5"])
    rec = tmp_path / "records.json"
    rec.write_text(json.dumps({"results": [result_to_dict(r) for r in runs]}))
    assert _cli(["simulate", str(rec), "--out", str(tmp_path / "sim")]) == 0
    assert "| specpipe | self |" in capsys.readouterr().out
    assert _cli(["project", "--tokens", "400", "--out", str(tmp_path / "proj")]) == 0
    md = (tmp_path / "proj" / "project.md").read_text()
    assert "| SpecPipe |" in md and "Assumptions" in md and "changed assumption" in md


def test_project_overrides(tmp_path: Path) -> None:
    """--set changes the setting: halving the stages doubles SpecPipe's step, not PP's total."""
    assert _cli(["project", "--tokens", "400", "--out", str(tmp_path / "a")]) == 0
    assert _cli(["project", "--tokens", "400", "--set", "stages=4", "--set",
                 "layers_per_stage=20", "--out", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "project.json").read_text())["tbt_ms"]
    b = json.loads((tmp_path / "b" / "project.json").read_text())["tbt_ms"]
    assert b["pp"] == pytest.approx(a["pp"], rel=0.02)
    assert b["specpipe"] > 1.4 * a["specpipe"]
    with pytest.raises(TreepipeError, match="bad --set"):
        _cli(["project", "--set", "nonsense=1"])


@pytest.mark.parametrize("item,words", [
    ("stages=NaN", "stages must be an integer >= 1"),
    ("stages=-1", "stages must be an integer >= 1"),
    ("layers_per_stage=1.5", "layers_per_stage must be an integer >= 1"),
    ("hit_rate=2", "hit_rate must be a number in (0, 1]"),
    ("link_gbps=0", "link_gbps must be a finite number > 0"),
    ("link_gbps=Infinity", "link_gbps must be a finite number > 0"),
    ("topk_hit=[1]", "topk_hit needs a JSON object"),
    ('topk_hit={"x": 1}', "topk_hit needs a JSON object"),
    ("branching=[0]", "branching needs a JSON list of integers >= 1"),
])
def test_project_refuses_a_set_value_outside_its_field(item: str, words: str) -> None:
    """A --set value of the wrong kind or out of its field's domain is one line naming the
    field (it used to reach the simulator and end in a traceback)."""
    with pytest.raises(TreepipeError) as e:
        _cli(["project", "--tokens", "400", "--set", item])
    assert words in str(e.value) and "\n" not in str(e.value)


def _schedule(steps: list) -> list[tuple[int, int, tuple[bool, ...]]]:
    """Per step: verified, hit, and which stages computed anything."""
    return [(s.verified, s.hits, tuple(n > 0 for n in s.stage_tokens)) for s in steps]


@pytest.mark.parametrize("m", [2, 3, 4])
def test_abstract_schedule_equals_the_step_core(m: int) -> None:
    """The simulator's depth-only schedule, fed the step core's outcomes, takes the
    engine's steps: same count, same hits and misses, same busy stages per step."""
    n = 20
    truth = PipelineEngine([target_whole()]).generate(PROMPT, n, method="ar").tokens
    shards = target_shards(m)
    # hit rate 0: pp (no source; every verification a miss)
    pp = PipelineEngine(shards).generate(PROMPT, n, method="pp")
    sim_pp = simulate_specpipe(_flat_profile(m), lambda v: HIT, n, None)
    assert _schedule(sim_pp.steps) == _schedule(pp.steps)
    # hit rate 1 (the target as its own draft), and a foreign draft's hits and misses with
    # the kept depths the core's replay reports (a draft model always proposes k children,
    # as the simulator's levels assume; n-gram lookup can propose none)
    seen = set()
    for draft, w, k in ((target_whole(), 4, 2), (other_draft(), 4, 2), (other_draft(), 1, 1),
                        (other_draft(), 8, 4)):
        res = PipelineEngine(shards, DraftModelSource(draft), width=w, topk=k).generate(
            PROMPT, n, method="specpipe")
        assert res.tokens == truth
        core = draft_eval.simulate_specpipe(DraftModelSource(draft), PROMPT, truth, m, w, k)
        kept = core.kept
        sim = simulate_specpipe(_flat_profile(m),
                                lambda v, kept=kept: MISS if kept[v] < 0 else float(kept[v]),
                                n, LevelModel(w, k))
        assert len(sim.steps) == len(res.steps) == core.steps
        assert _schedule(sim.steps) == _schedule(res.steps), (w, k)
        rate = core.hits / core.verified
        seen.add("all" if rate == 1 else "none" if rate == 0 else "some")
        if rate == 1:
            # at hit rate 1 no outcome needs the core: every hit keeps every level
            assert len(simulate_specpipe(_flat_profile(m), lambda v: HIT, n,
                                         LevelModel(w, k)).steps) == len(res.steps)
    assert "all" in seen and seen != {"all"}  # both regimes were compared


# ---- batching (issue 14) ------------------------------------------------------------------


def test_price_step_packs_requests_into_one_forward_per_stage() -> None:
    """Two requests in one step: one forward over their summed nodes per stage, plus the
    second request's KV read; one LM head; pruning per verifying request."""
    m = 3
    p = Profile(stage_time=[TimeCurve([1, 100], [1e-3, 100e-3])] * m, head_s=5e-3,
                prune_s=[1e-3] * m, node_bytes=10, request_s=0.5e-3)
    a, b = (PipeSchedule(p, lambda v: HIT, 50, LevelModel(8, 4)) for _ in range(2))
    for _ in range(m - 1):  # fill: both requests hold a level on every stage
        price_step(p, [a.step(), b.step()])
    sa, sb = a.step(), b.step()
    rec = price_step(p, [sa, sb])
    assert rec.stage_tokens == [x + y for x, y in zip(sa.rec.stage_tokens,
                                                      sb.rec.stage_tokens, strict=True)]
    assert rec.stage_s[0] == pytest.approx(rec.stage_tokens[0] * 1e-3 + 0.5e-3)
    assert rec.stage_s[m - 1] == pytest.approx(rec.stage_tokens[m - 1] * 1e-3 + 0.5e-3 + 5e-3)
    assert rec.verified == 2 and rec.prune_s == pytest.approx([2e-3] * m)
    assert rec.link_bytes[1] == sa.rec.link_bytes[1] + sb.rec.link_bytes[1]


BATCH_TOKENS = 300  # per request: enough for steady state, quick on a shared machine


@functools.cache
def paper_batch(method: str, batch: int) -> BatchSim:
    """``simulate_paper_batch`` in the paper's setting with BATCH_TOKENS per request,
    computed once (the load tests below compare the same runs)."""
    return simulate_paper_batch(PaperSetting(new_tokens=BATCH_TOKENS), method, batch)


@pytest.mark.parametrize("method,single", [("pp-continuous", "pp"), ("specinfer", "specinfer"),
                                           ("specpipe", "specpipe"), ("specpipe-db", "specpipe"),
                                           ("specpipe-db-adaptive", "specpipe")])
def test_batch_of_one_is_the_single_request_model(method: str, single: str) -> None:
    ps = PaperSetting(new_tokens=BATCH_TOKENS)
    alone = simulate_alone(ps.profile(), paper_request(ps, ps.profile(), single, seed=3))
    batch = simulate_paper_batch(ps, method, 1, seed=3)
    assert len(batch.steps) == len(alone.steps)
    assert batch.clock_s == alone.pipelined_s  # the same steps, priced the same, in order
    assert batch.tbt_ms == pytest.approx(alone.tbt_ms, rel=1e-12)
    assert batch.throughput == pytest.approx(1e3 / alone.tbt_ms)


def test_throughput_under_load() -> None:
    """Continuous PP and SpecPipe-DB gain throughput with B; SpecPipe taking turns does not."""
    thr = {m: [paper_batch(m, b).throughput for b in (1, 2, 4, 8, 16)]
           for m in ("pp-continuous", "specpipe-db", "specpipe")}
    for m in ("pp-continuous", "specpipe-db"):
        assert all(x < y for x, y in zip(thr[m], thr[m][1:], strict=False)), (m, thr[m])
    # B=16: 2 requests per micro-batch, still on Figure 9's flat part: close to 16x one
    # request (less: with the pipeline full, the LM-head stage sets every step)
    assert 12 * thr["pp-continuous"][0] < thr["pp-continuous"][-1] < 16 * thr["pp-continuous"][0]
    one = thr["specpipe"][0]
    assert all(abs(x - one) < 0.05 * one for x in thr["specpipe"]), thr["specpipe"]


def test_specpipe_db_over_continuous_pp_in_the_paper_setting() -> None:
    """Issue 14's goal, computed: SpecPipe-DB >= 1.6x continuous PP's throughput at B >= 2.

    The model meets it at B = 2 and 4 only.  From B = 8 on, SpecPipe-DB's step packs
    B x 64 nodes per stage and is compute-bound (Figure 9's linear part), while PP's
    micro-batches of B/8 tokens stay on the flat part; the paper's 1.64-2.08x at every
    B >= 2 would need several times the 3090's FLOPS (see docs/benchmarks.md).
    """
    ratio = {}
    for b in (2, 4, 8, 32):
        db = paper_batch("specpipe-db", b)
        pp = paper_batch("pp-continuous", b)
        ratio[b] = db.throughput / pp.throughput
    assert ratio[2] >= 1.6 and ratio[4] >= 1.6, ratio
    assert ratio[8] < 1.6 and ratio[32] < 1.0, ratio
    assert ratio[2] > ratio[4] > ratio[8] > ratio[32]


def test_the_adaptive_width_keeps_specpipe_db_ahead_of_continuous_pp() -> None:
    """With the engine's adaptive width policy choosing the tree width for B requests, the
    goal holds at every B >= 2: the width narrows as B grows (B x w nodes stay near
    Figure 9's flat part), where the paper's fixed w = 64 falls behind PP from B = 8.
    Alone the policy keeps w = 64 (the single-request model)."""
    from orchestrator.lab.benchmarks.simulator import adaptive_widths

    ps = PaperSetting(new_tokens=BATCH_TOKENS)
    widths, ratio = {}, {}
    for b in (1, 2, 8, 32):
        ws = adaptive_widths(ps, b)
        assert len(ws) == b and len(set(ws.values())) == 1, ws  # alike requests, alike widths
        widths[b] = ws[0]
        ad = paper_batch("specpipe-db-adaptive", b)
        fixed = paper_batch("specpipe-db", b)
        ratio[b] = ad.throughput / paper_batch("pp-continuous", b).throughput
        assert ad.throughput >= 0.99 * fixed.throughput, b  # never much below w = 64
    assert widths[1] == ps.width and widths[1] > widths[2] > widths[8] > widths[32] >= 1
    assert min(ratio[b] for b in (2, 8, 32)) >= 1.6, ratio
    # its width is the best fixed one (here the cost model is the simulator's own)
    from orchestrator.lab.benchmarks.simulator import paper_request, simulate_batch

    for b in (4, 16):
        prof = ps.profile(max_nodes=b * ps.width)
        fixed_at = {w: simulate_batch(prof, [paper_request(ps, prof, "specpipe", j,
                                                           BATCH_TOKENS, w)
                                             for j in range(b)], b).throughput
                    for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
        ad = paper_batch("specpipe-db-adaptive", b).throughput
        assert ad >= max(fixed_at.values()) * (1 - 1e-9), (b, ad, fixed_at)
    assert ps.level_accuracy(1) == ps.topk_hit[1] and ps.level_accuracy(ps.width) == ps.hit_rate
    assert ps.level_accuracy(0) == 0.0 and ps.level_accuracy(4) < ps.level_accuracy(8)


def test_cli_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["project", "--batch", "1,2", "--tokens", "60", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "project_batch.md").read_text()
    assert "| SpecPipe-DB |" in md and "1.64–2.08×" in md and "P99" in md
    rep = json.loads((tmp_path / "project_batch.json").read_text())
    assert [r["batch"] for r in rep["rows"]] == [1, 2]
    assert set(rep["rows"][1]["throughput_tok_s"]) == {"pp-continuous", "specinfer",
                                                       "specpipe", "specpipe-db",
                                                       "specpipe-db-adaptive"}
    assert "| SpecPipe-DB, adaptive w |" in md and rep["rows"][0]["adaptive_widths"] == [64]
    for bad in ("0", "two", ""):
        with pytest.raises(TreepipeError, match="bad --batch"):
            _cli(["project", "--batch", bad])


# ---- --calibrate FILE ---------------------------------------------------------------------


def _layer_file(tmp_path: Path, points: object, figure: object = "9",
                name: str = "sweep_layer_time.json") -> Path:
    f = tmp_path / name
    f.write_text(json.dumps({"figure": figure, "config": {
        "model": "llama-3.1-70b-layer", "dtype": "bfloat16", "device": "cuda", "layer": 40,
        "context": 2048}, "points": points}))
    return f


def test_calibrate_file_replaces_the_layer_curve(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    f = _layer_file(tmp_path, [{"tokens": 1, "ms": 2.0}, {"tokens": 64, "ms": 3.0},
                               {"tokens": 128, "ms": 6.0}])
    ps = PaperSetting(calibrate=str(f), new_tokens=200)
    prof = ps.profile()
    stage = prof.stage_time[0]
    # 10 layers per stage, each at the file's time: interpolated, then linear beyond 128
    for n, ms in ((1, 2.0), (32, 2.0 + 31 / 63), (64, 3.0), (96, 4.5), (128, 6.0),
                  (256, 12.0)):
        assert stage(n) == pytest.approx(10 * ms * 1e-3), n
    assert prof.head_s == pytest.approx(ps.head_layers * 2e-3)
    assert ps.layer_ms() == pytest.approx(2.0)
    proj = project(ps)
    assert "cuda" in proj["calibration"] and "bfloat16" in proj["calibration"]
    # SpecPipe's 64-node step follows the file: its step is at least 10 x 3 ms
    assert proj["tbt_ms"]["specpipe"] > 30
    assert _cli(["project", "--calibrate", str(f), "--tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert str(f) in out and "llama-3.1-70b-layer" in out and "device cuda" in out
    assert "Figure 9 shape" not in out and "instead of the measured file" in out


@pytest.mark.parametrize("content,error", [
    (None, "neither fig11 nor l40 nor a file"),
    ("{not json", "unreadable"),
    ({"figure": "10", "points": [{"tokens": 1, "ms": 1.0}]}, "not a Figure 9"),
    ({"figure": "9", "points": []}, "no points"),
    ({"figure": "9"}, "no points"),
    ({"figure": "9", "points": [{"tokens": 0, "ms": 1.0}]}, "point 0"),
    ({"figure": "9", "points": [{"tokens": 4, "ms": "fast"}]}, "point 0"),
    ({"figure": "9", "points": [{"tokens": 4, "ms": 1.0}, {"tokens": 4, "ms": 2.0}]},
     "measured twice"),
])
def test_calibrate_file_errors(tmp_path: Path, content: object, error: str) -> None:
    f = tmp_path / "layer.json"
    if content is not None:
        f.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TreepipeError, match=error) as e:
        _cli(["project", "--calibrate", str(f), "--tokens", "50"])
    assert "\n" not in str(e.value)
