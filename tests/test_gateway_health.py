"""The gateway's two health answers, on a real Redis: itself, and the pipeline behind it.

"" (what Kubernetes' readiness probe asks) says whether the gateway can take
requests: Redis answers.  ``treepipe.v1.Inference`` (what ``treepipe up --detach``
waits on) says whether every worker of the current plan heartbeats.  A re-plan
that reloads shards turns only the second one off, so the gateway is neither
restarted nor unlisted while it queues requests.
"""

from __future__ import annotations

import threading
import time
import uuid

from orchestrator.deploy.redis_server import RedisServer
from orchestrator.serving.client import Client
from orchestrator.serving.gateway import SERVICE, Gateway, GatewayLimits, InferenceService
from protocol import treepipe_pb2_grpc
from protocol.sync.synchroniser import Synchroniser

WORKERS = ["draft", "stage0", "stage1"]


def until(c: Client, want: tuple[str, str], timeout_s: float = 10.0) -> tuple[str, str]:
    """(health of "", health of SERVICE) once it equals ``want`` (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = (c.health(timeout_s=1.0), c.health(SERVICE, timeout_s=1.0))
        except Exception:  # noqa: BLE001 - the health servicer knows no status yet
            got = ("", "")
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_gateway_health_tracks_redis_and_the_pipeline() -> None:
    redis = RedisServer().start()
    sync = Synchroniser(redis.url, f"g{uuid.uuid4().hex[:6]}")
    gw = Gateway(InferenceService(sync, "tiny", None, 100, [0], GatewayLimits(256)),
                 "127.0.0.1:0").start()
    try:
        with Client(f"127.0.0.1:{gw.port}") as c:
            sync.register(WORKERS)  # workers not up yet (loading, or a re-plan)
            assert until(c, ("SERVING", "NOT_SERVING")) == ("SERVING", "NOT_SERVING")
            for w in WORKERS:
                sync.heartbeat(w, {"pid": 1, "inc": w, "plan": ""}, ttl_s=30)
            assert until(c, ("SERVING", "SERVING")) == ("SERVING", "SERVING")
            redis.stop()
            assert until(c, ("NOT_SERVING", "NOT_SERVING")) == ("NOT_SERVING", "NOT_SERVING")
    finally:
        gw.stop(0)
        redis.stop()


def test_stall_limit_waits_for_workers_coming_back() -> None:
    """No commit while every worker is up: the stall limit.  No commit while workers are
    down (a restart, a re-plan reloading shards): the longer recovery limit."""
    import grpc
    import pytest

    redis = RedisServer().start()
    sync = Synchroniser(redis.url, f"g{uuid.uuid4().hex[:6]}")
    limits = GatewayLimits(256, stall_s=0.5, recover_s=2.5)
    gw = Gateway(InferenceService(sync, "tiny", None, 100, [0], limits), "127.0.0.1:0").start()
    sync.register(WORKERS)
    try:
        with Client(f"127.0.0.1:{gw.port}") as c:
            # the message says which limit ended it; neither ends before its time
            for up, want, lo in ((False, "had workers down", 2.5),
                                 (True, "made no progress", 0.5)):
                for w in WORKERS:  # heartbeats that never commit anything
                    if up:
                        sync.heartbeat(w, {"pid": 1, "inc": w, "plan": ""}, ttl_s=30)
                t = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    c.generate(temperature=0, prompt_ids=[1, 2, 3], max_tokens=4, timeout_s=30)
                took = time.monotonic() - t
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert want in e.value.details() and lo <= took, (took, e.value.details())
    finally:
        gw.stop(0)
        redis.stop()


def test_health_answers_while_the_queue_is_full() -> None:
    """More callers than running + queued: the extra ones get RESOURCE_EXHAUSTED at once
    (not a wait inside gRPC), and a health check still answers promptly.  With a fixed
    pool of 32 handler threads, 50 waiting callers used to starve both."""
    import grpc

    from protocol import treepipe_pb2

    redis = RedisServer().start()
    sync = Synchroniser(redis.url, f"g{uuid.uuid4().hex[:6]}")
    sync.register(WORKERS)  # no worker runs: the admitted request never ends
    limits = GatewayLimits(256, concurrency=1, max_queue=40)
    service = InferenceService(sync, "tiny", None, 100, [0], limits)
    gw = Gateway(service, "127.0.0.1:0").start()
    chan = grpc.insecure_channel(f"127.0.0.1:{gw.port}")
    stub = treepipe_pb2_grpc.InferenceStub(chan)
    calls = [stub.Generate(treepipe_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4),
                           timeout=60) for _ in range(50)]
    codes: list[grpc.StatusCode] = []
    hints: list[str | None] = []  # the retry-after trailing metadata of each refusal

    def drain(call: grpc.Call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            codes.append(e.code())
            hints.append(dict(e.trailing_metadata() or ()).get("retry-after"))

    threads = [threading.Thread(target=drain, args=(c,), daemon=True) for c in calls]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        # 1 admitted + 40 queued hold a handler each; the other 9 were refused
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 9, codes
        assert hints == ["1"] * 9  # retry in a second
        t = time.monotonic()
        with Client(f"127.0.0.1:{gw.port}") as c:
            assert c.health(timeout_s=5) == "SERVING"
        assert time.monotonic() - t < 2.0
    finally:
        for c in calls:
            c.cancel()
        for t in threads:
            t.join(10)
        # the handlers notice their cancelled callers and end before Redis goes away
        deadline = time.monotonic() + 10
        while (service.runner.running or service.runner.waiting) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        chan.close()
        gw.stop(0)
        redis.stop()


def test_undecodable_request_is_invalid_argument() -> None:
    """Bytes that are no GenerateRequest (invalid UTF-8 in the prompt string) get
    INVALID_ARGUMENT with the reason, not gRPC's bare INTERNAL; the gateway serves on."""
    import grpc
    import pytest

    from protocol import treepipe_pb2

    redis = RedisServer().start()
    sync = Synchroniser(redis.url, f"g{uuid.uuid4().hex[:6]}")
    gw = Gateway(InferenceService(sync, "tiny", None, 100, [0], GatewayLimits(256)),
                 "127.0.0.1:0").start()
    raw = treepipe_pb2.GenerateRequest(prompt="ab", max_tokens=4).SerializeToString()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as chan:
            call = chan.unary_stream(f"/{SERVICE}/Generate")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as e:
                list(call(raw.replace(b"ab", b"\xff\xfe"), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bad UTF-8" in e.value.details() and "UTF-8" in e.value.details()
        with Client(f"127.0.0.1:{gw.port}") as c:
            assert c.health(timeout_s=5) == "SERVING"
    finally:
        gw.stop(0)
        redis.stop()
