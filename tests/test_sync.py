"""The synchroniser's join script on a real Redis: plan take-over and self-started epochs.

Workers announce themselves with the plan (stage layout) they were started with;
these tests drive the script the way workers do (heartbeat, then join) and check
when it switches the plan and when it restarts the running request.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest
import torch

from orchestrator.deploy.redis_server import RedisServer
from protocol.requests.stopping import end_reason
from protocol.sync.control import ControlError, Start, Step, Verdict, parse_control
from protocol.sync.synchroniser import Busy, Join, Report, SyncError, Synchroniser
from stages.runtime.admission import next_joins
from stages.speculation.step import decide, root_children
from stages.speculation.tree import Level, SpecTree

OLD = ["draft", "stage0", "stage1"]
NEW = ["draft", "stage0", "stage1", "stage2", "stage3"]


@pytest.fixture
def sync(redis_url):
    s = Synchroniser(redis_url, f"j{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


def beat(sync: Synchroniser, worker: str, plan: str, pool: int = 0) -> str:
    """A heartbeat of ``worker`` running ``plan`` (with a fixed KV pool of ``pool``
    blocks, as stages/runtime/kv_pool.py kv_use reports it; 0: none)."""
    inc = uuid.uuid4().hex
    info: dict[str, object] = {"pid": 1, "inc": inc, "plan": plan}
    if pool:
        info["kv"] = {"blocks": pool, "used": 0, "peak": 0, "block_size": 16, "fixed": 1}
    # a long TTL: a pause of the test machine must not expire it; "down" is a delete
    sync.heartbeat(worker, info, ttl_s=600)
    return inc


def up(sync: Synchroniser, names: list[str], plan: str, pool: int = 0) -> None:
    """Start a whole plan: every worker beats (``pool``: beat) and joins at startup."""
    for w in names:
        beat(sync, w, plan, pool)
        sync.join(w, plan, names, startup=True)


def running(sync: Synchroniser) -> str:
    rid = uuid.uuid4().hex[:8]
    sync.submit(rid, [1, 2, 3], {}, 16, [])
    return rid


def RESUMED(epoch: int) -> dict:  # noqa: N802 - a message constant, by epoch
    """The start message of a resumed epoch: every running request waits in line, and the
    scheduler lets them join at the epoch's barriers."""
    return {"op": "start", "epoch": epoch, "reqs": [], "resume": True, "more": True}


def ctl(sync: Synchroniser, worker: str) -> list[dict]:
    out = []
    while (m := sync.wait_ctl(worker, 0.01)) is not None:
        out.append(m.to_json())  # the wire form, to compare with what the scripts write
    return out


def test_first_start_sets_plan_and_participants(sync):
    # a worker beats before it joins: a plan with no live worker takes nothing over
    assert sync.join("stage0", "A", OLD, startup=True) == ("IDLE", "")
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=True) == ("IDLE", "A")
    assert sync.layout_id() == "A" and sync.participants() == OLD
    assert not sync.ready()  # nobody has a heartbeat yet
    up(sync, OLD, "A")
    assert sync.ready()


def test_restarted_worker_resumes_the_running_request(sync):
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    # an idle pipeline starts an epoch with the request first in line to join
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "epoch": e0, "reqs": [], "more": True}]
    # stage1 dies and comes back (a pod recreated): its startup join opens a new epoch
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))
    for w in OLD:
        assert ctl(sync, w) == [RESUMED(e0 + 1)]
    assert sync.in_flight() == [rid]
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
        assert sync.layout_id() == "B" and sync.participants() == NEW
        if i == 0:  # the take-over fences the request: the old plan's epoch is over
            fenced = sync.request(rid)
            assert fenced.epoch == e0 + 1 and fenced.layout_id == "B"
            assert all(ctl(sync, x) == [] for x in OLD + NEW)
        assert status == ("RESUMED" if i == len(NEW) - 1 else "WAITING")
    st = sync.request(rid)
    assert st.epoch == e0 + 2 and st.status == "running" and st.layout_id == "B"
    assert ctl(sync, "stage3") == [RESUMED(e0 + 2)] and sync.in_flight() == [rid]


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
    assert (st.epoch, st.layout_id) == (e0 + 1, "B")
    # A's stage0 still computes epoch e0: its arrive is fenced off, nothing commits
    assert sync.arrive(e0, 0, "stage0", {rid: Report(token=5)}) == "STALE"
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
    assert sync.layout_id() == "B" and not sync.ready() and sync.waiting() == ["stage0"]
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
    assert sync.layout_id() == "A" and sync.participants() == OLD and sync.epoch() == e0


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
    assert sync.layout_id() == "A" and sync.epoch() == e0
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))


def test_resume_from_an_input_timeout(sync):
    up(sync, OLD, "A")
    rid = running(sync)
    e0 = sync.epoch()
    # a worker still waiting in an epoch that is over changes nothing
    assert sync.resume(e0 - 1) == ("RUNNING", "A")
    assert sync.epoch() == e0
    # while a participant is down the epoch is pending, not started on a dead link
    sync.r.delete(sync.key("hb", "stage0"))
    assert sync.resume(e0) == ("WAITING", "A")
    beat(sync, "stage0", "A")
    assert sync.join("stage0", "A", OLD, startup=False) == ("RESUMED", str(e0 + 1))
    # with everyone up it starts at once
    assert sync.resume(e0 + 1) == ("RESUMED", str(e0 + 2))
    for w in OLD:
        assert ctl(sync, w) == [RESUMED(e0 + 2)]
    assert sync.in_flight() == [rid]


def test_resume_without_a_request_is_a_fresh_epoch(sync):
    sync.register(OLD)
    e0 = sync.epoch()
    assert sync.resume() == ("IDLE", str(e0 + 1))


# ---- arrive.lua: the step barrier ---------------------------------------------------------------

