"""``treepipe draft eval``: how well a token source predicts the target, without the target.

Ground truth is the target's own greedy continuation of each held-out prompt
(computed once with the engine's ``ar`` method and cached).  Two measures:

* **top-k hit ratio** (SpecPipe Fig. 7): the share of continuation tokens that are
  in the source's top-k proposals for the verified prefix, for each k;
* **level hit rate** P(w) (SpecPipe Eq. 2): the share of verification steps whose
  tree level holds the target's token, when the source grows a fixed-width tree
  (w nodes by cumulative probability from top-k children, ``fixed_width_level``)
  through an m-stage SpecPipe schedule.  :func:`simulate_specpipe` replays the
  engine's schedule step for step with the target replaced by the known tokens,
  so it equals the ``hit rate`` that ``treepipe bench`` measures for greedy
  decoding (a test checks this), at the cost of the draft alone.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from orchestrator.lab.benchmarks.prompts import load_prompts
from orchestrator.models.loading import EngineSpec, check_device, make_source
from orchestrator.models.registry import cache_dir, resolve_model
from protocol.config.recovery import NO_RECOVERY, Recovery
from protocol.errors import TreepipeError
from stages.model.checkpoint import load_model_args, load_shard
from stages.model.early_exit import AdaptedNorm
from stages.model.model import ModelArgs, StageShard
from stages.model.sampling import SamplingParams
from stages.model.tokenizer import TextTokenizer
from stages.speculation.engine import PipelineEngine
from stages.speculation.loop import Checked, Flight, Lane, TreeLane, pipeline_step
from stages.speculation.step import TreeOwner, Verdict
from stages.speculation.token_sources import DraftModelSource, HybridSource, TokenSource

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64)


# ---- measures ---------------------------------------------------------------------------------


def topk_hits(source: TokenSource, prompt: list[int], truth: list[int],
              ks: tuple[int, ...] = DEFAULT_KS) -> tuple[dict[int, int], int]:
    """Count, per k, the continuation tokens found in the source's top-k (verified prefix).

    Walks the truth one token at a time through the source's own tree interface
    (root = last verified token, expand, then prune to the next one), exactly as
    the engine feeds it; ``truth[0]`` comes from the prompt's prefill, so tokens
    ``truth[1:]`` are scored.  Returns (hits per k, tokens scored).
    """
    kmax = max(ks)
    source.reset(list(prompt))
    owner = TreeOwner(source, 1, kmax, list(prompt))
    owner.start(truth[0])
    hits = dict.fromkeys(ks, 0)
    for token in truth[1:]:
        assert owner.tree is not None
        root = owner.tree.root_id
        owner.propose(torch.zeros(1, dtype=torch.long))
        ranked = owner.proposals[root][0].tolist()
        rank = ranked.index(token) if token in ranked else None
        for k in ks:
            hits[k] += rank is not None and rank < k
        owner.apply(Verdict(token))  # the tree never grows here: each token is a new root
    return hits, len(truth) - 1


@dataclass
class LevelStats:
    """Outcome of one simulated SpecPipe run."""

    hits: int = 0
    verified: int = 0
    steps: int = 0
    recovered: int = 0  # hits on a correction child (re-roots), with recovery
    # per verification: -1 for a miss, else how many levels stay in flight behind the
    # new root (the tree's height after pruning): the simulator's Outcome of that step
    kept: list[int] = field(default_factory=list)
    # the source's time growing levels (expand + proposal bookkeeping), and their sizes
    draft_s: float = 0.0
    levels: int = 0
    level_nodes: int = 0

    def add(self, other: LevelStats) -> None:
        self.hits += other.hits
        self.recovered += other.recovered
        self.verified += other.verified
        self.steps += other.steps
        self.kept += other.kept
        self.draft_s += other.draft_s
        self.levels += other.levels
        self.level_nodes += other.level_nodes


def simulate_specpipe(source: TokenSource, prompt: list[int], truth: list[int], stages: int,
                      width: int, topk: int, recovery: Recovery = NO_RECOVERY) -> LevelStats:
    """Replay the engine's SpecPipe schedule with the target's tokens ``truth`` as verdicts.

    Stage s holds the level that entered s steps ago; the source expands the level
    entering stage 1; the last stage verifies the root against ``truth``.  Hits,
    verifications and steps match ``PipelineEngine.generate(..., 'specpipe')`` for
    greedy decoding, since the target's choices there are exactly ``truth``.  The
    schedule is the engine's own loop (:mod:`stages.speculation.loop`) with the
    stages' compute replaced by :class:`TruthReplay`.  ``recovery``: the tree owner's
    ``draft:K`` correction children (:class:`~stages.speculation.step.TreeOwner`).
    """
    st = LevelStats()
    source.reset(list(prompt))
    owner = TreeOwner(source, width, topk, list(prompt), recovery=recovery, stages=stages)
    owner.start(truth[0])
    lane = TreeLane(owner, stages)
    replay = TruthReplay(lane, truth, st)
    while replay.done < len(truth):
        st.steps += 1
        if pipeline_step([lane], replay, stages):
            break
    return st


class TruthReplay:
    """The schedule loop's compute for a replay: a stage passes its nodes on unchanged
    (the target is not run) and verification finds the target's known next token."""

    def __init__(self, lane: TreeLane, truth: list[int], stats: LevelStats):
        self.lane, self.truth, self.stats = lane, truth, stats
        self.done = 1  # truth[0] came from the prompt's prefill

    def forward(self, i: int, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[Flight]:
        """No target compute: the nodes themselves move on."""
        return [f for _, f in work]

    def propose(self, work: Sequence[tuple[Lane[Flight, int], Flight]]) -> None:
        """The source expands the level entering stage 1 (timed: the draft's cost)."""
        for _, f in work:
            t0 = time.perf_counter()
            self.lane.owner.propose(self.lane.index(f))
            self.stats.draft_s += time.perf_counter() - t0
            self.stats.levels += 1
            self.stats.level_nodes += int(f.ids.numel())

    def verify(self, roots: Sequence[tuple[Lane[Flight, int], Flight]]) -> list[int]:
        """The target's next token, from the truth."""
        return [self.truth[self.done] for _ in roots]

    def settle(self, lane: Lane[Flight, int], checked: Checked, found: int) -> bool:
        """Count the verdict; True once the whole truth is verified."""
        st, tree = self.stats, self.lane.owner.tree
        assert tree is not None
        st.verified += 1
        st.hits += checked.hit
        st.recovered += checked.late > 0
        st.kept.append(tree.height if checked.hit else -1)
        self.done += 1
        return self.done == len(self.truth)

    def going(self, lanes: Sequence[Lane[Flight, int]]) -> None:
        """A fixed width: nothing to choose."""

    def sent(self, lane: Lane[Flight, int], i: int, f: Flight) -> None:
        """Nothing crosses a link in a replay."""


# ---- compute accounting -------------------------------------------------------------------------


def layer_macs(args: ModelArgs) -> int:
    """Multiply-accumulates of one decoder layer per token (projections; attention scores
    grow with context and are left out, as they are for the target)."""
    hd = args.head_dim
    attn = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    return attn + 3 * args.dim * args.intermediate_size


def shard_macs(shard: StageShard) -> dict[str, int]:
    """Per-token MACs of a whole-model shard: body (layers [+ adapter]) and LM head."""
    args = shard.args
    body = layer_macs(args) * shard.n_local_layers
    if isinstance(shard.norm, AdaptedNorm):
        ad = shard.norm.adapter
        body += 2 * ad.down.in_features * ad.down.out_features
    head = args.dim * args.vocab_size if shard.lm_head is not None else 0
    return {"body": body, "head": head}


def source_flops(source: TokenSource | None, target: ModelArgs) -> dict[str, Any]:
    """FLOPs per token of the source relative to the target, with and without the LM head."""
    t_body = layer_macs(target) * target.n_layers
    t_head = target.dim * target.vocab_size
    draft = source.draft if isinstance(source, HybridSource) else source
    if isinstance(draft, DraftModelSource):
        d = shard_macs(draft.shard)
        if draft.head is not None:  # reduced head: K rows instead of V
            d["head"] = draft.shard.args.dim * draft.head.size
    else:
        d = {"body": 0, "head": 0}  # n-gram lookup: no model compute
    return {
        "draft_body_mflops": 2 * d["body"] / 1e6, "draft_head_mflops": 2 * d["head"] / 1e6,
        "target_body_mflops": 2 * t_body / 1e6, "target_head_mflops": 2 * t_head / 1e6,
        "ratio_body": d["body"] / t_body,
        "ratio_with_head": (d["body"] + d["head"]) / (t_body + t_head),
    }


# ---- ground truth --------------------------------------------------------------------------------


def read_continuations(cache: Path) -> dict[str, Any]:
    """What ``cache`` holds ({} when it does not exist yet), checked before the target
    runs; one line naming the file and the fix for anything else."""
    fix = "delete it (the next run rebuilds it) or pass another --cache"
    if not cache.exists():
        return {}
    try:
        stored = json.loads(cache.read_text(encoding="utf-8"))
    except OSError as e:
        raise TreepipeError(f"cannot read the continuation cache {cache} ({e.strerror}); "
                            "pass another --cache") from None
    except ValueError as e:  # not UTF-8, or not JSON (a run cut short while writing it)
        raise TreepipeError(f"the continuation cache {cache} is not JSON ({e}); {fix}") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("continuations"), list):
        raise TreepipeError(f"{cache} is not a continuation cache (no \"continuations\" "
                            f"list); {fix}")
    return stored


