"""``treepipe top``: the figures (pure functions) and one command run against a real Redis.

The command test fakes what ``treepipe up`` leaves behind (a state file naming a
live pid, a private ``redis-server``), writes the workers' heartbeats itself, with
and without ``stats``, and serves a real gateway ``Metrics`` page over HTTP.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from orchestrator.cli.main import main
from orchestrator.cli.top import (
    Beat,
    Top,
    build_frame,
    gateway_figures,
    metrics_url,
    parse_metrics,
    pick_base,
    quantile,
    remember,
    render,
    worker_rates,
)
from orchestrator.deploy.redis_server import RedisServer, write_secret
from orchestrator.serving.metrics import Metrics
from orchestrator.serving.runner import SpecStats
from protocol.sync.heartbeat import Heartbeat
from protocol.sync.synchroniser import Synchroniser

KEY = "sk-top-test"
NAMES = ["draft", "stage0", "stage1"]


def stats(steps: int, compute_s: float, sent_bytes: int = 0, **kw: float) -> dict[str, Any]:
    base = {"steps": steps, "compute_s": compute_s, "barrier_s": 0.0, "input_s": 0.0,
            "send_s": 0.0, "sent_bytes": sent_bytes, "nodes": 0}
    return {**base, **kw}


# ---- pure functions ------------------------------------------------------------------

def test_worker_rates_over_an_interval() -> None:
    a = stats(10, 1.0, 1_000_000, barrier_s=0.5, input_s=0.2, send_s=0.1, nodes=40)
    b = stats(30, 1.5, 3_000_000, barrier_s=0.9, input_s=0.4, send_s=0.3, nodes=120)
    r = worker_rates(a, b, 2.0)
    assert r["util"] == pytest.approx(0.25)
    assert r["steps_per_s"] == pytest.approx(10)
    assert r["compute_ms"] == pytest.approx(25)
    assert r["barrier_ms"] == pytest.approx(20)
    assert r["input_ms"] == pytest.approx(10)
    assert r["send_ms"] == pytest.approx(10)
    assert r["nodes_per_step"] == pytest.approx(4)
    assert r["link_mb_s"] == pytest.approx(1.0)


def test_worker_rates_unknown_figures_are_none() -> None:
    a, b = stats(10, 1.0), stats(10, 1.0)
    idle = worker_rates(a, b, 1.0)  # no step: utilisation 0, no per-step means
    assert idle["util"] == 0 and idle["steps_per_s"] == 0 and idle["compute_ms"] is None
    assert set(worker_rates({}, b, 1.0).values()) == {None}  # the older beat had no stats
    assert set(worker_rates(a, b, None).values()) == {None}  # only one beat so far
    assert set(worker_rates(stats(50, 9.0), b, 1.0).values()) == {None}  # counters went back
    partial = worker_rates({"steps": 1, "compute_s": 0.0}, {"steps": 3, "compute_s": 0.5}, 1.0)
    assert partial["compute_ms"] == pytest.approx(250) and partial["link_mb_s"] is None


def hb(raw: dict[str, Any]) -> Heartbeat:
    """A heartbeat as ``top`` reads it from the JSON a worker wrote."""
    out = Heartbeat.from_json(raw)
    assert out is not None
    return out


def test_history_keeps_one_entry_per_write_and_forgets_a_restart() -> None:
    one = {"pid": 1, "inc": "a"}
    h = remember([], Beat(hb(one), 10.0))
    h = remember(h, Beat(hb(one), 10.01))  # the same write read again (round trips apart)
    assert [b.clock for b in h] == [10.0]
    h = remember(h, Beat(hb(one), 11.0))
    cur = Beat(hb(one), 11.5)
    assert pick_base(h, cur).clock == 11.0
    assert pick_base(h, Beat(hb(one), 11.1)).clock == 10.0  # 0.1 s is too short a window
    restarted = Beat(hb({"pid": 2, "inc": "b"}), 12.0)
    assert pick_base(h, restarted) is None
    assert remember(h, restarted) == [restarted]


def metrics_page() -> str:
    """A real gateway's /metrics after two finished requests and one queued."""
    m = Metrics("tiny")
    m.queued(+1)
    m.running(+1, 10)
    m.tokens([(40.0, 40.0), (60.0, 20.0), (90.0, 30.0)], first=True)
    m.finished("eos", 5, 3, 0.1, SpecStats(steps=8, hits=3, misses=1, epochs=1))
    m.finished("length", 5, 4, 0.2, SpecStats(steps=4, hits=2, misses=0, epochs=1))
    return m.render().decode()


