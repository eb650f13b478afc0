"""The gateway's admission on a real Redis: up to ``limits.concurrency`` requests in the
pipeline at once, a bounded FIFO queue behind them, RESOURCE_EXHAUSTED beyond it, and a
slot that frees the moment its request ends.  No workers run: admitted requests sit in
the synchroniser's batch, which is all admission looks at."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest

from orchestrator.serving.runner import Admitted, GatewayLimits, RequestError, RequestRunner
from protocol.sync.synchroniser import Synchroniser


class Conn:
    """A caller's connection (what a gRPC context or an HTTP request gives the runner)."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def time_remaining(self) -> float | None:
        return None


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def stream(runner: RequestRunner, adm: Admitted, conn: Conn, errors: list[BaseException]) -> None:
    """Run ``adm`` through ``runner`` in a thread, as a client's stream; errors collected."""

    def run() -> None:
        try:
            list(runner.generate(adm, conn))
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            errors.append(e)

    threading.Thread(target=run, daemon=True).start()


def running_prompts(sync: Synchroniser) -> list[int]:
    """The first prompt token of every request the pipeline runs (a name per request)."""
    return sorted(st.prompt[0] for st in map(sync.request, sync.in_flight())
                  if st.status == "running")


def test_concurrency_slots_fifo_queue_and_resource_exhausted(sync: Synchroniser) -> None:
    runner = RequestRunner(sync, "m", None, 100, [], GatewayLimits(
        64, max_new_tokens=16, default_new_tokens=8, concurrency=2, max_queue=2))
    conns: dict[int, Conn] = {}
    errors: list[BaseException] = []

    def send(name: int) -> None:
        conns[name] = Conn()
        stream(runner, Admitted([name], 4, {}, [], []), conns[name], errors)

    send(1)
    send(2)
    wait_for(lambda: running_prompts(sync) == [1, 2], "two requests run at once")
    send(3)
    wait_for(lambda: runner.waiting == 1, "the third waits")
    send(4)
    wait_for(lambda: runner.waiting == 2, "the fourth waits")
    with pytest.raises(RequestError) as full:  # the queue holds two: the fifth is refused
        next(runner.generate(Admitted([5], 4, {}, [], []), Conn()))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running_prompts(sync) == [1, 2]
    # the first one's client goes away: its slot goes to the head of the queue at once
    conns[1].active = False
    wait_for(lambda: running_prompts(sync) == [2, 3], "the third takes the freed slot")
    assert runner.waiting == 1
    # a client that gives up in the queue leaves it; the next arrival moves up
    conns[4].active = False
    wait_for(lambda: runner.waiting == 0, "the fourth left the queue")
    send(6)
    conns[2].active = False
    wait_for(lambda: running_prompts(sync) == [3, 6], "the sixth takes the freed slot")
    assert 4 not in running_prompts(sync) and not errors
    for c in conns.values():
        c.active = False


def test_oversized_prompt_is_refused_before_tokenizing(tmp_path) -> None:  # noqa: ANN001
    """A 3.5 MB prompt is refused by its byte count, not after seconds of tokenizing (the
    length check after tokenizing words its refusal in tokens)."""
    from orchestrator.models.random_model import save_byte_tokenizer
    from orchestrator.serving.runner import PROMPT_BYTES_PER_TOKEN, validate
    from protocol import treepipe_pb2
    from stages.model.tokenizer import TextTokenizer

    save_byte_tokenizer(tmp_path)
    tok = TextTokenizer.from_folder(tmp_path)
    limits = GatewayLimits(2048)
    huge = treepipe_pb2.GenerateRequest(prompt="x" * 3_500_000, max_tokens=4)
    with pytest.raises(RequestError) as e:
        validate(huge, "m", tok, 256, [], limits)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "3500000 bytes" in str(e.value) and "shorten it" in str(e.value)
    # just under the byte bound it is tokenized, and refused in tokens
    long = treepipe_pb2.GenerateRequest(prompt="x" * (2048 * PROMPT_BYTES_PER_TOKEN),
                                        max_tokens=4)
    with pytest.raises(RequestError, match="tokens"):
        validate(long, "m", tok, 256, [], limits)


