"""start.lua is all or nothing: a bad argument (or bad stored state) writes nothing.

Redis keeps whatever a Lua script wrote before it raised an error, so start.lua checks
every argument before its first write.  Each case here calls the script with one bad
argument on a real redis-server, compares every key of the pipeline before and after
(nothing may change), then admits a good request, which must run as usual.  Before the
checks, a bad ``ttl_s`` failed in EXPIRE after the request hash, the event stream and
the active key were written: a half-admitted request that blocked the pipeline.
"""

from __future__ import annotations

import json
import uuid

import pytest

from protocol.sync.synchroniser import SyncError, Synchroniser

WORKERS = ["draft", "stage0", "stage1"]


def snapshot(sync: Synchroniser) -> dict[bytes, bytes | None]:
    """Every key of the pipeline with its serialised value."""
    return {k: sync.r.dump(k) for k in sorted(sync.r.scan_iter(f"{sync.prefix}:*"))}


# the arguments the entry rule checks in Python (Synchroniser.admit); the others are
# start.lua's own
RULE = ("params", "max_new", "slots", "kv_width", "kv_budget", "kv_cap")


def call(sync: Synchroniser, request: str, **bad: object) -> list[str]:
    """start.lua as Synchroniser.submit calls it, with the arguments in ``bad`` replaced:
    through the entry rule (Synchroniser.admit) unless one of start.lua's own arguments
    is replaced, which goes to the script as it is."""
    rid = request
    keys = {"req": sync.req_key(rid), "batch": sync.key("batch"), "epoch": sync.key("epoch"),
            "participants": sync.key("participants"), "log": sync.req_key(rid, "log"),
            "events": sync.req_key(rid, "ev"), "plan": sync.key("plan"),
            "joining": sync.key("joining"), "eplan": sync.key("eplan"),
            "pending": sync.key("pending")}
    args = {"rid": rid, "prompt": "[1, 2, 3]", "params": "{}", "max_new": 8, "stop": "[]",
            "ctl": sync.ctl_prefix, "now_ms": 1000, "prefix": sync.req_key(""), "ttl_s": 60,
            "chunk": 0, "kv_width": 0, "kv_budget": 0, "kv_cap": 0, "kv_blocks": 1}
    if all(k in RULE for k in bad):
        rule: dict[str, object] = {"params": {}, "max_new": 8, "slots": 4, "kv_width": 0,
                                   "kv_budget": 0, "kv_cap": 0}
        for k, v in bad.items():
            if k == "params":
                try:
                    v = json.loads(str(v))
                except ValueError:
                    pass
            rule[k] = v
        return list(sync.admit(rid, [1, 2, 3], rule["params"], rule["max_new"], [],  # type: ignore[arg-type]
                               rule["slots"], 0, rule["kv_width"], rule["kv_budget"],  # type: ignore[arg-type]
                               rule["kv_cap"]))  # type: ignore[arg-type]
    for k, v in bad.items():
        (keys if k in keys else args)[k] = v
    res = sync._start(keys=list(keys.values()), args=list(args.values()))
    return [x.decode() if isinstance(x, bytes) else str(x) for x in res]


def runs(sync: Synchroniser) -> None:
    """A good request is admitted: on an idle pipeline every worker is told to start it,
    else it waits to join the batch."""
    rid = uuid.uuid4().hex[:8]
    idle = not sync.in_flight()
    epoch = sync.submit(rid, [5, 6], {"temperature": 0.5, "seed": 2**64 - 1}, 4, [0], slots=64)
    st = sync.request(rid)
    assert (st.status, st.prompt, st.epoch) == ("running", [5, 6], epoch)
    for w in WORKERS:
        m = sync.pop_ctl(w)
        assert (m is not None and m.to_json()["op"] == "start") == idle
    assert rid in sync.in_flight()