def leader(sync: Synchroniser, step: int, names: list[str] = OLD) -> list[Join]:
    """The joins the draft service (the scheduler) hands the barrier of ``step``: the
    scheduling core's rule (stages/runtime/admission.py) on the batch as Redis holds it
    (each running member's KV worst case, and the prefill chunks of those prefilling)."""
    stages = max(len(names) - 1, 1)
    held, prefilling = 0, []
    for m in sync.r.smembers(sync.key("batch")):
        st = sync.request(m.decode())
        if st.status != "running":
            continue
        held += st.kv_need(stages)
        steps = st.prefill_steps(stages)
        t = step - joined(sync, st.rid) + steps - 1  # its prefill step now
        if 0 <= t < steps - 1:
            prefilling.append((st, t))
    return next_joins(sync, names, sync.layout_id(), stages, held, prefilling)


def admitted(sync: Synchroniser, max_new: int = 16, stop: tuple[int, ...] = ()) -> tuple[str, int]:
    """A running request on OLD (draft, stage0, stage1): the idle pipeline's epoch starts,
    and the request joins at its first barrier (step 0), so its step 0 is step 1."""
    sync.register(OLD)
    rid = uuid.uuid4().hex[:8]
    epoch = sync.submit(rid, [1, 2, 3], {}, max_new, list(stop))
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "epoch": epoch, "reqs": [], "more": True}]
    barrier(sync, epoch, 0, {})
    assert verdicts(sync)[0].join == (rid,) and joined(sync, rid) == 1
    return rid, epoch


def barrier(sync: Synchroniser, epoch: int, step: int,
            reqs: dict[str, tuple[int, int, list[tuple[int, int]]]]) -> list[str]:
    """Every participant of OLD arrives at ``step`` with a report per request of ``reqs``
    (rid -> (token, new root id, children)): the draft names the children, the new root
    id and who joins next (:func:`leader`), the last stage brings the token.  Returns the
    statuses in order."""
    return [sync.arrive(epoch, step, "draft",
                        {r: Report(root_id=root, children=tuple(kids))
                         for r, (_, root, kids) in reqs.items()}, leader(sync, step)),
            sync.arrive(epoch, step, "stage0", {r: Report() for r in reqs}),
            sync.arrive(epoch, step, "stage1",
                        {r: last(sync, r, t) for r, (t, _, _) in reqs.items()})]


def last(sync: Synchroniser, rid: str, token: int) -> Report:
    """The last stage's report of ``token`` for ``rid``: it ends the request as the
    stage's stop rule says (stages/runtime/worker.py, protocol/requests/stopping.py)."""
    if token < 0:
        return Report()
    st = sync.request(rid)
    return Report(token=token,
                  end=end_reason(token, len(st.log) + 1, st.max_new, st.stop_ids) or "")


def one(sync: Synchroniser, rid: str, epoch: int, step: int, token: int = -1, root: int = -1,
        children: list[tuple[int, int]] | None = None) -> list[str]:
    """:func:`barrier` of a batch of one request."""
    return barrier(sync, epoch, step, {rid: (token, root, children or [])})


def verdicts(sync: Synchroniser) -> list[Step]:
    """The one verdict message each participant got (all must be the same)."""
    got = [[parse_control(m) for m in ctl(sync, w)] for w in OLD]
    assert all(len(g) == 1 for g in got), got
    assert got[0] == got[1] == got[2]
    assert isinstance(got[0][0], Step)
    return got[0]


def verdict(sync: Synchroniser, rid: str) -> Verdict:
    """The verdict for ``rid`` in the one message each participant got."""
    (msg,) = verdicts(sync)
    return dict(msg.verdicts)[rid]


def test_arrive_counts_waits_then_sends_one_verdict(sync):
    rid, e = admitted(sync)
    assert sync.arrive(e, 1, "draft", {rid: Report(root_id=50)}) == "WAIT"
    assert sync.arrive(e, 1, "stage0", {rid: Report()}) == "WAIT"
    assert all(ctl(sync, w) == [] for w in OLD)  # nobody hears before everyone arrived
    assert sync.arrive(e, 1, "stage1", {rid: last(sync, rid, 9)}) == "GO"
    (v,) = verdicts(sync)
    assert v == Step(e, 1, ((rid, Verdict(token=9, child=-1, root=50, done=False)),))
    raw = sync.r.eval("return redis.call('HGET', KEYS[1], 'step')", 1, sync.req_key(rid))
    assert raw == b"0"


def test_arrive_twice_is_dup_and_not_counted(sync):
    rid, e = admitted(sync)
    assert sync.arrive(e, 1, "stage0", {rid: Report()}) == "WAIT"
    assert sync.arrive(e, 1, "stage0", {rid: Report()}) == "DUP"
    assert sync.arrive(e, 1, "draft", {rid: Report(root_id=5)}) == "WAIT"  # the DUP did not count
    assert sync.arrive(e, 1, "stage1", {rid: last(sync, rid, 4)}) == "GO"
    verdicts(sync)


def test_arrive_with_an_old_epoch_is_stale(sync):
    rid, e = admitted(sync)
    assert sync.arrive(e - 1, 0, "stage0", {rid: Report(token=3)}) == "STALE"
    assert sync.request(rid).log == []
    assert all(ctl(sync, w) == [] for w in OLD)


def test_last_stage_token_is_committed_with_an_event(sync):
    rid, e = admitted(sync)
    one(sync, rid, e, 1, token=9, root=50)
    assert sync.request(rid).log == [9]
    sync.arrive(e, 2, "stage1", {rid: last(sync, rid, 11)})
    assert sync.request(rid).log == [9, 11]  # committed at arrival, before the barrier ends
    toks = [(ev["tok"], ev["i"]) for _, ev in sync.events(rid, "0", 0) if "tok" in ev]
    assert toks == [("9", "0"), ("11", "1")]


def test_hit_names_the_child_and_miss_the_new_root(sync):
    rid, e = admitted(sync)
    one(sync, rid, e, 1, token=9, root=50)
    verdicts(sync)
    kids = [(3, 51), (5, 52), (7, 53)]
    assert one(sync, rid, e, 2, token=5, root=60, children=kids)[-1] == "GO"
    v = verdict(sync, rid)
    assert (v.token, v.child, v.hit) == (5, 52, True)
    one(sync, rid, e, 3, token=8, root=70, children=[(3, 61)])
    v = verdict(sync, rid)
    assert v == Verdict(token=8, child=-1, root=70, done=False) and v.miss
    one(sync, rid, e, 4, root=80, children=[(3, 71)])  # nothing verified this step
    assert verdict(sync, rid) == Verdict(token=-1, child=-1, root=80, done=False)
    assert sync.schedule(rid) == "|hm."
    assert sync.request(rid).log == [9, 5, 8]


