"""The ``treepipe`` command line: the command registry and ``main``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from orchestrator.cli.flags import OneLineParser
from orchestrator.models.registry import fetch_command
from protocol.errors import TreepipeError

# Where each subcommand is defined: (module, registrar, the top-level commands it registers).
# build_parser(command) imports a module only when ``command`` is one of its commands: most
# import torch (~2.5 s of a process's start), the rest pydantic, aiohttp, kubernetes or grpc,
# and a process needs only its own (`treepipe up`, `down`, `gateway`, `plan` start without
# torch; a stage worker without the launcher or the benchmarks).  A registrar takes the
# top-level subparsers, or (draft and model subcommands) its group's.
GENERATE = ("orchestrator.cli.generate", "add_generate_parser", ("generate",))
SERVE = ("orchestrator.cli.serve", "add_serve_parser", ("serve",))
CHAOS = ("orchestrator.deploy.chaos", "add_chaos_parser", ("chaos",))
BENCH = ("orchestrator.benchmarks.bench", "add_bench_parser", ("bench",))
SWEEP = ("orchestrator.benchmarks.sweeps", "add_sweep_parser", ("sweep",))
SIMULATOR = ("orchestrator.benchmarks.simulator", "add_simulator_parsers",
             ("simulate", "project"))
TUNE = ("orchestrator.benchmarks.tune", "add_tune_parser", ("tune",))
TIMELINE = ("orchestrator.benchmarks.timeline", "add_timeline_parser", ("timeline",))
PROCESSES = ("orchestrator.serving.processes", "add_process_parsers", ("stage", "draft"))
GATEWAY = ("orchestrator.serving.gateway_process", "add_gateway_parsers",
           ("link-keys", "gateway"))
LAUNCHER = ("orchestrator.deploy.launcher", "add_launcher_parsers",
            ("up", "down", "scale", "status"))
TOP = ("orchestrator.cli.top", "add_top_parser", ("top",))
RUNTIME_BENCH = ("orchestrator.benchmarks.runtime_bench", "add_runtime_bench_parser",
                 ("runtime-bench",))
DRAFT_TRAINING = ("orchestrator.cli.draft_commands", "add_draft_training_parsers", ("draft",))
MANIFEST = ("orchestrator.cli.manifest_commands", "add_manifest_parsers",
            ("plan", "render", "crd", "manifest-docs"))
RANDOM_MODEL = ("orchestrator.models.random_model", "add_random_model_parser", ("model",))
REGISTRARS = (GENERATE, SERVE, CHAOS, BENCH, SWEEP, SIMULATOR, TUNE, TIMELINE, PROCESSES,
              GATEWAY, LAUNCHER, TOP, RUNTIME_BENCH, DRAFT_TRAINING, MANIFEST, RANDOM_MODEL)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``treepipe`` parser: every subcommand sets ``func``, which main() calls.

    With ``command`` (the first word of argv), a registrar of REGISTRARS registers its
    subcommands only when ``command`` is one of them; without it, all of them do.
    """
    ap = OneLineParser(prog="treepipe", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    def register(registrar: tuple[str, str, tuple[str, ...]], *subparsers: Any) -> None:
        module, function, commands = registrar
        if command is None or command in commands:
            getattr(importlib.import_module(module), function)(*(subparsers or (sub,)))

    register(GENERATE)
    register(SERVE)
    register(CHAOS)
    register(BENCH)
    register(SWEEP)
    register(SIMULATOR)
    register(TUNE)
    register(TIMELINE)

    # `treepipe draft serve|distill|eval`: the draft service and draft training
    d = sub.add_parser("draft", help="draft service and draft training")
    dsub = d.add_subparsers(dest="draft_command", required=True)
    # serve: the draft service process (runtime); distill/eval: draft training
    register(PROCESSES, sub, dsub)
    register(GATEWAY)
    register(LAUNCHER)
    register(TOP)
    register(RUNTIME_BENCH)
    register(DRAFT_TRAINING, dsub)

    # Subcommands owned by other modules register here, each with
    # `set_defaults(func=...)`; main() dispatches on `func`.
    register(MANIFEST)

    m = sub.add_parser("model", help="manage models")
    msub = m.add_subparsers(dest="model_command", required=True)
    f = msub.add_parser("fetch", help="download and convert a known model")
    f.add_argument("name")
    f.add_argument("--force", action="store_true")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=fetch_command)
    register(RANDOM_MODEL, msub)
    return ap


def command_names(ap: argparse.ArgumentParser) -> set[str]:
    """The top-level commands ``ap`` registered."""
    return {name for action in ap._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``treepipe`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    ap = build_parser(command)
    if command is not None and command not in command_names(ap):
        ap = build_parser()  # an unknown command: the error lists every command
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TreepipeError as e:
        print(f"treepipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("treepipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
