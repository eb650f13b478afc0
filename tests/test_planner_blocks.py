"""The planner's paged-KV arithmetic agrees with the engine's admission."""

from __future__ import annotations

from orchestrator.deploy.manifest import validate_manifest
from orchestrator.deploy.planner import (
    GIB,
    MIB,
    kv_block_bytes,
    plan,
    requests_fit,
    stage_params,
    weight_bytes,
)
from orchestrator.models.architectures import KNOWN_ARCHITECTURES
from protocol.scheduling.kv_blocks import request_blocks
from stages.speculation.batch import BatchRun, Request
from stages.speculation.engine import PipelineEngine
from stages.speculation.token_sources import NgramSource
from tests.tiny_models import PROMPT, target_shards


def _spec(memory: str | None, device_type: str = "cuda", dtype: str = "bfloat16",
          quantize: str = "none"):
    device = {"type": device_type, **({"memory": memory} if memory else {})}
    return validate_manifest({"metadata": {"name": "t"}, "spec": {
        "model": {"source": "/models/l", "dtype": dtype, "quantize": quantize,
                  "architecture": {"name": "llama-3.2-1b"}},
        "stages": {"count": 4, "split": "even", "device": device},
        "draft": {"source": "ngram", "width": 8},
        "memory": {"runtimeMib": 256}, "backend": "kubernetes"}})


def test_requests_fit_is_block_arithmetic() -> None:
    m = _spec("8Gi")
    a = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    st = plan(m).stages[1]
    start, end = st.layers
    n = requests_fit(a, m.spec, start, end, False, False, 4096)
    per_block = 16 * (end - start) * 2 * a.kv_heads * a.dim_head * 2
    assert kv_block_bytes(a, start, end, "bfloat16") == per_block
    left = 8 * GIB - stage_params(a, start, end, False, False) * 2 - 256 * MIB
    per_req = request_blocks(4096, 4, 8) * per_block + 2 * 8 * a.hidden_size * 2 \
        + 8 * (4096 + 32)
    assert n == left // per_req and n > 0
    # longer requests: fewer fit; no device memory given: unknown
    assert requests_fit(a, m.spec, start, end, False, False, 32768) < n
    assert requests_fit(a, _spec(None).spec, start, end, False, False, 4096) is None


def test_cpu_stages_count_their_packed_weights_twice() -> None:
    """A CPU stage in float32 or bfloat16 keeps a oneDNN-packed copy of its matmul weights
    (layers and head, not the embedding table); GPUs hold one copy."""
    a = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    cpu = _spec("64Gi", "cpu", "float32").spec
    gpu = _spec("64Gi", "cuda", "float32").spec
    half = _spec("64Gi", "cpu", "bfloat16").spec
    mid = stage_params(a, 4, 8, False, False)
    assert weight_bytes(a, cpu, 4, 8, False, False, cpu.stages.device) == 2 * mid * 4
    assert weight_bytes(a, gpu, 4, 8, False, False, gpu.stages.device) == mid * 4
    assert weight_bytes(a, half, 4, 8, False, False, half.stages.device) == 2 * mid * 2
    gpu_half = _spec("64Gi", "cuda", "bfloat16").spec
    assert weight_bytes(a, gpu_half, 4, 8, False, False, gpu_half.stages.device) == mid * 2
    first = stage_params(a, 0, 4, True, False)
    embed = a.vocab_size * a.hidden_size
    assert weight_bytes(a, cpu, 0, 4, True, False, cpu.stages.device) == (2 * first - embed) * 4
    last = stage_params(a, 12, 16, False, True)
    assert weight_bytes(a, cpu, 12, 16, False, True, cpu.stages.device) == (
        2 * last - a.hidden_size) * 4
    # the plan's stage memory and the requests that fit use the same bytes
    s1 = plan(_spec("64Gi", "cpu", "float32")).stages[1]
    assert s1.memory.weights == weight_bytes(a, cpu, *s1.layers, False, False, cpu.stages.device)
    # a stage whose device is overridden has its weights and fits from that device
    m = _spec("64Gi", "cpu", "float32")
    over = validate_manifest({"metadata": {"name": "t"}, "spec": {
        **m.spec.model_dump(by_alias=True, exclude_none=True),
        "stages": {"count": 4, "split": "even", "device": {"type": "cpu", "memory": "64Gi"},
                   "overrides": [{"stage": 1, "device": {"type": "cuda", "memory": "8Gi"}}]}}})
    o1 = plan(over).stages[1]
    gpu8 = over.spec.stages.device_of(1)
    assert o1.memory.weights == weight_bytes(a, over.spec, *o1.layers, False, False, gpu8)
    assert o1.fits == requests_fit(a, over.spec, *o1.layers, False, False,
                                   over.spec.limits.context_length, device=gpu8)
    assert o1.fits < plan(over).stages[2].fits


def test_pool_of_n_request_blocks_runs_n_requests_at_once() -> None:
    """A pool sized by request_blocks for 3 requests runs exactly 3 at a time."""
    m, w = 2, 4
    eng = PipelineEngine(target_shards(m), NgramSource(), width=w, topk=2)
    per = request_blocks(len(PROMPT) + 8, m, w)
    run = BatchRun(eng, "specpipe", 8, kv_blocks=3 * per)
    for _ in range(5):
        run.add(Request(PROMPT, 8))
    run.step()  # decides who joins at the next step boundary (protocol/scheduling/scheduler.py)
    run.step()
    assert len(run.running) == 3 and len(run.queue) == 2
    run.run()
    assert run.used_blocks() == [0, 0]


def test_plan_reports_how_many_requests_fit_per_stage() -> None:
    """`treepipe plan` shows requests_fit for the manifest's context length, per stage."""
    from orchestrator.deploy.planner import format_plan

    m = _spec("8Gi")
    a = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    p = plan(m)
    ctx = m.spec.limits.context_length
    for i, st in enumerate(p.stages):
        assert st.fits == requests_fit(a, m.spec, *st.layers, i == 0, i == len(p.stages) - 1,
                                       ctx)
        assert p.to_dict()["stages"][i]["requestsFit"] == st.fits
    assert "fits" in format_plan(p).splitlines()[1]
    assert all(st.fits is None for st in plan(_spec(None)).stages)


def test_int8_stages_count_a_byte_per_matmul_weight_and_plan_apart() -> None:
    """With model.quantize int8 a stage's projections and head take a byte per weight and
    no packed copy (the embedding stays in dtype), and the layout id changes: int8 stages
    must not take part beside float ones."""
    from orchestrator.deploy.planner import layout_id

    a = KNOWN_ARCHITECTURES["llama-3.2-1b"]
    for device_type, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        m = _spec("64Gi", device_type, dtype, "int8").spec
        b = 4 if dtype == "float32" else 2
        mid = stage_params(a, 4, 8, False, False)
        assert weight_bytes(a, m, 4, 8, False, False, m.stages.device) == mid
        first = stage_params(a, 0, 4, True, False)
        embed = a.vocab_size * a.hidden_size
        assert weight_bytes(a, m, 0, 4, True, False, m.stages.device) == \
            embed * b + (first - embed)
    int8, plain = _spec("64Gi", quantize="int8"), _spec("64Gi")
    assert plan(int8).stages[1].memory.weights < plan(plain).stages[1].memory.weights
    bounds = [(0, 8), (8, 16)]
    assert layout_id(int8, bounds) != layout_id(plain, bounds)