def test_grpc_and_http_default_to_one_temperature() -> None:
    """A gRPC request without temperature samples at 1.0 (a fresh seed each), as an HTTP
    one does; 0 sent is greedy; the Python Client leaves it out unless given one."""
    from orchestrator.serving.client import Client
    from orchestrator.serving.openai_api import to_generate_request
    from orchestrator.serving.openai_models import CompletionRequest
    from orchestrator.serving.runner import validate
    from protocol import treepipe_pb2

    limits = GatewayLimits(512)
    bare = treepipe_pb2.GenerateRequest(prompt_ids=[1, 2], max_tokens=4)
    params = validate(bare, "m", None, 100, [], limits).params
    assert params["temperature"] == 1.0 and params["seed"] > 0
    http = to_generate_request(CompletionRequest.model_validate(
        {"model": "m", "prompt": [1, 2], "max_tokens": 4}))
    assert validate(http, "m", None, 100, [], limits).params["temperature"] == 1.0
    greedy = treepipe_pb2.GenerateRequest(prompt_ids=[1, 2], max_tokens=4)
    greedy.sampling.temperature = 0.0
    assert validate(greedy, "m", None, 100, [], limits).params["temperature"] == 0.0
    with Client("127.0.0.1:1") as c:  # the channel connects lazily: nothing is sent
        assert not c.request(prompt_ids=[1]).sampling.HasField("temperature")
        assert c.request(prompt_ids=[1], temperature=0).sampling.HasField("temperature")


def test_kv_budget_admits_in_arrival_order_and_refuses_what_never_fits(
        sync: Synchroniser) -> None:
    """With free slots, a request still waits until its worst case of KV blocks fits
    beside the running ones' (on a stage of 6 blocks: 3 for 1 + 4 tokens, 5 for 1 + 40);
    a small one behind a waiting big one does not overtake it; one that can never fit
    is refused at once, naming the limit."""
    from protocol import treepipe_pb2

    limits = GatewayLimits(512, max_new_tokens=64, default_new_tokens=4, concurrency=4,
                           kv_tokens=6 * 16, tree_width=4)
    runner = RequestRunner(sync, "m", None, 100, [], limits)
    conns: dict[int, Conn] = {}
    errors: list[BaseException] = []

    def send(name: int, max_new: int) -> None:
        conns[name] = Conn()
        adm = runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[name], max_tokens=max_new))
        stream(runner, adm, conns[name], errors)

    send(1, 4)
    send(2, 4)
    wait_for(lambda: running_prompts(sync) == [1, 2], "two fit the budget")
    send(3, 40)
    wait_for(lambda: runner.waiting == 1, "the big one waits for blocks, not for a slot")
    send(4, 4)
    wait_for(lambda: runner.waiting == 2, "the small one waits behind it")
    conns[1].active = False  # 3 blocks free: the small one would fit, the big one not
    wait_for(lambda: running_prompts(sync) == [2], "the first left")
    time.sleep(0.3)
    assert running_prompts(sync) == [2] and runner.waiting == 2
    conns[2].active = False  # 6 free: the big one runs; the small one still does not fit
    wait_for(lambda: running_prompts(sync) == [3], "the big one runs once it fits")
    time.sleep(0.3)
    assert running_prompts(sync) == [3] and runner.waiting == 1
    conns[3].active = False
    wait_for(lambda: running_prompts(sync) == [4], "then the small one")
    with pytest.raises(RequestError) as never:  # 10 + 64 tokens need 7 blocks of the 6
        runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[9] * 10, max_tokens=64))
    assert never.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 7 KV blocks on each stage, more than the 6" in str(never.value)
    assert "within 67 tokens" in str(never.value) and not errors
    conns[4].active = False


