"""Redis outages as the gateway sees them: bounded calls, the known-outage window and
the orphan reaper of a second gateway, on a real redis-server.

The outage bounds (``GatewayLimits.sync_outage_s``) hold only if no Redis call waits
for ever on a silent server, so every client has a socket timeout, and the blocking
reads stay under it.  While Redis is away every gateway's leases lapse together: a
second gateway must not take that for its peer being dead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

import protocol.sync.synchroniser as synchroniser
from orchestrator.serving.runner import OUTAGE_FRESH_S, GatewayLimits, RequestRunner
from protocol.sync.synchroniser import LEASE_S, SOCKET_TIMEOUT_S, Synchroniser


def test_every_sync_client_has_a_socket_timeout(sync: Synchroniser) -> None:
    # redis-py 5-7 default to none: a paused Redis would hold a call for ever
    kw = sync.r.connection_pool.connection_kwargs
    assert kw.get("socket_timeout") == SOCKET_TIMEOUT_S
    assert kw.get("socket_connect_timeout") == SOCKET_TIMEOUT_S


@pytest.fixture
def short_timeout(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Synchroniser]:
    """A synchroniser whose socket timeout is 0.5 s (blocking reads: 0.3 s a call)."""
    monkeypatch.setattr(synchroniser, "SOCKET_TIMEOUT_S", 0.5)
    monkeypatch.setattr(synchroniser, "BLOCK_MAX_S", 0.3)
    s = Synchroniser(redis_url, f"o{time.monotonic_ns()}")
    assert s.r.connection_pool.connection_kwargs["socket_timeout"] == 0.5
    yield s
    s.close()


def test_a_control_wait_longer_than_the_socket_timeout_is_no_lost_connection(
        short_timeout: Synchroniser) -> None:
    s = short_timeout
    t0 = time.monotonic()
    assert s.wait_ctl("stage0", 1.2) is None  # one BLPOP of 1.2 s: redis.TimeoutError
    assert 1.1 <= time.monotonic() - t0 < 5
    # a message sent after the first slice still arrives within the one call
    threading.Timer(0.7, lambda: s.r.rpush(s.key("ctl", "stage0"),
                                           '{"op": "start", "epoch": 3, "reqs": ["r"]}')).start()
    t0 = time.monotonic()
    got = s.wait_ctl("stage0", 3.0)
    assert got is not None and got.to_json()["op"] == "start"
    assert time.monotonic() - t0 < 2.5


def test_an_event_read_blocks_within_the_socket_timeout(short_timeout: Synchroniser) -> None:
    s = short_timeout
    for block_ms in (2000, 0):  # 0 is Redis's "for ever"
        t0 = time.monotonic()
        assert s.events("none", "0", block_ms) == []
        assert time.monotonic() - t0 < 1.0


def runner(sync: Synchroniser) -> RequestRunner:
    return RequestRunner(sync, "m", None, 100, [], GatewayLimits(64))


def test_a_known_outage_outlasts_a_late_health_report(sync: Synchroniser) -> None:
    """/health and new requests answer a known outage at once; the watcher reports one
    every socket timeout + 0.5 s, later on a loaded machine: the window spans two."""
    r = runner(sync)
    assert r.down_for() is None
    r.sync_state(False)
    assert r.down_for() is not None
    assert OUTAGE_FRESH_S >= 2 * (SOCKET_TIMEOUT_S + 0.5)
    # the last report came 7 s ago (one watcher period and a loaded machine's 1.5 s)
    r.down_seen -= 7.0
    r.down_since = (r.down_since or 0.0) - 40.0
    down = r.down_for()
    assert down is not None and down >= r.limits.sync_outage_s
    r.down_seen -= OUTAGE_FRESH_S  # no report for longer: the outage is no longer known
    assert r.down_for() is None
    r.sync_state(False)
    r.sync_state(True)  # any call that succeeds ends it at once
    assert r.down_for() is None


def lapse(sync: Synchroniser, rid: str) -> None:
    """``rid``'s lease lapsed, and it is older than two leases (orphaned, if its gateway
    is gone)."""
    sync.r.delete(sync.req_key(rid, "lease"))
    sync.r.hset(sync.req_key(rid), "created_ms", int((time.time() - 3 * LEASE_S) * 1000))


def test_a_second_gateway_does_not_reap_a_request_whose_lease_lapsed_in_an_outage(
        sync: Synchroniser, redis_url: str) -> None:
    """Two gateways on one Redis: an outage between 10 and 30 s lapses gateway A's lease
    while A waits it out; B, back first, must leave A's request alone until A could renew
    it, and A renews every lease it holds as soon as Redis answers."""
    other = Synchroniser(redis_url, sync.pipeline)
    try:
        a, b = runner(sync), runner(other)
        sync.submit("ra", [1, 2, 3], {}, 8, [])
        a.owned.add("ra")
        sync.renew_lease("ra")
        a.sync_state(False)  # the outage, as both gateways' calls see it
        b.sync_state(False)
        lapse(sync, "ra")
        b.sync_state(True)  # B is back first; A has not renewed yet
        assert other.orphaned("ra")
        assert other.reap_orphan(b.owned) == []  # held: A may be waiting the outage out
        assert sync.request("ra").status == "running"
        a.sync_state(True)  # A is back: its leases first
        assert sync.r.exists(sync.req_key("ra", "lease"))
        assert not other.orphaned("ra")
        # once the hold is over, a gateway that really died is reaped as before
        other.reap_hold_until = 0.0
        assert other.reap_orphan(b.owned) == []  # A's lease is live
        lapse(sync, "ra")
        assert other.reap_orphan(b.owned) == ["ra"]
        st = sync.request("ra")
        assert (st.status, st.reason) == ("cancelled", "gateway lost")
    finally:
        other.close()


def test_reaping_is_held_for_the_outage_bound_and_a_lease(sync: Synchroniser) -> None:
    r = runner(sync)
    r.sync_state(False)
    left = sync.reap_hold_until - time.monotonic()
    want = r.limits.sync_outage_s + LEASE_S
    assert want - 1 < left <= want
    sync.hold_reaping(1.0)  # a shorter hold keeps the longer one
    assert sync.reap_hold_until - time.monotonic() > want - 1
