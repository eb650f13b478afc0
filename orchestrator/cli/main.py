"""The ``treepipe`` command line: the command registry and ``main``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.exits import RUNTIME, USAGE, lost_redis
from orchestrator.cli.flags import OneLineParser, one_line
from protocol.errors import RuntimeFailure, TreepipeError
from stages.model.execution_modes import DEFAULT_DTYPE, resolve_dtype


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    ap = OneLineParser(prog="treepipe", description=__doc__)
    return ap, ap.add_subparsers(dest="command", required=True)


def listing_parser() -> argparse.ArgumentParser:
    """The top-level parser with a flagless stub per command: its help and errors only.

    Its --help and its errors (no command, an unknown one) read exactly as the full
    parser's.  The stubs take no flags, -h included, so that what they would parse is
    left to the command's full parser.
    """
    ap, sub = _top_parser()
    for name, summary in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return ap


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``treepipe`` parser: every subcommand sets ``func``, which main() calls.

    Each command's module is imported here, only when ``command`` (argv's first word) is
    one of the commands it registers, or when ``command`` is None (all of them).  Most
    of them import torch (~2.5 s of a process's start), the rest pydantic, aiohttp,
    kubernetes or grpc, and a process needs only its own: `treepipe up`, `down`,
    `gateway`, `plan` and `generate --endpoint` start without torch, a stage worker
    without the launcher or the benchmarks.
    """
    ap, sub = _top_parser()

    def wanted(*commands: str) -> bool:
        return command is None or command in commands

    if wanted("generate"):
        from orchestrator.cli.generate import add_generate_parser
        add_generate_parser(sub)
    if wanted("serve"):
        from orchestrator.cli.serve import add_serve_parser
        add_serve_parser(sub)
    if wanted("chaos"):
        from orchestrator.cli.chaos_commands import add_chaos_parser
        add_chaos_parser(sub)
    if wanted("bench"):
        from orchestrator.cli.bench_commands import add_bench_parser
        add_bench_parser(sub)
    if wanted("sweep"):
        from orchestrator.cli.sweep_commands import add_sweep_parser
        add_sweep_parser(sub)
    if wanted("simulate", "project"):
        from orchestrator.cli.simulator_commands import add_simulator_parsers
        add_simulator_parsers(sub)
    if wanted("tune"):
        from orchestrator.cli.tune_commands import add_tune_parser
        add_tune_parser(sub)
    if wanted("timeline"):
        from orchestrator.cli.timeline_commands import add_timeline_parser
        add_timeline_parser(sub)

    # `treepipe draft serve|distill|eval`: the draft service and draft training
    d = sub.add_parser("draft", help=COMMANDS["draft"])
    dsub = d.add_subparsers(dest="draft_command", required=True)
    # serve: the draft service process (runtime); distill/eval: draft training
    if wanted("stage", "draft"):
        from orchestrator.cli.worker_commands import add_process_parsers
        add_process_parsers(sub, dsub)
    if wanted("link-keys", "gateway"):
        from orchestrator.cli.gateway_commands import add_gateway_parsers
        add_gateway_parsers(sub)
    if wanted("up", "down", "scale", "status"):
        from orchestrator.cli.pipeline_commands import add_launcher_parsers
        add_launcher_parsers(sub)
    if wanted("top"):
        from orchestrator.cli.top import add_top_parser
        add_top_parser(sub)
    if wanted("runtime-bench"):
        from orchestrator.cli.runtime_bench_commands import add_runtime_bench_parser
        add_runtime_bench_parser(sub)
    if wanted("bench-serve"):
        from orchestrator.cli.bench_serve_commands import add_bench_serve_parser
        add_bench_serve_parser(sub)
    if wanted("draft"):
        from orchestrator.cli.draft_commands import add_draft_training_parsers
        add_draft_training_parsers(dsub)

    # Subcommands owned by other modules register here, each with
    # `set_defaults(func=...)`; main() dispatches on `func`.
    if wanted("plan", "render", "crd", "manifest-docs"):
        from orchestrator.cli.manifest_commands import add_manifest_parsers
        add_manifest_parsers(sub)

    from orchestrator.cli.model_commands import add_model_parsers
    add_model_parsers(sub, with_random=wanted("model"))
    return ap


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The top-level commands ``ap`` registered, each with its parser."""
    return {name: parser for action in ap._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, parser in action.choices.items()}


def with_dtype(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--dtype auto`` made the dtype it means on ``--device``, so every
    command, stats line and report names the dtype that ran."""
    if getattr(args, "dtype", None) == DEFAULT_DTYPE:
        args.dtype = resolve_dtype(args.dtype, getattr(args, "device", "cpu"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``treepipe`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command not in COMMANDS:
        # --help, no command or an unknown one: the listing prints the help or the error
        # and exits.  It returns only for a command after leading flags (`--bogus plan`).
        command = listing_parser().parse_known_args(argv)[0].command
    args = with_dtype(build_parser(command).parse_args(argv))
    try:
        return int(args.func(args) or 0)
    except RuntimeFailure as e:
        print(f"treepipe: error: {one_line(str(e))}", file=sys.stderr)
        return RUNTIME
    except TreepipeError as e:
        print(f"treepipe: error: {one_line(str(e))}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("treepipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`treepipe plan | head`): stop quietly, as a Unix tool
        # killed by SIGPIPE does, and keep Python from complaining at exit while it
        # flushes the dead pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        # a Redis outage mid-command is a runtime failure to retry, not a bug to trace
        why = lost_redis(e)
        if why is None:
            raise
        print(f"treepipe: error: {one_line(why)}", file=sys.stderr)
        return RUNTIME


if __name__ == "__main__":
    sys.exit(main())
