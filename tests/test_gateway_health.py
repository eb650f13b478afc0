"""The gateway's two health answers, on a real Redis: itself, and the pipeline behind it.

"" (what Kubernetes' readiness probe asks) says whether the gateway can take
requests: Redis answers.  ``treepipe.v1.Inference`` (what ``treepipe up --detach``
waits on) says whether every worker of the current plan heartbeats.  A re-plan
that reloads shards turns only the second one off, so the gateway is neither
restarted nor unlisted while it queues requests.
"""

from __future__ import annotations

import time
import uuid

from orchestrator.deploy.redis_server import RedisServer
from orchestrator.serving.client import Client
from orchestrator.serving.gateway import SERVICE, Gateway, GatewayLimits, InferenceService
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
                    c.generate(prompt_ids=[1, 2, 3], max_tokens=4, timeout_s=30)
                took = time.monotonic() - t
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert want in e.value.details() and lo <= took, (took, e.value.details())
    finally:
        gw.stop(0)
        redis.stop()
