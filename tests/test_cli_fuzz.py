"""Hypothesis over the flags of every ``treepipe`` subcommand (issue 41 item 6).

Numbers: every numeric flag of every subcommand (found by walking the real parser, so a
new flag is fuzzed without editing this file) gets NaN, infinities, negatives, zero,
huge integers, floats where an integer belongs, non-numbers, blanks, control characters.
Each must either parse to a value inside the flag's declared bounds, or be refused by the
parser with exit status 2 and one line naming the flag; nothing else may escape.  Every
numeric flag declares its bounds (``orchestrator.cli.flags.Bounded``): a bare ``int`` or
``float`` takes "nan", "inf" or a 5 000-digit number, which then fail far from the
command line.  The only exceptions are ``generate``'s sampling flags, which
``SamplingParams`` checks before any model loads or gateway is called: those run
through ``main()`` itself.

Files: every flag that names a file to read gets a missing path, a directory, bytes that
are not UTF-8, an empty file and text of the wrong shape; each command must refuse it in
one line naming the flag or the file, with exit status 2, before it loads a model or
calls a pipeline (the model loader is replaced by a tripwire).

All in process: a parse costs microseconds, a file case a command's start.  Examples per
test: 60, or ``$TREEPIPE_FUZZ_EXAMPLES`` (``treepipe chaos --fuzz`` sets it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.cli.flags import Bounded
from orchestrator.cli.main import build_parser, main

EXAMPLES = int(os.environ.get("TREEPIPE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])

# generate's sampling flags: SamplingParams checks them in the command, before any work
# (tests/test_sampling_params.py, tests/test_generate_flags.py); their bounds, as it has them
SAMPLING: dict[str, tuple[type, float, float, bool]] = {
    "--temperature": (float, 0, 100, False), "--top-p": (float, 0, 1, True),
    "--sample-top-k": (int, 0, 2**31 - 1, False), "--seed": (int, 0, 2**64 - 1, False),
    "--presence-penalty": (float, -2, 2, False), "--frequency-penalty": (float, -2, 2, False),
    "--repetition-penalty": (float, 0, math.inf, True), "--min-tokens": (int, 0, 64, False),
    "--min-p": (float, 0, 1, False)}

# what a required argument of each dest gets, so that only the fuzzed flag can be wrong
PLACEHOLDER = {"prompt": "hi", "model": "smollm2-135m", "out": "out", "records": "r.json",
               "file": "m.yaml", "pipeline": "p", "redis": "redis://127.0.0.1:9/0",
               "name": "n", "layers": "0:2", "listen": "127.0.0.1:0", "folder": "keys",
               "draft": "ngram", "stages": "2"}


@dataclass(frozen=True)
class Flag:
    command: tuple[str, ...]  # ("draft", "serve")
    option: str  # "--kv-tokens"
    action: argparse.Action
    required: tuple[str, ...]  # argv that fills the command's required arguments

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        return f"{' '.join(self.command)} {self.option}"


def _required(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    argv: list[str] = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or not (a.required or not a.option_strings):
            continue
        value = str(sorted(a.choices)[0]) if a.choices else PLACEHOLDER[a.dest]
        argv += [value] if not a.option_strings else [a.option_strings[-1], value]
    return tuple(argv)


def _walk(parser: argparse.ArgumentParser, command: tuple[str, ...]) -> Iterator[Flag]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        for name, sp in subs[0].choices.items():
            yield from _walk(sp, (*command, name))
        return
    for a in parser._actions:
        if a.option_strings and a.type is not None and a.nargs is None:
            yield Flag(command, a.option_strings[-1], a, _required(parser))


FLAGS = list(_walk(build_parser(), ()))
NUMERIC = [f for f in FLAGS if isinstance(f.action.type, Bounded)]
SAMPLED = [f for f in FLAGS if f.command == ("generate",) and f.option in SAMPLING]
OTHER_TYPED = [f for f in FLAGS if f not in NUMERIC and f not in SAMPLED
               and f.action.type not in (str, Path)]

HOSTILE = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999", "-1e999", "-1", "0",
           "-0", "0.0", "1", "1.5", "-0.5", "1e-320", "2147483647", "2147483648",
           "18446744073709551615", "18446744073709551616", "9" * 400, "9" * 5000, "1e308",
           "0x10", "1_000", " 7 ", "", " ", "abc", "1,2", "1-2", "1:2", "\n", "3\n", "\x00",
           "٣", "²", "1e3", "+5", "-"]
# sent as --flag=VALUE, so a value that starts with "-" is not read as a flag; except
# "--", which argparse (3.11) drops from an explicit value, leaving the default
values = st.one_of(st.sampled_from(HOSTILE), st.integers(-(2**80), 2**80).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(max_size=12)).filter(lambda v: v != "--")


def parse(argv: list[str]) -> tuple[int, argparse.Namespace | None, str]:
    """``treepipe ARGV``'s parse in this process: (exit status, namespace, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return 0, build_parser(argv[0]).parse_args(argv), err.getvalue()
        except SystemExit as e:
            return int(e.code or 0), None, err.getvalue()


