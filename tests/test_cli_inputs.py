"""Bad input on the command line: one line naming the problem and the fix, exit 2, no
traceback, nothing on disk changed (real `python -m orchestrator` runs, real files)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.links.keys import CURVE_SECRET, KEY_FILES

ROOT = Path(__file__).resolve().parent.parent
REDIS = ["--pipeline", "p", "--redis", "redis://127.0.0.1:1/0"]


def treepipe(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def refused(cp: subprocess.CompletedProcess, *needles: str) -> str:
    """The one error line of a usage error holding every needle."""
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert "Traceback" not in cp.stderr, cp.stderr
    lines = [ln for ln in cp.stderr.strip().splitlines() if "error:" in ln]
    assert len(lines) == 1, cp.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- treepipe link-keys ---------------------------------------------------------------

def test_link_keys_refuses_a_file_and_a_folder_of_other_things(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("mine")
    refused(treepipe("link-keys", str(f)), str(f), "not a folder", "new folder")
    assert f.read_text() == "mine"
    shared = tmp_path / "shared"  # as /tmp would be: others' files, its own mode
    shared.mkdir()
    (shared / "notes").write_text("theirs")
    shared.chmod(0o755)
    refused(treepipe("link-keys", str(shared)), str(shared), "other files", "new folder")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert sorted(p.name for p in shared.iterdir()) == ["notes"]


def test_link_keys_replaces_a_key_folder_only_with_force(tmp_path: Path) -> None:
    keys = tmp_path / "a" / "b" / "keys"  # missing parents are made
    assert treepipe("link-keys", str(keys)).returncode == 0
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert sorted(p.name for p in keys.iterdir()) == sorted(KEY_FILES)
    before = (keys / CURVE_SECRET).read_bytes()
    line = refused(treepipe("link-keys", str(keys)), str(keys), "already holds link keys",
                   "--force", "restarted")
    assert "keep the old keys" in line
    assert (keys / CURVE_SECRET).read_bytes() == before  # a running pipeline's keys stay
    cp = treepipe("link-keys", str(keys), "--force")
    assert cp.returncode == 0, cp.stderr
    assert (keys / CURVE_SECRET).read_bytes() != before
    empty = tmp_path / "empty"  # an empty folder is as good as a new one
    empty.mkdir(mode=0o755)
    assert treepipe("link-keys", str(empty), "--transport", "zmq").returncode == 0
    assert stat.S_IMODE(empty.stat().st_mode) == 0o700


# ---- HOST:PORT flags -------------------------------------------------------------------

STAGE = ["stage", *REDIS, "--name", "stage0", "--layers", "0:2", "--insecure-links"]
DRAFT = ["draft", "serve", *REDIS, "--name", "draft", "--insecure-links"]
GATEWAY = ["gateway", *REDIS]


@pytest.mark.parametrize("args,flag", [
    ([*STAGE, "--listen", "nope", "--next", "127.0.0.1:5"], "--listen"),
    ([*STAGE, "--listen", "127.0.0.1:0", "--next", "nope"], "--next"),
    ([*STAGE, "--listen", "127.0.0.1:0", "--next", "127.0.0.1:0"], "--next"),  # connect: 1+
    ([*STAGE, "--listen", "127.0.0.1:0", "--exit-to", "h:70000"], "--exit-to"),
    ([*DRAFT, "--next", "nope"], "--next"),
    ([*DRAFT, "--next", "127.0.0.1:5", "--listen", "[::1:5"], "--listen"),
    ([*GATEWAY, "--listen", "nope"], "--listen"),
    ([*GATEWAY, "--listen", "127.0.0.1:99999"], "--listen"),
    ([*GATEWAY, "--health-listen", "nope"], "--health-listen"),
    ([*GATEWAY, "--http-listen", "0.0.0.0:http"], "--http-listen"),
    ([*GATEWAY, "--http-listen", "::1:8000"], "--http-listen"),  # IPv6 unbracketed
], ids=lambda x: x if isinstance(x, str) else " ".join(x[:2]) + " " + x[-2])
def test_host_port_flags_are_checked_while_parsing(args: list[str], flag: str) -> None:
    # refused while parsing, at once (unchecked, a gateway would serve on: the timeout)
    refused(treepipe(*args, timeout=60), f"argument {flag}:", "HOST:PORT", "65535")


@pytest.mark.parametrize("flag,what", [("--health-listen", "health"),
                                       ("--http-listen", "HTTP")])
def test_gateway_on_a_busy_port_is_one_line(smollm2_path: Path, busy_port: int, flag: str,
                                            what: str) -> None:
    cp = treepipe(*GATEWAY, "--model", str(smollm2_path), flag, f"127.0.0.1:{busy_port}")
    refused(cp, f"cannot serve {what} on 127.0.0.1:{busy_port}", "pick a free")


# ---- treepipe draft recovery -------------------------------------------------------------

def test_recovery_print_of_a_file_that_is_no_report(tmp_path: Path) -> None:
    refused(treepipe("draft", "recovery", "--print", str(tmp_path / "missing.json")),
            "missing.json", "cannot read", "--json FILE")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused(treepipe("draft", "recovery", "--print", str(bad)), "bad.json", "not JSON")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hop": []}))
    refused(treepipe("draft", "recovery", "--print", str(other)), "other.json", '"rows"',
            "--json")


@pytest.mark.parametrize("flag,value,needles", [
    ("--kappas", "abc", ["argument --kappas:", "comma list of integers"]),
    ("--stages", "0", ["argument --stages:", "[1, "]),
    ("--lags", "x", ["argument --lags:", "comma list of integers"]),
    ("--heads", "bogus", ["argument --heads:", "'bogus'", "a head is full, vocab=FILE"]),
])
def test_recovery_flags_are_checked_before_the_model_runs(tmp_path: Path, flag: str,
                                                          value: str,
                                                          needles: list[str]) -> None:
    # one short prompt: without the check the target would run, then fail
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    line = refused(treepipe("draft", "recovery", "--prompts", str(prompts),
                            "--max-new-tokens", "2", "--sources", "ngram", flag, value),
                   *needles)
    assert "early-exit:1:8" not in line  # no setting the user never wrote


def test_recovery_finds_its_default_prompts_from_any_folder(tmp_path: Path,
                                                            smollm2_path: Path) -> None:
    """The default held-out prompts load from another folder: the next check (the stage
    count against the model's layers, before the model runs) is what answers."""
    cp = treepipe("draft", "recovery", "--target", str(smollm2_path), "--stages", "99",
                  cwd=tmp_path)
    refused(cp, "--stages", "99 stages", "at most 30")