def test_arrive_decides_what_the_step_core_decides(sync):
    """arrive.lua's child for a token equals stages.speculation.step.decide on the draft's tree."""
    rid, e = admitted(sync, max_new=64)
    one(sync, rid, e, 1, token=9, root=50)
    verdicts(sync)
    tree = SpecTree(9, 3)
    # root children with a repeated token (3): both must pick the first
    tree.append_level(Level(torch.zeros(4, dtype=torch.long), torch.tensor([3, 5, 3, 7]),
                            torch.full((4,), 0.25, dtype=torch.float64)))
    owner_children = root_children(tree)  # what the draft service reports
    for step, token in enumerate([3, 5, 7, 4], start=2):
        one(sync, rid, e, step, token=token, root=1000 + step, children=owner_children)
        assert verdict(sync, rid) == decide(tree, token, 1000 + step), token
    assert sync.schedule(rid) == "|hhhm"


@pytest.mark.parametrize("stop,max_new,reason", [((11,), 16, "eos"), ((), 2, "length")])
def test_eos_or_length_ends_and_the_verdict_is_done(sync, stop, max_new, reason):
    rid, e = admitted(sync, max_new=max_new, stop=stop)
    assert sync.in_flight() == [rid]
    one(sync, rid, e, 1, token=9, root=50)
    assert not verdict(sync, rid).done
    one(sync, rid, e, 2, token=11, root=60)
    (msg,) = verdicts(sync)
    v = dict(msg.verdicts)[rid]
    assert v.done and v.token == 11 and not msg.goes_on
    st = sync.request(rid)
    assert (st.status, st.reason, st.log) == ("done", reason, [9, 11])
    ends = [ev for _, ev in sync.events(rid, "0", 0) if "end" in ev]
    assert ends == [{"end": "done", "reason": reason, "t": ends[0]["t"]}]
    assert sync.in_flight() == []  # the pipeline is free again


def test_a_retried_submit_returns_the_admission_and_writes_nothing(sync):
    """runner.py resubmits the same id when the reply to a submit was lost: the retry
    must not admit the request a second time (delete its committed tokens, queue it to
    join the batch it is in, or find itself holding the only slot: BUSY)."""
    rid, e = admitted(sync)
    one(sync, rid, e, 1, token=9, root=50)
    verdicts(sync)
    before = {k: sync.r.dump(k) for k in sorted(sync.r.scan_iter(f"{sync.prefix}:*"))}
    assert sync.submit(rid, [1, 2, 3], {}, 16, []) == e  # one slot, held by rid itself
    after = {k: sync.r.dump(k) for k in sorted(sync.r.scan_iter(f"{sync.prefix}:*"))}
    assert after == before
    assert sync.in_flight() == [rid] and sync.request(rid).log == [9]
    assert all(ctl(sync, w) == [] for w in OLD)
    # one still waiting to join the batch is queued once
    b = uuid.uuid4().hex[:8]
    assert sync.submit(b, [4, 5], {}, 8, [], slots=2) == e
    assert sync.submit(b, [4, 5], {}, 8, [], slots=2) == e
    assert sync.in_flight() == [rid, b]
    # the same id with another prompt is not a retry: refused, nothing written
    with pytest.raises(SyncError, match="already running"):
        sync.submit(b, [6], {}, 8, [], slots=4)
    assert sync.request(b).prompt == [4, 5]



@pytest.mark.parametrize("stored", [None, "garbage", '["draft", 3]'])
def test_start_relies_on_the_participant_list_admit_checked_and_watched(
        sync, monkeypatch, stored):
    """start.lua does not check the participant list again: Synchroniser.admit's entry
    rule checked it, and the WATCH makes a change between that read and the script (here
    to none or garbage) abort the script's write, so admit reads and refuses it."""
    sync.register(OLD)
    entry, reads = sync._entry, []

    def entry_then_corrupt(*args):
        reads.append(entry(*args))
        if len(reads) == 1:
            sync.r.delete(sync.key("participants"))
            if stored is not None:
                sync.r.set(sync.key("participants"), stored)
        return reads[-1]

    monkeypatch.setattr(sync, "_entry", entry_then_corrupt)
    status, _why = sync.admit("r1", [1, 2, 3], {}, 8, [])
    assert len(reads) == 2 and reads[0][0] is None  # the first read let it in
    assert status == ("NOPIPE" if stored is None else "BAD")
    assert not sync.r.exists(sync.req_key("r1"), sync.req_key("r1", "ev"))
    assert sync.in_flight() == [] and sync.epoch() == 0
    assert all(ctl(sync, w) == [] for w in OLD)

def request_key_ttls(sync: Synchroniser, rid: str) -> dict[str, int]:
    """TTL in seconds of every key of request ``rid`` (-1: kept forever)."""
    keys = [sync.req_key(rid)] + [k.decode() for k in sync.r.scan_iter(sync.req_key(rid) + ":*")]
    return {k: sync.r.ttl(k) for k in keys}


def test_every_key_of_a_finished_request_expires(sync):
    """The token log too: arrive.lua creates it, after start.lua set the others' TTLs."""
    rid, e = admitted(sync, max_new=3)
    sync.renew_lease(rid)
    for step, token in enumerate([9, 5, 8], start=1):
        one(sync, rid, e, step, token=token, root=50 + step)
        done = verdict(sync, rid).done
    assert done and sync.request(rid).log == [9, 5, 8]
    ttls = request_key_ttls(sync, rid)
    # the hash, its log, events, schedule and the gateway's lease
    assert {k.rsplit(":", 1)[-1] for k in ttls} >= {rid, "log", "ev", "sched", "lease"}
    assert all(t > 0 for t in ttls.values()), ttls


