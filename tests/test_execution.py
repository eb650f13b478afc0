"""Execution modes of a stage: compiled layers and measured CPU matmul kernels give the
eager forward's results (tokens: test_lossless_tiny.py runs every configuration in both
modes)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from stages.model import linear_tuning
from stages.model.compiled import WARM_SHAPES, compile_shard, eager, prepare
from stages.model.config import ModelArgs
from stages.model.cuda_graphs import StepGraphs
from stages.model.execution_modes import resolve_execution
from stages.model.kv_cache import StageCache
from stages.model.model import (
    CPU_KERNELS,
    ROW_BUCKETS,
    UNTUNED,
    Segment,
    layer_call,
    linear,
    random_shards,
    row_bucket,
)
from tests.tiny_models import target_shards

MID = ModelArgs(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                intermediate_size=512, max_seq_len=256)


def packed_step(shard, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill three requests of different lengths in one pool, then one packed step of a
    committed row, a tree level and a prompt chunk; the outputs and the pool's keys."""
    gen = torch.Generator().manual_seed(seed)
    pool = shard.new_pool(16, growable=True)
    caches = [StageCache.in_pool(pool) for _ in range(3)]
    lengths = [5, 9, 3]
    ids = torch.randint(0, shard.args.vocab_size, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    outs = [shard.forward_packed(ids, pos, [Segment(c, n) for c, n in zip(caches, lengths,
                                                                             strict=True)])]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    segs = [Segment(caches[0], 1), Segment(caches[1], 3, tree, torch.arange(3)),
            Segment(caches[2], 4)]
    ids = torch.randint(0, shard.args.vocab_size, (8,), generator=gen)
    pos = torch.tensor([5, 9, 9, 9, 3, 4, 5, 6])
    outs.append(shard.forward_packed(ids, pos, segs))
    return outs, pool.k.clone()


def test_compiled_layers_give_the_eager_forward_and_kv():
    shard = target_shards(1)[0]
    ref, ref_k = packed_step(shard)
    seconds = compile_shard(shard, progress=False)
    assert set(seconds) == {s.name for s in WARM_SHAPES}
    got, got_k = packed_step(shard)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref_k, got_k, rtol=0, atol=1e-12)
    eager(shard)
    again, _ = packed_step(shard)
    torch.testing.assert_close(again[1], ref[1], rtol=0, atol=0)


def test_warm_shapes_leave_later_shapes_right():
    """After warming every step shape, a shape never seen still equals eager (a stage-wide
    graph with nested regions did not: it reused a layer's subgraph across shapes)."""
    a, b = target_shards(2), target_shards(2)
    for s in b:
        compile_shard(s, progress=False)
    x = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    for prefix in (a, b):
        caches = [s.new_cache(32) for s in prefix]
        h = x
        for s, c in zip(prefix, caches, strict=True):
            h = s(h, torch.arange(len(x)), c)
        prefix.append(h)
    torch.testing.assert_close(a[-1], b[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("upcast,dtype", [(0, torch.float64), (1, torch.float64),
                                          (16, torch.float64), (0, torch.bfloat16)])
def test_a_warmed_stage_compiles_nothing_more_under_a_batch(upcast, dtype):
    """The warm shapes' graphs serve every step of a SpecPipe-DB batch: requests joining
    and leaving, tree levels of every width, prompt chunks and a growing pool (each
    recompile costs seconds mid-request; a batch on an H200 met some 20 of them). Also
    with one-row steps attending in float32 throughout, or from 16 keys on, as
    the CPU tuner may choose (warm_up then warms both sides of 16 keys), and in bf16,
    whose CPU attention folds the grouped query heads."""
    from torch._dynamo.utils import counters

    from stages.speculation.batch import Request, generate_many
    from stages.speculation.engine import PipelineEngine
    from stages.speculation.token_sources import NgramSource
    from tests.tiny_models import PROMPT

    # graphs other tests compiled in this process (other upcast_from values, other
    # shapes) would shape the guards here; a worker starts from none
    torch._dynamo.reset()
    shards = target_shards(2, dtype=dtype)
    for s in shards:
        linear_tuning.set_upcast_from(s, upcast)
        compile_shard(s, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    eng = PipelineEngine(shards, NgramSource(), width=4, topk=2)
    specs = [(12, 10), (5, 14), (20, 6), (9, 12), (3, 8)]
    outs = generate_many(eng, [Request(PROMPT[:n], k, source=NgramSource()) for n, k in specs],
                         "specpipe", max_batch=4)
    assert counters["stats"]["unique_graphs"] == graphs
    if dtype == torch.float64:  # bf16 may flip a near-tie: the lossless suites judge those
        ref = PipelineEngine(target_shards(1))
        for (n, k), out in zip(specs, outs, strict=True):
            assert out.tokens == ref.generate(PROMPT[:n], k, method="ar").tokens


@pytest.mark.parametrize("kernel", sorted(CPU_KERNELS))
def test_every_cpu_kernel_is_the_same_product(kernel):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=gen)
    with torch.inference_mode():
        for n in (1, 2, 3, 4, 7, 16, 65):
            x = torch.randn(n, 80, generator=gen)
            torch.testing.assert_close(CPU_KERNELS[kernel](x, w), F.linear(x, w),
                                       rtol=1e-5, atol=1e-5)


def test_rows_take_the_largest_bucket_not_above_them():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 7, 8, 63, 64, 1000)] == \
        [0, 1, 1, 2, 2, 3, 5, 6, 6]
    assert len(UNTUNED) == len(ROW_BUCKETS)


