"""The synchroniser's join script on a real Redis: plan take-over and self-started epochs.

Workers announce themselves with the plan (stage layout) they were started with;
these tests drive the script the way workers do (heartbeat, then join) and check
when it switches the plan and when it restarts the running request.
"""

from __future__ import annotations

import uuid

import pytest

from orchestrator.redis_server import RedisServer
from orchestrator.sync import Synchroniser

OLD = ["draft", "stage0", "stage1"]
NEW = ["draft", "stage0", "stage1", "stage2", "stage3"]


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture
def sync(redis_url):
    s = Synchroniser(redis_url, f"j{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


def beat(sync: Synchroniser, worker: str, plan: str) -> str:
    inc = uuid.uuid4().hex
    # a long TTL: a pause of the test machine must not expire it; "down" is a delete
    sync.heartbeat(worker, {"pid": 1, "inc": inc, "plan": plan}, ttl_s=600)
    return inc


def up(sync: Synchroniser, names: list[str], plan: str) -> None:
    """Start a whole plan: every worker beats and joins at startup."""
    for w in names:
        beat(sync, w, plan)
        sync.join(w, plan, names, startup=True)


def running(sync: Synchroniser) -> str:
    rid = uuid.uuid4().hex[:8]
    sync.submit(rid, [1, 2, 3], {}, 16, [])
    return rid


def ctl(sync: Synchroniser, worker: str) -> list[dict]:
    out = []
    while (m := sync.wait_ctl(worker, 0.01)) is not None:
        out.append(m)
    return out


def test_first_start_sets_plan_and_participants(sync):
    # a worker beats before it joins: a plan with no live worker takes nothing over
    assert sync.join("stage0", "A", OLD, startup=True) == ("IDLE", "")
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=True) == ("IDLE", "A")
    assert sync.plan() == "A" and sync.participants() == OLD
    assert not sync.ready()  # nobody has a heartbeat yet
    up(sync, OLD, "A")
    assert sync.ready()


def test_restarted_worker_resumes_the_running_request(sync):
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "req": rid, "epoch": e0}]
    # stage1 dies and comes back (a pod recreated): its startup join opens a new epoch
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "req": rid, "epoch": e0 + 1, "resume": True}]
    assert sync.request(rid).epoch == e0 + 1
    # a periodic (not startup) join of the same plan changes nothing
    assert sync.join("stage0", "A", OLD, startup=False) == ("RUNNING", "A")
    assert sync.epoch() == e0 + 1


def test_restart_waits_while_a_participant_is_down(sync):
    up(sync, OLD, "A")
    running(sync)
    e0 = sync.epoch()
    sync.r.delete(sync.key("hb", "stage0"))  # stage0 is down too
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("WAITING", "A")
    assert sync.epoch() == e0
    # the last one up starts the epoch
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))


def test_replan_new_workers_take_over_and_the_last_one_resumes(sync):
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    for w in OLD:  # the old workers stop (a clean exit drops the heartbeat)
        sync.r.delete(sync.key("hb", w))
    for i, w in enumerate(NEW):
        beat(sync, w, "B")
        status, _ = sync.join(w, "B", NEW, startup=True)
        assert sync.plan() == "B" and sync.participants() == NEW
        if i == 0:  # the take-over fences the request: the old plan's epoch is over
            fenced = sync.request(rid)
            assert fenced.epoch == e0 + 1 and fenced.plan == "B"
            assert all(ctl(sync, x) == [] for x in OLD + NEW)
        assert status == ("RESUMED" if i == len(NEW) - 1 else "WAITING")
    st = sync.request(rid)
    assert st.epoch == e0 + 2 and st.status == "running" and st.plan == "B"
    assert ctl(sync, "stage3") == [{"op": "start", "req": rid, "epoch": e0 + 2, "resume": True}]


def test_old_plan_worker_does_not_take_part_after_a_take_over(sync):
    """A worker of plan A that still holds a start of A's epoch finds the request moved on."""
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    for w in ("stage0", "stage1"):  # A's stages are being replaced
        sync.r.delete(sync.key("hb", w))
    beat(sync, "stage2", "B")  # one live worker each: no take-over yet
    assert sync.join("stage2", "B", NEW, startup=True) == ("RUNNING", "A")
    beat(sync, "stage3", "B")  # B has more live workers than A
    assert sync.join("stage3", "B", NEW, startup=True) == ("WAITING", "B")
    st = sync.request(rid)
    assert (st.epoch, st.plan) == (e0 + 1, "B")
    # A's stage0 still computes epoch e0: its arrive is fenced off, nothing commits
    assert sync.arrive(rid, e0, 0, "stage0", token=5) == "STALE"
    assert sync.request(rid).log == []


