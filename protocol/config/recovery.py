"""``--recovery``: how the tree owner recovers a miss in flight (docs/engine.md, "Miss
recovery").

* ``none``: a miss flushes the tree and the pipeline refills (SpecPipe).
* ``draft:K``: speculative speculative decoding's pre-speculation.  Each live node's top-K
  draft proposals that its own level left out may follow later as *correction children*,
  in the slots the step's on-time level leaves; a miss whose token a correction carries
  re-roots the tree there instead of flushing it.
* ``early-exit:J:K``: Mirror-SD's token channel.  When stage J has computed a node, an
  early exit (the final norm and the LM head on stage J's output) proposes its top-K next
  tokens, which become its correction candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOVERY_CHOICES = "none, draft:K or early-exit:J:K"
MAX_RECOVERY_K = 1024  # correction candidates per node, at most


@dataclass(frozen=True)
class Recovery:
    """A parsed ``--recovery``: K candidates per node (0: none), from the draft's ranking
    or, with ``exit_stage`` J >= 1, from stage J's early exit."""

    k: int = 0
    exit_stage: int = 0

    @property
    def name(self) -> str:
        """The ``--recovery`` spelling."""
        if not self.k:
            return "none"
        return f"early-exit:{self.exit_stage}:{self.k}" if self.exit_stage else f"draft:{self.k}"

    def check_stages(self, stages: int) -> None:
        """ValueError naming the fix when the exit stage cannot save a step at ``stages``."""
        if self.exit_stage and not 1 <= self.exit_stage < stages:
            raise ValueError(f"--recovery {self.name}: the exit stage must be 1..{stages - 1} "
                             f"with {stages} stages (a later exit saves no step)")


NO_RECOVERY = Recovery()


def parse_recovery(text: str) -> Recovery:
    """``none``, ``draft:K`` or ``early-exit:J:K`` -> :class:`Recovery`; ValueError naming
    the fix."""
    parts = text.strip().split(":")
    nums = [int(x) for x in parts[1:] if x.isdigit()]
    if parts == ["none"]:
        return NO_RECOVERY
    ok = len(nums) == len(parts) - 1 and all(n >= 1 for n in nums) and \
        (parts[0], len(nums)) in (("draft", 1), ("early-exit", 2)) and \
        nums[-1] <= MAX_RECOVERY_K
    if not ok:
        raise ValueError(f"recovery {text!r} is not {RECOVERY_CHOICES} (J, K >= 1, K <= "
                         f"{MAX_RECOVERY_K}), e.g. --recovery draft:16")
    return Recovery(nums[-1], nums[0] if len(nums) == 2 else 0)