def target_continuations(folder: Path, prompts: list[list[int]], max_new: int, device: str,
                         cache: Path | None, progress: bool = True) -> list[list[int]]:
    """The target's greedy continuation of each prompt (EOS ignored), cached in ``cache``."""

    key = hashlib.sha256(json.dumps([str(folder.resolve()), max_new, prompts]).encode())
    stored = read_continuations(cache) if cache is not None else {}
    if stored.get("key") == key.hexdigest():
        return stored["continuations"]
    args = load_model_args(folder)
    engine = PipelineEngine([load_shard(folder, 0, args.n_layers, torch.float32, device)])
    outs = []
    for p in tqdm(prompts, desc="target greedy", unit="prompt", file=sys.stderr,
                  dynamic_ncols=True, disable=not progress):
        outs.append(engine.generate(p, max_new, SamplingParams(), "ar").tokens)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key.hexdigest(), "continuations": outs}) + "\n",
                         encoding="utf-8")
    return outs


# ---- command ----------------------------------------------------------------------------


def evaluate(source: TokenSource, prompts: list[list[int]], truths: list[list[int]],
             ks: tuple[int, ...], shapes: list[tuple[int, int]], stages: int,
             progress: bool = True, recoveries: tuple[Recovery, ...] = (NO_RECOVERY,)
             ) -> dict[str, Any]:
    """Top-k hit ratios and level hit rates of ``source`` over the prompts, for each tree
    shape (w, k) and each ``--recovery`` K (0: none)."""
    hits = dict.fromkeys(ks, 0)
    scored = 0
    level = {(w, k, r): LevelStats() for w, k in shapes for r in recoveries}
    with tqdm(total=len(prompts) * (1 + len(level)), desc="draft eval", unit="run",
              file=sys.stderr, dynamic_ncols=True, disable=not progress) as bar:
        for p, t in zip(prompts, truths, strict=True):
            h, n = topk_hits(source, p, t, ks)
            scored += n
            for k in ks:
                hits[k] += h[k]
            bar.update()
            for w, k, r in level:
                level[(w, k, r)].add(simulate_specpipe(source, p, t, stages, w, k, r))
                bar.update()
    rows = []
    for (w, k, r), st in level.items():
        # the level held the token on time (a re-root is a hit on a late correction)
        p_hit = (st.hits - st.recovered) / st.verified if st.verified else 0.0
        rows.append({"width": w, "topk": k, "stages": stages, "recovery": r.name,
                     "level_hit_rate": p_hit, "re_roots": st.recovered,
                     "misses": st.verified - st.hits,
                     "steps_per_token": st.steps / max(1, st.verified),
                     "eq2_steps_per_token": 1 + (1 - p_hit) * (stages - 1),
                     "draft_ms_per_level": 1e3 * st.draft_s / max(1, st.levels),
                     "nodes_per_level": st.level_nodes / max(1, st.levels)})
    return {"tokens": scored,
            "topk_hit": {str(k): hits[k] / scored if scored else 0.0 for k in ks},
            "level_hit_rate": rows[0]["level_hit_rate"] if rows else None,
            "level": rows}


