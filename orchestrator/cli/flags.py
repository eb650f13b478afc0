"""Flags and the parser class every command shares (a leaf: command modules import it)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

from protocol.config.pipeline import PipelineConfig
from protocol.config.recovery import NO_RECOVERY, Recovery, parse_recovery
from protocol.errors import TreepipeError
from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE, pool_blocks
from stages.model.execution_modes import (
    DEFAULT_DTYPE,
    DEFAULT_EXECUTION,
    DEFAULT_QUANTIZE,
    EXECUTION_MODES,
    QUANTIZE_MODES,
)

T = TypeVar("T")


def options(cls: type[T], a: argparse.Namespace) -> T:
    """The typed options ``cls`` (a dataclass whose fields are flag dests) of a parsed
    command line: the one place a Namespace turns into what a library takes."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.name: getattr(a, f.name) for f in fields})


INT32_MAX = 2**31 - 1  # every count and size a flag takes (as the manifests' bounds)
SEED_LIMIT = 2**64  # seeds are in [0, 2^64), as the gateway's and SamplingParams'
MAX_SECONDS = 30 * 86400.0  # a month: any wait or deadline a flag gives


def shown(text: str, limit: int = 40) -> str:
    """``text`` for a one-line error: quoted, escaped, at most about ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit // 2]!r}... ({len(text)} characters)"


class Bounded:
    """argparse type: an integer or a finite number in [lo, hi] (``lo_open``: above lo).

    Every numeric flag takes one of these, never bare ``int`` or ``float``: ``float()``
    takes "nan" and "inf" and ``int()`` any size, which then fail far from the command
    line (a traceback, a wait that never ends) or silently mean something else.  A value
    outside is a one-line usage error naming the flag (argparse adds "argument FLAG:").
    The bounds are attributes, so tests can tell which values a flag must refuse.
    """

    def __init__(self, kind: type, lo: float, hi: float, lo_open: bool = False,
                 what: str = "") -> None:
        self.kind, self.lo, self.hi, self.lo_open, self.what = kind, lo, hi, lo_open, what
        self.__name__ = kind.__name__  # argparse's "invalid <name> value" wording

    def __call__(self, text: str) -> int | float:
        noun = "an integer" if self.kind is int else "a number"
        try:
            v = self.kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{shown(text)} is not {noun}") from None
        # only a float can be NaN or infinite (isfinite of a 400-digit int overflows)
        if self.kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {shown(text)}")
        if (v <= self.lo if self.lo_open else v < self.lo) or v > self.hi:
            raise argparse.ArgumentTypeError(f"{self.domain(v)}, got {shown(text)}")
        return v

    def domain(self, v: float) -> str:
        """What the flag takes, for the error of ``v``: "must be 1 or more", "must be a
        finite number in (0, 2.592e+06] seconds"."""
        if self.kind is int and self.hi == INT32_MAX:  # a count: its ceiling rarely matters
            if v > self.hi:
                return f"must be at most {INT32_MAX}{self.what}"
            return f"must be {self._num(self.lo)} or more{self.what}"
        lo = "(" if self.lo_open else "["
        what = "an integer" if self.kind is int else "a finite number"
        return f"must be {what} in {lo}{self._num(self.lo)}, {self._num(self.hi)}]{self.what}"

    def _num(self, x: float) -> str:
        return str(int(x)) if self.kind is int else f"{x:g}"

    def __repr__(self) -> str:
        return f"Bounded({self.kind.__name__}, {self.lo}, {self.hi}, lo_open={self.lo_open})"


def count(lo: int = 0, what: str = "") -> Bounded:
    """argparse type: an integer from ``lo`` up to 2^31 - 1."""
    return Bounded(int, lo, INT32_MAX, what=what)


def fraction(what: str = "") -> Bounded:
    """argparse type: a finite number in [0, 1]."""
    return Bounded(float, 0.0, 1.0, what=what)


def finite(lo: float, hi: float, lo_open: bool = False, what: str = "") -> Bounded:
    """argparse type: a finite number in [lo, hi] (``lo_open``: above lo)."""
    return Bounded(float, lo, hi, lo_open, what)


