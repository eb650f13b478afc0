"""``treepipe top NAME``: a live view of a local pipeline's workers and gateway.

Every refresh reads the workers' heartbeats from the pipeline's Redis and
scrapes the gateway's Prometheus ``/metrics``; what is missing (a worker down,
a heartbeat without ``stats``, no gateway) shows as ``-`` (``null`` in JSON).

Rates come from two heartbeats of the same worker process.  A worker writes
its heartbeat about once a second, as often as ``top`` refreshes, so dividing
by top's own sampling interval would alias (0 % one frame, 200 % the next).
Instead each heartbeat is timed by when it was *written*: the key's remaining
TTL, read in the same MULTI as its value, moves that instant by the worker's
constant TTL, which cancels in the difference of two heartbeats.

Computing the figures (parsing, rates, quantiles, the frame) is pure and lives
in the functions below; :class:`Top` only reads Redis and HTTP.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from http.client import HTTPException
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.cli.command_help import COMMANDS
from orchestrator.cli.flags import finite
from orchestrator.deploy.launcher import (
    pid_alive,
    read_state,
    running_state,
    state_sync,
    supervisor_alive,
)
from orchestrator.deploy.run_state import RunStateError
from orchestrator.serving.auth import API_KEY_FILE_ENV, read_api_key
from protocol.errors import TreepipeError
from protocol.sync.heartbeat import Heartbeat, StepStats
from protocol.sync.synchroniser import Synchroniser, participant_names

if TYPE_CHECKING:
    from rich.console import RenderableType

# the cumulative counters a worker's heartbeat carries under "stats"
STAT_KEYS = tuple(f.name for f in fields(StepStats))
# two readings of one heartbeat differ by Redis round trips (ms); two writes by ~1 s
SAME_WRITE_S = 0.05
# the shortest span between two heartbeats that rates are computed over
MIN_WINDOW_S = 0.2
HISTORY = 8  # heartbeats kept per worker


# ---- pure: heartbeats ------------------------------------------------------------------

@dataclass(frozen=True)
class Beat:
    """One reading of a worker's heartbeat."""

    hb: Heartbeat  # what the worker wrote
    # the write instant plus the key's TTL, on this host's monotonic clock: differences
    # between two heartbeats of one worker are the wall time between their writes
    clock: float


def stats_of(hb: Heartbeat | None) -> dict[str, float]:
    """The finite cumulative counters of a heartbeat's ``stats`` ({} when it has none)."""
    if hb is None or hb.stats is None:
        return {}
    return {k: float(v) for k, v in hb.stats.as_dict().items() if math.isfinite(v)}


def same_process(a: Beat, b: Beat) -> bool:
    """Whether two heartbeats come from one worker process (its counters are comparable)."""
    return (a.hb.inc, a.hb.pid) == (b.hb.inc, b.hb.pid)


def remember(history: list[Beat], beat: Beat | None, keep: int = HISTORY) -> list[Beat]:
    """``history`` with ``beat`` appended when it is a new write of the same process."""
    if beat is None:
        return history
    if history and not same_process(history[-1], beat):
        history = []  # a restarted worker counts from zero again
    if history and abs(beat.clock - history[-1].clock) < SAME_WRITE_S:
        return history  # the same write, read again
    return [*history, beat][-keep:]


def pick_base(history: Iterable[Beat], cur: Beat, min_s: float = MIN_WINDOW_S) -> Beat | None:
    """The newest earlier heartbeat of ``cur``'s process at least ``min_s`` older."""
    base = None
    for b in history:
        if same_process(b, cur) and cur.clock - b.clock >= min_s:
            base = b
    return base