def test_a_request_running_longer_than_the_ttl_keeps_its_state(redis_url):
    """Each commit renews the expiry: the TTL counts from a request's last token, not
    from its start, so a long generation never loses its prompt or log mid-run."""
    s = Synchroniser(redis_url, f"j{uuid.uuid4().hex[:8]}", ttl_s=2)
    try:
        rid, e = admitted(s, max_new=8)
        for step, token in enumerate([9, 5, 7], start=1):
            time.sleep(0.8)  # 2.4 s in all: past the TTL counted from the start
            one(s, rid, e, step, token=token, root=50 + step)
            verdict(s, rid)
        assert s.request(rid).log == [9, 5, 7]
        assert all(0 < t <= 2 for t in request_key_ttls(s, rid).values())
    finally:
        s.close()


def test_a_redis_restarted_from_its_log_keeps_the_keys_and_their_expiry(tmp_path):
    """The launcher's Redis persists its log (appendonly): after a restart the finished
    request is still there, for the hour the docs promise, and still expires."""
    server = RedisServer(data_dir=tmp_path / "data").start()
    try:
        s = Synchroniser(server.url, f"j{uuid.uuid4().hex[:8]}")
        rid, e = admitted(s, max_new=2)
        for step, token in enumerate([9, 5], start=1):
            one(s, rid, e, step, token=token, root=50 + step)
            verdict(s, rid)
        before = request_key_ttls(s, rid)
        s.close()
        server.stop()
        server.start()
        s = Synchroniser(server.url, s.pipeline)
        after = request_key_ttls(s, rid)
        assert set(after) == set(before) and s.request(rid).log == [9, 5]
        assert all(0 < after[k] <= before[k] for k in before), (before, after)
        s.close()
    finally:
        server.stop()


def test_a_heartbeat_while_the_last_barrier_completes_keeps_its_mark(sync):
    """The last stage commits a request's last token before the others arrive; a
    heartbeat's join in between (no request running any more) must leave the batch
    alone: clearing it lost the request's last schedule mark (a flaky stats test)."""
    rid, e = admitted(sync, max_new=2)
    one(sync, rid, e, 1, token=9, root=50)
    verdicts(sync)
    assert sync.arrive(e, 2, "stage1", {rid: last(sync, rid, 11)}) == "WAIT"
    assert sync.request(rid).status == "done"  # the client has its last token now
    for w in OLD:
        beat(sync, w, "")
        assert sync.join(w, "", OLD, startup=False)[0] == "IDLE"
    assert sync.in_flight() == [rid]  # it leaves at the barrier that completes now
    assert sync.arrive(e, 2, "draft", {rid: Report(root_id=60)}) == "WAIT"
    assert sync.arrive(e, 2, "stage0", {rid: Report()}) == "GO"
    assert verdict(sync, rid).done
    assert sync.schedule(rid) == "|m" and sync.in_flight() == []
    # a batch of finished requests whose barrier will never complete is cleared: after
    # a participant's restart, with a new epoch pending, or once it has sat there long
    stuck = sync.key("batch") + ":finished"

    def finished_in_batch() -> str:
        rid = uuid.uuid4().hex[:8]
        e = sync.submit(rid, [1], {}, 1, [])
        for w in OLD:
            ctl(sync, w)
        barrier(sync, e, 0, {})
        assert verdicts(sync)[0].join == (rid,)
        assert sync.arrive(e, 1, "stage1", {rid: last(sync, rid, 3)}) == "WAIT"
        assert sync.join("stage1", "", OLD, startup=False)[0] == "IDLE"
        assert sync.in_flight() == [rid]
        return rid

    finished_in_batch()
    assert sync.join("stage0", "", OLD, startup=True)[0] == "IDLE"  # it restarted
    assert sync.in_flight() == []
    finished_in_batch()
    sync.r.set(sync.key("pending"), 1)
    assert sync.join("stage0", "", OLD, startup=False)[0] == "IDLE"
    assert sync.in_flight() == [] and not sync.r.exists(sync.key("pending"))
    finished_in_batch()
    sync.r.set(stuck, int(sync.r.time()[0]) - 30)  # finished-only for 30 s
    assert sync.join("stage0", "", OLD, startup=False)[0] == "IDLE"
    assert sync.in_flight() == [] and not sync.r.exists(stuck)


def test_stage_curves_round_trip_and_a_malformed_one_is_left_out(sync, caplog):
    sync.publish_curve("stage0", {1: {4: 0.002, 1: 0.001}, 2: {2: 0.0015, 4: 0.0021}},
                       last=False, plan="A")
    sync.publish_curve("stage1", {1: {1: 0.003}}, last=True, plan="A")
    sync.publish_curve("stage2", {1: {1: 0.003}}, last=False, plan="B")  # another layout's
    bad = {"stage3": [[1, [[0, "x"]]]], "stage4": [[1, [[1, 0.1], [4, 0.2], [4, 0.3]]]],
           "stage5": [[1, [[10**400, 0.1]]]], "stage6": [[1, [[1, float("nan")]]]],
           "stage7": [[1, [[1, 0.1]]], [1, [[1, 0.2]]]], "stage8": [[0, [[1, 0.1]]]],
           "stage9": [], "stage10": [[r, [[1, 0.1]]] for r in range(1, 100)]}
    for name, loads in bad.items():
        raw = json.dumps({"last": False, "plan": "A", "loads": loads})
        sync.r.set(sync.key("curve", name), raw)
    names = ["stage0", "stage1", "stage2", *bad, "draft"]
    got = sync.curves(names, "A")
    assert got == {"stage0": (False, {1: [(1, 0.001), (4, 0.002)], 2: [(2, 0.0015), (4, 0.0021)]}),
                   "stage1": (True, {1: [(1, 0.003)]})}
    assert all(n in caplog.text for n in bad)
    assert set(sync.curves(names, "B")) == {"stage2"}
    sync.drop_curve("stage0")
    assert set(sync.curves(names, "A")) == {"stage1"}
    assert sync.curves([]) == {}