def test_parse_metrics_of_a_real_gateway_page() -> None:
    got = parse_metrics(metrics_page())
    assert got["queue"] == 1 and got["running"] == 1 and got["requests"] == 2
    assert (got["steps"], got["hits"], got["verifications"], got["flushes"]) == (12, 5, 6, 1)
    assert got["ttft"]["count"] == 1 and got["ttft"]["sum"] == pytest.approx(0.04)
    assert got["tbt"]["count"] == 2 and got["tbt"]["sum"] == pytest.approx(0.05)
    assert got["tbt"]["buckets"][-1] == (float("inf"), 2)
    g = gateway_figures(got, None)
    assert g["up"] and g["hit_rate"] == pytest.approx(5 / 6)
    assert g["tokens_per_step"] == pytest.approx(6 / 12)
    assert g["tbt_s"]["mean"] == pytest.approx(0.025) and g["tbt_s"]["recent"] is None
    # the mean since the previous scrape: one more token 10 ms after the one before
    later = {**got, "tbt": {**got["tbt"], "sum": got["tbt"]["sum"] + 0.01, "count": 3}}
    assert gateway_figures(later, got)["tbt_s"]["recent"] == pytest.approx(0.01)
    down = gateway_figures(None, None, "unreachable")
    assert not down["up"] and down["queue"] is None and down["ttft_s"]["p95"] is None