def worker_rates(base: Mapping[str, float], cur: Mapping[str, float],
                 dt: float | None) -> dict[str, float | None]:
    """Figures over ``dt`` seconds between two cumulative ``stats`` readings.

    ``util`` is compute time over wall time; the ``*_ms`` figures and
    ``nodes_per_step`` are means per step; ``link_mb_s`` is link megabytes sent per
    second.  A figure whose counters are missing, or a step-less interval for the
    per-step means, gives None; so does every figure when a counter went backwards
    (a restart the heartbeat did not reveal).
    """
    out: dict[str, float | None] = dict.fromkeys(
        ("util", "steps_per_s", "compute_ms", "barrier_ms", "input_ms", "send_ms",
         "nodes_per_step", "link_mb_s"))
    if not dt or dt <= 0:
        return out
    d = {k: cur[k] - base[k] for k in STAT_KEYS if k in cur and k in base}
    if any(v < 0 for v in d.values()):
        return out
    steps = d.get("steps")

    def per_s(k: str, scale: float = 1.0) -> float | None:
        return d[k] * scale / dt if k in d else None

    def per_step(k: str, scale: float = 1.0) -> float | None:
        return d[k] * scale / steps if k in d and steps else None

    out.update(util=per_s("compute_s"), steps_per_s=per_s("steps"),
               compute_ms=per_step("compute_s", 1e3), barrier_ms=per_step("barrier_s", 1e3),
               input_ms=per_step("input_s", 1e3), send_ms=per_step("send_s", 1e3),
               nodes_per_step=per_step("nodes"), link_mb_s=per_s("sent_bytes", 1e-6))
    return out