def test_a_cancelled_request_keeps_its_steps_token_then_ends(sync):
    """A cancel that lands while a step runs: the barrier still commits the token that
    step verified (as the in-process engine's cancel keeps it), ends the request, and
    its end event follows that token."""
    rid, e = admitted(sync)
    one(sync, rid, e, 1, token=9, root=50)
    verdicts(sync)
    assert sync.cancel(rid, "client") == "cancelled"
    assert not [ev for _, ev in sync.events(rid, "0", 0) if "end" in ev]  # due at the barrier
    one(sync, rid, e, 2, token=11, root=60, children=[(11, 51)])
    v = verdict(sync, rid)
    assert v.done and v.token == 11
    assert sync.request(rid).log == [9, 11] and sync.request(rid).status == "cancelled"
    evs = [ev for _, ev in sync.events(rid, "0", 0) if "start" not in ev]
    assert [ev.get("tok", ev.get("end")) for ev in evs] == ["9", "11", "cancelled"]
    assert evs[-1]["reason"] == "client"
    assert sync.in_flight() == []


def test_a_request_cancelled_in_a_batch_whose_barrier_never_completes_still_ends(sync):
    """Its end is due at the barrier; a new epoch (an input timeout's) sends it instead,
    and does not resume it."""
    rid, e = admitted(sync)
    sync.cancel(rid, "client")
    assert sync.resume(e)[0] == "IDLE"  # nothing runs: the batch is cleared
    assert [ev["end"] for _, ev in sync.events(rid, "0", 0) if "end" in ev] == ["cancelled"]
    assert rid not in sync.in_flight()


# ---- the batch: many requests, one barrier per step ---------------------------------------

def test_one_barrier_carries_a_verdict_per_request_and_admits_at_the_next_step(sync):
    """A request admitted while a batch steps joins at the next barrier (its step 0 is the
    next step); each request commits, hits, misses and ends on its own."""
    a, e = admitted(sync, max_new=3)
    assert sync.in_flight() == [a]
    b = uuid.uuid4().hex[:8]
    assert sync.submit(b, [4, 5], {}, 8, [], slots=2) == e  # joins the running epoch
    assert all(ctl(sync, w) == [] for w in OLD)  # no start: it joins at the barrier
    with pytest.raises(Busy):  # two slots, both taken
        sync.submit("c" + b, [6], {}, 8, [], slots=2)
    one(sync, a, e, 1, token=9, root=50)
    (msg,) = verdicts(sync)
    assert msg.join == (b,) and dict(msg.verdicts)[a] == Verdict(9, -1, 50, False)
    # step 2: a's first decode step, b's step 0 (its prefill commits its first token)
    barrier(sync, e, 2, {a: (5, 60, [(5, 51)]), b: (7, 61, [])})
    (msg,) = verdicts(sync)
    got = dict(msg.verdicts)
    assert got[a] == Verdict(5, 51, 60, False) and got[b] == Verdict(7, -1, 61, False)
    assert msg.join == ()
    # step 3: a misses and reaches its length; b hits
    barrier(sync, e, 3, {a: (8, 70, [(3, 62)]), b: (4, 71, [(4, 63)])})
    got = dict(verdicts(sync)[0].verdicts)
    assert got[a] == Verdict(8, -1, 70, True) and got[b] == Verdict(4, 63, 71, False)
    assert sync.in_flight() == [b]  # a left the batch at once
    barrier(sync, e, 4, {b: (-1, 80, [])})
    assert dict(verdicts(sync)[0].verdicts) == {b: Verdict(-1, -1, 80, False)}
    assert (sync.schedule(a), sync.schedule(b)) == ("|hm", "|h.")
    assert (sync.request(a).log, sync.request(b).log) == ([9, 5, 8], [7, 4])


def test_a_report_for_a_request_outside_the_batch_commits_nothing(sync):
    a, e = admitted(sync)
    one(sync, a, e, 1, token=9, root=50)
    verdicts(sync)
    b = uuid.uuid4().hex[:8]
    sync.submit(b, [4, 5], {}, 8, [], slots=2)  # waits to join at the next barrier
    barrier(sync, e, 2, {a: (5, 60, []), b: (7, 61, [])})
    assert sync.request(b).log == []  # b's step 0 is the next step, not this one
    assert verdicts(sync)[0].join == (b,)


def test_a_request_cancelled_before_it_joins_never_joins(sync):
    a, e = admitted(sync)
    b = uuid.uuid4().hex[:8]
    sync.submit(b, [4, 5], {}, 8, [], slots=2)
    sync.cancel(b, "client")
    # it was in no batch: it ends at once
    assert [ev["end"] for _, ev in sync.events(b, "0", 0) if "end" in ev] == ["cancelled"]
    one(sync, a, e, 1, token=9, root=50)
    assert verdicts(sync)[0].join == ()
    assert sync.in_flight() == [a]


def test_a_finished_batch_starts_the_next_request_in_a_new_epoch(sync):
    a, e = admitted(sync, max_new=1)
    one(sync, a, e, 1, token=9, root=50)
    (msg,) = verdicts(sync)
    assert not msg.goes_on and sync.in_flight() == []
    b = uuid.uuid4().hex[:8]
    e2 = sync.submit(b, [4], {}, 4, [])
    assert e2 == e + 1
    for w in OLD:
        assert ctl(sync, w) == [{"op": "start", "epoch": e2, "reqs": [], "more": True}]
    assert sync.in_flight() == [b]


def test_a_restart_resumes_every_request_of_the_batch(sync):
    up(sync, OLD, "A")
    a = running(sync)
    e0 = sync.epoch()
    b = uuid.uuid4().hex[:8]
    sync.submit(b, [1, 2], {}, 16, [], slots=4)  # still waiting to join
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))
    for w in OLD:
        assert ctl(sync, w) == [RESUMED(e0 + 1)]
    assert sync.in_flight() == [a, b]  # in line in their order, to join at its barriers
    barrier(sync, e0 + 1, 0, {})
    assert verdicts(sync)[0].join == (a, b)


def joined(sync: Synchroniser, rid: str) -> int:
    return int(sync.r.hget(sync.req_key(rid), "joined"))


