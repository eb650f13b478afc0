"""Draft distillation on a tiny model: forward, loss, checkpoints, resume, lossless plug-in."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator.lab.drafting.training import (
    TRAIN_LOG,
    TRAIN_STATE,
    TeacherData,
    TrainConfig,
    causal_forward,
    corpus_files,
    docstring_prompt_ends,
    draft_args,
    draft_state,
    generate_batch,
    generate_labelled,
    head_logits,
    init_draft_from_target,
    load_teacher_shard,
    save_teacher_shard,
    soft_cross_entropy,
    teacher_batch,
    train,
)
from orchestrator.models.loading import load_draft_model
from stages.model.checkpoint import load_shard, save_checkpoint
from stages.model.sampling import SamplingParams
from stages.speculation.engine import METHODS, PipelineEngine
from stages.speculation.token_sources import DraftModelSource, HybridSource
from tests.tiny_models import PROMPT, TARGET, target_shards, target_whole

N_NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return target_whole()


@pytest.fixture(scope="module")
def teacher(target):
    """Teacher data: the tiny target's greedy and sampled continuations of random prompts."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, TARGET.vocab_size, (16, 8), generator=gen)
    seqs = torch.cat([generate_batch(target, prompts[:8], 24),
                      generate_batch(target, prompts[8:], 24, temperature=1.0, generator=gen)])
    return teacher_batch(target, seqs, k=16)


def make_draft(target):
    torch.manual_seed(0)
    return init_draft_from_target(target, [0, 1])


def loss_fn(model):
    def fn(b):
        h, _, _ = causal_forward(model, b.ids)
        return soft_cross_entropy(head_logits(model, h), b.top_ids, b.top_logp)
    return fn


def run(target, teacher, out, steps, max_steps=None):
    draft = make_draft(target)
    cfg = TrainConfig(lr=3e-3, total_steps=steps, batch_size=4, ckpt_every=10, warmup_steps=2)
    args = draft_args(target.args, 2)
    summary = train(draft, loss_fn(draft), TeacherData([teacher]), cfg, out,
                    lambda d: save_checkpoint(d, args, draft_state(draft)),
                    max_steps=max_steps, progress=False)
    return draft, summary


def test_causal_forward_matches_engine(target):
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        h, taps, _ = causal_forward(target, ids, exits=[2])
        got = head_logits(target, h)[0]
        ref = target.logits(target(ids[0], torch.arange(len(PROMPT)), target.new_cache(64)))
    assert torch.allclose(got, ref, atol=1e-9)
    assert taps[2].shape == (1, len(PROMPT), TARGET.dim)


def test_generate_batch_greedy_equals_ar(target):
    ar = PipelineEngine([target]).generate(PROMPT, 12, SamplingParams(), "ar").tokens
    out = generate_batch(target, torch.tensor([PROMPT, PROMPT]), 12)
    assert out[0, len(PROMPT):].tolist() == ar and out[1].tolist() == out[0].tolist()


def test_generation_labels_equal_a_teacher_pass(target):
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, TARGET.vocab_size, (3, 6), generator=gen)
    ids, lab = generate_labelled(target, prompts, 5, k=8)
    ref = teacher_batch(target, ids, k=8)
    assert ids.shape == (3, 11) and torch.equal(lab.ids, ids)
    assert torch.equal(lab.top_ids, ref.top_ids)
    assert torch.allclose(lab.top_logp.float(), ref.top_logp.float(), atol=1e-3)


def test_teacher_topk_is_the_targets_distribution(target, teacher, tmp_path):
    with torch.inference_mode():
        h, _, _ = causal_forward(target, teacher.ids[:1])
        lp = torch.log_softmax(head_logits(target, h), -1)
    top = lp.topk(16, -1)
    assert torch.equal(teacher.top_ids[:1].long(), top.indices)
    assert torch.allclose(teacher.top_logp[:1].float(), top.values.float(), atol=1e-2)
    save_teacher_shard(tmp_path / "s.pt", teacher)
    back = load_teacher_shard(tmp_path / "s.pt")
    assert torch.equal(back.ids, teacher.ids) and torch.equal(back.top_ids, teacher.top_ids)


def test_draft_shares_frozen_embedding_and_head(target):
    draft = make_draft(target)
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    assert not draft.lm_head.weight.requires_grad
    assert torch.equal(draft.layers[1].mlp.up_proj.weight, target.layers[1].mlp.up_proj.weight)
    assert all(p.requires_grad for p in draft.layers.parameters())


def test_loss_decreases_and_checkpoint_round_trips(target, teacher, tmp_path):
    draft, summary = run(target, teacher, tmp_path, 30)
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / TRAIN_LOG).read_text().splitlines()]
    assert summary["step"] == 30 and len(losses) == 30
    # soft cross-entropy = target entropy (~3 nats here) + KL: a 10% drop halves the KL
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    # the saved folder is an ordinary checkpoint: same logits as the in-memory draft
    loaded = load_shard(tmp_path, 0, 2, torch.float64)
    ids = teacher.ids[:2]
    with torch.inference_mode():
        a = head_logits(draft, causal_forward(draft, ids)[0])
        b = head_logits(loaded, causal_forward(loaded, ids)[0])
    # (load_shard builds the RoPE table in float32, the in-memory float64 copy kept float64)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_resume_continues_where_it_stopped(target, teacher, tmp_path):
    straight, _ = run(target, teacher, tmp_path / "a", 20)
    run(target, teacher, tmp_path / "b", 20, max_steps=10)
    state = torch.load(tmp_path / "b" / TRAIN_STATE, weights_only=False)
    assert state["step"] == 10
    resumed, summary = run(target, teacher, tmp_path / "b", 20)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "b" / TRAIN_LOG).read_text().splitlines()]
    assert summary["step"] == 20 and steps == list(range(1, 21))
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-10)
    # a finished run resumed again does nothing more
    _, again = run(target, teacher, tmp_path / "b", 20)
    assert again["step"] == 20


@pytest.fixture(scope="module")
def distilled(target, teacher, tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft")
    run(target, teacher, folder, 20)
    return folder


@pytest.mark.parametrize("m", [1, 3])
def test_distilled_draft_is_lossless_in_every_method(distilled, m):
    src = load_draft_model(str(distilled), distilled, torch.float64, "cpu")
    assert isinstance(src, DraftModelSource) and src.shard.args.n_layers == 2
    shards = target_shards(m)
    samp = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    refs = {sp: PipelineEngine(shards).generate(PROMPT, N_NEW, sp, "ar").tokens
            for sp in (SamplingParams(), samp)}
    for source, shapes in ((src, ((1, 1), (8, 4))), (HybridSource(src), ((8, 4),))):
        for method in METHODS:
            for w, k in shapes:
                eng = PipelineEngine(shards, source, width=w, topk=k)
                for sp, ref in refs.items():
                    assert eng.generate(PROMPT, N_NEW, sp, method).tokens == ref, (method, w, k)


def test_corpus_text_helpers(tmp_path):
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "human_eval" / "x.py").write_text("x = 1\n" * 1000)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "y.py").write_text("y = 2\n" * 1000)
    assert [p.name for p in corpus_files([tmp_path])] == ["y.py"]
    src = 'def f(a):\n    """Add one."""\n    return a + 1\n\ndef g():\n    pass\n'
    ends = docstring_prompt_ends(src)
    assert [src[:e] for e in ends] == ['def f(a):\n    """Add one."""\n']