seed = Bounded(int, 0, SEED_LIMIT - 1)  # argparse type: a seed in [0, 2^64)
port = Bounded(int, 0, 65535, what=" (0: none)")  # argparse type: a TCP port or 0
positive_int = Bounded(int, 1, INT32_MAX)  # argparse type: an integer of 1 or more
positive_int.__name__ = "positive_int"


class HostPort:
    """argparse type: ``HOST:PORT`` (an IPv6 host in brackets), the port in [1, 65535],
    or from 0 where ``listen`` (0: the system picks one); returned as given. A bad one is
    a one-line usage error here, not a socket library's traceback at start-up."""

    def __init__(self, listen: bool):
        self.listen = listen
        self.__name__ = "HOST:PORT"

    def __call__(self, text: str) -> str:
        host, sep, port = text.rpartition(":")
        lo = 0 if self.listen else 1
        bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
        plain = bool(host) and not set("[]:") & set(host)  # a name or an IPv4 address
        if not sep or not (bracketed or plain) or not (port.isascii() and port.isdigit()) \
                or not lo <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(
                f"{shown(text)} is not HOST:PORT with a port in [{lo}, 65535] (an IPv6 host "
                f"in brackets: [::1]:8000)")
        return text


def _path(text: str) -> str:
    """A path for a one-line error: quoted, up to 200 characters (a path cut short at 40
    says little)."""
    return shown(text, 200)