def test_a_weight_follows_the_kernel_stored_on_it(monkeypatch):
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    called = []
    monkeypatch.setitem(CPU_KERNELS, "plain", lambda x, w: called.append("plain") or x @ w.t())
    monkeypatch.setitem(CPU_KERNELS, "packed", lambda x, w: called.append("packed") or x @ w.t())
    w._treepipe_kernels = ("packed",) * len(ROW_BUCKETS)
    linear(x, w)
    w._treepipe_kernels = ("plain",) * len(ROW_BUCKETS)
    linear(x, w)
    assert called == ["packed", "plain"]


def test_tuning_stores_choices_on_the_weights_and_reads_them_back(tmp_path, monkeypatch):
    shard = random_shards(MID, [(0, 2)], dtype=torch.float32)[0]
    x = torch.randint(0, MID.vocab_size, (6,))
    before = shard(x, torch.arange(6), shard.new_cache(16))
    cache = tmp_path / "kernels.json"
    chosen = linear_tuning.tune_shard(shard, cache, progress=False)
    assert set(chosen) == {"qkv", "o", "gate_up", "down", "lm_head", "attention"}
    for role, ws in linear_tuning.weight_groups(shard).items():
        for w in ws:
            assert w._treepipe_kernels == tuple(chosen[role])
    assert all(layer.self_attn.upcast_from == chosen["attention"] for layer in shard.layers)
    assert chosen["attention"] in (0, *linear_tuning.ATTENTION_KEYS)
    stored = json.loads(cache.read_text())
    assert list(stored) == [linear_tuning.machine_key()]
    after = shard(x, torch.arange(6), shard.new_cache(16))
    torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-4)

    def no_measuring(weights):
        raise AssertionError("measured again although the cache has the choices")

    monkeypatch.setattr(linear_tuning, "measure", no_measuring)
    monkeypatch.setattr(linear_tuning, "measure_attention", no_measuring)
    fresh = random_shards(MID, [(0, 2)], dtype=torch.float32)[0]
    assert linear_tuning.tune_shard(fresh, cache, progress=False) == chosen
    linear_tuning.untune_shard(fresh)
    assert not hasattr(fresh.lm_head.weight, "_treepipe_kernels")
    assert fresh.layers[0].self_attn.upcast_from == 0


