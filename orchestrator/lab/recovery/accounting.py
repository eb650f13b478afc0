"""Miss recovery projected on a replay: which misses an early exit catches, what it saves.

Timing (SpecPipe, m stages, one stage a step).  A node n entering stage 1 at step s0
leaves stage j at the end of step s0 + j - 1 and is verified (its children's level is
decided) at step s0 + m - 1.  Its exit's top-kappa tokens reach the scheduler then, and
the corrections enter stage 1 ``lag`` steps after the next one: at step s0 + j + lag
(``lag`` = 0 when the token channel makes the next barrier, 1 as the issue assumes).
Each correction is extended by the draft one node a step (a branch-complete chain, as in
Mirror-SD) until n is verified, so a correction chain holds m - j - lag nodes.

* a **hit** costs the steps to the next verification the replay measured (1, or more
  after an empty level);
* a **flush** (no correction carries the token) costs the replay's gap, about m;
* a **re-root** (a correction under n carries the token) costs j + lag: the correction
  is m - j - lag steps behind a normal child.  Its chain holds the next m - j - lag - 1
  levels, each one node: they hit when the source's own best proposal for their parent
  is the target's token (the replay records that for every verification), then normal
  growth resumes.

Nodes.  Corrections are issued for every live node whose level has passed stage j (we
cannot know which will miss), c of them per node: c = kappa less the exit's tokens that
are already issued children, estimated on the verified path.  A step holds
c * (live nodes of stages j + lag + 1 .. m) correction nodes.  Budgets:

* ``free``: no limit (the upper bound of the gain);
* ``spare``: the same cap of w nodes a step as without recovery: corrections fill only
  the slots the normal level left empty, the root's side first (stage m, then m - 1, ...);
  within a stage the verified path's node is served last (pessimistic).  A re-root needs
  every node of its chain served.

Approximations (stated in docs/bench/recovery.md): levels that are not chain levels keep
the replay's outcome at the same verified token; occupancy and spare slots around a miss
are the replay's around the same verification; a changed outcome costs the replay's mean
gap of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.lab.recovery.replay import Replay


@dataclass
class Trace:
    """One prompt's replay and, per exit stage j, the exit's top tokens at each verified
    token's parent: ``exits[j][v]`` lists the best tokens (best first) for verification v."""

    replay: Replay
    exits: dict[int, list[list[int]]] = field(default_factory=dict)


@dataclass
class Projection:
    """Totals of one recovery setting over one or more traces."""

    steps: float = 0.0
    steps_base: int = 0
    verified: int = 0
    misses_base: int = 0
    miss_steps_base: int = 0  # summed gaps after the baseline's misses (not the last one)
    misses_base_counted: int = 0
    misses: int = 0
    caught: int = 0
    caught_free: int = 0  # caught had there been no node limit
    miss_steps: float = 0.0  # summed gaps after misses with recovery
    misses_counted: int = 0
    exit_hits: int = 0  # baseline misses whose token is in the exit's top-kappa
    demand: float = 0.0  # correction nodes wanted, summed over steps
    served: float = 0.0  # correction nodes that fitted the budget, summed over steps
    entering: int = 0  # normal nodes entering stage 1, summed over steps
    new_per_node: float = 0.0  # c: summed over verifications
    new_counted: int = 0

    def add(self, o: Projection) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(o, name))

    @property
    def steps_per_token(self) -> float:
        return self.steps / max(1, self.verified)

    @property
    def steps_per_token_base(self) -> float:
        return self.steps_base / max(1, self.verified)

    @property
    def cut(self) -> float:
        """Relative cut in steps per token (0.25 is the issue's goal)."""
        return 1 - self.steps / max(1, self.steps_base)

    @property
    def caught_share(self) -> float:
        """Share of the misses (with recovery) that a correction caught."""
        return self.caught / max(1, self.misses)

    @property
    def exit_share(self) -> float:
        """Share of the baseline's misses whose token the exit's top-kappa holds."""
        return self.exit_hits / max(1, self.misses_base)

    @property
    def steps_per_miss_base(self) -> float:
        return self.miss_steps_base / max(1, self.misses_base_counted)

    @property
    def steps_per_miss(self) -> float:
        return self.miss_steps / max(1, self.misses_counted)


def exit_stage_useful(stages: int, j: int, lag: int) -> bool:
    """A correction from stage j can overtake a refill only if it enters stage 1 before
    the miss is known: j + lag < m."""
    return 1 <= j < stages and j + lag < stages