def expanded(text: str) -> Path:
    """``text`` as a path with ``~`` expanded; an unknown ``~user`` is an argparse error."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{_path(text)}: no such user's home; write the "
                                         f"path out") from None


def _writable_place(path: Path, text: str) -> None:
    """Refuse ``text`` unless the nearest existing folder at or above ``path`` takes a new
    file (a scratch file, made and gone at once: permission bits lie to root, /proc). The
    folders are made when the command writes, not here: a command line refused later, or
    --help, leaves nothing behind."""
    up = path.absolute()
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise argparse.ArgumentTypeError(f"{_path(str(up))} is a file, not a folder; name "
                                         f"another path for {_path(text)}")
    try:
        with tempfile.TemporaryFile(dir=up):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {_path(str(up))} "
                                         f"({e.strerror or type(e).__name__}); name another "
                                         f"path for {_path(text)}") from None


def out_folder(text: str) -> Path:
    """argparse type: a folder to write results in (made by the command if missing),
    checked before any work: a path that is a file, or in a place that cannot be written,
    is refused here rather than after a long run."""
    path = expanded(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{_path(text)} is a file, not a folder; name a "
                                         f"folder (it is made if missing)")
    _writable_place(path, text)
    return path


def out_file(text: str) -> Path:
    """argparse type: a file to write (its folder made by the command if missing), checked
    before any work as :func:`out_folder`."""
    path = expanded(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{_path(text)} is a folder; name a file in it")
    _writable_place(path.parent, text)
    return path


listen_address = HostPort(listen=True)  # argparse type: where to bind (port 0: any)
peer_address = HostPort(listen=False)  # argparse type: where to connect


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


ANY_VOCAB = 2**31 - 1  # the target is not loaded yet: ExitHead checks the ids against it


def resolve_exit(rec: Recovery, root: Path | None = None) -> Recovery:
    """``rec`` with its early exit's names resolved: ``+vocab=FILE[:N]`` to the ids (the
    ``--draft-vocab`` reader), ``+adapter=PATH|auto`` to adapter folders by exit layer
    (auto: ``root``, default ``<cache>/drafts``), since stages read no files or cache;
    ValueError (one line, naming the fix) for a file or folder that is not one."""
    if not rec.exit_stage:
        return rec
    # here, not at the top: the light commands (gateway, plan, serve) import these flags
    # and must start without torch, which the vocabulary and adapter readers import
    from orchestrator.models.draft_vocab import read_vocab
    from orchestrator.models.registry import cache_dir
    from stages.model.checkpoint import ModelError
    from stages.model.early_exit import cached_adapters, load_adapter

    rows: tuple[int, ...] = ()
    if rec.vocab:
        try:
            rows = tuple(read_vocab(rec.vocab, ANY_VOCAB).tolist())
        except TreepipeError as e:
            raise ValueError(f"--recovery {rec.name}: "
                             f"{str(e).removeprefix('--draft-vocab: ')}") from None
    adapters: tuple[tuple[int, str], ...] = ()
    if rec.adapter == "auto":
        found = cached_adapters(root or cache_dir() / "drafts", None)
        adapters = tuple(sorted((layer, str(p)) for layer, (_, p) in found.items()))
    elif rec.adapter:
        folder = Path(rec.adapter).expanduser()
        try:
            _, meta = load_adapter(folder)
        except ModelError as e:
            raise ValueError(f"--recovery {rec.name}: {e}") from None
        adapters = ((int(meta["exit_layer"]), str(folder)),)
    return dataclasses.replace(rec, rows=rows, adapters=adapters)


def recovery(text: str) -> Recovery:
    """argparse type: ``--recovery none|draft:K|early-exit:J:K[+options]``, an early exit's
    vocabulary and adapter read here (stages read no files)."""
    try:
        return resolve_exit(parse_recovery(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def recovery_name(text: str) -> str:
    """argparse type: a checked ``--recovery`` spelling, kept as text (for a manifest)."""
    return recovery(text).name


def recovery_list(text: str) -> list[Recovery]:
    """argparse type: a comma list of ``--recovery`` settings."""
    return [recovery(x) for x in text.split(",")]


def int_list(lo: int) -> Callable[[str], list[int]]:
    """argparse type: ``1,2,4`` -> [1, 2, 4], each an integer in [lo, 2^31 - 1], at least
    one (empty entries skipped)."""
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a comma list of "
                                             "integers") from None
        if not vals or min(vals) < lo or max(vals) > INT32_MAX:
            raise argparse.ArgumentTypeError(f"{shown(text)}: give integers in [{lo}, "
                                             f"{INT32_MAX}], e.g. {lo},{lo + 1},{lo + 3}")
        return vals
    parse.__name__ = "int_list"
    return parse


positive_int_list = int_list(1)  # argparse type: integers of 1 or more, e.g. 1,2,4,8


def int_range(text: str) -> tuple[int, int]:
    """argparse type: ``16-48`` -> (16, 48), 1 <= low <= high <= 2^31 - 1."""
    lo, sep, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        low, high = 0, 0
    if not sep or not 1 <= low <= high <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a range LOW-HIGH of "
                                         "integers 1 <= LOW <= HIGH, e.g. 16-48")
    return low, high


def name_list(text: str) -> list[str]:
    """argparse type: ``a,b`` -> ["a", "b"] (at least one name)."""
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more names separated by commas")
    return vals


# what str.splitlines() breaks a line at: an error holding one (a path or a value with a
# newline or a carriage return in it) would no longer be one line
LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(text: str) -> str:
    """``text`` with every line break escaped (``\\n``), so an error stays on one line."""
    return text.translate(LINE_BREAKS)


SECRET_VALUE = re.compile(r"(--api[\w-]*=)\S+")  # a key's value written into a flag


class RefusedSecret(argparse.Action):
    """A hidden ``--api-key``: refused at once, its value never echoed. Without it argparse
    reads ``--api-key SECRET`` as an abbreviation of ``--api-key-file`` and prints the
    secret in the error about a file of that name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error("--api-key would put the secret on the command line, where every user "
                     "of this machine can read it; write it to a file and pass --api-key-file "
                     "FILE, or set $TREEPIPE_API_KEY (or $VLLM_API_KEY for serve)")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of the whole usage block, and
    refuses a secret on the command line where a command takes ``--api-key-file``."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes what it could not match whole: --api=SECRET (an ambiguous
        # abbreviation) would reach the terminal and the logs
        message = SECRET_VALUE.sub(r"\1...", message)
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def add_argument(self, *names: str, **kw: object) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*names, **kw)  # type: ignore[arg-type]
        if "--api-key-file" in names:
            super().add_argument("--api-key", action=RefusedSecret, help=argparse.SUPPRESS)
        return action


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
    p.add_argument("--recovery", type=recovery, default=NO_RECOVERY,
                   metavar="none|draft:K|early-exit:J:K[+OPTION]",
                   help="miss recovery: none (default: a miss flushes the tree); draft:K "
                        "(each node's top-K draft proposals its level left out follow as "
                        "correction children in the width's spare slots; a miss one holds "
                        "re-roots the tree there instead of flushing); early-exit:J:K (the "
                        "candidates are the top-K of an early exit on stage J's output; "
                        "+vocab=FILE[:N] scores only the first N ids of a `treepipe draft "
                        "vocab` file, +draft only the node's draft proposals, "
                        "+adapter=PATH|auto applies a trained exit adapter); docs/engine.md")
    p.add_argument("--dtype", default=DEFAULT_DTYPE,
                   help="auto (default: bfloat16 on a GPU and on a CPU with bf16 units, "
                        "float32 on other CPUs; what measured fastest on each), float32, "
                        "bfloat16, float16, float64")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_execution_flags(p)
    add_quantize_flag(p)
    p.add_argument("--link-latency-us", type=finite(0, 1e9), default=100.0,
                   help="modelled link latency for pipelined time (µs)")
    p.add_argument("--link-gbps", type=finite(0, 1e9, lo_open=True), default=10.0,
                   help="modelled link bandwidth for pipelined time (Gbit/s)")