def worker_row(beat: Beat | None, base: Beat | None, layout_id: str,
               proc: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One worker's line of a frame: liveness, plan, request/step and its rates.

    ``proc`` is what the launcher knows of the process (pid, alive, restarts).
    """
    hb = beat.hb if beat else None
    proc = proc or {}
    window = beat.clock - base.clock if beat and base else None
    rates = worker_rates(stats_of(base.hb) if base else {}, stats_of(hb), window)
    plan = hb.plan or None if hb else None
    pool = hb.kv if hb else None  # a stage's KV pool (the draft's only with a draft model)
    return {"alive": hb is not None,
            "pid": hb.pid if hb and hb.pid is not None else proc.get("pid"),
            "process_alive": proc.get("alive"), "restarts": proc.get("restarts"),
            "plan": plan, "plan_ok": None if plan is None else plan == layout_id,
            "req": hb.req if hb else None, "epoch": hb.epoch if hb else None,
            "step": hb.step if hb else None, "rejected": hb.rejected if hb else None,
            "has_stats": hb is not None and hb.stats is not None, "window_s": window,
            # blocks held now, at most, and in all
            "kv_used": pool.used if pool else None, "kv_peak": pool.peak if pool else None,
            "kv_blocks": pool.blocks if pool else None, **rates}


# ---- pure: gateway metrics -------------------------------------------------------------

# sample name in /metrics -> key of parse_metrics (counters summed over their labels)
SCALARS = {"treepipe_requests_waiting": "queue", "treepipe_requests_running": "running",
           "treepipe_requests_total": "requests", "treepipe_spec_steps_total": "steps",
           "treepipe_spec_hits_total": "hits",
           "treepipe_spec_verifications_total": "verifications",
           "treepipe_spec_flushes_total": "flushes",
           "treepipe_generation_tokens_total": "generated"}
HISTOGRAMS = {"treepipe_time_to_first_token_seconds": "ttft",
              "treepipe_inter_token_latency_seconds": "tbt"}


def parse_metrics(text: str) -> dict[str, Any]:
    """The figures ``top`` shows from a gateway's Prometheus text.

    Scalars are floats; ``ttft`` and ``tbt`` are ``{"sum", "count", "buckets"}``
    with ``buckets`` the cumulative (upper bound, count) pairs, +Inf last.
    """
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in SCALARS:
                key = SCALARS[s.name]
                out[key] = out.get(key, 0.0) + s.value
                continue
            base, _, part = s.name.rpartition("_")
            if base not in HISTOGRAMS:
                continue
            h = out.setdefault(HISTOGRAMS[base], {"sum": 0.0, "count": 0.0, "buckets": []})
            if part in ("sum", "count"):
                h[part] += s.value
            elif part == "bucket":
                h["buckets"].append((float(s.labels["le"]), s.value))
    for key in HISTOGRAMS.values():
        if key in out:
            out[key]["buckets"].sort()
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, as Prometheus' histogram_quantile.

    Linear within the bucket that holds it; None without observations.  A quantile
    in the +Inf bucket is the largest finite bound (nothing better is known).
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def latency(cur: Mapping[str, Any] | None, prev: Mapping[str, Any] | None) -> dict[str, Any]:
    """Mean, p50 and p95 since the gateway started, and the mean since ``prev`` (recent)."""
    if not cur:
        return dict.fromkeys(("mean", "p50", "p95", "recent"))
    recent = None
    if prev and cur["count"] > prev["count"] and cur["sum"] >= prev["sum"]:
        recent = (cur["sum"] - prev["sum"]) / (cur["count"] - prev["count"])
    return {"mean": _ratio(cur["sum"], cur["count"]), "p50": quantile(cur["buckets"], 0.5),
            "p95": quantile(cur["buckets"], 0.95), "recent": recent}


def gateway_figures(cur: Mapping[str, Any] | None, prev: Mapping[str, Any] | None,
                    error: str | None = None) -> dict[str, Any]:
    """The pipeline-wide figures of a frame from two parsed scrapes (``prev`` may be None).

    Hit rate and tokens per step count the requests finished since the gateway
    started (its counters move when a request ends); TBT's ``recent`` is the mean
    over the tokens since the previous scrape.
    """
    cur = cur or {}
    prev = prev or {}
    return {"up": bool(cur), "error": error, "queue": cur.get("queue"),
            "running": cur.get("running"), "requests": cur.get("requests"),
            "hit_rate": _ratio(cur.get("hits"), cur.get("verifications")),
            "tokens_per_step": _ratio(cur.get("verifications"), cur.get("steps")),
            "flushes": cur.get("flushes"),
            "ttft_s": latency(cur.get("ttft"), prev.get("ttft")),
            "tbt_s": latency(cur.get("tbt"), prev.get("tbt"))}


def metrics_url(http: str) -> str:
    """The ``/metrics`` URL of the gateway HTTP address published in Redis."""
    host, _, port = http.rpartition(":")
    host = host.strip("[]")
    # a wildcard listen address is reached on loopback: a local pipeline runs here
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


# ---- pure: frames --------------------------------------------------------------------

@dataclass
class Sample:
    """What one refresh read (Redis and the gateway), before any figure is computed."""

    wall: float  # time.time()
    participants: list[str]
    layout_id: str | None
    epoch: int | None
    beats: dict[str, Beat]
    http: str | None
    metrics: dict[str, Any] | None
    gateway_error: str | None = None
    redis_error: str | None = None
    procs: dict[str, dict[str, Any]] = field(default_factory=dict)


def build_frame(name: str, grpc: str, cur: Sample, history: Mapping[str, list[Beat]],
                prev_metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """The frame ``top`` shows (and ``--json`` prints) for ``cur``.

    ``history`` holds each worker's earlier heartbeats, ``cur``'s included or not.
    """
    workers = {}
    for w in cur.participants:
        beat = cur.beats.get(w)
        base = pick_base(history.get(w, []), beat) if beat else None
        workers[w] = worker_row(beat, base, cur.layout_id or "", cur.procs.get(w))
    # as Synchroniser.waiting(): no live heartbeat, or one of another layout
    waiting = [w for w, r in workers.items() if not r["alive"] or not r["plan_ok"]]
    return {"name": name, "time": cur.wall, "epoch": cur.epoch, "plan": cur.layout_id,
            "waiting": waiting, "redis_error": cur.redis_error,
            "endpoints": {"grpc": grpc, "http": cur.http},
            "gateway": gateway_figures(cur.metrics, prev_metrics, cur.gateway_error),
            "workers": workers}


def fmt(v: Any, spec: str = "") -> str:
    """A figure as text; None (unknown) is '-'."""
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ms(lat: Mapping[str, Any]) -> str:
    parts = [fmt(None if lat[k] is None else 1e3 * lat[k], ".1f")
             for k in ("mean", "p95", "recent")]
    return "/".join(parts) + " ms"


def render(frame: Mapping[str, Any]) -> RenderableType:
    """A frame as a rich renderable: a header, the gateway's figures, a table of workers."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ep = frame["endpoints"]
    head = Text.assemble(
        (frame["name"], "bold"), f"  epoch {fmt(frame['epoch'])}  plan {frame['plan'] or '-'}"
        f"  gRPC {fmt(ep['grpc'])}  HTTP {'http://' + ep['http'] if ep['http'] else '-'}")
    if frame["redis_error"]:
        head.append(f"  Redis: {frame['redis_error']}", "red")
    elif frame["waiting"]:
        head.append(f"  waiting for {', '.join(frame['waiting'])}", "yellow")
    g = frame["gateway"]
    gw = Text(f"queue {fmt(g['queue'], '.0f')}  running {fmt(g['running'], '.0f')}  "
              f"requests {fmt(g['requests'], '.0f')}  hit rate {fmt(g['hit_rate'], '.2f')}  "
              f"tokens/step {fmt(g['tokens_per_step'], '.2f')}  "
              f"flushes {fmt(g['flushes'], '.0f')}\nTTFT mean/p95/recent {_ms(g['ttft_s'])}  "
              f"TBT mean/p95/recent {_ms(g['tbt_s'])}")
    if g["error"]:
        gw.append(f"  gateway: {g['error']}", "yellow")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, caption_justify="left",
              caption="per step: compute, barrier (arrive to verdict), input wait and send "
                      "in ms, tree nodes; MB/s: link bytes sent; KV: blocks held of the pool")
    # a narrow terminal squeezes the figures, never the worker's name
    t.add_column("worker", no_wrap=True, min_width=6)
    for col in ("heartbeat", "pid", "plan", "request", "step", "util", "steps/s", "compute",
                "barrier", "input", "send", "nodes", "MB/s", "KV"):
        t.add_column(col, justify="left" if col in ("heartbeat", "plan", "request")
                     else "right")
    for w, r in frame["workers"].items():
        if r["alive"]:
            hb = "ok" if r["plan_ok"] else "other plan"
            style = "green" if r["plan_ok"] else "yellow"
        else:
            hb, style = "none", "red"
        # ids cut to 8 characters, enough to tell them apart on one screen
        t.add_row(w, Text(hb, style), fmt(r["pid"]), fmt(r["plan"])[:8], fmt(r["req"])[:8],
                  fmt(r["step"]), _pct(r["util"]), fmt(r["steps_per_s"], ".1f"),
                  fmt(r["compute_ms"], ".2f"), fmt(r["barrier_ms"], ".2f"),
                  fmt(r["input_ms"], ".2f"), fmt(r["send_ms"], ".2f"),
                  fmt(r["nodes_per_step"], ".1f"), fmt(r["link_mb_s"], ".2f"),
                  "-" if r["kv_blocks"] is None else f"{fmt(r['kv_used'])}/{r['kv_blocks']}")
    return Group(head, gw, t)