def corrections_per_node(trace: Trace, j: int, kappa: int) -> tuple[float, int]:
    """Summed new corrections (exit top-kappa less the issued children) on the verified
    path, and how many nodes were counted."""
    total, n = 0, 0
    for v, ver in enumerate(trace.replay.verifications):
        top = trace.exits[j][v][:kappa]
        total += len(set(top) - set(ver.children))
        n += 1
    return float(total), n


def project(trace: Trace, j: int, kappa: int, lag: int = 1, budget: str = "spare",
            cap: int | None = None) -> Projection:
    """Steps with early-exit recovery from stage j at top-``kappa`` against the replay.

    ``cap``: nodes a step may enter stage 1 with (default the replay's width); a replay
    at a narrower width than the cap leaves slots for corrections.
    """
    if budget not in ("free", "spare"):
        raise ValueError(f"budget is free or spare, not {budget!r}")
    rp = trace.replay
    m, w = rp.stages, cap if cap is not None else rp.width
    vers = rp.verifications
    out = Projection(steps_base=rp.steps, verified=len(vers))
    if not vers:
        return out
    gaps = [b.step - a.step for a, b in zip(vers, vers[1:], strict=False)] + [0]
    hit_gaps = [g for v, g in zip(vers[:-1], gaps, strict=False) if v.hit]
    miss_gaps = [g for v, g in zip(vers[:-1], gaps, strict=False) if not v.hit]
    mean_hit = sum(hit_gaps) / len(hit_gaps) if hit_gaps else 1.0
    mean_miss = sum(miss_gaps) / len(miss_gaps) if miss_gaps else float(m)
    out.misses_base = sum(not v.hit for v in vers)
    out.miss_steps_base = sum(miss_gaps)
    out.misses_base_counted = len(miss_gaps)
    useful = exit_stage_useful(m, j, lag)
    new, counted = corrections_per_node(trace, j, kappa) if useful else (0.0, 0)
    out.new_per_node, out.new_counted = new, counted
    c = new / counted if counted else 0.0
    first_stage = j + lag + 1  # parents on stages first_stage .. m have chains growing

    def wanted(t: int, from_stage: int) -> float:
        held = rp.held[t - 1]
        return c * sum(held[s - 1] for s in range(from_stage, m + 1))

    def spare(t: int) -> int:
        return max(0, w - rp.entering[t - 1])

    out.entering = sum(rp.entering)
    if useful:
        for t in range(1, rp.steps + 1):
            d = wanted(t, first_stage)
            out.demand += d
            out.served += d if budget == "free" else min(d, spare(t))

    def fits(v: int) -> bool:
        t_d = vers[v].step
        n_chain = m - j - lag
        for a in range(n_chain):
            t = t_d - n_chain + 1 + a
            stage = first_stage + a
            if t < 1:
                return False
            need = c * sum(max(1, rp.held[t - 1][s - 1]) if s == stage else rp.held[t - 1][s - 1]
                           for s in range(stage, m + 1))
            if need > spare(t):
                return False
        return True

    steps = float(vers[0].step)
    chain_left = 0
    for v, ver in enumerate(vers):
        last = v == len(vers) - 1
        changed = False
        hit = ver.hit
        if chain_left > 0:
            hit = ver.top1
            chain_left -= 1
            changed = hit != ver.hit
        if not ver.hit:
            out.exit_hits += useful and _holds(trace, j, v, kappa)
        if hit:
            gap = mean_hit if changed else gaps[v]
        else:
            out.misses += 1
            holds = useful and _holds(trace, j, v, kappa)
            out.caught_free += holds
            if holds and (budget == "free" or fits(v)):
                out.caught += 1
                gap = float(j + lag)
                chain_left = m - j - lag - 1
            else:
                gap = mean_miss if changed else gaps[v]
                chain_left = 0
            if not last:
                out.miss_steps += gap
                out.misses_counted += 1
        if not last:
            steps += gap
    out.steps = steps
    return out


def _holds(trace: Trace, j: int, v: int, kappa: int) -> bool:
    """The exit's top-kappa at the parent of verification v holds the target's token."""
    ver = trace.replay.verifications[v]
    return ver.token in trace.exits[j][v][:kappa]


__all__ = ["Trace", "Projection", "project", "exit_stage_useful", "corrections_per_node"]