def test_a_long_prompt_prefills_in_pipelined_chunks_beside_the_batch(sync):
    """A prompt longer than its chunk is pipelined through the stages (stage i has chunk j
    in step j + i): chunks + stages - 1 steps; its step 0 (and its first token) is the
    last one's, and a request admitted meanwhile joins and decodes as usual."""
    sync.register(OLD)  # 2 stages
    a = uuid.uuid4().hex[:8]
    e = sync.submit(a, [1, 2, 3, 4, 5, 6, 7], {}, 4, [], slots=2, chunk=3)
    assert all([m["op"] for m in ctl(sync, w)] == ["start"] for w in OLD)
    barrier(sync, e, 0, {})  # the idle pipeline's first barrier lets a in
    assert verdicts(sync)[0].join == (a,)
    st = sync.request(a)
    assert (st.chunk, st.prefill_chunks(), st.prefill_steps(2), joined(sync, a)) == (3, 3, 4, 4)
    assert [st.prefill_rows(i) for i in range(3)] == [(0, 3), (3, 6), (6, 7)]
    # stage 0 has chunks 0, 1, 2 in its prefill steps 0, 1, 2 (batch steps 1, 2, 3);
    # stage 1 has them in prefill steps 1, 2, 3
    assert [st.prefill_chunk(t, 0) for t in range(4)] == [0, 1, 2, None]
    assert [st.prefill_chunk(t, 1) for t in range(4)] == [None, 0, 1, 2]
    b = uuid.uuid4().hex[:8]
    # one chunk: a step 0 as before (no budget: chunk 0 never waits for a's chunks)
    sync.submit(b, [4, 5], {}, 3, [], slots=2, chunk=0)
    assert sync.request(b).prefill_steps(2) == 1
    barrier(sync, e, 1, {a: (-1, -1, [])})
    (msg,) = verdicts(sync)
    assert dict(msg.verdicts)[a] == Verdict(-1, -1, -1, False) and msg.join == (b,)
    assert joined(sync, b) == 2
    # step 2: b's step 0 (its whole prompt through both stages); a still prefilling
    barrier(sync, e, 2, {a: (-1, -1, []), b: (7, 61, [])})
    got = dict(verdicts(sync)[0].verdicts)
    assert got[a] == Verdict(-1, -1, -1, False) and got[b] == Verdict(7, -1, 61, False)
    barrier(sync, e, 3, {a: (-1, -1, []), b: (4, 71, [(4, 63)])})
    assert dict(verdicts(sync)[0].verdicts)[a] == Verdict(-1, -1, -1, False)
    # step 4: the last stage has a's last chunk and commits its first token: its step 0
    barrier(sync, e, 4, {a: (9, 50, []), b: (-1, 72, [])})
    got = dict(verdicts(sync)[0].verdicts)
    assert got[a] == Verdict(9, -1, 50, False)
    assert (sync.schedule(a), sync.schedule(b)) == (":::|", "|h.")
    assert sync.request(a).log == [9]


def test_a_prompt_of_one_chunk_is_pipelined_too(sync):
    """A prompt that fits one chunk crosses one stage a step, as longer ones do, so a step
    never holds its pass through every stage: stages steps, its step 0 the last."""
    sync.register(OLD)  # 2 stages
    a = uuid.uuid4().hex[:8]
    e = sync.submit(a, [1, 2], {}, 4, [], slots=1, chunk=3)
    assert all([m["op"] for m in ctl(sync, w)] == ["start"] for w in OLD)
    barrier(sync, e, 0, {})
    assert verdicts(sync)[0].join == (a,)
    st = sync.request(a)
    assert (st.prefill_chunks(), st.prefill_steps(2), joined(sync, a)) == (1, 2, 2)
    assert [st.prefill_chunk(t, 0) for t in range(2)] == [0, None]
    assert [st.prefill_chunk(t, 1) for t in range(2)] == [None, 0]
    barrier(sync, e, 1, {a: (-1, -1, [])})
    assert dict(verdicts(sync)[0].verdicts)[a] == Verdict(-1, -1, -1, False)
    barrier(sync, e, 2, {a: (9, 50, [])})
    assert dict(verdicts(sync)[0].verdicts)[a] == Verdict(9, -1, 50, False)
    assert sync.request(a).log == [9]


def test_joiners_share_the_chunk_as_a_budget_of_prefill_rows_per_step(sync):
    """Requests join in order while stage 1 has room in the next step beside the chunks
    it has (their chunk is the budget of rows a step): the first chunk takes that room,
    the later ones whole chunks; the first without room waits, first in line, and the
    requests behind it wait with it (protocol/scheduling/prefill.py)."""
    sync.register(OLD)  # 2 stages
    a, b, c = (uuid.uuid4().hex[:8] for _ in range(3))
    e = sync.submit(a, [1, 2, 3, 4, 5, 6, 7], {}, 4, [], slots=3, chunk=3)  # 3, 3, 1 rows
    for w in OLD:
        ctl(sync, w)
    sync.submit(b, [1, 2, 3, 4, 5], {}, 4, [], slots=3, chunk=3)
    sync.submit(c, [8], {}, 4, [], slots=3, chunk=3)  # 1 row: there is room, but b is first
    pre = {a: (-1, -1, [])}
    # step 1: a's first chunk takes the whole budget: b waits (and c behind it)
    barrier(sync, e, 0, {})
    assert verdicts(sync)[0].join == (a,)
    # step 2: stage 1 has a's second chunk (3 rows): no room for b
    barrier(sync, e, 1, pre)
    assert verdicts(sync)[0].join == ()
    assert sync.in_flight() == [a, b, c]
    # step 3: a's last chunk is 1 row: b starts in the 2 rows left (then 3 rows), and c
    # finds no room beside them
    barrier(sync, e, 2, pre)
    assert verdicts(sync)[0].join == (b,)
    st = sync.request(b)
    assert (st.head, st.prefill_rows(0), st.prefill_rows(1), st.prefill_chunks()) == (
        2, (0, 2), (2, 5), 2)
    assert joined(sync, b) == 2 + st.prefill_steps(2) == 5
    barrier(sync, e, 3, {a: (-1, -1, []), b: (-1, -1, [])})
    assert verdicts(sync)[0].join == ()  # step 4: b's second chunk (3 rows)
    barrier(sync, e, 4, {a: (9, 50, []), b: (-1, -1, [])})
    assert verdicts(sync)[0].join == (c,)  # step 5: stage 1 has nothing of b's
    # c's one chunk is pipelined too: stage 1 in step 5, stage 2 (and c's step 0) in 6
    assert sync.request(c).prefill_steps(2) == 2 and sync.request(c).head == 3
    assert (joined(sync, c), sync.schedule(a), sync.schedule(b)) == (6, ":::|", "::")