BAD = [
    ("rid", "a:b", "request id"),
    ("rid", "", "request id"),
    ("req", "tp:other:req:x", "keys do not match"),
    ("prompt", "not json", "prompt"),
    ("prompt", "[]", "prompt"),
    ("prompt", "{}", "prompt"),
    ("prompt", '[1, "x"]', "prompt"),
    ("prompt", "[1.5]", "prompt"),
    ("prompt", "[-1]", "prompt"),
    ("params", "nope", "params"),
    ("params", "[]", "params"),
    ("params", '{"temperature": NaN}', "params.temperature"),
    ("params", '{"temperature": -1}', "params.temperature"),
    ("params", '{"temperature": null}', "params.temperature"),
    ("params", '{"top_p": 0}', "params.top_p"),
    ("params", '{"top_p": Infinity}', "params.top_p"),
    ("params", '{"top_k": 1.5}', "params.top_k"),
    ("params", '{"seed": -3}', "params.seed"),
    ("max_new", "0", "max_new"),
    ("max_new", "1e3", "max_new"),
    ("max_new", "nan", "max_new"),
    ("stop", "eos", "stop"),
    ("stop", '{"a": 1}', "stop"),
    ("stop", "[0.5]", "stop"),
    ("now_ms", "soon", "now_ms"),
    ("ttl_s", "abc", "ttl_s"),  # failed in EXPIRE, after the first writes, before the fix
    ("ttl_s", "0", "ttl_s"),
    ("slots", "0", "slots"),
    ("slots", "many", "slots"),
    ("chunk", "-1", "chunk"),
    ("chunk", "two", "chunk"),
    ("kv_width", "-2", "kv width"),
    ("kv_width", "1.5", "kv width"),
    ("kv_budget", "all", "kv budget"),
    ("kv_cap", "-1", "kv cap"),
]


@pytest.mark.parametrize("arg,value,words", BAD, ids=[f"{a}={v}" for a, v, _ in BAD])
def test_a_bad_argument_writes_nothing_and_the_next_request_runs(
        sync: Synchroniser, arg: str, value: str, words: str) -> None:
    before = snapshot(sync)
    status, why = call(sync, "r1", **{arg: value})
    assert status == "BAD" and words in why, why
    assert snapshot(sync) == before
    runs(sync)


def test_a_bad_argument_while_a_request_runs_leaves_it_alone(sync: Synchroniser) -> None:
    """A bad start must not touch the running batch or its workers' queue."""
    runs(sync)
    before = snapshot(sync)
    assert call(sync, "r2", ttl_s="x")[0] == "BAD"
    assert snapshot(sync) == before


@pytest.mark.parametrize("key,value,words", [("participants", "garbage", "participant list"),
                                              ("participants", '["draft", 3]', "participant"),
                                              ("epoch", "x", "epoch")])
def test_bad_stored_state_writes_nothing(sync: Synchroniser, key: str, value: str,
                                         words: str) -> None:
    sync.r.set(sync.key(key), value)
    before = snapshot(sync)
    status, why = call(sync, "r1")
    assert status == "BAD" and words in why, why
    assert snapshot(sync) == before
    sync.register(WORKERS)
    sync.r.set(sync.key("epoch"), 0)
    runs(sync)


def test_submit_raises_a_one_line_sync_error(sync: Synchroniser) -> None:
    before = snapshot(sync)
    with pytest.raises(SyncError, match=r"request r1 refused: params.temperature"):
        sync.submit("r1", [1, 2], {"temperature": float("nan")}, 4, [])
    with pytest.raises(SyncError, match="max_new"):
        sync.submit("r1", [1, 2], {}, 0, [])
    assert snapshot(sync) == before
    assert json.loads(sync.r.get(sync.key("participants"))) == WORKERS
    runs(sync)


