"""``treepipe model fetch`` and ``treepipe model random``: the argv side of model tooling.

Light at import (no torch): the ``model`` group is registered for every command, so
the random-weight writer is imported only for ``treepipe model ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import count, out_folder, seed
from orchestrator.models.architectures import KNOWN_ARCHITECTURES
from orchestrator.models.registry import fetch_model
from protocol.errors import TreepipeError
from stages.model.config import ModelError


def add_model_parsers(sub: Any, with_random: bool) -> None:
    """Register the ``model`` group: ``fetch`` always, ``random`` when ``with_random``."""
    m = sub.add_parser("model", help=COMMANDS["model"])
    msub = m.add_subparsers(dest="model_command", required=True)
    f = msub.add_parser("fetch", help="download and convert a known model")
    f.add_argument("name")
    f.add_argument("--force", action="store_true")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=fetch_command)
    if with_random:
        add_random_model_parser(msub)


def fetch_command(args: argparse.Namespace) -> int:
    """``treepipe model fetch NAME [--force]``: fetch, then print the folder on stdout."""
    try:
        folder = fetch_model(args.name, force=getattr(args, "force", False),
                             progress=not getattr(args, "quiet", False))
    except ModelError as e:
        # Exit status 2, like the rest of the CLI's user-facing errors.
        print(f"treepipe: error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def cmd_model_random(a: argparse.Namespace) -> int:
    """``treepipe model random``: a random-weight model of a known shape."""
    from orchestrator.deploy.planner import stage_params
    from orchestrator.models.random_model import check_byte_vocab, save_random_model, shape_args

    arch = KNOWN_ARCHITECTURES[a.shape]
    if a.layers is not None and a.layers < 1:
        raise TreepipeError(f"--layers {a.layers}: a model needs at least one layer")
    args = shape_args(arch, a.layers, a.vocab, a.context)
    check_byte_vocab(args)
    # the planner's exact count (GQA's smaller K/V, a tied head stored once)
    shape = arch.with_overrides(layers=args.n_layers, vocab_size=args.vocab_size)
    n = stage_params(shape, 0, args.n_layers, first=True, last=True)
    print(f"writing a random {a.shape}-shaped model ({args.n_layers} layers, vocabulary "
          f"{args.vocab_size}, about {n / 1e9:.2f} B parameters) to {a.out}", file=sys.stderr)
    save_random_model(Path(a.out), args, a.seed)
    print(a.out)
    return 0


def add_random_model_parser(msub: argparse._SubParsersAction) -> None:
    """Register ``treepipe model random``."""
    # its help names the byte alphabet, and the writer imports torch: only for `model`
    from orchestrator.models.random_model import BYTE_VOCAB

    r = msub.add_parser("random", help="write a random-weight model of a known shape "
                                       "(for benchmarks; byte-level tokenizer)")
    r.add_argument("--shape", required=True, choices=sorted(KNOWN_ARCHITECTURES),
                   help="architecture whose layer shapes to use")
    r.add_argument("--layers", type=count(1), default=None, help="decoder layers (default: the "
                                                            "shape's own)")
    r.add_argument("--vocab", type=count(1), default=None,
                   help=f"vocabulary size (default: the shape's own; at least {BYTE_VOCAB})")
    r.add_argument("--context", type=count(1), default=4096, help="max_position_embeddings")
    r.add_argument("--seed", type=seed, default=0)
    r.add_argument("--out", type=out_folder, required=True, help="folder to write")
    r.set_defaults(func=cmd_model_random)
