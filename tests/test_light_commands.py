"""Commands that run no model start without torch (~2.5 s of every process's start).

`treepipe up` starts a supervisor, the gateway and `down`; `plan`, `render`, `generate
--endpoint` and the like run in CI and in tests many times: none of them may import torch,
and the lazy registry in orchestrator/cli/main.py must still give every command its full
parser.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.main import build_parser, listing_parser, subcommands

ROOT = Path(__file__).resolve().parent.parent
# generate: its --endpoint client; in process it imports the engine when it runs
LIGHT = ("up", "down", "scale", "status", "serve", "top", "gateway", "link-keys", "plan",
         "render", "crd", "manifest-docs", "generate")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_light_commands_and_the_gateway_import_no_torch():
    cp = _run("import sys\n"
              "from orchestrator.cli.main import build_parser\n"
              "import orchestrator.cli.gateway_commands\n"
              f"for c in {LIGHT!r}:\n"
              "    build_parser(c)\n"
              "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    assert cp.returncode == 0, cp.stderr


def test_the_gateway_imports_no_manifest_schema():
    # its limits come from protocol.config.limits, not from the manifest schema (pydantic it does
    # import now: the OpenAI request models are declared with it)
    cp = _run("import sys\n"
              "from orchestrator.cli.main import build_parser\n"
              "import orchestrator.cli.gateway_commands\n"
              "build_parser('gateway')\n"
              "assert 'orchestrator.deploy.manifest' not in sys.modules\n")
    assert cp.returncode == 0, cp.stderr


def test_plan_runs_without_torch():
    cp = _run("import sys\n"
              "from orchestrator.cli.main import main\n"
              "assert main(['plan', '-f', 'manifests/examples/local.yaml']) == 0\n"
              "assert 'torch' not in sys.modules\n")
    assert cp.returncode == 0, cp.stderr
    assert "pipeline local" in cp.stdout


@pytest.mark.parametrize("argv,needle", [(["--help"], "manifest-docs"),
                                         ([], "required: command")])
def test_top_level_help_and_no_command_import_no_command_module(argv, needle):
    cp = _run("import sys\n"
              "from orchestrator.cli.main import main\n"
              "try:\n"
              f"    main({argv!r})\n"
              "except SystemExit:\n"
              "    pass\n"
              "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
              "assert 'orchestrator.lab.benchmarks.bench' not in sys.modules\n")
    assert cp.returncode == 0, cp.stderr
    assert needle in cp.stdout + cp.stderr


def test_the_cheap_listing_matches_the_full_parser():
    full = build_parser()
    registered = {c.dest: c.help for a in full._actions
                  if isinstance(a, argparse._SubParsersAction) for c in a._choices_actions}
    assert list(COMMANDS) == list(subcommands(full)) == list(registered)
    assert COMMANDS == registered
    # hence the same --help, byte for byte
    assert listing_parser().format_help() == full.format_help()


def test_each_command_gets_its_full_parser_when_named():
    full = build_parser()
    for name, parser in subcommands(full).items():
        lazy = subcommands(build_parser(name))
        assert name in lazy, name
        # the same flags, and a group (draft, model) the same subcommands
        assert lazy[name].format_help() == parser.format_help(), name


@pytest.mark.parametrize("argv", [["no-such-command"], ["--help"]])
def test_unknown_command_and_help_list_every_command(argv, capsys):
    from orchestrator.cli.main import main

    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr()
    for name in ("generate", "bench", "stage", "up", "gateway", "plan", "model"):
        assert name in out.out + out.err, name


def test_a_closed_stdout_ends_quietly_with_141() -> None:
    """``treepipe plan | head -1``: the reader gone before the output is written gives the
    SIGPIPE exit status, not a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        cp = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-f",
                             "manifests/examples/local.yaml"], stdout=write,
                            stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write)
    assert (cp.returncode, cp.stderr) == (141, "")