def test_admission_holds_to_the_smallest_fixed_pool_a_stage_reports(sync: Synchroniser) -> None:
    """A stage started with a smaller pool than the gateway's --kv-tokens (or a gateway
    run without one) must not be overbooked: the budget is the smallest fixed pool the
    participants' heartbeats report; a growable pool (no budget) limits nothing. Only a
    reading of every participant of the plan counts (as Synchroniser.kv_pool reads them): while one
    does not beat (restarting), or beats with another plan (the old plan's worker of
    that name on its way out), the last reading holds."""
    from protocol import treepipe_pb2

    def pool(worker: str, blocks: int, fixed: int, plan: str = "") -> None:
        sync.heartbeat(worker, {"plan": plan, "kv": {"blocks": blocks, "used": 0, "peak": 0,
                                                     "block_size": 16, "fixed": fixed}},
                       ttl_s=600)

    big = treepipe_pb2.GenerateRequest(prompt_ids=[9] * 10, max_tokens=64)  # 7 blocks
    limits = GatewayLimits(512, max_new_tokens=64, concurrency=4, tree_width=4)
    pool("draft", 8, 0)
    pool("stage0", 8, 0)  # growing: no limit
    pool("stage1", 999, 1)
    runner = RequestRunner(sync, "m", None, 100, [], limits)
    assert runner.validate(big).kv_budget == 999
    pool("stage1", 6, 1)  # a stage with 6 blocks: the same request can never fit it
    with pytest.raises(RequestError, match="needs 7 KV blocks on each stage, more than the 6"):
        runner.validate(big)
    limits.kv_tokens = 5 * 16  # the gateway's own budget, smaller still, wins
    with pytest.raises(RequestError, match="more than the 5"):
        runner.validate(big)
    pool("draft", 4, 1)  # the draft model's pool holds the same rows: it counts too
    with pytest.raises(RequestError, match="more than the 4"):
        runner.validate(big)
    pool("draft", 8, 0)
    with pytest.raises(RequestError, match="more than the 5"):
        runner.validate(big)
    limits.kv_tokens = 0
    sync.r.delete(sync.key("hb", "stage1"))  # restarting: the last reading holds
    small = treepipe_pb2.GenerateRequest(prompt_ids=[9], max_tokens=4)
    assert runner.validate(small).kv_budget == 6
    sync.r.set(sync.key("plan"), "B")  # a re-plan: the old plan's heartbeats do not count
    pool("stage1", 99, 1)
    assert runner.validate(small).kv_budget == 6
    for w in ("draft", "stage0"):
        pool(w, 8, 0, plan="B")
    pool("stage1", 12, 1, plan="B")
    assert runner.validate(small).kv_budget == 12


def test_a_replan_to_more_stages_reprices_the_running_reservations(
        sync: Synchroniser) -> None:
    """A running request was admitted at its worst case for two stages; after a re-plan
    to four a stage holds two more levels of its tree, and admission (start.lua) prices
    every running request at the stage count now: a request that fitted beside the
    two-stage worst case waits beside the four-stage one."""
    from protocol import treepipe_pb2
    from protocol.scheduling.kv_blocks import request_blocks
    from protocol.sync.synchroniser import participant_names

    w = 16
    two, four = request_blocks(1 + 40, 2, w), request_blocks(1 + 40, 4, w)
    assert four > two
    limits = GatewayLimits(512, max_new_tokens=64, concurrency=4,
                           kv_tokens=(two + four) * 16, tree_width=w)
    runner = RequestRunner(sync, "m", None, 100, [], limits)
    errors: list[BaseException] = []
    conns = [Conn(), Conn()]
    first = runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[1], max_tokens=40))
    assert first.kv_blocks == two
    stream(runner, first, conns[0], errors)
    wait_for(lambda: running_prompts(sync) == [1], "the first runs")
    sync.register(participant_names(4))  # the re-plan
    second = runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[2], max_tokens=40))
    assert second.kv_blocks == four
    stream(runner, second, conns[1], errors)
    # two + four blocks would have fitted; four + four do not: it waits for the first
    wait_for(lambda: runner.waiting == 1, "the second waits for blocks")
    assert running_prompts(sync) == [1]
    conns[0].active = False
    wait_for(lambda: running_prompts(sync) == [2], "then runs")
    conns[1].active = False
    assert not errors


