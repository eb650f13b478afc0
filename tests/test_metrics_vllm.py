"""vLLM's metric names beside treepipe's, with ``model_name``, driven through the observer.

The gateway's runner calls these observer methods for every request over gRPC and HTTP
(tests/test_openai_api.py scrapes a real gateway); here they are called directly, and
the KV usage is read from heartbeats in a real Redis.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from orchestrator.serving.metrics import Metrics, vllm_finished
from orchestrator.serving.runner import SpecStats
from protocol.sync.synchroniser import Synchroniser

# what issue 39 lists, and what llm-d's endpoint picker scrapes
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info", "vllm:lora_requests_info",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success", "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one_request(m: Metrics, reason: str = "length", stats: SpecStats | None = None) -> None:
    """A request's life as the runner reports it: queued, running, three tokens, done."""
    m.queued(1)
    m.queued(-1)
    m.admitted(0.25)
    m.running(1, 5)
    m.tokens([(40.0, 40.0), (60.0, 20.0)], first=True)
    m.tokens([(90.0, 30.0)], first=False)
    m.running(-1, 8)
    m.finished(reason, 5, 3, 0.09, stats)


def test_every_vllm_name_is_exported_with_the_served_model_name() -> None:
    m = Metrics("llama-served", None, concurrency=2, context_length=512, kv_tokens=1024)
    one_request(m, stats=SpecStats(steps=4, hits=2, misses=1, epochs=1))
    got = samples(m)
    families = {n.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
                .removesuffix("_bucket") for n, _ in got}
    assert VLLM_NAMES <= families, VLLM_NAMES - families
    for (name, labels), _ in got.items():
        if name.startswith("vllm:") and name != "vllm:lora_requests_info":
            assert ("model_name", "llama-served") in labels, (name, labels)


def test_the_vllm_series_move_with_the_requests() -> None:
    m = Metrics("tiny", None, concurrency=2, context_length=512, kv_tokens=1024,
                dtype="bfloat16", execution="compiled", quantize="int8")
    one_request(m, "length", SpecStats(steps=4, hits=2, misses=1, epochs=1))
    one_request(m, "eos", SpecStats(steps=3, hits=1, misses=1, epochs=1))
    one_request(m, "cancelled", None)
    got = samples(m)
    lab = (("model_name", "tiny"),)
    assert got[("vllm:time_to_first_token_seconds_count", lab)] == 3
    assert got[("vllm:inter_token_latency_seconds_count", lab)] == 6
    assert got[("vllm:inter_token_latency_seconds_sum", lab)] == 3 * (0.02 + 0.03)
    assert got[("vllm:e2e_request_latency_seconds_count", lab)] == 3
    assert got[("vllm:request_queue_time_seconds_count", lab)] == 3
    assert got[("vllm:request_queue_time_seconds_sum", lab)] == 0.75
    # 0.25 s is in the 0.25 bucket and above the 0.1 one
    assert got[("vllm:request_queue_time_seconds_bucket", (("le", "0.25"), *lab))] == 3
    assert got[("vllm:request_queue_time_seconds_bucket", (("le", "0.1"), *lab))] == 0
    assert got[("vllm:prompt_tokens_total", lab)] == 15
    assert got[("vllm:generation_tokens_total", lab)] == 9
    # the same figures as treepipe's own series
    assert got[("treepipe_generation_tokens_total", ())] == 9
    ok = {r: got[("vllm:request_success_total", (("finished_reason", r), *lab))]
          for r in ("stop", "length", "abort")}
    assert ok == {"stop": 1, "length": 1, "abort": 1}
    # one draft of one position per verified token after each epoch's first
    assert got[("vllm:spec_decode_num_drafts_total", lab)] == 5  # (2 + 1) + (1 + 1)
    assert got[("vllm:spec_decode_num_draft_tokens_total", lab)] == 5
    assert got[("vllm:spec_decode_num_accepted_tokens_total", lab)] == 3
    assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                (*lab, ("position", "0")))] == 3
    assert got[("vllm:num_requests_running", lab)] == 0
    assert got[("vllm:cache_config_info", (("block_size", "16"), *lab,
                                           ("num_gpu_blocks", "64")))] == 1
    assert got[("treepipe_model_info", (("dtype", "bfloat16"), ("execution", "compiled"),
                                        ("model", "tiny"), ("quantize", "int8")))] == 1


def test_finish_reasons_map_onto_vllms() -> None:
    assert [vllm_finished(r) for r in ("eos", "stop", "length", "cancelled", "deadline",
                                       "stalled", "failed: bad prompt")] == [
        "stop", "stop", "length", "abort", "abort", "abort", "abort"]


def test_kv_usage_is_the_fullest_stages_blocks_in_use(sync: Synchroniser) -> None:
    m = Metrics("tiny", sync, concurrency=2, context_length=512, kv_tokens=1024)
    m.running(1, 256)  # the gateway's estimate: 256 of 1024 tokens
    lab = (("model_name", "tiny"),)
    assert samples(m)[("vllm:kv_cache_usage_perc", lab)] == 0.25  # no stage reports a pool
    for w, used in (("stage0", 3), ("stage1", 6)):
        sync.heartbeat(w, {"pid": 1, "inc": w, "plan": "",
                           "kv": {"blocks": 8, "used": used, "peak": used, "block_size": 16,
                                  "fixed": 1}}, ttl_s=60)
    sync.heartbeat("draft", {"pid": 1, "inc": "d", "plan": ""}, ttl_s=60)  # holds no pool
    assert samples(m)[("vllm:kv_cache_usage_perc", lab)] == 6 / 8


def test_every_vllm_name_the_gateway_serves_is_in_the_docs() -> None:
    """docs/serving.md's metric tables name every vLLM series /metrics carries."""
    doc = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    served = {fam.name for fam in text_string_to_metric_families(
        Metrics("m", None, concurrency=1, context_length=64).render().decode())
        # the parser reads the client's *_created timestamps as families of their own
        if fam.name.startswith("vllm:") and not fam.name.endswith("_created")}
    assert served >= VLLM_NAMES
    missing = [n for n in sorted(served)
               if not re.search(rf"`{re.escape(n)}(_total)?[`{{]", doc)]
    assert not missing, missing