def test_kv_budget_holds_back_a_request_until_blocks_free(sync: Synchroniser) -> None:
    """The running requests' worst cases and the new one's must fit the stages' pools:
    beyond, FULL writes nothing; a request that ends frees its blocks at once. The
    entry rule (Synchroniser.admit) prices each worst case with request_blocks, for the
    pipeline's stage count (two here) and the request's tree width."""
    from protocol.scheduling.kv_blocks import request_blocks

    def need(w: int) -> int:  # the calls' requests: 3 prompt tokens, 8 new
        return request_blocks(3 + 8, len(WORKERS) - 1, w)

    assert [need(w) for w in (21, 16, 10, 0, 99)] == [6, 5, 4, 2, 21]
    assert call(sync, "a", kv_width=21, kv_budget=10)[0] == "OK"
    before = snapshot(sync)
    assert call(sync, "b", kv_width=16, kv_budget=10) == ["FULL", "6/5/10"]
    assert snapshot(sync) == before
    with pytest.raises(SyncError, match="hold 6 of the 10 KV blocks a stage has; this one needs 5"):
        sync.submit("b", [1, 2, 3], {}, 8, [], slots=4, kv_width=16, kv_budget=10)
    assert call(sync, "c", kv_width=10, kv_budget=10)[0] == "OK"  # 6 + 4 fit exactly
    assert call(sync, "d", kv_width=0, kv_budget=10) == ["FULL", "10/2/10"]
    assert call(sync, "e", kv_width=99, kv_budget=0)[0] == "OK"  # 0: no budget
    sync.cancel("a", "test")
    assert call(sync, "b", kv_width=16, kv_budget=10) == ["FULL", "25/5/10"]
    sync.cancel("e", "test")
    assert call(sync, "b", kv_width=16, kv_budget=10)[0] == "OK"


def test_a_request_that_would_not_fit_even_alone_is_refused(sync: Synchroniser) -> None:
    """The gateway checked the request alone against the pool at two stages; a re-plan
    to four raised its worst case above the whole pool before it was submitted (or its
    gateway read larger pools than there are). It is refused, nothing written, naming
    the numbers (the gateway turns it into INVALID_ARGUMENT), rather than run a pool out
    of blocks or wait for ever, holding up the queue behind it."""
    from protocol.scheduling.kv_blocks import request_blocks
    from protocol.sync.synchroniser import TooBig

    budget, need = request_blocks(3 + 8, 2, 16), request_blocks(3 + 8, 4, 16)
    assert need > budget
    sync.register(["draft", "stage0", "stage1", "stage2", "stage3"])
    before = snapshot(sync)
    assert call(sync, "a", kv_width=16, kv_budget=budget) == ["TOOBIG", f"{need}/{budget}/4"]
    assert snapshot(sync) == before
    with pytest.raises(TooBig, match=f"needs {need} KV blocks on each of 4 stages, more "
                                     f"than the {budget}"):
        sync.submit("a", [1, 2, 3], {}, 8, [], slots=4, kv_width=16, kv_budget=budget)
    assert call(sync, "a", kv_width=4, kv_budget=budget)[0] == "OK"


def test_a_rolling_upgrade_counts_the_blocks_an_earlier_version_stored(
        sync: Synchroniser) -> None:
    """An earlier version stored only a request's blocks ('kv_blocks'); this one prices
    from its tokens and width, and stores the blocks too, so while both versions run
    each counts the other's requests."""
    assert call(sync, "old", kv_width=21, kv_budget=10)[0] == "OK"  # 6 blocks
    assert sync.r.hget(sync.req_key("old"), "kv_blocks") == b"6"
    sync.r.hdel(sync.req_key("old"), "kv_tokens", "kv_w")  # as an earlier version's
    assert call(sync, "b", kv_width=16, kv_budget=10) == ["FULL", "6/5/10"]


def pools(sync: Synchroniser, blocks: dict[str, object], plan: str = "") -> None:
    """Heartbeats of the workers (those named; None: none) of layout ``plan`` reporting
    fixed KV pools of these blocks (0: a pool that grows), as
    stages/runtime/kv_pool.py kv_use does."""
    for w in WORKERS:
        sync.r.delete(sync.key("hb", w))
        if w in blocks and blocks[w] is not None:
            n = blocks[w] or 8
            sync.heartbeat(w, {"pid": 1, "plan": plan, "kv": {
                "blocks": n, "used": 0, "peak": 0, "block_size": 16,
                "fixed": int(bool(blocks[w]))}}, ttl_s=600)


