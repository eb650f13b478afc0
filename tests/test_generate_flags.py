"""`treepipe generate`'s penalty flags: SamplingParams' penalties and min_tokens, each out
of range a one-line error naming the flag before any model loads or gateway is called
(tests/test_openai_api.py runs them through a gateway against ar)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from orchestrator.cli.main import main
from protocol.requests.sampling_params import SamplingParams


@pytest.mark.parametrize("argv,flag,words", [
    (["--presence-penalty", "2.5"], "--presence-penalty", "in [-2, 2] (0 = off), got 2.5"),
    (["--frequency-penalty", "nan"], "--frequency-penalty", "finite number in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty", "got -3.0"),
    (["--repetition-penalty", "0"], "--repetition-penalty", "number > 0 (1 = off)"),
    (["--repetition-penalty", "inf"], "--repetition-penalty", "finite number > 0"),
    (["--min-tokens", "-1"], "--min-tokens", "min_tokens must be an integer in [0,"),
    (["--min-tokens", "65", "--max-new-tokens", "64"], "--min-tokens",
     "65 is more than --max-new-tokens 64"),
    (["--min-p", "1.5"], "--min-p", "min_p must be a finite number in [0, 1]"),
    # through a gateway too (nothing listens there: refused before connecting)
    (["--endpoint", "127.0.0.1:9", "--presence-penalty", "9"], "--presence-penalty", "got 9.0"),
])
def test_penalty_flags_out_of_range_are_one_line(argv: list[str], flag: str, words: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-model-is-loaded", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"treepipe: error: {flag}: "), err
    assert words in err[0], err


def test_an_unseeded_run_draws_its_seed_and_reports_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In process, no --seed samples with a fresh seed (random unless seeded, as over HTTP
    and gRPC), handed to the engine and printed to repeat the run; --seed is kept."""
    import json
    from types import SimpleNamespace

    import orchestrator.models.loading as loading

    used: list[SamplingParams] = []

    class Engine:
        def generate(self, prompt: list[int], n: int, sampling: SamplingParams, method: str,
                     stop: list[int], on_token: Callable[[int], None]) -> SimpleNamespace:
            used.append(sampling)
            return SimpleNamespace(tokens=[1], stats=lambda: {"new_tokens": 1})

    tok = SimpleNamespace(encode=lambda text: [1], decode=lambda ids, **kw: "x",
                          eos_token_ids=[])
    monkeypatch.setattr(loading, "build_engine", lambda spec: (Engine(), tok, None))
    seeds = []
    for _ in range(2):
        assert main(["generate", "--prompt", "hi", "--temperature", "1", "--json"]) == 0
        seeds.append(json.loads(capsys.readouterr().out)["seed"])
    assert seeds[0] != seeds[1] and [s.seed for s in used] == seeds
    assert main(["generate", "--prompt", "hi", "--temperature", "1", "--seed", "7",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seed"] == 7 and used[-1].seed == 7
    # penalties reach the engine's SamplingParams
    assert main(["generate", "--prompt", "hi", "--presence-penalty", "0.5",
                 "--repetition-penalty", "1.25", "--min-tokens", "3", "--min-p", "0.1",
                 "--json"]) == 0
    capsys.readouterr()
    assert (used[-1].presence_penalty, used[-1].repetition_penalty, used[-1].min_tokens,
            used[-1].min_p) == (0.5, 1.25, 3, 0.1)