def add_execution_flags(p: argparse.ArgumentParser, default: str | None = DEFAULT_EXECUTION
                        ) -> None:
    """``--execution`` and its vLLM-style shortcuts ``--eager`` and ``--compile``
    (``default`` None: unset, for a pipeline process, whose config holds the default)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--execution", choices=EXECUTION_MODES, default=default,
                   help="auto (default): compiled on a GPU, tuned on a CPU (what measured "
                        "fastest on each); eager: plain PyTorch, as before measured kernels "
                        "(debugging); tuned: CPU matmul and attention kernels measured fastest "
                        "on this machine; compiled: tuned, each layer a torch.compile graph, each "
                        "step a CUDA graph on a GPU")
    g.add_argument("--eager", "--enforce-eager", dest="execution", action="store_const",
                   const="eager", help="same as --execution eager (--enforce-eager: vLLM's "
                                       "name)")
    g.add_argument("--compile", dest="execution", action="store_const", const="compiled",
                   help="same as --execution compiled")


def add_quantize_flag(p: argparse.ArgumentParser, default: str | None = DEFAULT_QUANTIZE
                      ) -> None:
    """``--quantize none|int8`` (vLLM: ``--quantization``; ``default`` None: unset, for a
    pipeline process, whose config holds the default)."""
    p.add_argument("--quantize", choices=QUANTIZE_MODES, default=default,
                   help="none (default): weights in --dtype; int8: weight-only int8, one "
                        "scale per output row, for every stage's attention and MLP "
                        "projections and the LM head (on a CPU the products run with "
                        "bfloat16 activations; docs/engine.md)")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--pipeline``, ``--redis`` and ``--model``: what every pipeline
    process takes.  The pipeline's own settings default to None (unset): a process fills
    them from its --config file or from the config's defaults
    (orchestrator/cli/pipeline_config.py)."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the pipeline's config (JSON, written by treepipe up and treepipe "
                        "render) instead of --pipeline, --model and the other pipeline "
                        "flags")
    p.add_argument("--pipeline", default=None,
                   help="pipeline name (Redis key namespace); needed without --config")
    p.add_argument("--redis", required=True, help="synchroniser URL, redis://host:port/db")
    p.add_argument("--model", default=None, help="target model name or folder (default "
                   f"{PipelineConfig.model_fields['model'].default})")


# argparse type: a finite number of seconds above 0, at most a month
positive_seconds = Bounded(float, 0.0, MAX_SECONDS, lo_open=True, what=" seconds")
positive_seconds.__name__ = "positive_seconds"


# ---- files a flag names: read and checked while parsing, before any model loads -------

def text_file(path_text: str) -> str:
    """The UTF-8 text of the file ``path_text``, or an ArgumentTypeError saying why not
    (missing, a directory, unreadable, not UTF-8)."""
    name = shown(path_text, 300)
    try:
        data = expanded(path_text).read_bytes()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {name}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name} is not UTF-8 text (byte "
                                         f"{data[e.start]:#04x} at offset {e.start})") from None


def manifest_file(text: str) -> str:
    """argparse type: a TreePipeline manifest, read and schema-checked (not planned)."""
    from orchestrator.deploy.manifest import load_manifest
    from protocol.errors import TreepipeError

    try:
        load_manifest(text)
    except TreepipeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