def test_a_request_a_replan_made_too_big_for_a_pool_is_refused_with_the_fix(
        sync: Synchroniser) -> None:
    """It fitted a whole pool alone at two stages when the gateway checked it; a re-plan
    to four before it was submitted raised its worst case above the pool. start.lua
    refuses it (TOOBIG) and the client gets INVALID_ARGUMENT naming the longest request
    that fits now, rather than a request that runs a pool out of blocks."""
    import grpc

    from protocol import treepipe_pb2
    from protocol.scheduling.kv_blocks import longest_request, request_blocks
    from protocol.sync.synchroniser import participant_names

    w = 16
    two, four = request_blocks(1 + 40, 2, w), request_blocks(1 + 40, 4, w)
    limits = GatewayLimits(512, max_new_tokens=64, concurrency=4, kv_tokens=two * 16,
                           tree_width=w)
    runner = RequestRunner(sync, "m", None, 100, [], limits)
    adm = runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[1], max_tokens=40))
    assert adm.kv_blocks == two < four
    sync.register(participant_names(4))  # the re-plan
    with pytest.raises(RequestError) as e:
        list(runner.generate(adm, Conn()))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"needs {four} KV blocks on each stage, more than the {two}" in str(e.value)
    assert f"within {longest_request(two, 4, w)} tokens" in str(e.value)
    assert not sync.in_flight() and runner.waiting == 0 and runner.running == 0


def test_a_wait_beside_a_running_batch_is_no_stall_and_leaves_half_the_limit(
        sync: Synchroniser) -> None:
    """A request waiting to join beside a running one (as one a KV budget holds back
    after a re-plan) is not ended by the stall limit while it waits, however long. When
    the wait ends its clock has started again: the limit ends it if nothing moves then,
    but not at the first quiet poll (it did, when the clock ran on through the wait)."""
    from protocol import treepipe_pb2
    from stages.runtime.admission import next_joins
    from tests.conftest import PIPELINE_WORKERS

    for w in PIPELINE_WORKERS:  # workers that beat and never step
        sync.heartbeat(w, {"pid": 1, "inc": w, "plan": sync.layout_id()}, ttl_s=600)
    assert sync.ready()
    e = sync.submit("first", [1, 2, 3], {}, 16, [], slots=4)  # the batch: it runs
    for w in PIPELINE_WORKERS:  # the epoch's first barrier: the draft (scheduler) lets it in
        joins = next_joins(sync, PIPELINE_WORKERS, sync.layout_id(), len(PIPELINE_WORKERS) - 1,
                           0, []) if w == PIPELINE_WORKERS[0] else []
        sync.arrive(e, 0, w, {}, joins)
    runner = RequestRunner(sync, "m", None, 100, [], GatewayLimits(
        64, max_new_tokens=16, concurrency=4, stall_s=1.0, recover_s=30))
    errors: list[BaseException] = []
    stream(runner, runner.validate(treepipe_pb2.GenerateRequest(prompt_ids=[2], max_tokens=8)),
           Conn(), errors)
    wait_for(lambda: running_prompts(sync) == [1, 2], "the second waits to join")
    (rid,) = [r for r in sync.in_flight() if sync.request(r).prompt == [2]]
    assert sync.waits_beside_a_batch(rid)
    time.sleep(3.0)  # three times the limit
    assert not errors and sync.request(rid).status == "running"
    sync.cancel("first", "test")
    assert not sync.waits_beside_a_batch(rid)  # nothing runs beside it any more
    t = time.monotonic()
    wait_for(lambda: bool(errors), "the limit ends it once nothing moves")
    assert time.monotonic() - t >= 0.25, "ended at the first quiet poll after its wait"
    assert isinstance(errors[0], RequestError) and "made no progress" in str(errors[0])