def test_weights_are_timed_from_memory_where_the_shard_outgrows_the_cache(tmp_path,
                                                                        monkeypatch):
    """A shard whose weights outgrow the CPU's largest cache is read from memory in a
    step, so every matmul timing first reads a buffer of 1.5x that cache; a shard that
    fits is timed as it stands. The two are stored apart."""
    shard = random_shards(MID, [(0, 2)], dtype=torch.float32)[0]
    real = linear_tuning._time
    evicted: list[bool] = []

    def spy(kernel, weights, x, evict):
        evicted.append(evict is not None and evict.numel() * 4 >= min(
            3 * llc // 2, linear_tuning.EVICT_MAX))
        return real(kernel, weights, x, evict)

    monkeypatch.setattr(linear_tuning, "_time", spy)
    for llc, from_memory in ((1 << 40, False), (1 << 12, True)):
        monkeypatch.setattr(linear_tuning, "last_level_cache_bytes", lambda llc=llc: llc)
        evicted.clear()
        cache = tmp_path / f"{llc}.json"
        linear_tuning.tune_shard(shard, cache, progress=False)
        assert evicted and set(evicted) == {from_memory}
        keys = [k for k in json.loads(cache.read_text())[linear_tuning.machine_key()]
                if not k.startswith("attention")]
        assert len(keys) == 5 and all(k.endswith("|from memory") == from_memory for k in keys)
    linear_tuning.untune_shard(shard)


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    sizes = {"index0": "48K", "index2": "1M", "index3": "32768K", "index4": "junk"}
    for name, size in sizes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert linear_tuning.last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("100663296")  # bare bytes
    assert linear_tuning.last_level_cache_bytes(tmp_path) == 96 << 20
    assert linear_tuning.last_level_cache_bytes(tmp_path / "none") == 32 << 20


def test_an_int8_shards_attention_is_still_tuned(tmp_path):
    """int8 weights have one kernel and are not measured, but attention runs in the
    model's dtype and is."""
    from stages.model.quantization import quantize_shard

    shard = quantize_shard(random_shards(MID, [(0, 2)], dtype=torch.float32)[0])
    assert linear_tuning.weight_groups(shard) == {}
    chosen = linear_tuning.tune_shard(shard, tmp_path / "k.json", progress=False)
    assert set(chosen) == {"attention"}
    assert all(layer.self_attn.upcast_from == chosen["attention"] for layer in shard.layers)


def test_a_damaged_cache_is_measured_again(tmp_path):
    cache = tmp_path / "kernels.json"
    cache.write_text("{not json")
    shard = random_shards(MID, [(0, 1)], dtype=torch.float32)[0]
    assert linear_tuning.tune_shard(shard, cache, progress=False)
    assert linear_tuning.machine_key() in json.loads(cache.read_text())


def test_tiny_and_float64_weights_keep_the_untuned_rule(tmp_path):
    shard = target_shards(1)[0]  # float64, and far below MIN_ELEMENTS
    assert linear_tuning.tune_shard(shard, tmp_path / "k.json", progress=False) == {}
    assert not (tmp_path / "k.json").exists()


def test_auto_is_compiled_on_a_gpu_and_tuned_on_a_cpu():
    assert resolve_execution("auto", "cuda") == resolve_execution("auto", "cuda:1") == "compiled"
    assert resolve_execution("auto", "cpu") == "tuned"
    assert [resolve_execution(m, "cuda") for m in ("eager", "tuned", "compiled")] == \
        ["eager", "tuned", "compiled"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["bench"],
                                     ["serve", "smollm2-135m"]])
def test_auto_dtype_is_bf16_on_a_gpu_and_a_cpu_with_bf16_units(command):
    from orchestrator.cli.main import build_parser, with_dtype
    from stages.model.execution_modes import host_has_bf16_units

    def dtype(*flags: str) -> str:
        return with_dtype(build_parser(command[0]).parse_args([*command, *flags])).dtype

    assert dtype() == ("bfloat16" if host_has_bf16_units() else "float32")
    assert dtype("--device", "cuda") == "bfloat16"
    assert dtype("--device", "cuda", "--dtype", "float32") == "float32"
    assert dtype("--dtype", "float64") == "float64"


@pytest.mark.parametrize("units", [True, False])
def test_auto_dtype_on_a_cpu_follows_its_bf16_units(monkeypatch, units):
    """Both branches on any host: bf16 on a CPU with bf16 units, float32 on one without
    and on CPUs elsewhere (Kubernetes nodes); a GPU is bf16 either way."""
    import stages.model.execution_modes as modes

    monkeypatch.setattr(modes, "host_has_bf16_units", lambda: units)
    assert modes.resolve_dtype("auto", "cpu") == ("bfloat16" if units else "float32")
    assert modes.resolve_dtype("auto", "cpu", here=False) == "float32"
    assert modes.resolve_dtype("auto", "cuda", here=False) == "bfloat16"
    assert modes.resolve_dtype("float64", "cpu") == "float64"


def test_bf16_units_are_read_from_the_cpu_flags():
    from stages.model.execution_modes import bf16_units

    epyc = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    xeon = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
    avx2 = "flags\t\t: fpu avx2 fma\nbugs\t\t: avx512_bf16_is_not_a_flag_here\n"
    assert bf16_units(epyc) and bf16_units(xeon)
    assert not bf16_units(avx2) and not bf16_units("") and not bf16_units("flags: avx512f")


def test_prepare_auto_runs_a_cpu_shard_tuned_and_eager_undoes_it(tmp_path):
    shard = target_shards(1)[0]
    prepare(shard, "auto", tmp_path, progress=False)
    assert shard.layer_fn is layer_call and shard.step_fn == shard.layer_loop
    shard.step_fn = StepGraphs(shard.layer_loop, capture=False)
    prepare(shard, "eager", tmp_path, progress=False)  # no graphs or padding left
    assert shard.step_fn == shard.layer_loop


def test_a_draft_models_shard_runs_as_the_stages_do():
    """build_engine and the draft service prepare the shard a source runs (source_shards)."""
    from orchestrator.models.loading import source_shards
    from stages.speculation.token_sources import DraftModelSource, HybridSource, NgramSource
    from tests.tiny_models import other_draft

    draft = DraftModelSource(other_draft())
    assert source_shards(draft) == [draft.shard]
    assert source_shards(HybridSource(draft)) == [draft.shard]
    assert source_shards(NgramSource()) == [] and source_shards(None) == []