# ---- I/O -------------------------------------------------------------------------------

def api_key(path: str) -> str | None:
    """The gateway's bearer key as the gateway reads it: a file, else ``$TREEPIPE_API_KEY``."""
    return read_api_key(path)


def read_beats(sync: Synchroniser, names: list[str]) -> dict[str, Beat]:
    """Every live heartbeat of ``names``, timed by its write (see the module docstring)."""
    if not names:
        return {}
    pipe = sync.r.pipeline(transaction=True)  # value and TTL of one write, not of two
    for w in names:
        pipe.get(sync.key("hb", w))
        pipe.pttl(sync.key("hb", w))
    t0 = time.monotonic()
    res = pipe.execute()
    now = (t0 + time.monotonic()) / 2
    out = {}
    for i, w in enumerate(names):
        raw, ttl_ms = res[2 * i], res[2 * i + 1]
        if raw is None:
            continue
        try:
            info = json.loads(raw)
        except ValueError:
            continue  # garbage under a heartbeat key is no heartbeat
        hb = Heartbeat.from_json(info)
        if hb is not None:
            # no TTL (-1): time it by this read; its rates are then only as good as top's
            out[w] = Beat(hb, now + (ttl_ms / 1000 if ttl_ms >= 0 else 0.0))
    return out


def scrape(http: str, key: str | None, timeout_s: float) -> tuple[str | None, str | None]:
    """(metrics text, None), or (None, why not)."""
    req = urllib.request.Request(metrics_url(http))
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    # the gateway is on this machine: an http_proxy in the environment must not take it
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace"), None
    except urllib.error.HTTPError as e:
        return None, f"/metrics answered HTTP {e.code}"
    except (urllib.error.URLError, OSError, HTTPException, ValueError) as e:
        return None, f"unreachable ({getattr(e, 'reason', e)})"