def test_a_restart_resumes_as_many_as_the_budget_takes_and_queues_the_rest(sync):
    """On a resume every running request prefills again: the new epoch's first barrier
    lets in those that fit the budget together (the first always), the rest join at
    later barriers."""
    up(sync, OLD, "A")
    a, b, c = (uuid.uuid4().hex[:8] for _ in range(3))
    sync.submit(a, [1, 2, 3, 4], {}, 16, [], slots=3, chunk=2)
    sync.submit(b, [5, 6, 7], {}, 16, [], slots=3, chunk=2)
    sync.submit(c, [8], {}, 16, [], slots=3, chunk=0)  # no budget: never waits
    e0 = sync.epoch()
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True) == ("RESUMED", str(e0 + 1))
    for w in OLD:
        assert ctl(sync, w) == [RESUMED(e0 + 1)]
    assert sync.in_flight() == [a, b, c] and joined(sync, b) == -1
    # the workers load the waiting requests when they join: they are this epoch's
    assert sync.request(b).epoch == e0 + 1
    barrier(sync, e0 + 1, 0, {})
    assert verdicts(sync)[0].join == (a,)  # its first chunk takes the budget
    # step 2: a's last chunk (2 rows) leaves no room for b's first 2; c waits behind b
    barrier(sync, e0 + 1, 1, {a: (-1, -1, [])})
    assert verdicts(sync)[0].join == ()
    barrier(sync, e0 + 1, 2, {a: (9, 50, [])})
    assert verdicts(sync)[0].join == (b, c)  # step 3: b's 2 rows, and c's (no budget)


def arrive_all(sync: Synchroniser, names: list[str], epoch: int, step: int,
               tokens: dict[str, int]) -> list[Step]:
    """Every participant of ``names`` arrives at ``step``; the last stage brings
    ``tokens`` (rid -> token); returns the verdict message each got (the same)."""
    for w in names:
        sync.arrive(epoch, step, w, {r: last(sync, r, t) if w == names[-1] else Report()
                                     for r, t in tokens.items()},
                    leader(sync, step, names) if w == names[0] else ())
    got = [[parse_control(m) for m in ctl(sync, w)] for w in names]
    assert all(g == got[0] and len(g) == 1 for g in got), got
    return got[0]


def test_a_replan_to_more_stages_resumes_what_fits_its_kv_budget_and_queues_the_rest(sync):
    """Two requests fit the stages' KV pools at their two-stage worst cases; at four
    stages a stage holds two more levels of each tree and only one fits. The new plan's
    epoch restarts that one; the other waits first in line (its gateway sees it wait
    beside a stepping batch, not stall) and joins at the barrier where the first ends."""
    from protocol.scheduling.kv_blocks import request_blocks

    up(sync, OLD, "A")
    w, tokens = 16, 3 + 16  # each: 3 prompt tokens and 16 new
    two, four = request_blocks(tokens, 2, w), request_blocks(tokens, 4, w)
    budget = 2 * two
    assert 2 * four > budget >= four
    # the epoch resumes the oldest first, whatever the ids' order
    a, b = (f"{n}{uuid.uuid4().hex[:8]}" for n in "za")
    for r in (a, b):
        sync.submit(r, [1, 2, 3], {}, 16, [], slots=4, kv_width=w, kv_budget=budget)
        time.sleep(0.01)  # created_ms apart
    for x in OLD:
        assert [m["op"] for m in ctl(sync, x)] == ["start"]  # on the idle pipeline
    barrier(sync, sync.epoch(), 0, {})
    assert verdicts(sync)[0].join == (a, b)  # both run at two stages
    for x in OLD:  # the re-plan: the old workers stop, the new ones come up
        sync.r.delete(sync.key("hb", x))
    up(sync, NEW, "B")
    e = sync.epoch()
    assert ctl(sync, "stage3") == [RESUMED(e)]
    for x in NEW[:-1]:
        ctl(sync, x)
    assert arrive_all(sync, NEW, e, 0, {})[0].join == (a,)  # the oldest; b does not fit
    assert sync.in_flight() == [a, b] and joined(sync, b) == -1
    assert sync.waits_beside_a_batch(b) and not sync.waits_beside_a_batch(a)
    # a new request would not fit either: it waits behind b
    with pytest.raises(Busy, match=f"hold {2 * four} of the {budget} KV blocks"):
        sync.submit("c", [1, 2, 3], {}, 16, [], slots=4, kv_width=w, kv_budget=budget)
    assert arrive_all(sync, NEW, e, 1, {a: 7})[0].join == ()
    assert arrive_all(sync, NEW, e, 2, {a: 8})[0].join == ()
    sync.cancel(a, "test")
    assert not sync.waits_beside_a_batch(b)  # nothing runs beside it: its time counts
    step = arrive_all(sync, NEW, e, 3, {a: -1})[0]
    assert dict(step.verdicts)[a].done and step.join == (b,)
    assert not sync.waits_beside_a_batch(b)


