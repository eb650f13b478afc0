"""Planner: layer split, §4.5 memory model (Table 1 of SpecPipe), rack placement, fit checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.deploy.manifest import ManifestError, validate_manifest
from orchestrator.deploy.planner import (
    GIB,
    balanced_bounds,
    format_plan,
    plan,
    plan_manifest,
    stage_params,
)
from orchestrator.models.architectures import KNOWN_ARCHITECTURES, Architecture
from stages.model.model import ModelArgs, random_shards

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"


def manifest(**spec):
    return validate_manifest({"metadata": {"name": "t"}, "spec": spec})


def table1_manifest():
    """SpecPipe §4.5: Llama-3.1-70B, bf16, 8 GPUs × 10 layers, 81,920 KV tokens, 256 MiB."""
    return manifest(
        model={"source": "/models/llama-70b", "dtype": "bfloat16",
               "architecture": {"name": "llama-3.1-70b"}},
        stages={"count": 8, "split": "even", "device": {"type": "cuda", "memory": "24Gi"}},
        draft={"source": "ngram", "width": 16},
        memory={"kvTokens": 81920, "runtimeMib": 256, "paramCount": "paper"},
        backend="kubernetes")


def test_table1_per_gpu_totals_within_5_percent():
    p = plan(table1_manifest())
    assert [s.layers for s in p.stages] == [(10 * i, 10 * i + 10) for i in range(8)]
    paper = [23.5] + [21.5] * 6 + [23.5]  # Table 1, GiB
    for s, want in zip(p.stages, paper, strict=True):
        got = s.memory.total / GIB
        assert abs(got - want) / want < 0.05, (s.index, got, want)
    # and the parts: 10 layers of 4d²+3df in bf16 ≈ 18.1 GiB, KV 3.125 GiB per stage
    mid = p.stages[3].memory
    assert abs(mid.weights / GIB - 18.125) < 0.01 and abs(mid.kv / GIB - 3.125) < 0.01
    assert mid.tree < 4 * 2**20  # "at most 4 MiB per shard" for a middle stage


def test_exact_counts_give_the_real_70b_and_1b():
    a70 = KNOWN_ARCHITECTURES["llama-3.1-70b"]
    assert abs(stage_params(a70, 0, 80, True, True) / 70.55e9 - 1) < 0.01
    a1 = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    assert abs(stage_params(a1, 0, 16, True, True) / 1.236e9 - 1) < 0.01


def test_exact_counts_match_real_shards():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=5, n_heads=4, n_kv_heads=2,
                     intermediate_size=64, max_seq_len=512)
    arch = Architecture(5, 32, 64, 4, 2, 64)
    bounds = [(0, 2), (2, 4), (4, 5)]
    for i, (shard, (a, b)) in enumerate(zip(random_shards(args, bounds), bounds, strict=True)):
        real = sum(p.numel() for p in shard.parameters())
        assert stage_params(arch, a, b, i == 0, i == 2) == real


@pytest.mark.parametrize("name", sorted(KNOWN_ARCHITECTURES))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_balanced_split_is_contiguous_and_no_worse_than_even(name, m):
    from stages.model.planning import even_bounds

    a = KNOWN_ARCHITECTURES[name]
    b = balanced_bounds(a, m)
    assert b[0][0] == 0 and b[-1][1] == a.layers and len(b) == m
    assert all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))
    assert all(e > s for s, e in b)

    def worst(bounds):
        c = stage_params(a, 0, 1, False, False)
        head = a.vocab_size * a.hidden_size
        return max((e - s) * c + (head if i == len(bounds) - 1 else 0)
                   for i, (s, e) in enumerate(bounds))

    assert worst(b) <= worst(even_bounds(a.layers, m))


def test_balanced_split_gives_the_head_stage_fewer_layers():
    # SmolLM2's 49152×576 head is worth ~8 layers of compute
    p = plan(manifest(stages={"count": 3}))
    sizes = [e - s for s, e in (st.layers for st in p.stages)]
    assert sum(sizes) == 30 and sizes[-1] < min(sizes[:-1])
    # the first stage (embedding) never gets more layers than a middle stage
    p70 = plan(validate_manifest(yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml")
                                                .read_text())))
    sizes = [e - s for s, e in (st.layers for st in p70.stages)]
    assert sizes[0] <= min(sizes[1:-1])


def test_explicit_layers_are_kept():
    p = plan(manifest(stages={"layers": [{"start": 0, "end": 5}, {"start": 5, "end": 30}]}))
    assert [s.layers for s in p.stages] == [(0, 5), (5, 30)]
    assert p.stages[0].embedding and p.stages[1].head and not p.stages[0].head


def test_stage_that_does_not_fit_names_stage_and_shortfall():
    m = table1_manifest().model_copy(deep=True)
    m.spec.memory.param_count = "exact"
    m.spec.stages.device.memory = "20Gi"
    with pytest.raises(ManifestError) as e:
        plan(m)
    msg = str(e.value)
    assert "stage 0 (layers 0-10)" in msg and "short" in msg and "20Gi" in msg
    assert "spec.stages.device.memory" in msg


def test_override_device_is_checked_on_its_own_stage():
    d = yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml").read_text())
    d["spec"]["stages"]["overrides"] = [{"stage": 5, "device": {"type": "cuda",
                                                                "memory": "16Gi"}}]
    with pytest.raises(ManifestError, match=r"overrides\[0\].device.memory: stage 5"):
        plan_manifest(d)


def test_draft_fit_is_checked():
    d = yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml").read_text())
    d["spec"]["draft"]["device"]["memory"] = "2Gi"
    with pytest.raises(ManifestError, match="spec.draft.device.memory: the draft needs"):
        plan_manifest(d)


def test_the_drafts_kv_is_the_stages_budget():
    """The draft service's draft-model pool holds memory.kvTokens rows (by default the
    stages' budget), allocated at start like a stage's (treepipe draft serve
    --kv-tokens): the plan counts those rows for it, at its own bytes per row."""
    from orchestrator.deploy.planner import draft_memory, kv_tokens

    d = yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml").read_text())
    target = KNOWN_ARCHITECTURES["llama-3.1-70b"]

    def draft_kv(rows: int | None) -> tuple[int, int]:
        if rows is not None:
            d["spec"].setdefault("memory", {})["kvTokens"] = rows
        spec = validate_manifest(d).spec
        got = draft_memory(spec, target)
        assert got is not None
        return got[1].kv, kv_tokens(spec)

    default, budget = draft_kv(None)
    per_row = draft_kv(4096)[0] // 4096
    assert per_row > 0 and draft_kv(8192)[0] == 8192 * per_row
    assert default == budget * per_row


def _racks(*caps, strategy="pack"):
    return {"strategy": strategy,
            "racks": [{"name": f"r{i}", "capacity": c, "nodeSelector": {"rack": f"r{i}"}}
                      for i, c in enumerate(caps)]}


def gpu_manifest(stages, placement, draft_gpu=True, overrides=(), draft_rack=None):
    draft = {"source": "ngram", "device": {"type": "cuda" if draft_gpu else "cpu"}}
    if draft_rack:
        draft["rack"] = draft_rack
    return manifest(stages={"count": stages, "device": {"type": "cuda"},
                            "overrides": list(overrides)},
                    placement=placement, draft=draft)


def test_pack_uses_fewest_racks_and_puts_draft_next_to_stage_0():
    p = plan(gpu_manifest(8, _racks(2, 5, 4)))
    racks = [s.rack for s in p.stages]
    # 9 slots (8 stages + draft): the 5- and 4-slot racks suffice, one crossing
    assert p.rack_crossings == 1 and set(racks) == {"r1", "r2"}
    assert p.draft.rack == racks[0] == "r1"
    assert racks == ["r1"] * 4 + ["r2"] * 4
    assert p.stages[0].node_selector == {"rack": "r1"}
    assert p.stages[3].link.crosses_racks and not p.stages[0].link.crosses_racks
    assert p.stages[3].link.level_us > p.stages[0].link.level_us


def test_cpu_draft_takes_no_slot_but_sits_with_stage_0():
    p = plan(gpu_manifest(4, _racks(2, 2), draft_gpu=False))
    assert [s.rack for s in p.stages] == ["r0", "r0", "r1", "r1"] and p.draft.rack == "r0"


def test_spread_crosses_more_than_pack():
    pack = plan(gpu_manifest(4, _racks(4, 4), draft_gpu=False))
    spread = plan(gpu_manifest(4, _racks(4, 4, strategy="spread"), draft_gpu=False))
    assert pack.rack_crossings == 0 and spread.rack_crossings == 3


def test_pins_are_honoured_and_neighbours_follow():
    p = plan(gpu_manifest(4, _racks(3, 3), draft_gpu=False,
                          overrides=[{"stage": 3, "rack": "r1"}, {"stage": 0, "rack": "r1"}]))
    racks = [s.rack for s in p.stages]
    assert racks[0] == "r1" and racks[3] == "r1" and racks[1] == "r1"
    assert p.draft.rack == "r1"
    p = plan(gpu_manifest(2, _racks(2, 2), draft_rack="r1"))
    assert p.draft.rack == "r1" and p.stages[0].rack == "r1"


def test_too_many_pins_on_a_rack():
    with pytest.raises(ManifestError, match="rack 'r0' has capacity"):
        plan(gpu_manifest(3, _racks(1, 4), draft_gpu=False,
                          overrides=[{"stage": 0, "rack": "r0"}, {"stage": 1, "rack": "r0"}]))


def test_unknown_architecture_asks_for_one():
    with pytest.raises(ManifestError, match="spec.model.architecture"):
        plan(manifest(model={"source": "/models/not-here"}))


def test_plan_table_has_every_stage_and_the_draft():
    p = plan(validate_manifest(yaml.safe_load((EXAMPLES / "llama-70b-two-racks.yaml")
                                              .read_text())))
    text = format_plan(p)
    for col in ("stage", "layers", "params", "est. memory", "rack/node", "link to next"):
        assert col in text
    assert text.count("rack-b") >= 4 and "between racks" in text and "draft" in text
    d = p.to_dict()
    assert [s["layers"] for s in d["stages"]][0][0] == 0 and d["rackCrossings"] == 1
