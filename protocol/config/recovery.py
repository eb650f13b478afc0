"""``--recovery``: how the tree owner recovers a miss in flight (docs/engine.md, "Miss
recovery").

* ``none``: a miss flushes the tree and the pipeline refills (SpecPipe).
* ``draft:K``: speculative speculative decoding's pre-speculation.  Each live node's top-K
  draft proposals that its own level left out may follow later as *correction children*,
  in the slots the step's on-time level leaves; a miss whose token a correction carries
  re-roots the tree there instead of flushing it.
* ``early-exit:J:K``: Mirror-SD's token channel.  When stage J has computed a node, an
  early exit (the final norm and the LM head on stage J's output) proposes its top-K next
  tokens, which become its correction candidates.  Options after ``+`` choose the exit's
  head (docs/bench/recovery-heads.md); they only change which candidates are offered, so
  every one is lossless:

  * ``+vocab=FILE[:N]``: the LM head's rows for the first N ids of a ``treepipe draft
    vocab`` file (the ``--draft-vocab`` format) instead of all of them;
  * ``+draft``: score only the node's own draft proposals (no vocabulary-wide head);
  * ``+adapter=PATH``: a trained exit adapter (``treepipe draft distill --early-exit L``,
    L = stage J's last layer) before the norm; ``+adapter=auto``: the newest cached one
    for that layer, else the plain exit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECOVERY_CHOICES = "none, draft:K or early-exit:J:K[+vocab=FILE[:N]|+draft][+adapter=PATH|auto]"
MAX_RECOVERY_K = 1024  # correction candidates per node, at most
EXIT_OPTIONS = ("vocab", "draft", "adapter")


@dataclass(frozen=True)
class Recovery:
    """A parsed ``--recovery``: K candidates per node (0: none), from the draft's ranking
    or, with ``exit_stage`` J >= 1, from stage J's early exit, whose head is the full LM
    head, the rows of ``vocab`` (FILE[:N]) or the node's draft proposals (``draft_only``),
    after the exit adapter ``adapter`` (a folder, ``auto`` or none).

    ``rows`` and ``adapters`` are what the orchestrator resolved those names to (the
    vocabulary's ids; the adapter folders by exit layer): stages read no vocabulary
    files and no cache, and the setting compares and renders by its names only."""

    k: int = 0
    exit_stage: int = 0
    vocab: str = ""
    draft_only: bool = False
    adapter: str = ""
    rows: tuple[int, ...] = field(default=(), compare=False, repr=False)
    adapters: tuple[tuple[int, str], ...] = field(default=(), compare=False, repr=False)

    @property
    def name(self) -> str:
        """The ``--recovery`` spelling."""
        if not self.k:
            return "none"
        if not self.exit_stage:
            return f"draft:{self.k}"
        opts = ([f"+vocab={self.vocab}"] if self.vocab else []) + \
            (["+draft"] if self.draft_only else []) + \
            ([f"+adapter={self.adapter}"] if self.adapter else [])
        return f"early-exit:{self.exit_stage}:{self.k}" + "".join(opts)

    @property
    def head(self) -> str:
        """The exit's head in words: ``full``, ``vocab=FILE[:N]`` or ``draft``."""
        return f"vocab={self.vocab}" if self.vocab else "draft" if self.draft_only else "full"

    def check_stages(self, stages: int, what: str = "--recovery") -> None:
        """ValueError naming the fix when the exit stage cannot save a step at ``stages``
        (``what``: where the setting was given, for the message)."""
        if self.exit_stage and not 1 <= self.exit_stage < stages:
            raise ValueError(f"{what} {self.name}: the exit stage must be 1..{stages - 1} "
                             f"with {stages} stages (a later exit saves no step)")


NO_RECOVERY = Recovery()


def _exit_options(text: str, opts: list[str]) -> dict[str, str | bool]:
    """``vocab=FILE[:N]``, ``draft``, ``adapter=PATH|auto`` -> Recovery fields; ValueError."""
    out: dict[str, str | bool] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in EXIT_OPTIONS or (key == "draft") == bool(eq) or (eq and not value):
            raise ValueError(f"recovery {text!r}: exit option {opt!r} is not vocab=FILE[:N], "
                             "draft or adapter=PATH|auto")
        field_name = {"vocab": "vocab", "draft": "draft_only", "adapter": "adapter"}[key]
        if field_name in out:
            raise ValueError(f"recovery {text!r}: exit option {key} given twice")
        out[field_name] = value if eq else True
    if "vocab" in out and "draft_only" in out:
        raise ValueError(f"recovery {text!r}: vocab= and draft are two heads; pick one")
    vocab = str(out.get("vocab", ""))
    n = vocab.rpartition(":")[2] if ":" in vocab else ""
    if n.lstrip("+-").isdigit() and int(n) < 1:
        raise ValueError(f"recovery {text!r}: vocab=FILE:N needs N >= 1, got {n}")
    return out


def parse_recovery(text: str) -> Recovery:
    """``none``, ``draft:K`` or ``early-exit:J:K`` with its exit options ->
    :class:`Recovery`; ValueError naming the fix."""
    base, *opts = text.strip().split("+")
    parts = base.split(":")
    nums = [int(x) for x in parts[1:] if x.isdigit()]
    if parts == ["none"] and not opts:
        return NO_RECOVERY
    ok = len(nums) == len(parts) - 1 and all(n >= 1 for n in nums) and \
        (parts[0], len(nums)) in (("draft", 1), ("early-exit", 2)) and \
        nums[-1] <= MAX_RECOVERY_K
    if not ok:
        raise ValueError(f"recovery {text!r} is not {RECOVERY_CHOICES} (J, K >= 1, K <= "
                         f"{MAX_RECOVERY_K}), e.g. --recovery draft:16")
    if opts and parts[0] != "early-exit":
        raise ValueError(f"recovery {text!r}: +options choose an early exit's head; "
                         "draft:K has none")
    return Recovery(nums[-1], nums[0] if len(nums) == 2 else 0,
                    **_exit_options(text, opts))  # type: ignore[arg-type]
