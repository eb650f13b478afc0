"""Flags and the parser class every command shares (a leaf: command modules import it)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import NoReturn, TypeVar

from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE, pool_blocks
from stages.model.execution_modes import DEFAULT_EXECUTION, EXECUTION_MODES

T = TypeVar("T")


def options(cls: type[T], a: argparse.Namespace) -> T:
    """The typed options ``cls`` (a dataclass whose fields are flag dests) of a parsed
    command line: the one place a Namespace turns into what a library takes."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.name: getattr(a, f.name) for f in fields})


def positive_int(text: str) -> int:
    """argparse type: an integer of 1 or more."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {v}")
    return v


def kv_tokens(text: str) -> int:
    """argparse type: a KV budget in rows, at least one block."""
    v = positive_int(text)
    if pool_blocks(v) < 1:
        raise argparse.ArgumentTypeError(f"{v} rows are less than one KV block; give at least "
                                         f"{DEFAULT_BLOCK_SIZE}")
    return v


def add_kv_tokens(parser: argparse.ArgumentParser, what: str) -> None:
    """``--kv-tokens N``, the stages' KV budget in rows (``memory.kvTokens``); ``what``:
    what this command does with it."""
    parser.add_argument("--kv-tokens", type=kv_tokens, default=None, metavar="N",
                        help=f"KV rows each stage's pool holds (memory.kvTokens): {what}")


def positive_int_list(text: str) -> list[int]:
    """argparse type: ``1,2,4`` -> [1, 2, 4], each 1 or more."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 1,2,4,8")
    return vals


def int_range(text: str) -> tuple[int, int]:
    """argparse type: ``16-48`` -> (16, 48), 1 <= low <= high."""
    lo, sep, hi = text.partition("-")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit() \
            or not 1 <= int(lo) <= int(hi):
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LOW-HIGH of integers "
                                         "1 <= LOW <= HIGH, e.g. 16-48")
    return int(lo), int(hi)


def name_list(text: str) -> list[str]:
    """argparse type: ``a,b`` -> ["a", "b"] (at least one name)."""
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more names separated by commas")
    return vals


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name, Hugging Face folder, or .gguf file")
    p.add_argument("--stages", type=positive_int, default=4, help="pipeline stages (m)")
    p.add_argument("--draft", default="ngram",
                   help="token source: ngram, hybrid, layers:N (first N target layers), "
                        "a draft model name/path, or replay:P / replay:P-Q (BENCHMARKS "
                        "ONLY: replays the target's own greedy output with hit probability P "
                        "at any width, or P at width 1 rising toward Q with the width)")
    p.add_argument("--draft-model", default="layers:4",
                   help="draft model used by --draft hybrid (default: layers:4)")
    p.add_argument("--draft-vocab", default="", metavar="FILE[:K]",
                   help="draft model proposes only the first K ids of FILE (`treepipe draft "
                        "vocab`): a cheaper LM head, probabilities over that subset")
    p.add_argument("--width", type=positive_int, default=16, help="tree width w")
    p.add_argument("--topk", type=positive_int, default=8, help="draft top-k per node")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_execution_flags(p)
    p.add_argument("--link-latency-us", type=float, default=100.0,
                   help="modelled link latency for pipelined time (µs)")
    p.add_argument("--link-gbps", type=float, default=10.0,
                   help="modelled link bandwidth for pipelined time (Gbit/s)")


def add_execution_flags(p: argparse.ArgumentParser) -> None:
    """``--execution`` and its vLLM-style shortcuts ``--eager`` and ``--compile``."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--execution", choices=EXECUTION_MODES, default=DEFAULT_EXECUTION,
                   help="auto (default): compiled on a GPU, tuned on a CPU (what measured "
                        "fastest on each); eager: plain PyTorch, as before measured kernels "
                        "(debugging); tuned: CPU matmul kernels measured fastest on this "
                        "machine; compiled: tuned, each layer a torch.compile graph, each "
                        "step a CUDA graph on a GPU")
    g.add_argument("--eager", dest="execution", action="store_const", const="eager",
                   help="same as --execution eager (vLLM: --enforce-eager)")
    g.add_argument("--compile", dest="execution", action="store_const", const="compiled",
                   help="same as --execution compiled")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--pipeline``, ``--redis`` and ``--model``: what every pipeline process takes."""
    p.add_argument("--pipeline", required=True, help="pipeline name (Redis key namespace)")
    p.add_argument("--redis", required=True, help="synchroniser URL, redis://host:port/db")
    p.add_argument("--model", default="smollm2-135m", help="target model name or folder")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds above 0 (float() alone takes nan, inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, "
                                         f"got {text}")
    return v
