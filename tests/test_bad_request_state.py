"""Garbage in an admitted request's Redis fields fails that request, never a worker.

Before, a malformed field (written by a buggy client holding the secret, or by hand)
made every worker raise while starting the request; the supervisor restarted them
into the same request, a crash loop that took the pipeline down.
"""

from __future__ import annotations

import pytest

from orchestrator.deploy.redis_server import free_port
from protocol.links.transport import open_inbox, open_outbox
from protocol.sync.control import Start
from protocol.sync.synchroniser import FAILED_PREFIX, BadRequestState, Synchroniser
from stages.runtime.worker import StageWorker
from tests.tiny_models import target_shards

GARBAGE = [("prompt", "not json"), ("prompt", '{"a": 1}'), ("params", '{"temperature": NaN}'),
           ("params", "[1, 2]"), ("stop", '["eos"]'), ("max_new", "many"),
           ("epoch", "x")]


@pytest.mark.parametrize("field, value", GARBAGE)
def test_a_worker_fails_the_request_and_serves_the_next(sync: Synchroniser, field: str,
                                                        value: str) -> None:
    shard = target_shards(2)[0]
    addr = f"127.0.0.1:{free_port()}"
    inbox, outbox = open_inbox("zmq", addr), open_outbox("zmq", f"127.0.0.1:{free_port()}")
    worker = StageWorker("stage0", sync, shard, inbox, outbox)
    try:
        epoch = sync.submit("bad", [1, 2, 3], {"temperature": 0.0}, 4, [])
        sync.r.hset(sync.req_key("bad"), field, value)
        with pytest.raises(BadRequestState if field != "params" or value.startswith("[")
                           else ValueError):
            st = sync.request("bad")
            if field == "params":  # well-formed JSON, bad numbers: the sampler refuses
                from protocol.requests.sampling_params import SamplingParams
                SamplingParams.from_wire(st.params)
        worker.handle(Start(epoch, ("bad",)))  # must not raise
        assert worker.joined == {} and worker.reqs == {}
        h = sync.r.hgetall(sync.req_key("bad"))
        assert h[b"status"] == b"cancelled"
        assert h[b"reason"].decode().startswith(FAILED_PREFIX)
        ends = [f for _, f in sync.events("bad", "0", 10) if "end" in f]
        assert ends and ends[0]["reason"].startswith(FAILED_PREFIX)
        # the worker arrived without it: the barrier ends it and frees the pipeline
        sync.arrive(epoch, 0, "draft")
        sync.arrive(epoch, 0, "stage1")
        assert sync.in_flight() == []
        # the next request is admitted and starts on this worker
        nxt = sync.submit("next", [1, 2, 3], {"temperature": 0.0}, 4, [])
        st = sync.request("next")
        assert st.status == "running" and st.epoch == nxt
        worker.epoch = nxt
        assert worker.takes_part(st)
    finally:
        inbox.close()
        outbox.close()


def test_a_request_whose_gateway_died_is_reaped(sync: Synchroniser) -> None:
    """A gateway leases each request it streams; a lapsed lease means its gateway died,
    and the next gateway that looks cancels the request instead of letting it hold the
    pipeline to its end."""
    import time

    from protocol.sync.synchroniser import LEASE_S

    sync.submit("r1", [1, 2, 3], {}, 8, [])
    sync.renew_lease("r1")
    assert not sync.orphaned("r1") and sync.reap_orphan() == []  # its gateway is alive
    sync.r.delete(sync.req_key("r1", "lease"))
    assert not sync.orphaned("r1")  # younger than two leases: its gateway may be slow
    old = int((time.time() - 3 * LEASE_S) * 1000)
    sync.r.hset(sync.req_key("r1"), "created_ms", old)
    assert sync.orphaned("r1")
    assert sync.reap_orphan(own={"r1"}) == []  # the caller streams it itself
    assert sync.reap_orphan() == ["r1"]
    h = sync.r.hgetall(sync.req_key("r1"))
    assert (h[b"status"], h[b"reason"]) == (b"cancelled", b"gateway lost")
    assert sync.reap_orphan() == [] and not sync.orphaned("r1")
    sync.submit("r2", [1, 2, 3], {}, 8, [])  # the pipeline takes the next request