class Top:
    """Reads one local pipeline each refresh and keeps what rates need."""

    def __init__(self, name: str, key: str | None, timeout_s: float):
        try:
            self.st = running_state(name)
        except RunStateError:
            raise  # a broken state file: its own line names the file and the fix
        except TreepipeError:
            raise TreepipeError(f"no local pipeline {name!r} is running; start it with "
                                "treepipe up -f FILE (treepipe top watches local pipelines "
                                "only)") from None
        self.name, self.key, self.timeout_s = name, key, timeout_s
        try:
            self.sync = state_sync(self.st, name)
        except OSError as e:  # the secret file of a pipeline that is starting or stopping
            raise TreepipeError(f"cannot read pipeline {name!r}'s Redis password: "
                                f"{e}") from None
        self.history: dict[str, list[Beat]] = {}
        self.prev_metrics: dict[str, Any] | None = None

    def sample(self) -> Sample:
        """Read the launcher's state, Redis and the gateway once."""
        st = read_state(self.name)
        if not st or not supervisor_alive(st):
            raise TreepipeError(f"pipeline {self.name!r} stopped")
        self.st = st
        procs = {n: {"pid": pid, "alive": pid_alive(pid),
                     "restarts": st.restarts[n].total if n in st.restarts else 0}
                 for n, pid in st.procs.items()}
        s = Sample(time.time(), participant_names(len(st.stages)), None, None, {},
                   None, None, procs=procs)
        try:
            r = self.sync.r
            names, plan, epoch, http = r.mget([
                self.sync.key("participants"), self.sync.key("plan"), self.sync.key("epoch"),
                self.sync.key("gateway", "http")])
            s.participants = json.loads(names) if names else s.participants
            s.layout_id = plan.decode() if plan else ""
            s.epoch = int(epoch or 0)
            s.http = http.decode() if http else None
            s.beats = read_beats(self.sync, s.participants)
        except (redis.RedisError, ValueError) as e:
            s.redis_error = f"{type(e).__name__}: {e}"
        if s.http:
            text, s.gateway_error = scrape(s.http, self.key, self.timeout_s)
            if text is not None:
                try:
                    s.metrics = parse_metrics(text)
                except ValueError as e:
                    s.gateway_error = f"unparsable /metrics ({e})"
        else:
            s.gateway_error = "no HTTP endpoint published"
        return s

    def step(self) -> dict[str, Any]:
        """Sample once and return the frame, the rates measured since earlier samples."""
        s = self.sample()
        for w in s.participants:
            self.history[w] = remember(self.history.get(w, []), s.beats.get(w))
        frame = build_frame(self.name, self.st.endpoint, s, self.history, self.prev_metrics)
        self.prev_metrics = s.metrics
        return frame


def cmd_top(a: argparse.Namespace) -> int:
    """``treepipe top NAME``: refresh until Ctrl-C, or one frame with --once."""
    top = Top(a.name, api_key(a.api_key_file), timeout_s=max(0.5, min(2.0, a.interval)))
    if a.once:
        top.step()  # the first reading: rates need a second one
        time.sleep(a.interval)
        frame = top.step()
        if frame["redis_error"]:
            raise TreepipeError(f"cannot read pipeline {a.name!r}'s Redis: "
                                f"{frame['redis_error']}")
        if a.json:
            print(json.dumps(frame), flush=True)
        else:
            from rich.console import Console

            Console().print(render(frame))
        return 0
    try:
        if a.json:
            while True:
                print(json.dumps(top.step()), flush=True)
                time.sleep(a.interval)
        from rich.live import Live

        with Live(render(top.step()), auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(a.interval)
                live.update(render(top.step()), refresh=True)
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how one leaves top
    except BrokenPipeError:  # `treepipe top NAME --json | head`: the reader is done
        # stdout's own flush at exit would fail again, with a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def add_top_parser(sub: Any) -> None:
    """Register ``treepipe top``."""
    t = sub.add_parser("top", help=COMMANDS["top"])
    t.add_argument("name", help="metadata.name of a pipeline started by treepipe up/serve")
    t.add_argument("--interval", type=finite(0.05, 3600, what=" seconds"), default=1.0,
                   help="seconds between refreshes (default 1)")
    t.add_argument("--once", action="store_true",
                   help="print one frame (rates over one --interval) and exit")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object per refresh (once with --once)")
    t.add_argument("--api-key-file", default=os.environ.get(API_KEY_FILE_ENV, ""),
                   help="file with the gateway's bearer key (default $TREEPIPE_API_KEY_FILE; "
                        "or set $TREEPIPE_API_KEY); never the key itself on the command line")
    t.set_defaults(func=cmd_top)