def test_the_pools_the_workers_report_now_are_the_budget(sync: Synchroniser) -> None:
    """The gateway read 10 blocks when it admitted the requests; the workers now report
    their pools (a re-plan's may be smaller or larger): the smallest fixed one is the
    budget, within the gateway's own cap (--kv-tokens); a pool that grows limits nothing,
    and while a worker does not beat the gateway's reading stands."""
    assert call(sync, "a", kv_width=21, kv_budget=10)[0] == "OK"  # 6 blocks
    pools(sync, {"draft": 0, "stage0": 12, "stage1": 20})
    assert call(sync, "b", kv_width=16, kv_budget=10)[0] == "OK"  # 6 + 5 <= 12
    pools(sync, {"draft": 0, "stage0": 9, "stage1": 20})
    assert call(sync, "c", kv_width=0, kv_budget=10) == ["FULL", "11/2/9"]
    pools(sync, {"draft": 0, "stage0": 40, "stage1": 40})
    assert call(sync, "c", kv_width=0, kv_budget=10, kv_cap=12) == ["FULL", "11/2/12"]
    assert call(sync, "c", kv_width=0, kv_budget=10, kv_cap=13)[0] == "OK"
    pools(sync, {"draft": 0, "stage0": 40, "stage1": None})  # stage1 restarting
    assert call(sync, "d", kv_width=0, kv_budget=10) == ["FULL", "13/2/10"]
    pools(sync, {"draft": 0, "stage0": 0, "stage1": 0})  # pools that grow
    assert call(sync, "d", kv_width=0, kv_budget=10, kv_cap=14) == ["FULL", "13/2/14"]
    assert call(sync, "d", kv_width=0, kv_budget=10) == ["FULL", "13/2/10"]
    assert call(sync, "d", kv_width=0, kv_budget=0)[0] == "OK"  # no budget at all


def test_only_this_plans_heartbeats_count_and_malformed_pools_limit_nothing(
        sync: Synchroniser) -> None:
    """A worker of the old plan on its way out beats under the same name as the new
    plan's: its pool is not the new one's. While any participant does not beat with the
    plan, the pools the plan's epoch started with count (join.lua saves them), or else
    the gateway's reading. A pool reported as no whole number of blocks limits nothing,
    as every reader takes it (protocol/sync/heartbeat.py KvUse)."""
    from protocol.sync.heartbeat import KvUse

    def fixed_blocks(kv: object) -> int:
        use = KvUse.from_json(kv)
        return use.fixed_blocks if use is not None else 0

    assert call(sync, "a", kv_width=21, kv_budget=10)[0] == "OK"  # 6 blocks
    sync.r.set(sync.key("plan"), "B")
    pools(sync, {"draft": 0, "stage0": 40, "stage1": 40}, plan="A")  # the old plan's
    assert call(sync, "b", kv_width=16, kv_budget=10) == ["FULL", "6/5/10"]
    sync.r.hset(sync.key("kvpool"), mapping={"plan": "B", "blocks": 11})
    assert call(sync, "b", kv_width=16, kv_budget=10)[0] == "OK"  # 6 + 5 <= 11
    sync.r.hset(sync.key("kvpool"), mapping={"plan": "A", "blocks": 99})
    assert call(sync, "c", kv_width=0, kv_budget=10) == ["FULL", "11/2/10"]
    for bad in (7.5, "9", True, -3, float("inf")):
        pools(sync, {"draft": 0, "stage0": bad, "stage1": 12}, plan="B")
        assert fixed_blocks(json.loads(sync.r.get(sync.key("hb", "stage0")))["kv"]) == 0
        assert call(sync, "c", kv_width=0, kv_budget=10) == ["FULL", "11/2/12"], bad
    pools(sync, {"draft": 0, "stage0": 9, "stage1": 12}, plan="B")
    assert call(sync, "c", kv_width=0, kv_budget=10) == ["FULL", "11/2/9"]
    pools(sync, {"draft": 0, "stage0": 13, "stage1": 40}, plan="B")
    assert call(sync, "c", kv_width=0, kv_budget=10)[0] == "OK"