def _print_side_by_side(full: dict[str, Any], red: dict[str, Any], label: str,
                        vocab_size: int) -> None:
    """The full head's and the reduced head's figures in one table."""
    print(f"| measure | full head (V={vocab_size}) | reduced head {label} |")
    print("| --- | --- | --- |")
    for k, v in full["topk_hit"].items():
        print(f"| top-{k} hit ratio | {v:.3f} | {red['topk_hit'][k]:.3f} |")
    for rf, rr in zip(full["level"], red["level"], strict=True):
        shape = f"w={rf['width']}, k={rf['topk']}, m={rf['stages']}"
        print(f"| level hit rate P({shape}) | {rf['level_hit_rate']:.3f} | "
              f"{rr['level_hit_rate']:.3f} |")
        print(f"| draft ms per level ({shape}; {rf['nodes_per_level']:.1f} nodes) | "
              f"{rf['draft_ms_per_level']:.2f} | {rr['draft_ms_per_level']:.2f} |")
    print(f"| draft LM head MFLOPs per token | {full['flops']['draft_head_mflops']:.1f} | "
          f"{red['flops']['draft_head_mflops']:.1f} |")


@dataclass(frozen=True)
class DraftEvalOptions:
    """``treepipe draft eval``'s options, one field per flag."""

    target: str
    draft: str
    draft_model: str
    draft_vocab: str
    prompts: str
    chat: bool
    max_new_tokens: int
    width: list[int]
    topk: list[int]
    stages: int
    recovery: list[Recovery]
    ks: list[int]
    device: str
    threads: int | None
    cache: Path | None
    json: bool


