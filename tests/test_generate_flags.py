"""`treepipe generate`'s penalty flags: SamplingParams' penalties and min_tokens, each out
of range a one-line error naming the flag before any model loads or gateway is called
(tests/test_openai_api.py runs them through a gateway against ar)."""

from __future__ import annotations

import pytest

from orchestrator.cli.main import main


@pytest.mark.parametrize("argv,flag,words", [
    (["--presence-penalty", "2.5"], "--presence-penalty", "in [-2, 2] (0 = off), got 2.5"),
    (["--frequency-penalty", "nan"], "--frequency-penalty", "finite number in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty", "got -3.0"),
    (["--repetition-penalty", "0"], "--repetition-penalty", "number > 0 (1 = off)"),
    (["--repetition-penalty", "inf"], "--repetition-penalty", "finite number > 0"),
    (["--min-tokens", "-1"], "--min-tokens", "min_tokens must be an integer in [0,"),
    (["--min-tokens", "65", "--max-new-tokens", "64"], "--min-tokens",
     "65 is more than --max-new-tokens 64"),
    # through a gateway too (nothing listens there: refused before connecting)
    (["--endpoint", "127.0.0.1:9", "--presence-penalty", "9"], "--presence-penalty", "got 9.0"),
])
def test_penalty_flags_out_of_range_are_one_line(argv: list[str], flag: str, words: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-model-is-loaded", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"treepipe: error: {flag}: "), err
    assert words in err[0], err