def test_quantile_interpolates_like_prometheus() -> None:
    b = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert quantile(b, 0.5) == pytest.approx(0.2)
    assert quantile(b, 0.75) == pytest.approx(0.3)
    assert quantile([(0.1, 0.0), (float("inf"), 4.0)], 0.5) == 0.1  # in +Inf: largest bound
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_metrics_url_reaches_a_wildcard_listen_on_loopback() -> None:
    assert metrics_url("0.0.0.0:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("10.0.0.2:81") == "http://10.0.0.2:81/metrics"
    assert metrics_url(":::8000") == "http://[::1]:8000/metrics"


# ---- against a real Redis and a gateway /metrics page --------------------------------

class _Gateway(BaseHTTPRequestHandler):
    page = ""
    auth: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).auth.append(self.headers.get("Authorization", ""))
        body = type(self).page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A faked `treepipe up` state, its private Redis and a gateway /metrics page."""
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEPIPE_API_KEY_FILE", raising=False)
    monkeypatch.setenv("TREEPIPE_API_KEY", KEY)
    _Gateway.page, _Gateway.auth = metrics_page(), []
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    with RedisServer() as server:
        name = "toptest"
        folder = tmp_path / "run" / name
        folder.mkdir(parents=True)
        secret = write_secret(folder / "redis.secret", server.password)
        me = os.getpid()  # a live pid stands in for the supervisor and its children
        (folder / "state.json").write_text(json.dumps({
            "name": name, "supervisor_pid": me, "redis": server.address,
            "redis_secret": str(secret), "endpoint": "127.0.0.1:50999",
            "stages": [[0, 2], [2, 4]],
            "procs": {w: me for w in [*NAMES, "gateway"]},
            "restarts": {"stage1": {"total": 2, "in_window": 1}}}))
        sync = Synchroniser(server.url, name)
        sync.register(NAMES)
        sync.r.set(sync.key("plan"), "A")
        sync.r.set(sync.key("gateway", "http"), f"0.0.0.0:{http.server_port}")
        try:
            yield {"name": name, "sync": sync, "http": http}
        finally:
            sync.close()
            http.shutdown()
            http.server_close()


def beat(sync: Synchroniser, worker: str, s: dict[str, Any] | None = None, **info: Any) -> None:
    """A heartbeat as a worker writes it; a long TTL so a slow machine cannot expire it."""
    hb = {"pid": 7, "inc": f"{worker}-1", "plan": "A", "req": "r1", "epoch": 1, "step": 5,
          "rejected": 0, **info}
    sync.heartbeat(worker, {**hb, "stats": s} if s is not None else hb, ttl_s=600)


def test_top_measures_utilisation_between_two_heartbeats(pipeline: dict[str, Any]) -> None:
    sync = pipeline["sync"]
    beat(sync, "stage0", stats(100, 2.0, 0))
    t0 = time.monotonic()
    top = Top(pipeline["name"], KEY, timeout_s=2.0)
    first = top.step()
    assert first["workers"]["stage0"]["util"] is None  # one heartbeat: no rate yet
    time.sleep(0.4)
    beat(sync, "stage0", stats(140, 2.2, 4_000_000))
    dt = time.monotonic() - t0
    time.sleep(0.3)  # top reads the same write later: the rate is over the writes
    r = top.step()["workers"]["stage0"]
    assert r["window_s"] == pytest.approx(dt, abs=0.05)
    assert r["util"] == pytest.approx(0.2 / dt, rel=0.15)
    assert r["compute_ms"] == pytest.approx(5.0) and r["steps_per_s"] == pytest.approx(
        40 / dt, rel=0.15)
    # a restarted worker (new incarnation) counts from zero: no rate across it
    beat(sync, "stage0", stats(3, 0.1), inc="stage0-2", pid=8)
    assert top.step()["workers"]["stage0"]["util"] is None


def test_top_once_json_with_and_without_stats(pipeline: dict[str, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    sync = pipeline["sync"]
    beat(sync, "draft", stats(10, 0.5))
    beat(sync, "stage0")  # no stats yet (a worker from before stats existed)
    # stage1 is down: no heartbeat
    assert main(["top", pipeline["name"], "--once", "--json", "--interval", "0.05"]) == 0
    frame = json.loads(capsys.readouterr().out)
    assert frame["endpoints"] == {"grpc": "127.0.0.1:50999",
                                  "http": f"0.0.0.0:{pipeline['http'].server_port}"}
    assert frame["plan"] == "A" and frame["waiting"] == ["stage1"]
    w = frame["workers"]
    assert list(w) == NAMES
    assert w["draft"]["alive"] and w["draft"]["plan_ok"] and w["draft"]["has_stats"]
    assert w["draft"]["step"] == 5 and w["draft"]["req"] == "r1"
    assert w["stage0"]["alive"] and not w["stage0"]["has_stats"]
    assert w["stage0"]["util"] is None and w["stage0"]["compute_ms"] is None
    assert not w["stage1"]["alive"] and w["stage1"]["plan"] is None
    assert w["stage1"]["restarts"] == 2
    g = frame["gateway"]
    assert g["up"] and g["queue"] == 1 and g["running"] == 1 and g["requests"] == 2
    assert g["hit_rate"] == pytest.approx(5 / 6) and g["ttft_s"]["mean"] == pytest.approx(0.04)
    assert _Gateway.auth and set(_Gateway.auth) == {f"Bearer {KEY}"}


def test_top_once_text_shows_dashes_for_what_is_missing(
        pipeline: dict[str, Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich's width when stdout is no terminal
    sync = pipeline["sync"]
    sync.r.delete(sync.key("gateway", "http"))  # a gateway without HTTP
    beat(sync, "draft")
    beat(sync, "stage0", plan="B")
    assert main(["top", pipeline["name"], "--once", "--interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "waiting for stage0, stage1" in out and "no HTTP endpoint published" in out
    assert "queue -  running -" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["draft"][1] == "ok" and rows["draft"][6:] == ["-"] * 9
    assert rows["stage0"][1:3] == ["other", "plan"]
    assert rows["stage1"][1:3] == ["none", str(os.getpid())]  # the pid the launcher started
    assert set(rows["stage1"][3:]) == {"-"}


def test_gateway_that_does_not_answer_is_dashes(pipeline: dict[str, Any]) -> None:
    sync = pipeline["sync"]
    closed = pipeline["http"].server_port
    pipeline["http"].shutdown()
    pipeline["http"].server_close()
    sync.r.set(sync.key("gateway", "http"), f"127.0.0.1:{closed}")
    g = Top(pipeline["name"], None, timeout_s=1.0).step()["gateway"]
    assert not g["up"] and g["error"].startswith("unreachable") and g["hit_rate"] is None


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "live"])
def test_refreshes_until_ctrl_c(pipeline: dict[str, Any], json_out: bool,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    beat(pipeline["sync"], "draft", stats(1, 0.1))
    sleeps = []

    def sleep(s: float) -> None:  # the third refresh is interrupted
        sleeps.append(s)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("orchestrator.cli.top.time.sleep", sleep)
    assert main(["top", pipeline["name"], "--interval", "0.5",
                 *(["--json"] if json_out else [])]) == 0
    out = capsys.readouterr().out
    assert sleeps == [0.5] * 3
    if json_out:
        frames = [json.loads(line) for line in out.splitlines()]
        assert len(frames) == 3 and frames[-1]["workers"]["draft"]["alive"]
    else:
        assert "draft" in out and "queue 1" in out


def test_render_a_frame_with_rates() -> None:
    history = {"stage0": [Beat(hb({"pid": 1, "inc": "a", "plan": "A",
                                   "stats": stats(0, 0.0, 0)}), 1.0)]}
    from orchestrator.cli.top import Sample

    s = Sample(0.0, ["stage0"], "A", 3, {"stage0": Beat(hb(
        {"pid": 1, "inc": "a", "plan": "A", "req": "abcdef0123456789", "step": 9,
         "stats": stats(10, 0.5, 2_000_000, barrier_s=0.25),
         "kv": {"blocks": 20, "used": 3, "peak": 7, "block_size": 16}}), 2.0)}, "0.0.0.0:8000",
        parse_metrics(metrics_page()))
    frame = build_frame("p", "127.0.0.1:1", s, history, None)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render(frame))
    out = console.file.getvalue()
    assert "epoch 3  plan A  gRPC 127.0.0.1:1  HTTP http://0.0.0.0:8000" in out
    assert "hit rate 0.83" in out and "TBT mean/p95/recent 25.0/" in out
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("stage0"))
    assert row == ["stage0", "ok", "1", "A", "abcdef01", "9", "50%", "10.0", "50.00",
                   "25.00", "0.00", "0.00", "0.0", "2.00", "3/20"]
    assert frame["workers"]["stage0"]["kv_peak"] == 7


def test_bad_input_is_one_line_and_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path))
    assert main(["top", "nosuch", "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no local pipeline 'nosuch' is running" in err
    for bad in ("0", "nan", "soon", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["top", "nosuch", "--interval", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--interval" in err