def one_usage_line(rc: int, err: str, *names: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert "Traceback" not in err and any(n in lines[0] for n in names), (names, err)


def in_bounds(kind: type, lo: float, hi: float, lo_open: bool, text: str) -> bool:
    """Whether ``text`` is a value a flag of these bounds must take (the reference)."""
    try:
        v = kind(text)
    except (ValueError, OverflowError):
        return False
    if kind is float and not math.isfinite(v):
        return False
    return (lo < v if lo_open else lo <= v) and v <= hi


def test_every_numeric_flag_declares_its_bounds() -> None:
    bare = [f for f in FLAGS if f.action.type in (int, float) and f not in SAMPLED]
    assert not bare, f"give these flags a bounded type (orchestrator/cli/flags.py): {bare}"
    assert len(NUMERIC) > 60 and len(SAMPLED) == len(SAMPLING), (len(NUMERIC), SAMPLED)


@pytest.mark.parametrize("command", sorted({f.command for f in FLAGS}))
def test_the_placeholders_parse(command: tuple[str, ...]) -> None:
    """Each command parses with its required arguments filled in, so a fuzzed flag's
    refusal is that flag's alone."""
    flag = next(f for f in FLAGS if f.command == command)
    rc, _, err = parse([*command, *flag.required])
    assert rc == 0, err


@FUZZ
@given(flag=st.sampled_from(NUMERIC), text=values)
def test_a_numeric_flag_takes_what_its_bounds_say_or_refuses_in_one_line(
        flag: Flag, text: str) -> None:
    t: Bounded = flag.action.type  # type: ignore[assignment]
    rc, ns, err = parse([*flag.command, *flag.required, f"{flag.option}={text}"])
    if in_bounds(t.kind, t.lo, t.hi, t.lo_open, text):
        assert rc == 0 and ns is not None, err
        v = getattr(ns, flag.action.dest)
        assert isinstance(v, t.kind) and t.lo <= v <= t.hi
    else:
        one_usage_line(rc, err, flag.option)


@FUZZ
@given(flag=st.sampled_from(OTHER_TYPED), text=values)
def test_every_other_typed_flag_parses_or_refuses_in_one_line(flag: Flag, text: str) -> None:
    """Lists, ranges, ports, layer ranges, choices of files: no exception but argparse's."""
    rc, _, err = parse([*flag.command, *flag.required, f"{flag.option}={text}"])
    if rc:
        one_usage_line(rc, err, flag.option)


@FUZZ
@given(flag=st.sampled_from(SAMPLED), text=values)
def test_generate_refuses_bad_sampling_numbers_before_any_work(
        flag: Flag, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    kind, lo, hi, lo_open = SAMPLING[flag.option]
    assume(not in_bounds(kind, lo, hi, lo_open, text))
    try:  # nothing listens at the endpoint: only the refusal can answer in time
        rc = main(["generate", "--prompt", "hi", "--endpoint", "127.0.0.1:9", "--timeout",
                   "5", f"{flag.option}={text}"])
    except SystemExit as e:  # argparse's: not a number at all
        rc = int(e.code or 0)
    one_usage_line(rc, capsys.readouterr().err, flag.option)


# ---- files ----------------------------------------------------------------------------

# (argv with F where the file goes, the flag, what the file holds: "text" takes any
# UTF-8 text as valid, "json" a structure)
FILE_CASES: list[tuple[tuple[str, ...], str, str]] = [
    (("plan", "-f", "F"), "-f", "json"), (("up", "-f", "F"), "-f", "json"),
    (("render", "-f", "F"), "-f", "json"), (("down", "-f", "F"), "-f", "json"),
    (("chaos", "-f", "F"), "-f", "json"),
    (("serve", "smollm2-135m", "--chat-template", "F"), "--chat-template", "text"),
    (("serve", "smollm2-135m", "--api-key-file", "F"), "--api-key-file", "text"),
    (("generate", "--prompt", "hi", "--endpoint", "127.0.0.1:9", "--api-key-file", "F"),
     "--api-key-file", "text"),
    (("generate", "--prompt", "hi", "--endpoint", "127.0.0.1:9", "--tls-ca-file", "F"),
     "--tls-ca-file", "json"),
    (("gateway", "--pipeline", "p", "--redis", "redis://127.0.0.1:9/0", "--api-key-file", "F"),
     "--api-key-file", "text"),
    (("gateway", "--pipeline", "p", "--redis", "redis://127.0.0.1:9/0", "--chat-template",
      "F"), "--chat-template", "text"),
    (("gateway", "--pipeline", "p", "--redis", "redis://127.0.0.1:9/0", "--tls-cert-file",
      "F", "--tls-key-file", "F"), "--tls-cert-file", "json"),
    (("top", "p", "--once", "--api-key-file", "F"), "--api-key-file", "text"),
    # a pipeline process's config, before link keys, devices or weights
    (("stage", "--name", "stage0", "--redis", "redis://127.0.0.1:9/0", "--layers", "0:2",
      "--listen", "127.0.0.1:0", "--config", "F"), "--config", "json"),
    (("draft", "serve", "--name", "draft", "--redis", "redis://127.0.0.1:9/0", "--next",
      "127.0.0.1:9", "--config", "F"), "--config", "json"),
    (("gateway", "--redis", "redis://127.0.0.1:9/0", "--config", "F"), "--config", "json"),
    (("simulate", "F"), "records", "json"),
    (("timeline", "--records", "F", "--out", "OUT"), "--records", "json"),
    (("timeline", "--prompts", "F", "--out", "OUT"), "--prompts", "json"),
    (("bench", "--tune", "F"), "--tune", "json"),
    (("bench", "--prompts", "F"), "--prompts", "json"),
    (("sweep", "width", "--prompts", "F", "--out", "OUT"), "--prompts", "json"),
    (("tune", "--prompts", "F", "--out", "OUT"), "--prompts", "json"),
    (("tune", "--verify-prompts", "F", "--out", "OUT"), "--verify-prompts", "json"),
    (("draft", "eval", "--draft", "ngram", "--prompts", "F"), "--prompts", "json"),
    (("draft", "vocab", "--prompts", "F", "--out", "OUT"), "--prompts", "json"),
    (("project", "--calibrate", "F"), "--calibrate", "json"),
    (("runtime-bench", "--tbt", "F"), "--tbt", "json"),
    (("runtime-bench", "--batch", "F"), "--batch", "json"),
    (("runtime-bench", "--overload", "F"), "--overload", "json"),
    (("runtime-bench", "--long-join", "F"), "--long-join", "json"),
]
KINDS = ["missing", "directory", "not utf-8", "empty", "wrong shape"]


class Reached(Exception):
    """A command went on to load a model with a file it should have refused."""


@FUZZ
@given(case=st.sampled_from(FILE_CASES), kind=st.sampled_from(KINDS),
       junk=st.binary(max_size=64))
def test_a_bad_file_is_one_line_before_any_work(
        case: tuple[tuple[str, ...], str, str], kind: str, junk: bytes, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv, flag, holds = case
    assume(not (holds == "text" and kind == "wrong shape"))  # any text is a key/template
    f = tmp_path / f"{kind.replace(' ', '-')}.in"
    if f.is_dir():  # examples share tmp_path
        f.rmdir()
    f.unlink(missing_ok=True)
    if kind == "directory":
        f.mkdir()
    elif kind == "not utf-8":
        f.write_bytes(b"ok\n\xff" + junk)
    elif kind == "empty":
        f.write_bytes(b"")
    elif kind == "wrong shape":
        f.write_text('[1, 2, {"a": "\\u00e9"}]\n- :\n')
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TREEPIPE_API_KEY", raising=False)
    import orchestrator.models.loading as loading
    import orchestrator.models.registry as registry

    def tripwire(*_a: object, **_k: object) -> None:
        raise Reached(f"{' '.join(argv)}: a model was loaded or fetched before {flag} was "
                      "refused")

    monkeypatch.setattr(loading, "build_engine", tripwire)
    monkeypatch.setattr(registry, "_download_wheel", tripwire)  # never pip in a test
    args = [str(f) if a == "F" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    try:
        rc = main(args)
    except SystemExit as e:
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    one_usage_line(rc, err, flag, str(f))


# ---- treepipe chaos --fuzz --------------------------------------------------------------

def test_chaos_fuzz_without_hypothesis_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hypothesis" else real(name, *a))
    assert main(["chaos", "--fuzz"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs hypothesis" in err[0], err
    assert "pip install -e '.[dev]'" in err[0], err


def test_chaos_fuzz_runs_the_suites_with_its_example_count(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    from orchestrator.cli.chaos_commands import FUZZ_SUITES

    seen: dict[str, Any] = {"rc": 0}

    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.update(cmd=cmd, **kw)
        return subprocess.CompletedProcess(cmd, seen["rc"])

    monkeypatch.setattr(subprocess, "run", run)
    assert main(["chaos", "--fuzz", "--examples", "7"]) == 0
    env, cmd = seen["env"], seen["cmd"]
    assert env["TREEPIPE_FUZZ_EXAMPLES"] == env["FUZZ_CASES"] == "7"
    assert cmd[1:3] == ["-m", "pytest"], cmd
    assert [Path(c).relative_to(seen["cwd"]).as_posix() for c in cmd[-3:]] == list(FUZZ_SUITES)
    assert all(Path(c).is_file() for c in cmd[-3:])
    seen["rc"] = 3  # a failing suite: exit 1
    assert main(["chaos", "--fuzz", "--examples", "7"]) == 1
    with pytest.raises(SystemExit):
        main(["chaos", "--fuzz", "--examples", "0"])
    assert main(["chaos"]) == 2  # neither a manifest nor --fuzz: one line
    assert "needs -f MANIFEST" in capsys.readouterr().err.strip().splitlines()[-1]