@pytest.mark.parametrize("pools", ["grow", "grow capped", "grow later", "shrink"])
def test_a_replan_holds_the_running_requests_to_the_new_plans_pools(sync, pools):
    """Two requests fit the first plan's pools (as its workers report them, and as their
    gateway read them). The new plan's workers report other pools: four stages with
    pools that hold both at four stages (both resume, though the budget the gateway read
    would hold one, unless the gateway's own --kv-tokens caps it there; or, with pools
    that grow only once its epoch runs, the second joins at the next barrier), or two
    stages with pools that hold one (one resumes, though the budget read would hold both
    and run the new pools out of blocks; the other joins at the barrier where the first
    ends, and waits for it even while a stage's heartbeat is missing: the pools the
    epoch started with stand)."""
    from protocol.scheduling.kv_blocks import request_blocks

    w, tokens = 16, 3 + 16  # each: 3 prompt tokens and 16 new
    two, four = request_blocks(tokens, 2, w), request_blocks(tokens, 4, w)
    assert 2 * four > 2 * two >= four
    up(sync, OLD, "A", pool=2 * two)
    a, b = (f"{n}{uuid.uuid4().hex[:8]}" for n in "za")
    for r in (a, b):
        sync.submit(r, [1, 2, 3], {}, 16, [], slots=4, kv_width=w, kv_budget=2 * two,
                    kv_cap=2 * two if pools == "grow capped" else 0)
        time.sleep(0.01)  # created_ms apart: a is the older
    for x in OLD:
        ctl(sync, x)
    barrier(sync, sync.epoch(), 0, {})
    assert verdicts(sync)[0].join == (a, b)
    for x in OLD:
        sync.r.delete(sync.key("hb", x))
    names = ["draft2", "stage20", "stage21"] if pools == "shrink" else NEW
    up(sync, names, "B", pool={"grow": 2 * four, "grow capped": 2 * four,
                               "grow later": 2 * two, "shrink": two + 1}[pools])
    e = sync.epoch()
    starts = (a, b) if pools == "grow" else (a,)
    assert ctl(sync, names[-1]) == [RESUMED(e)]
    for x in names[:-1]:
        ctl(sync, x)
    assert arrive_all(sync, names, e, 0, {})[0].join == starts
    if pools == "grow later":
        for x in names:  # e.g. a stage restarted with a larger --kv-tokens
            beat(sync, x, "B", 2 * four)
        assert arrive_all(sync, names, e, 1, {a: 7})[0].join == (b,)
    if pools != "shrink":
        return
    sync.r.delete(sync.key("hb", names[1]))  # a stage's heartbeat lapses
    assert arrive_all(sync, names, e, 1, {a: 7})[0].join == ()
    sync.cancel(a, "test")
    step = arrive_all(sync, names, e, 2, {a: -1})[0]
    assert dict(step.verdicts)[a].done and step.join == (b,)


@pytest.mark.parametrize(("prompt", "chunk", "logged"), [
    (7, 3, 0), (7, 3, 1), (7, 3, 3), (6, 3, 0), (6, 3, 2), (1, 3, 0), (5, 0, 4), (9, 1, 2),
    (40, 16, 30)])
def test_a_resumed_request_prefills_its_log_and_joins_for_its_prefill_steps(
        sync, prompt, chunk, logged):
    """RequestState.prefill_steps for a new request and for one that resumes with tokens
    in its log (which it prefills again), and the 'joined' step the barrier records from
    the scheduler's join: the barrier step plus those steps."""
    up(sync, OLD, "A")  # 2 stages
    rid = uuid.uuid4().hex[:8]
    sync.submit(rid, list(range(1, prompt + 1)), {}, 64, [], chunk=chunk)
    if logged:
        sync.r.rpush(sync.req_key(rid, "log"), *range(logged))
    beat(sync, "stage1", "A")
    assert sync.join("stage1", "A", OLD, startup=True)[0] == "RESUMED"
    st = sync.request(rid)
    rows = prompt + max(logged - 1, 0)
    assert len(st.committed()) == rows
    chunks = max(-(-rows // chunk), 1) if chunk else 1
    assert st.prefill_chunks() == chunks
    # pipelined over the 2 stages, one chunk too; chunk 0: every stage in one step
    assert st.prefill_steps(2) == (chunks + 1 if chunk else 1)
    for w in OLD:
        assert ctl(sync, w)[-1] == RESUMED(sync.epoch())
    assert arrive_all(sync, OLD, sync.epoch(), 0, {})[0].join == (rid,)
    assert joined(sync, rid) == st.prefill_steps(2)


# ---- control messages ---------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"not json", b"[1, 2]", b'{"op": "halt"}', b'{"op": "start", "reqs": [""], "epoch": 0}',
    b'{"op": "start", "reqs": ["r"], "epoch": -1}', b'{"op": "start", "reqs": ["r"], "epoch": "1"}',
    b'{"op": "start", "reqs": "r", "epoch": 1}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [["r", 2, -1, 5]], "join": []}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [["r", "x", -1, 5, false]], "join": []}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [["r", 2, -7, 5, false]], "join": []}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [[7, 2, -1, 5, false]], "join": []}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [], "join": [3]}',
    b'{"op": "step", "epoch": 0, "step": 1, "v": [], "join": [], "more": 1}',
    b'{"op": "start", "reqs": [], "epoch": 1, "more": "yes"}',
])
def test_garbage_control_message_is_dropped_not_raised(sync, raw, caplog):
    with pytest.raises(ControlError):
        parse_control(raw)
    sync.r.rpush(sync.key("ctl", "stage0"), raw)
    sync.r.rpush(sync.key("ctl", "stage0"), json.dumps({"op": "start", "reqs": ["r"], "epoch": 3}))
    with caplog.at_level(logging.ERROR, logger="treepipe.sync"):
        assert sync.wait_ctl("stage0", 0.01) is None  # logged and dropped
    assert "bad control message" in caplog.text
    assert sync.wait_ctl("stage0", 0.01) == Start(3, ("r",))  # the next one still comes


def test_control_messages_round_trip():
    for msg in (Start(2, ("r1",)), Start(2, ("r1", "r2"), resume=True),
                Start(3, (), resume=True, more=True), Step(3, 0, (), (), more=True),
                Step(2, 7, (("r1", Verdict(5, 52, 60, False)),), ("r2",)),
                Step(0, 1, (("r", Verdict(done=True)),))):
        assert parse_control(json.dumps(msg.to_json())) == msg
    # Redis's cjson writes an empty list as {}
    empty = b'{"op": "step", "epoch": 1, "step": 2, "v": {}, "join": {}}'
    assert parse_control(empty) == Step(1, 2)