def evaluate_draft(o: DraftEvalOptions) -> int:
    """``treepipe draft eval``."""

    device = check_device(o.device)
    if any(r.exit_stage for r in o.recovery):
        raise TreepipeError("--recovery early-exit needs the target's hidden states, which a "
                            "replay does not compute; measure it with treepipe bench "
                            "--recovery early-exit:J:K")
    if o.threads:
        torch.set_num_threads(o.threads)
    folder = resolve_model(o.target)
    targs = load_model_args(folder)
    tok = TextTokenizer.from_folder(folder)
    prompts = load_prompts(o.prompts)
    ids = [p.ids(tok, o.chat) for p in prompts]
    progress = not o.json
    spec = EngineSpec(model=o.target, draft=o.draft, draft_model=o.draft_model, device=device,
                      draft_vocab=o.draft_vocab)
    source = make_source(spec, folder, torch.float32)
    if source is None:
        raise TreepipeError("--draft none has nothing to evaluate; name a token source")
    draft = source.draft if isinstance(source, HybridSource) else source
    reduced = draft.head if isinstance(draft, DraftModelSource) else None
    name = hashlib.sha256(json.dumps([o.prompts, o.chat]).encode()).hexdigest()[:16]
    cache = o.cache or cache_dir() / "draft_eval" / f"{folder.name}-{name}-{o.max_new_tokens}.json"
    truths = target_continuations(folder, ids, o.max_new_tokens, device, cache, progress)
    shapes = [(w, k) for w in o.width for k in o.topk]
    if reduced is not None:  # the full head first, then the reduced one: same prompts
        assert isinstance(draft, DraftModelSource)
        draft.head = None
        full = evaluate(source, ids, truths, tuple(o.ks), shapes, o.stages, progress,
                       tuple(o.recovery))
        full["flops"] = source_flops(source, targs)
        draft.head = reduced
    res = evaluate(source, ids, truths, tuple(o.ks), shapes, o.stages, progress,
                       tuple(o.recovery))
    report = {"target": o.target, "draft": o.draft, "prompts": o.prompts,
              "n_prompts": len(ids), "max_new_tokens": o.max_new_tokens, **res,
              "flops": source_flops(source, targs)}
    if reduced is not None:
        report.update(draft_vocab=o.draft_vocab, draft_vocab_size=reduced.size, full_head=full)
    if o.json:
        print(json.dumps(report))
        return 0
    print(f"draft {o.draft} vs target {o.target}: {len(ids)} prompts ({o.prompts}), "
          f"{res['tokens']} scored tokens")
    if reduced is not None:
        _print_side_by_side(full, report, f"K={reduced.size} ({o.draft_vocab})",
                            targs.vocab_size)
        return 0
    print("top-k hit ratio: " + ", ".join(f"k={k}: {v:.3f}" for k, v in res["topk_hit"].items()))
    for r in res["level"]:
        rec = "" if r["recovery"] == "none" else \
            f", recovery {r['recovery']}: {r['re_roots']} re-roots, {r['misses']} flushes"
        print(f"level hit rate P(w={r['width']}, k={r['topk']}, m={r['stages']}) = "
              f"{r['level_hit_rate']:.3f}  ({r['steps_per_token']:.2f} steps/token, draft "
              f"{r['draft_ms_per_level']:.2f} ms/level{rec})")
    fl = report["flops"]
    print(f"compute per token: {fl['ratio_body']:.3f} of the target's body, "
          f"{fl['ratio_with_head']:.3f} counting both LM heads")
    return 0


__all__ = ["topk_hits", "simulate_specpipe", "evaluate", "DraftEvalOptions", "evaluate_draft",
           "source_flops", "target_continuations", "LevelStats"]
