"""``treepipe chaos``: the argv side of the kill-and-check series (orchestrator/deploy/chaos.py),
and ``--fuzz``, the long runs of the fuzz suites."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import (
    fraction,
    options,
    positive_int,
    positive_seconds,
    seed,
)
from orchestrator.deploy.chaos import KINDS, ChaosOptions, chaos_series
from protocol.errors import RuntimeFailure, TreepipeError

# the fuzz suites `chaos --fuzz` runs: the HTTP API (against one `treepipe up` pipeline),
# manifests and the CLI's flags (in process); docs/reliability.md says what each sends
FUZZ_SUITES = ("tests/test_cli_fuzz.py", "tests/test_manifest_fuzz.py",
               "tests/test_openai_fuzz.py")


def run_fuzz(examples: int) -> int:
    """``treepipe chaos --fuzz``: the fuzz suites of this source checkout, ``examples``
    hypothesis examples per test (and HTTP route) and as many seeded manifest cases.

    Exits 0 when every suite passes, 1 when one fails (pytest's report says which
    example; the runs are derandomized, so the same command repeats it)."""
    lacking = [m for m in ("hypothesis", "pytest") if importlib.util.find_spec(m) is None]
    if lacking:
        raise RuntimeFailure(f"treepipe chaos --fuzz needs {' and '.join(lacking)}, "
                             "development dependencies: pip install -e '.[dev]' in a treepipe "
                             "checkout")
    root = Path(__file__).resolve().parents[2]
    suites = [root / s for s in FUZZ_SUITES]
    if not all(s.is_file() for s in suites):
        raise RuntimeFailure(f"treepipe chaos --fuzz runs the fuzz suites of a treepipe source "
                             f"checkout ({', '.join(FUZZ_SUITES)}); {root} has none: run it "
                             "from a checkout installed with pip install -e '.[dev]'")
    env = dict(os.environ, TREEPIPE_FUZZ_EXAMPLES=str(examples), FUZZ_CASES=str(examples),
               PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                         os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")  # the suite's pipeline shares the cores
    print(f"treepipe chaos --fuzz: {examples} examples per test, "
          f"{', '.join(FUZZ_SUITES)}", file=sys.stderr, flush=True)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *map(str, suites)], cwd=root, env=env, check=False)
    return 0 if res.returncode == 0 else 1


def cmd_chaos(a: argparse.Namespace) -> int:
    """``treepipe chaos -f MANIFEST``: up, the seeded series with kills, down; or
    ``treepipe chaos --fuzz``: the fuzz suites."""
    if a.fuzz:
        return run_fuzz(a.examples)
    if not a.file:
        raise TreepipeError("treepipe chaos needs -f MANIFEST (a backend: local pipeline to "
                            "kill processes of), or --fuzz")
    return chaos_series(options(ChaosOptions, a))


def add_chaos_parser(sub: Any) -> None:
    """Register ``treepipe chaos``."""
    c = sub.add_parser("chaos", help=COMMANDS["chaos"])
    c.add_argument("-f", "--file", default=None, type=str,
                   help="TreePipeline manifest (backend local)")
    c.add_argument("--requests", type=positive_int, default=12)
    c.add_argument("--seed", type=seed, default=0)
    c.add_argument("--kill-prob", type=fraction(), default=0.75,
                   help="probability that a request sees a kill (default 0.75)")
    c.add_argument("--kinds", default=",".join(KINDS),
                   help=f"processes to kill, comma list (default {','.join(KINDS)})")
    c.add_argument("--max-new-tokens", type=positive_int, default=48)
    c.add_argument("--deadline", type=positive_seconds, default=120.0,
                   help="seconds each request may take before its client gives up")
    c.add_argument("--json", action="store_true")
    c.add_argument("--fuzz", action="store_true",
                   help="instead of kills: the long run of the fuzz suites (HTTP API, "
                        "manifests, CLI flags) of this source checkout; needs the dev "
                        "dependencies (hypothesis, pytest)")
    c.add_argument("--examples", type=positive_int, default=1000,
                   help="with --fuzz: hypothesis examples per test (and HTTP route), and "
                        "seeded manifest cases (default 1000)")
    c.set_defaults(func=cmd_chaos)
