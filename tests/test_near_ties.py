"""The near-tie rule (stages/speculation/near_ties.py) and ``treepipe bench`` judging by it.

A difference from ar is allowed only where it starts at a near-tie of ar's choice within
the dtype's tolerance; float64 allows none. The bench keeps ``matches_ar`` exact and
says, per differing run, whether it is such a flip (bf16 random models tie often).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import orchestrator.lab.benchmarks.bench as bench_module
from orchestrator.models.loading import EngineSpec, build_engine
from protocol.scheduling.records import GenerationResult
from stages.model.sampling import SamplingParams, uniform_for
from stages.speculation.engine import PipelineEngine
from stages.speculation.near_ties import first_difference, flip_at_tie, tie_tolerance
from tests.lossless_rule import assert_lossless
from tests.test_bench import ARGS, PROMPTS, bench, prompts_file  # noqa: F401 - a fixture
from tests.tiny_models import save_byte_level_model

GREEDY = SamplingParams()


def row(top: float, second: float, vocab: int = 8) -> torch.Tensor:
    """Logits with the given best two (token 0 then token 1) and the rest far below."""
    out = torch.full((vocab,), top - 10.0)
    out[0], out[1] = top, second
    return out


def test_tolerances_and_first_difference() -> None:
    assert tie_tolerance(torch.float64, 5.0) == 0.0
    assert tie_tolerance(torch.float32, 50.0) == 1e-4
    assert tie_tolerance(torch.bfloat16, 0.5) == 2.0 ** -6  # at least 2^-6
    assert tie_tolerance(torch.bfloat16, -8.0) == 8 * 2.0 ** -6  # scales with |top|
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 2]) is None  # a prefix: no differing token
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_flip_at_a_tie_is_allowed(dtype: torch.dtype) -> None:
    ref, logits = [4, 0, 2], [row(3.0, 1.0), row(2.0, 2.0), row(3.0, 1.0)]
    assert flip_at_tie(ref, logits, ref, GREEDY, dtype) is None
    flip = flip_at_tie(ref, logits, [4, 1, 7], GREEDY, dtype)
    assert flip is not None and flip.allowed
    assert flip.index == 1 and flip.margin == 0.0
    assert flip.describe().startswith("from token 1, at a near-tie of ar's top two logits "
                                      "(gap 0, ")
    assert flip.describe().endswith(": allowed")


@pytest.mark.parametrize(("dtype", "top", "gap", "allowed"), [
    (torch.float32, 3.0, 5e-5, True), (torch.float32, 3.0, 2e-4, False),
    (torch.bfloat16, 1.0, 2.0 ** -6, True), (torch.bfloat16, 1.0, 2.0 ** -5, False),
    (torch.bfloat16, 8.0, 2.0 ** -4, True),  # within 2^-6 of |top| = 8: 0.125
    (torch.bfloat16, 8.0, 0.5, False)])
def test_greedy_flip_away_from_a_tie_is_refused(dtype: torch.dtype, top: float, gap: float,
                                                allowed: bool) -> None:
    ref = [0, 0]
    flip = flip_at_tie(ref, [row(top, top - 1), row(top, top - gap)], [0, 1], GREEDY, dtype)
    assert flip is not None and flip.index == 1 and flip.allowed is allowed
    assert flip.margin == pytest.approx(gap, rel=1e-2)
    assert ("not at a near-tie" in flip.describe()) is not allowed


def test_float64_refuses_any_flip_even_an_exact_tie() -> None:
    # float64 reads no logits: an empty list would raise if it tried
    flip = flip_at_tie([0, 0], [], [0, 1], GREEDY, torch.float64)
    assert flip is not None and not flip.allowed and flip.margin is None
    assert flip.describe() == "from token 1 (float64 is exact)"
    flip = flip_at_tie([0, 0], [row(1.0, 1.0)] * 2, [0, 1], GREEDY, torch.float64)
    assert flip is not None and not flip.allowed


def test_a_longer_run_is_never_a_tie() -> None:
    flip = flip_at_tie([0, 0, 0], [row(1.0, 1.0)] * 3, [0, 0], GREEDY, torch.bfloat16)
    assert flip is not None and flip.index == 2 and not flip.allowed
    assert "2 tokens, ar 3" in flip.describe()


def _draw_above_half(seed: int) -> tuple[int, float]:
    """A generated position whose seeded uniform draw lies in (0.5, 0.95)."""
    return next((i, u) for i in range(100) if 0.5 < (u := uniform_for(seed, i)) < 0.95)


@pytest.mark.parametrize(("offset", "allowed"), [(3e-5, True), (-3e-5, True), (0.02, False)])
def test_sampling_flip_only_where_the_draw_sits_on_a_boundary(offset: float,
                                                              allowed: bool) -> None:
    """Two tokens, the first with probability u + offset: the draw u lies ``offset`` from
    the CDF boundary between them (the other boundary, 1, is far)."""
    sampling = SamplingParams(temperature=1.0, seed=11)
    i, u = _draw_above_half(11)
    p = u + offset
    logits = torch.tensor([math.log(p), math.log(1 - p)], dtype=torch.float32)
    ref = [0] * (i + 1)
    flip = flip_at_tie(ref, {i: logits}, [0] * i + [1], sampling, torch.float32)
    assert flip is not None and flip.index == i and flip.allowed is allowed
    assert flip.margin == pytest.approx(abs(offset), rel=1e-2)
    assert "a CDF boundary (draw" in flip.describe()


def test_assert_lossless_keeps_its_messages() -> None:
    """tests/lossless_rule.py judges by the package rule and words its failures as before."""
    ref = GenerationResult("ar", 1, 1, 1, "none", 1, tokens=[0, 0],
                                        logits=[row(1.0, 0.0), row(1.0, 1.0)])
    out = GenerationResult("pp", 1, 1, 1, "none", 1, tokens=[0, 1])
    assert_lossless(ref, out, GREEDY, torch.float32, "tie")
    out.tokens = [1, 0]
    with pytest.raises(AssertionError, match="far: differs from ar at token 0 where ar's "
                                             "top-2 gap is 1 \\(tolerance 0.0001\\)"):
        assert_lossless(ref, out, GREEDY, torch.float32, "far")
    out.tokens = [0]
    with pytest.raises(AssertionError, match="short: 1 tokens"):
        assert_lossless(ref, out, GREEDY, torch.float32, "short")


# ---- the bench ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """test_bench's tiny random model with one LM-head row copied onto the next token's, so
    ar's first token on the first prompt, t, always ties exactly with t + 1 (argmax keeps
    the lower id: ar never emits t + 1); returns (folder, t, t + 1)."""
    folder = save_byte_level_model(tmp_path_factory.mktemp("tied-model"), ARGS)
    spec = EngineSpec(model=str(folder), stages=1, draft="none", width=1, topk=1,
                      dtype="bfloat16", device="cpu")
    engine, tok, _ = build_engine(spec)
    t = engine.generate(tok.encode(PROMPTS[0]["prompt"]), 1, method="ar").tokens[0]
    assert t + 1 < ARGS.vocab_size
    (path,) = folder.glob("*.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"][t + 1] = weights["lm_head.weight"][t]
    save_file(weights, path, metadata={"format": "pt"})
    return folder, t, t + 1


def _flip(tokens: list[int], at: int, to: int) -> list[int]:
    return tokens[:at] + [to] + tokens[at + 1:]


def _forge(prompt_index: int, tokens: list[int], tied: tuple[Path, int, int]) -> list[int]:
    """pp's output, forged: on prompt 0 ar's tied token t becomes t + 1 (a flip at an exact
    tie: allowed); on prompt 1 the third token becomes another one (ar's top-two gap there
    is wide on this model: a real difference)."""
    _, t, alt = tied
    if prompt_index == 0:
        return _flip(tokens, tokens.index(t), alt)
    return _flip(tokens, 2, (tokens[2] + 1) % ARGS.vocab_size)


def _argv(folder: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(folder), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--stages", "2", "--width", "2", "--topk", "2", "--dtype", "bfloat16",
            "--threads", "1", "--no-warmup", "--out", str(out), *extra]


def test_bench_allows_a_flip_at_a_near_tie_and_flags_a_real_difference(
        tied_model: tuple[Path, int, int], prompts_file: Path,  # noqa: F811 - the fixture
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, t, alt = tied_model
    real = PipelineEngine.generate
    prompts: list[list[int]] = []

    def generate(self, prompt, max_new_tokens, sampling=None, method="specpipe",  # noqa: ANN001, ANN202
                 *args, **kw):
        res = real(self, prompt, max_new_tokens, sampling, method, *args, **kw)
        if method == "ar" and not kw.get("keep_logits") and prompt not in prompts:
            prompts.append(list(prompt))
        if method == "pp":
            res.tokens = _forge(prompts.index(prompt), res.tokens, tied_model)
        return res

    monkeypatch.setattr(PipelineEngine, "generate", generate)
    threads = torch.get_num_threads()
    try:
        assert bench(_argv(folder, prompts_file, tmp_path, "--methods", "ar,pp")) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench.json").read_text())
    pp = next(r for r in report["rows"] if r["method"] == "pp")
    # matches_ar stays the exact count; the near-tie flip is reported beside it
    assert pp["matches_ar"] == 0 and pp["mismatched_prompts"] == [0, 1]
    assert pp["near_tie_prompts"] == [0]
    runs = {r["prompt"]: r for r in report["results"] if r["method"] == "pp"}
    assert runs[0]["near_tie"] is True and runs[1]["near_tie"] is False
    md = (tmp_path / "bench.md").read_text()
    first = report["results"][0]["tokens"].index(t)
    assert (f"pp differs from ar on prompt 0 from token {first}, at a near-tie of ar's top two "
            "logits (gap 0, bf16 tolerance ") in md and "): allowed." in md
    assert "Tokens differ from ar: pp on prompts 1." in md
    assert "exactly ar's tokens" not in md


def test_bench_concurrency_counts_near_tie_flips_as_lossless(
        tied_model: tuple[Path, int, int], prompts_file: Path,  # noqa: F811 - the fixture
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--concurrency: pp flipped at the tie only stays lossless (near_tie_flips 1);
    specpipe flipped at the tie and away from it is lossy."""
    folder, _, _ = tied_model
    real = bench_module.concurrency_rows

    def forged(configs, batch, prompts, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows = real(configs, batch, prompts, *args, **kw)
        for r in rows:
            if r["method"] == "pp":
                r["outputs"] = [_forge(0, r["outputs"][0], tied_model), r["outputs"][1]]
            elif r["method"] == "specpipe":
                r["outputs"] = [_forge(j, o, tied_model) for j, o in enumerate(r["outputs"])]
        return rows

    monkeypatch.setattr(bench_module, "concurrency_rows", forged)
    threads = torch.get_num_threads()
    try:
        assert bench(_argv(folder, prompts_file, tmp_path, "--methods", "pp,specpipe",
                           "--sources", "ngram", "--concurrency", "2")) == 0
    finally:
        torch.set_num_threads(threads)
    points = json.loads((tmp_path / "bench.json").read_text())["concurrency"]
    got = {p["method"]: (p["lossless"], p["near_tie_flips"]) for p in points}
    assert got == {"pp": (True, 1), "specpipe": (False, 1), "specpipe-serial": (False, 1)}
    md = (tmp_path / "bench.md").read_text()
    assert "| 1.00 (1 near-tie) |" in md and "| 0.00 (1 near-tie) |" in md
    assert "first differs from it at a near-tie" in md
