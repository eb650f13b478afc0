"""Prometheus metrics of one gateway: request latency, tokens, SpecPipe's own figures.

:class:`Metrics` is the runner's observer (orchestrator/serving/runner.py), so
requests over gRPC and HTTP count alike.  Names carry the ``treepipe_`` prefix, and
beside them vLLM's own names with a ``model_name`` label (the served model name), so
dashboards, llm-d's endpoint picker and ``vllm bench`` read a treepipe gateway as
they read vLLM: the request gauges, ``kv_cache_usage_perc`` (KV blocks in use over
blocks, the fullest stage's, from the stages' heartbeats), ``cache_config_info``,
``lora_requests_info`` (no adapters), the latency and queue-time histograms, the token and
success counters and the speculative-decoding counters.

How SpecPipe maps onto vLLM's speculation counters: every verified token after a
request's first is one *draft* of one *position*: the tree level under the verified
root held the alternatives (up to the tree width) for that one next token, and the
draft is *accepted* when the target's token was among them (a hit).  So
``spec_decode_num_drafts`` = ``num_draft_tokens`` = hits + flushes,
``num_accepted_tokens`` = hits, and ``num_accepted_tokens_per_pos`` has the one
position 0; the acceptance rate vLLM users compute (accepted / draft tokens) is the
hit rate.

Per-worker figures come from the workers' heartbeats in Redis at scrape time,
including where each worker's time goes (compute, barrier, input wait, link sends;
protocol/sync/heartbeat.py).  Each gateway has its own registry, so several in one
process (tests) do not collide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.scheduling.kv_blocks import DEFAULT_BLOCK_SIZE, pool_blocks
from protocol.sync.synchroniser import SpecStats, Synchroniser

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# latency buckets in seconds: tokens arrive every few ms on a fast pipeline, minutes on a slow one
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
                   600.0)
PER_STEP_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# treepipe's finish reasons -> vLLM's finished_reason label (stop, length, abort)
VLLM_FINISHED = {"eos": "stop", "stop": "stop", "length": "length"}


def vllm_finished(reason: str) -> str:
    """vLLM's ``finished_reason`` for a treepipe finish reason (anything cut short: abort)."""
    return VLLM_FINISHED.get(reason, "abort")


