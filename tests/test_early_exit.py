"""Early-exit adapter (Mirror-SD Eq. 6): training, save/load, and lossless use as a source."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrator.lab.drafting.draft_eval import source_flops
from orchestrator.lab.drafting.training import (
    TRAIN_LOG,
    TeacherData,
    TrainConfig,
    causal_forward,
    generate_labelled,
    head_logits,
    soft_cross_entropy,
    train,
)
from orchestrator.models.loading import early_exit_draft, load_draft_model
from stages.model.checkpoint import ModelError, save_checkpoint
from stages.model.early_exit import (
    AdaptedNorm,
    ExitAdapter,
    attach_adapter,
    load_adapter,
    save_adapter,
)
from stages.model.sampling import SamplingParams
from stages.speculation.engine import METHODS, PipelineEngine
from stages.speculation.token_sources import EarlyExitSource, HybridSource
from tests.tiny_models import PROMPT, TARGET, target_shards, target_whole

EXIT = 2
N_NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    whole = target_whole()
    sd = whole.state_dict()
    folder = tmp_path_factory.mktemp("target")
    save_checkpoint(folder, TARGET, {hf: sd[n] for hf, n in whole.checkpoint_keys().items()})
    return folder


@pytest.fixture(scope="module")
def trained(target_folder, tmp_path_factory):
    """An adapter on layer 2 of the tiny target, trained on the target's own generations."""
    target = target_whole()
    prompts = torch.randint(0, TARGET.vocab_size, (12, 6),
                            generator=torch.Generator().manual_seed(4))
    _, teacher = generate_labelled(target, prompts, 26, k=16)
    cut = early_exit_draft(target_folder, EXIT, torch.float64, "cpu")
    for p in cut.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    model = attach_adapter(cut, ExitAdapter(TARGET.dim))
    adapter = model.norm.adapter

    def loss_fn(b):
        h, _, _ = causal_forward(model, b.ids)
        return soft_cross_entropy(head_logits(model, h), b.top_ids, b.top_logp)

    out = tmp_path_factory.mktemp("adapter")
    cfg = TrainConfig(lr=1e-2, total_steps=30, batch_size=4, ckpt_every=10, warmup_steps=2)
    train(model, loss_fn, TeacherData([teacher]), cfg, out,
          lambda d: save_adapter(d, adapter, EXIT, str(target_folder)), progress=False)
    return model, out


def test_untrained_adapter_is_the_plain_early_exit(target_folder):
    plain = early_exit_draft(target_folder, EXIT, torch.float64, "cpu")
    adapted = attach_adapter(early_exit_draft(target_folder, EXIT, torch.float64, "cpu"),
                             ExitAdapter(TARGET.dim))
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        a = head_logits(plain, causal_forward(plain, ids)[0])
        b = head_logits(adapted, causal_forward(adapted, ids)[0])
    assert torch.equal(a, b)
    with pytest.raises(ModelError):
        attach_adapter(adapted, ExitAdapter(TARGET.dim))


def test_adapter_training_lowers_loss_and_touches_only_the_adapter(trained, target_folder):
    model, out = trained
    losses = [json.loads(ln)["loss"] for ln in (out / TRAIN_LOG).read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses
    plain = early_exit_draft(target_folder, EXIT, torch.float64, "cpu")
    for (n, p), q in zip(model.layers.named_parameters(), plain.layers.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert model.norm.adapter.up.weight.abs().sum() > 0


def test_saved_adapter_loads_as_a_token_source(trained, target_folder):
    model, out = trained
    src = load_draft_model(str(out), target_folder, torch.float64, "cpu")
    assert isinstance(src, EarlyExitSource) and src.exit_layer == EXIT
    assert isinstance(src.shard.norm, AdaptedNorm)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        a = head_logits(model, causal_forward(model, ids)[0])
        b = head_logits(src.shard, causal_forward(src.shard, ids)[0])
    assert torch.allclose(a, b, atol=1e-6)
    fl = source_flops(src, TARGET)
    assert EXIT / TARGET.n_layers < fl["ratio_body"] < (EXIT + 1) / TARGET.n_layers
    adapter, meta = load_adapter(out)
    assert meta["exit_layer"] == EXIT and adapter.down.out_features == TARGET.dim // 2


def test_bad_adapter_folder_is_a_model_error(tmp_path):
    (tmp_path / "early_exit.json").write_text('{"kind": "something else"}')
    with pytest.raises(ModelError, match="early-exit adapter"):
        load_adapter(tmp_path)


@pytest.mark.parametrize("m", [2, 3])
def test_early_exit_source_is_lossless(trained, target_folder, m):
    _, out = trained
    src = load_draft_model(str(out), target_folder, torch.float64, "cpu")
    shards = target_shards(m)
    samp = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    refs = {sp: PipelineEngine(shards).generate(PROMPT, N_NEW, sp, "ar").tokens
            for sp in (SamplingParams(), samp)}
    for source in (src, HybridSource(src)):
        for method in METHODS:
            eng = PipelineEngine(shards, source, width=8, topk=4)
            for sp, ref in refs.items():
                assert eng.generate(PROMPT, N_NEW, sp, method).tokens == ref, (method, sp)
