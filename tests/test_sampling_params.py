"""Bad sampling numbers are refused with one line: in SamplingParams (the engine and the
stage workers build one) and in ``treepipe generate``, before any model is loaded.

NaN compares false with every bound, so plain range checks let it through; before this,
``treepipe generate --temperature nan`` decoded NaN-softmax noise and exited 0.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from orchestrator.cli.main import main
from protocol.errors import TreepipeError
from protocol.requests.sampling_params import SamplingError, SamplingParams

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("kw,field", [
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -INF}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 100.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"top_p": INF}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_sampling_params_refuse_bad_numbers(kw: dict, field: str) -> None:
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert e.value.field == field
    assert isinstance(e.value, TreepipeError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value) and field.replace("_", "-") in str(e.value)


def test_sampling_params_take_the_bounds() -> None:
    SamplingParams(temperature=0, top_p=1.0, top_k=0, seed=0)
    SamplingParams(temperature=100.0, top_p=1e-9, top_k=2**31 - 1, seed=2**64 - 1)


def test_a_worker_refuses_bad_stored_params() -> None:
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams.from_wire({"temperature": "nan"})


@pytest.mark.parametrize("argv,flag", [
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "1e999"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--sample-top-k", "-3"], "--sample-top-k"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    # through a gateway too (nothing listens there: refused before connecting)
    (["--endpoint", "127.0.0.1:9", "--seed", "-1"], "--seed"),
])
def test_generate_refuses_bad_sampling_flags(argv: list[str], flag: str,
                                             capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", "no-model-is-loaded", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"treepipe: error: {flag}: "), err


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5"])
def test_generate_refuses_a_bad_timeout(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--endpoint", "127.0.0.1:9", "--timeout", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--timeout" in err[0] and "finite" in err[0], err


def test_generate_temperature_nan_exits_non_zero_without_a_traceback() -> None:
    """The whole command, as a user runs it (issue 12: it used to exit 0)."""
    cp = subprocess.run([sys.executable, "-m", "orchestrator", "generate", "--prompt", "hi",
                         "--temperature", "nan"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert cp.stderr.strip() == ("treepipe: error: --temperature: temperature must be a finite "
                                 "number in [0, 100] (0 = greedy), got nan")