def test_stale_heartbeat_of_the_old_plan_does_not_count(sync):
    up(sync, OLD, "A")
    running(sync)
    e0 = sync.epoch()
    # the old stage0 still beats with plan A while the new plan's workers come up
    for w in NEW:
        if w != "stage0":
            beat(sync, w, "B")
            sync.join(w, "B", NEW, startup=True)
    assert sync.plan() == "B" and not sync.ready() and sync.waiting() == ["stage0"]
    beat(sync, "stage0", "B")
    assert sync.join("stage0", "B", NEW, startup=True)[0] == "RESUMED"
    assert sync.ready() and sync.epoch() > e0


def test_superseded_worker_cannot_take_a_running_plan(sync):
    # scaled down from 4 stages (plan B) to 2 (plan A); B's stage3 is not gone yet and
    # even restarts: it changes nothing while A can run
    up(sync, OLD, "A")
    running(sync)
    e0 = sync.epoch()
    beat(sync, "stage3", "B")
    for startup in (True, False):
        assert sync.join("stage3", "B", NEW, startup=startup) == ("RUNNING", "A")
    assert sync.plan() == "A" and sync.participants() == OLD and sync.epoch() == e0


def test_restart_while_a_peer_beat_lapsed_resumes_once_it_beats(sync):
    """A restarted worker finds a peer's heartbeat briefly missing: the epoch is pending,
    and the peer's next heartbeat join starts it (nobody waits for an input timeout)."""
    up(sync, OLD, "A")
    running(sync)
    e0 = sync.epoch()
    sync.r.delete(sync.key("hb", "stage0"))
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("WAITING", "A")
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=False) == ("RESUMED", str(e0 + 1))
    assert sync.join("draft", "A", OLD, startup=False) == ("RUNNING", "A")  # once only


def test_idle_pipeline_needs_no_epoch(sync):
    up(sync, OLD, "A")
    e0 = sync.epoch()
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("IDLE", "A")
    assert sync.epoch() == e0


def test_leave_drops_only_its_own_heartbeat(sync):
    inc = beat(sync, "stage0", "A")
    sync.leave("stage0", "someone-else")  # a successor's heartbeat stays
    assert sync.r.exists(sync.key("hb", "stage0"))
    sync.leave("stage0", inc)
    assert not sync.r.exists(sync.key("hb", "stage0"))


def test_two_partly_up_plans_do_not_take_turns(sync):
    """Plan A with one stage restarting and two lingering workers of an older plan B:
    neither may take the pipeline from the other, so no epoch churns."""
    up(sync, OLD, "A")
    running(sync)
    e0 = sync.epoch()
    sync.r.delete(sync.key("hb", "stage1"))  # A's stage1 is restarting
    for w in ("stage2", "stage3"):
        beat(sync, w, "B")
    for _ in range(3):  # heartbeat joins of everyone alive, round after round
        for w, plan, names in (("stage2", "B", NEW), ("stage3", "B", NEW),
                               ("draft", "A", OLD), ("stage0", "A", OLD)):
            sync.join(w, plan, names, startup=False)
    assert sync.plan() == "A" and sync.epoch() == e0
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))


def test_resume_from_an_input_timeout(sync):
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    # a worker still waiting in an epoch that is over changes nothing
    assert sync.resume(rid, e0 - 1) == ("RUNNING", "A")
    assert sync.epoch() == e0
    # while a participant is down the epoch is pending, not started on a dead link
    sync.r.delete(sync.key("hb", "stage0"))
    assert sync.resume(rid, e0) == ("WAITING", "A")
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=False) == ("RESUMED", str(e0 + 1))
    # with everyone up it starts at once
    assert sync.resume(rid, e0 + 1) == ("RESUMED", str(e0 + 2))
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "req": rid, "epoch": e0 + 2, "resume": True}]


def test_resume_without_a_request_is_a_fresh_epoch(sync):
    sync.register(OLD)
    e0 = sync.epoch()
    assert sync.resume() == ("IDLE", str(e0 + 1))