class _KvUsage(Collector):
    """``vllm:kv_cache_usage_perc``: KV blocks in use over blocks on the fullest stage (the
    stage that stops admission first), read from the stages' heartbeats at scrape time;
    the gateway's own estimate (tokens held over its budget) while no stage reports one."""

    def __init__(self, model: str, sync: Synchroniser | None, estimate: Callable[[], float]):
        self.model, self.sync, self.estimate = model, sync, estimate

    def usage(self) -> float:
        """The fullest stage's share of its pool in use, or the gateway's estimate."""
        shares = []
        if self.sync is not None:
            try:
                beats = self.sync.heartbeats(self.sync.participants())
            except Exception:  # noqa: BLE001 - Redis down: the estimate this scrape
                beats = {}
            for hb in beats.values():
                if hb.kv is not None and hb.kv.blocks > 0:
                    shares.append(hb.kv.used / hb.kv.blocks)
        return min(1.0, max(shares)) if shares else self.estimate()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache blocks in use over the "
                              "blocks of the fullest stage's pool (0..1; vLLM name)",
                              labels=["model_name"])
        g.add_metric([self.model], self.usage())
        yield g
        # vLLM's LoRA gauge, whose value is the time it was set; no adapters here
        lora = GaugeMetricFamily("vllm:lora_requests_info", "running and waiting LoRA "
                                 "adapters (none: treepipe serves no adapters; vLLM name)",
                                 labels=["max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora


class _Workers(Collector):
    """Per-worker gauges from the heartbeats the stage workers and draft write to Redis."""

    def __init__(self, sync: Synchroniser):
        self.sync = sync

    # heartbeat ``stats`` field -> (metric name without _total, help)
    COUNTERS = {
        "steps": ("treepipe_worker_steps", "decode steps (after each prefill) the worker "
                  "arrived at"),
        "compute_s": ("treepipe_worker_compute_seconds",
                      "time in forwards, tree and KV-cache work and proposals"),
        "barrier_s": ("treepipe_worker_barrier_seconds",
                      "time from arriving at the step barrier to holding the verdict"),
        "input_s": ("treepipe_worker_input_wait_seconds",
                    "time waiting for the step's link message"),
        "send_s": ("treepipe_worker_link_send_seconds", "time sending link messages"),
        "sent_bytes": ("treepipe_worker_link_sent_bytes", "link bytes sent"),
        "nodes": ("treepipe_worker_nodes",
                  "tree nodes computed (stages) or proposed (draft) in decode steps"),
        "prefill_s": ("treepipe_worker_prefill_seconds",
                      "prefill chunks' compute and input, and steps that only prefilled"),
    }

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("treepipe_worker_up", "1 while the worker heartbeats",
                               labels=["worker"])
        step = GaugeMetricFamily("treepipe_worker_step",
                                 "pipeline step the worker is at", labels=["worker"])
        epoch = GaugeMetricFamily("treepipe_worker_epoch", "epoch the worker runs in",
                                  labels=["worker"])
        rejected = GaugeMetricFamily("treepipe_worker_rejected_messages",
                                     "link messages the worker's inbox refused",
                                     labels=["worker"])
        kv = {k: GaugeMetricFamily(f"treepipe_worker_kv_blocks{suffix}", h, labels=["worker"])
              for k, suffix, h in (("blocks", "", "blocks in the stage's KV pool"),
                                   ("used", "_used", "KV blocks the requests hold now"),
                                   ("peak", "_peak", "most KV blocks held at once"))}
        try:
            names = self.sync.participants()
            beats = self.sync.heartbeats(names)
        except Exception:  # noqa: BLE001 - Redis down: no per-worker figures this scrape
            names, beats = [], {}
        counters = {k: CounterMetricFamily(n, h, labels=["worker"])
                    for k, (n, h) in self.COUNTERS.items()}
        for w in names:
            hb = beats.get(w)
            up.add_metric([w], 1.0 if hb else 0.0)
            if hb:
                step.add_metric([w], float(hb.step))
                epoch.add_metric([w], float(hb.epoch))
                rejected.add_metric([w], float(hb.rejected))
                if hb.stats is not None:
                    for k, fam in counters.items():
                        fam.add_metric([w], float(getattr(hb.stats, k)))
                if hb.kv is not None:  # those that hold a pool
                    for k, fam in kv.items():
                        fam.add_metric([w], float(getattr(hb.kv, k)))
        yield from (up, step, epoch, rejected, *counters.values(), *kv.values())


class Metrics:
    """The gateway's metrics; implements the runner's ``Observer``."""

    def __init__(self, model: str, sync: Synchroniser | None = None, concurrency: int = 1,
                 context_length: int = 0, kv_tokens: int = 0, dtype: str = "",
                 execution: str = "", quantize: str = "none"):
        self.registry = r = CollectorRegistry()
        self.model = model
        # the stages' KV budget, or (none set) every slot's whole context
        self.capacity = max(1, kv_tokens or concurrency * context_length)
        self.held_tokens = 0  # prompt + generated tokens of the running requests
        self.lock = threading.Lock()
        self.requests = Counter("treepipe_requests", "finished requests by finish reason "
                                "(eos, length, stop, cancelled, deadline, stalled, failed)",
                                ["finish_reason"], registry=r)
        self.g_waiting = Gauge("treepipe_requests_waiting", "requests queued for a pipeline "
                               "slot (or, with a KV budget, for blocks)", registry=r)
        self.g_running = Gauge("treepipe_requests_running", "requests being decoded", registry=r)
        self.ttft = Histogram("treepipe_time_to_first_token_seconds",
                              "request arrival to first token", buckets=REQUEST_BUCKETS,
                              registry=r)
        self.tbt = Histogram("treepipe_inter_token_latency_seconds",
                             "time between consecutive tokens of a request (TBT)",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("treepipe_e2e_request_latency_seconds",
                             "request arrival to its last token", buckets=REQUEST_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("treepipe_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("treepipe_generation_tokens", "tokens generated",
                                         registry=r)
        self.steps = Counter("treepipe_spec_steps", "pipeline steps of finished requests",
                             registry=r)
        self.hits = Counter("treepipe_spec_hits", "verified tokens found in the speculative "
                            "tree", registry=r)
        self.verified = Counter("treepipe_spec_verifications", "verified tokens after a "
                                "request's first (hits + flushes)", registry=r)
        self.flushes = Counter("treepipe_spec_flushes", "misses: verified tokens not in the "
                               "tree, each flushing the request's pipeline", registry=r)
        self.per_step = Histogram("treepipe_spec_tokens_per_step", "verified tokens per "
                                  "pipeline step, one sample per request",
                                  buckets=PER_STEP_BUCKETS, registry=r)
        labels = ["model_name"]
        # vLLM's names, for what vLLM has a name for (llm-d's endpoint picker, dashboards)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "requests queued (vLLM name)",
                               labels, registry=r).labels(model)
        self.v_running = Gauge("vllm:num_requests_running", "requests decoding (vLLM name)",
                               labels, registry=r).labels(model)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "request arrival to "
                                "first token (vLLM name)", labels, buckets=REQUEST_BUCKETS,
                                registry=r).labels(model)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "time between consecutive "
                               "tokens of a request (vLLM name)", labels, buckets=TOKEN_BUCKETS,
                               registry=r).labels(model)
        # arrival to submission: waiting for a slot (and, with a KV budget, for blocks),
        # vLLM's time in the WAITING state
        self.v_queue = Histogram("vllm:request_queue_time_seconds", "request arrival to its "
                                 "submission to the pipeline: the queue (vLLM name)", labels,
                                 buckets=REQUEST_BUCKETS, registry=r).labels(model)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "request arrival to its "
                               "last token (vLLM name)", labels, buckets=REQUEST_BUCKETS,
                               registry=r).labels(model)
        self.v_prompt = Counter("vllm:prompt_tokens", "prompt tokens of finished requests "
                                "(vLLM name)", labels, registry=r).labels(model)
        self.v_generation = Counter("vllm:generation_tokens", "tokens generated (vLLM name)",
                                    labels, registry=r).labels(model)
        self.v_success = Counter("vllm:request_success", "finished requests by vLLM's "
                                 "finished_reason: stop (EOS or a stop string), length, "
                                 "abort (cancelled, deadline, failed; vLLM name)",
                                 [*labels, "finished_reason"], registry=r)
        spec = "(a tree level verified: one draft of one position; vLLM name)"
        self.v_drafts = Counter("vllm:spec_decode_num_drafts", f"speculative drafts {spec}",
                                labels, registry=r).labels(model)
        self.v_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens "
                                      f"verified {spec}", labels, registry=r).labels(model)
        self.v_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens the "
                                  f"target accepted: hits {spec}", labels,
                                  registry=r).labels(model)
        self.v_accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      f"accepted draft tokens by position {spec}",
                                      [*labels, "position"], registry=r).labels(model, "0")
        # the stages' pools: blocks of DEFAULT_BLOCK_SIZE rows, the budget in whole blocks
        info = Gauge("vllm:cache_config_info", "KV-cache configuration: the stages' pool "
                     "(vLLM name)", [*labels, "block_size", "num_gpu_blocks"], registry=r)
        info.labels(model, str(DEFAULT_BLOCK_SIZE), str(pool_blocks(self.capacity))).set(1)
        # which weights' dtype, quantization and execution mode the pipeline was configured
        # with (--dtype, model.quantize, model.execution: auto is compiled on a GPU, tuned
        # on a CPU)
        Gauge("treepipe_model_info", "the pipeline's dtype, quantization and execution mode",
              ["model", "dtype", "quantize", "execution"],
              registry=r).labels(model, dtype, quantize, execution).set(1)
        r.register(_KvUsage(model, sync, self._estimate))
        if sync is not None:
            r.register(_Workers(sync))

    # ---- Observer ------------------------------------------------------------------------
    def queued(self, delta: int) -> None:
        """A request joined (+1) or left (-1) the queue."""
        self.g_waiting.inc(delta)
        self.v_waiting.inc(delta)

    def admitted(self, queue_s: float) -> None:
        """A request left the queue for the pipeline after ``queue_s`` seconds."""
        self.v_queue.observe(queue_s)

    def running(self, delta: int, tokens: int) -> None:
        """A request took (+1) or gave back (-1) a pipeline slot, holding ``tokens``."""
        self.g_running.inc(delta)
        self.v_running.inc(delta)
        with self.lock:
            self.held_tokens += delta * tokens

    def _estimate(self) -> float:
        """The gateway's KV estimate: tokens the running requests hold over the budget."""
        with self.lock:
            return min(1.0, max(0.0, self.held_tokens / self.capacity))

    def tokens(self, timing: list[tuple[float, float]], first: bool) -> None:
        """Tokens arrived: ``timing`` is (ms since request, ms since previous) per token."""
        with self.lock:
            self.held_tokens += len(timing)
        for i, (since_req, since_prev) in enumerate(timing):
            if first and i == 0:
                self.ttft.observe(since_req / 1000)
                self.v_ttft.observe(since_req / 1000)
            else:
                self.tbt.observe(since_prev / 1000)
                self.v_itl.observe(since_prev / 1000)

    def finished(self, reason: str, prompt_tokens: int, generated: int, e2e_s: float,
                 stats: SpecStats | None) -> None:
        """A request ended (``stats`` is None when it did not run to its end)."""
        self.requests.labels(reason).inc()
        self.v_success.labels(self.model, vllm_finished(reason)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.v_prompt.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.v_generation.inc(generated)
        if generated:
            self.e2e.observe(e2e_s)
            self.v_e2e.observe(e2e_s)
        if stats is not None:
            self.steps.inc(stats.steps)
            self.hits.inc(stats.hits)
            self.verified.inc(stats.verified)
            self.flushes.inc(stats.misses)
            self.v_drafts.inc(stats.verified)
            self.v_draft_tokens.inc(stats.verified)
            self.v_accepted.inc(stats.hits)
            self.v_accepted_pos.inc(stats.hits)
            if stats.steps:
                self.per_step.observe(stats.verified / stats.steps)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
