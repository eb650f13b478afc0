"""Miss-recovery measurement: the observed replay, the exits' states, the accounting by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orchestrator.lab.drafting.draft_eval import simulate_specpipe
from orchestrator.lab.recovery.accounting import Trace, exit_stage_useful, project
from orchestrator.lab.recovery.replay import (
    Replay,
    Verification,
    observed_replay,
    replay_from_json,
    replay_to_json,
)
from protocol.config.recovery import Recovery, parse_recovery
from stages.model.early_exit import boundary_states, exit_logits
from stages.model.sampling import SamplingParams
from stages.speculation.engine import ConfigError, PipelineEngine
from stages.speculation.token_sources import DraftModelSource, HybridSource, NgramSource
from tests.tiny_models import PROMPT, TARGET, other_draft, target_shards, target_whole

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("m", [2, 3])
def test_observed_replay_is_simulate_specpipe(m):
    truth = PipelineEngine([target_whole()]).generate(PROMPT, 20, SamplingParams(), "ar").tokens
    for src in (NgramSource(), HybridSource(DraftModelSource(other_draft()))):
        st = simulate_specpipe(src, PROMPT, truth, m, 4, 4)
        rp = observed_replay(src, PROMPT, truth, m, 4, 4)
        assert (rp.hits, len(rp.verifications), rp.steps) == (st.hits, st.verified, st.steps)
        assert [v.index for v in rp.verifications] == list(range(1, len(truth)))
        assert len(rp.held) == len(rp.entering) == rp.steps
        assert all(h[-1] <= 1 for h in rp.held)  # the last stage holds the root alone
        back = replay_from_json(replay_to_json(rp))
        assert back == rp


def test_boundary_states_are_the_stages_outputs():
    whole = target_whole()
    states = boundary_states(whole, PROMPT, [1, 2, 3, 4])
    shards = target_shards(TARGET.n_layers)  # one layer per shard
    x = torch.tensor(PROMPT)
    pos = torch.arange(len(PROMPT))
    for layer, shard in enumerate(shards, start=1):
        x = shard(x, pos, shard.new_cache(len(PROMPT) + 4))
        assert torch.allclose(states[layer], x, atol=1e-9)
    final = exit_logits(whole, states[TARGET.n_layers], TARGET.n_layers)
    assert torch.allclose(final, whole.logits(x), atol=1e-9)
    mid = exit_logits(whole, states[2], 2)
    assert mid.shape == final.shape and not torch.allclose(mid, final)


def hand_replay(top1_v3: bool = True) -> Trace:
    """m = 4, w = 4: hit, miss (flush: 4 steps), hit, hit, hit; 11 steps, 5 tokens."""
    vs = [Verification(1, 101, 4, True, True, [101]),
          Verification(2, 102, 5, False, False, [55]),
          Verification(3, 103, 9, True, True, [103]),
          Verification(4, 104, 10, True, top1_v3, [104]),
          Verification(5, 105, 11, True, True, [105])]
    rp = Replay(4, 4, 11, [1] * 11, [[1, 1, 1, 1]] * 11, vs)
    # exit stage 1's top tokens at each parent: the missed token 102 is its second choice
    exits = {j: [[7, 8], [9, 102], [7, 8], [7, 8], [7, 8]] for j in (1, 2, 3)}
    return Trace(rp, exits)


def test_accounting_by_hand():
    tr = hand_replay()
    base = project(tr, 1, 1, lag=1, budget="free")  # top-1 misses 102: nothing caught
    assert (base.steps, base.steps_base, base.verified, base.caught) == (11, 11, 5, 0)
    assert base.steps_per_miss_base == 4 and base.misses_base == 1
    # top-2 catches it: the re-root costs j + lag = 2 steps instead of 4; the chain holds
    # the next m - j - lag - 1 = 1 level (a hit: the source's best proposal is 103)
    rec = project(tr, 1, 2, lag=1, budget="free")
    assert (rec.steps, rec.caught, rec.misses) == (9, 1, 1)
    assert rec.steps_per_miss == 2 and rec.cut == pytest.approx(2 / 11)
    # 2 new corrections per node (none is an issued child), for parents on stages 3 and 4
    assert rec.new_per_node / rec.new_counted == 2
    assert rec.demand == 11 * 2 * 2
    # lag 0: the re-root costs 1 step and the chain holds the next 2 levels
    assert project(tr, 1, 2, lag=0, budget="free").steps == 4 + 1 + 1 + 1 + 1
    # ... and when the source's best proposal for the second one's parent is wrong, that
    # chain level misses where the replay's full-width level hit: it flushes (the replay's
    # mean miss gap, 4), and recovery costs more than it saved
    worse = project(hand_replay(top1_v3=False), 1, 2, lag=0, budget="free")
    assert (worse.steps, worse.misses, worse.caught) == (4 + 1 + 1 + 1 + 4, 2, 1)
    # same budget of w = 4 a step: 3 spare slots, but the chain's first node needs
    # 2 corrections for each of the 2 parents on stages 3..4: it does not fit
    spare = project(tr, 1, 2, lag=1, budget="spare")
    assert (spare.steps, spare.caught, spare.caught_free) == (11, 0, 1)
    assert spare.served == 11 * 3
    # a cap of 5 leaves 4 slots: it fits
    assert project(tr, 1, 2, lag=1, budget="spare", cap=5).steps == 9
    # stage 3 of 4 with a lag of 1 enters stage 1 when the refill would: useless
    assert not exit_stage_useful(4, 3, 1) and exit_stage_useful(4, 3, 0)
    assert project(tr, 3, 8, lag=1, budget="free").steps == 11


# ---- draft:K recovery in the step core: lossless, and it does re-root ------------------------

def _replay_source():
    """``replay:0.5-0.95``: the target's token first half the time, else ranked lower, so
    a level of each node's top-1 misses tokens that its next proposals hold (what draft:K
    catches, in the slots such a narrow level leaves)."""
    from orchestrator.models.loading import replay_source
    from stages.speculation.replay import parse_replay

    return replay_source(parse_replay("replay:0.5-0.95:32"), [target_whole()])


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9,
                                                                       top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_draft_recovery_is_lossless_at_every_stage_count(sampling):
    ref = PipelineEngine([target_whole()]).generate(PROMPT, 24, sampling, "ar").tokens
    caught = {}
    for m in (2, 3, 4, 5):
        for src in (_replay_source(), HybridSource(DraftModelSource(other_draft()))):
            eng = PipelineEngine(target_shards(m), src, width=4, topk=1, recovery=Recovery(6))
            res = eng.generate(PROMPT, 24, sampling, "specpipe")
            assert res.tokens == ref, (m, src.name)
            caught[m] = caught.get(m, 0) + res.stats()["recovered"]
    assert caught[2] == 0  # with two stages a late child saves no step: none is issued
    assert caught[3] + caught[4] + caught[5] > 0  # the replay's misses are re-rooted


def test_draft_recovery_re_roots_a_miss_that_plain_specpipe_flushes():
    truth = PipelineEngine([target_whole()]).generate(PROMPT, 24, SamplingParams(), "ar").tokens
    plain = simulate_specpipe(_replay_source(), PROMPT, truth, 4, 4, 1)
    rec = simulate_specpipe(_replay_source(), PROMPT, truth, 4, 4, 1, recovery=Recovery(6))
    assert plain.recovered == 0 and rec.recovered > 0
    assert rec.verified == plain.verified == len(truth) - 1
    assert rec.steps < plain.steps  # a re-root idles fewer steps than the flush it saves


@pytest.mark.parametrize("source,recovery", [(_replay_source, Recovery(6)),
                                              (NgramSource, Recovery(4, 2))],
                         ids=["draft", "early-exit"])
def test_recovery_is_lossless_in_a_batch(source, recovery):
    from stages.speculation.batch import Request, generate_many

    top1 = recovery.exit_stage == 0  # draft:K needs the slots top-1 levels leave
    eng = PipelineEngine(target_shards(4), source(), width=4, topk=1 if top1 else 4,
                         recovery=recovery)
    ar = PipelineEngine([target_whole()])
    reqs = [Request(PROMPT, 24), Request(PROMPT[5:], 16, SamplingParams(temperature=0.8,
                                                                         seed=3)),
            Request(PROMPT[::-1], 16), Request([7, 7, 1, 2], 12)]
    out = generate_many(eng, reqs, max_batch=3)
    for req, res in zip(reqs, out, strict=True):
        assert res.tokens == ar.generate(req.prompt, req.max_new_tokens, req.sampling,
                                         "ar").tokens
    assert sum(r.stats()["recovered"] for r in out) > 0


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9,
                                                                       top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_early_exit_recovery_is_lossless_at_every_stage_count_and_exit(sampling):
    ref = PipelineEngine([target_whole()]).generate(PROMPT, 24, sampling, "ar").tokens
    caught = 0
    for m in (2, 3, 4, 5):
        for j in range(1, m):
            eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=4,
                                 recovery=Recovery(4, j))
            res = eng.generate(PROMPT, 24, sampling, "specpipe")
            assert res.tokens == ref, (m, j)
            caught += res.stats()["recovered"]
    assert caught > 0  # the exits' candidates re-root misses the n-gram level flushes


def test_an_exit_stage_that_saves_no_step_is_refused():
    with pytest.raises(ConfigError, match="exit stage must be 1..3"):
        PipelineEngine(target_shards(4), NgramSource(), recovery=Recovery(4, 4))
    assert parse_recovery("early-exit:2:8") == Recovery(8, 2)
    assert parse_recovery("draft:16").name == "draft:16"
    for bad in ("draft", "draft:0", "early-exit:2", "exit:1:2", "draft:9999"):
        with pytest.raises(ValueError, match="none, draft:K or early-exit:J:K"):
            parse_recovery(bad)


# ---- the early exit's head variants (issue 40, item 4) ---------------------------------------

def _head_settings(tmp_path) -> dict[str, Recovery]:
    """Every exit head on the tiny target (64 tokens): full, a 24-row vocabulary, the
    draft's proposals only, and an adapter at layer 2 (random, so its ranking differs),
    each resolved as the command line resolves it."""
    from orchestrator.cli.flags import recovery
    from orchestrator.models.draft_vocab import write_vocab
    from stages.model.early_exit import ExitAdapter, save_adapter

    vocab = tmp_path / "vocab.json"
    ids = list(range(63, 23, -1))  # 40 ids, most "frequent" first; :24 keeps 63..40
    write_vocab(vocab, ids, [1] * len(ids), {"model": "tiny"})
    adapter = ExitAdapter(TARGET.dim)
    torch.nn.init.normal_(adapter.up.weight, std=0.5)
    save_adapter(tmp_path / "ad2", adapter, 2, "tiny")
    return {name: recovery(f"early-exit:1:4{opts}") for name, opts in (
        ("full", ""), ("vocab", f"+vocab={vocab}:24"), ("draft", "+draft"),
        ("adapter", f"+adapter={tmp_path / 'ad2'}"),
        ("adapter+vocab", f"+vocab={vocab}:24+adapter={tmp_path / 'ad2'}"))}


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9,
                                                                       top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_every_exit_head_is_lossless(tmp_path, sampling):
    ref = PipelineEngine([target_whole()]).generate(PROMPT, 20, sampling, "ar").tokens
    caught: dict[str, int] = {}
    for name, rec in _head_settings(tmp_path).items():
        # the adapter is for layer 2, the end of stage 1 of 3 (at m = 2 it is refused,
        # tested below); each head at both exits of m = 3, the reduced one also at m = 2
        for m, j in ((3, 1),) if "adapter" in name else \
                ((3, 1), (3, 2), (2, 1)) if name == "vocab" else ((3, 1), (3, 2)):
            eng = PipelineEngine(target_shards(m), NgramSource(), width=4, topk=4,
                                 recovery=dataclasses.replace(rec, exit_stage=j))
            res = eng.generate(PROMPT, 20, sampling, "specpipe")
            assert res.tokens == ref, (name, m, j)
            caught[name] = caught.get(name, 0) + res.stats()["recovered"]
    # the heads that look beyond the n-gram's own proposals re-root misses (the random
    # adapter may or may not: it only has to stay lossless)
    assert caught["full"] > 0 and caught["vocab"] > 0


def test_exit_heads_rank_as_the_full_head_does_on_their_tokens(tmp_path):
    from stages.model.early_exit import ExitHead, exit_head

    whole = target_whole()
    h = boundary_states(whole, PROMPT, [2])[2]
    full_t, full_p = ExitHead(whole, 2).top(h, 64)
    rows = torch.arange(40, 64)
    sub_t, sub_p = ExitHead(whole, 2, rows=rows).top(h, 8)
    # the reduced head's order is the full head's order restricted to its rows
    for i in range(h.shape[0]):
        kept = [t for t in full_t[i].tolist() if t >= 40][:8]
        assert sub_t[i].tolist() == kept
    # probabilities renormalised over the 24 rows, as a reduced draft head's are
    all_p = ExitHead(whole, 2, rows=rows).top(h, 24)[1]
    assert torch.allclose(all_p.sum(-1), torch.ones(h.shape[0], dtype=torch.float64))
    cands = [torch.tensor([5, 9, 30]) for _ in range(h.shape[0])]
    c_t, c_p = ExitHead(whole, 2, by_candidates=True).top(h, 4, candidates=cands)
    for i in range(h.shape[0]):
        want = [t for t in full_t[i].tolist() if t in (5, 9, 30)]
        assert c_t[i].tolist() == want  # 3 candidates: 3 columns, the full head's order
    assert c_p.shape == (h.shape[0], 3)
    settings = _head_settings(tmp_path)
    assert exit_head(whole, 2, settings["vocab"]) is exit_head(whole, 2, settings["vocab"])
    assert "plain (no adapter)" in exit_head(whole, 2, settings["vocab"]).describe()
    assert "ad2" in exit_head(whole, 2, settings["adapter"]).describe()


def test_bad_exit_heads_are_refused_in_one_line(tmp_path):
    import argparse

    from orchestrator.cli.flags import recovery

    for bad in ("early-exit:1:8+vocab", "early-exit:1:8+draft=3", "early-exit:1:8+lm",
                "early-exit:1:8+draft+draft", "early-exit:1:8+vocab=v.json+draft",
                "draft:8+draft", "early-exit:1:8+vocab=v.json:0", "early-exit:1:8+adapter="):
        with pytest.raises(ValueError) as e:
            parse_recovery(bad)
        assert "\n" not in str(e.value), bad
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "early_exit.json").write_text("{}")
    for bad, why in ((f"+vocab={tmp_path}/missing.json", "not found"),
                     (f"+adapter={tmp_path}", "not a usable early-exit adapter"),
                     (f"+adapter={tmp_path / 'notes'}", "not a usable early-exit adapter")):
        with pytest.raises(argparse.ArgumentTypeError, match=why) as e:
            recovery("early-exit:1:8" + bad)
        assert "\n" not in str(e.value)
    # an adapter for another layer than stage J's last one is refused by name
    settings = _head_settings(tmp_path)
    eng = PipelineEngine(target_shards(2), NgramSource(), width=4, topk=4,
                         recovery=settings["adapter"])
    with pytest.raises(Exception, match="adapter is for layer 2, but stage 1 ends at layer 3"):
        eng.generate(PROMPT, 8, SamplingParams(), "specpipe")
    rec = parse_recovery("early-exit:2:8+vocab=v.json:16384+adapter=auto")
    assert rec.name == "early-exit:2:8+vocab=v.json:16384+adapter=auto"
    assert rec.head == "vocab=v.json:16384" and parse_recovery(rec.name) == rec
