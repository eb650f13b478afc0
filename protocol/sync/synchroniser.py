"""The synchroniser: per-request state and step order in Redis, moved by Lua scripts.

Keys, namespaced per pipeline ``P`` and request ``R`` (one Redis may serve many
pipelines)::

    tp:P:epoch               pipeline epoch; bumped when a worker restarts or stages re-plan
    tp:P:participants        JSON list of the workers in the step barrier
    tp:P:plan                id of the stage layout the participants run (see join.lua)
    tp:P:ctl:W               control list of worker W (start / step verdicts), FIFO
    tp:P:hb:W                heartbeat of worker W (expires)
    tp:P:curve:W             stage W's measured forward seconds against rows (JSON), for
                             the draft service's adaptive width
    tp:P:batch               set of the requests the participants step together
    tp:P:joining             requests admitted since the last barrier (join at the next)
    tp:P:eplan               the plan the current epoch runs
    tp:P:pending             set while an epoch waits for every participant to be up
    tp:P:kvpool              hash: plan, blocks (the smallest fixed KV pool its workers
                             reported when its resumed epoch started: kv_pool)
    tp:P:bar:E:S             barrier of step S in epoch E (deleted when it completes)
    tp:P:req:R               hash: prompt, params, max_new, stop ids, status, epoch,
                             rows (prompt length), chunk (prefill rows a step),
                             head (rows of its first chunk: the room it joined into),
                             joined (the batch step of its step 0), step, kv_tokens,
                             kv_w, kv_budget, kv_cap (its KV worst case, and the
                             budget its gateway read and the cap it set: admit),
                             kv_blocks (that worst case at admission, for a gateway or
                             worker of an earlier version during a rolling upgrade)
    tp:P:req:R:log           committed token log (generated tokens, in order)
    tp:P:req:R:ev            stream of commits and the end event, read by the gateway
                             (a commit: tok, i, t, and lp, its logprobs, when asked)
    tp:P:req:R:sched         per-step hit / miss record of the request (see arrive.lua)

A request's keys expire ``ttl_s`` after its last commit.  Every transition is one Lua script,
loaded once and called by SHA (redis-py's ``Script``), so a step costs each
participant two round trips, however many requests are in flight: ``arrive``
(one report per request) and the blocking pop of the verdicts (one per request).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis

from protocol.errors import TreepipeError
from protocol.requests.logprobs import TokenLogprobs
from protocol.requests.sampling_params import SamplingError, SamplingParams
from protocol.scheduling.kv_blocks import kv_limit, request_blocks
from protocol.scheduling.prefill import PrefillLayout
from protocol.scheduling.scheduler import refuse_entry
from protocol.sync.control import Control, ControlError, parse_control
from protocol.sync.heartbeat import Heartbeat

DEFAULT_TTL_S = 3600
MAX_CURVE_POINTS = 1000  # a stage's forward-time curve (publish_curve): bounds on what
MAX_CURVE_ROWS = 1 << 20  # the draft will read from Redis
MAX_CURVE_LOADS = 64  # counts of requests one curve is measured at
FAILED_PREFIX = "failed: "  # the end reason of a request a worker could not run
# a gateway renews the lease of each request it streams; a request whose lease lapsed
# (its gateway died) is cancelled by the next gateway that looks (reap_orphan)
LEASE_S = 10.0
EVENTS_RECONNECT_S = 60.0  # how long a reader of a request's events waits for Redis
# Every Redis call gives up after this long on a silent server (a paused or partitioned
# Redis): the outage bounds of the gateway (runner.py) count on it.  redis-py 8 has it
# as a default, 5-7 wait for ever, so connect() sets it.
SOCKET_TIMEOUT_S = 5.0
# the longest a blocking read (BLPOP, XREAD BLOCK) waits in one call: under the socket
# timeout, or a quiet list would read as a lost connection (longer waits loop)
BLOCK_MAX_S = SOCKET_TIMEOUT_S - 1.0
log = logging.getLogger("treepipe.sync")
# the Redis password reaches a process through one of these, never its command line
# (``ps`` shows every user's command lines; a process's environment only to its owner)
PASSWORD_FILE_ENV = "TREEPIPE_REDIS_PASSWORD_FILE"
PASSWORD_ENV = "TREEPIPE_REDIS_PASSWORD"
# while Redis is unreachable a caller waits up to this long between attempts
BACKOFF_CAP_S = 2.0
T = TypeVar("T")
# what a lost (or restarting, or paused) Redis raises; a refused password is not one
LOST = (redis.ConnectionError, redis.TimeoutError)


def is_lost(e: BaseException) -> bool:
    """Whether ``e`` is a lost Redis connection, worth waiting out (not a refused password)."""
    return isinstance(e, LOST) and not isinstance(e, redis.AuthenticationError)


def participant_names(stages: int) -> list[str]:
    """The workers in a pipeline's step barrier: the draft service, then every stage."""
    return ["draft"] + [f"stage{i}" for i in range(stages)]


class SyncError(TreepipeError, RuntimeError):
    """The synchroniser refused an operation; the message says why."""


class BadRequestState(SyncError, ValueError):
    """A request's stored fields cannot be read (a value out of range, too); that request
    fails, nothing else."""


class Busy(SyncError):
    """The pipeline already runs as many requests as it has slots."""


class TooBig(SyncError):
    """A request's worst case of KV blocks exceeds a whole pool of the pipeline as it is:
    it could not run even alone."""

    def __init__(self, need: int, budget: int, stages: int):
        super().__init__(f"the request needs {need} KV blocks on each of {stages} stages, "
                         f"more than the {budget} a stage has")
        self.need, self.budget, self.stages = need, budget, stages


def redis_password() -> str | None:
    """The Redis password from ``$TREEPIPE_REDIS_PASSWORD_FILE`` or ``$TREEPIPE_REDIS_PASSWORD``."""
    path = os.environ.get(PASSWORD_FILE_ENV)
    if path:
        try:
            return open(path).read().strip()  # noqa: SIM115 - read whole, closed by GC
        except OSError as e:
            raise SyncError(f"cannot read the Redis password file {path} "
                            f"(${PASSWORD_FILE_ENV}): {e.strerror}") from None
    return os.environ.get(PASSWORD_ENV) or None


def check_redis_url(url: str) -> None:
    """Refuse what is not ``redis[s]://HOST[:PORT][/DB]`` with a one-line error."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok, parts = False, urlsplit("")
    if parts.scheme not in ("redis", "rediss", "unix") or not port_ok or (
            parts.scheme != "unix" and not parts.hostname):
        raise SyncError(f"--redis {url!r} is not a Redis URL; use redis://HOST:PORT/DB "
                        "(the password goes in $TREEPIPE_REDIS_PASSWORD_FILE, not the URL)")


def connect(url: str, password: str | None = None) -> redis.Redis:
    """A client of ``url``; the password, unless the URL has one, comes from ``password``
    or the environment (:func:`redis_password`)."""
    check_redis_url(url)
    if not urlsplit(url).password:
        password = password or redis_password()
    try:
        return redis.Redis.from_url(url, password=password, socket_keepalive=True,
                                    socket_timeout=SOCKET_TIMEOUT_S,
                                    socket_connect_timeout=SOCKET_TIMEOUT_S,
                                    health_check_interval=30)
    except ValueError as e:
        raise SyncError(f"--redis {url!r}: {e}") from None


def with_reconnect(fn: Callable[[], T], what: str, give_up_s: float,
                   stop: Callable[[], bool] = lambda: False) -> T:
    """Call ``fn`` until it does not fail for a lost Redis connection.

    A Redis restart (or a pause) is a pause for the caller, not a crash: it retries
    with a backoff doubling up to :data:`BACKOFF_CAP_S`, and re-raises after
    ``give_up_s`` or once ``stop()`` is true.  Anything but a connection error
    (a refused password, a script error) is raised at once.
    """
    deadline = time.monotonic() + give_up_s
    delay = 0.05
    while True:
        try:
            return fn()
        except LOST as e:
            if not is_lost(e) or time.monotonic() > deadline or stop():
                raise
            log.warning("%s: Redis unreachable (%s); retrying in %.2f s", what, e, delay)
            time.sleep(delay)
            delay = min(BACKOFF_CAP_S, delay * 2)


def _script(name: str) -> str:
    return resources.files("protocol.sync").joinpath("lua", f"{name}.lua").read_text()


def _with_prelude(name: str) -> str:
    """A script with the helpers it shares with the others (prelude.lua) in front."""
    return _script("prelude") + _script(name)


@dataclass(frozen=True)
class Report:
    """One request's part of a participant's arrival at a step barrier.

    ``token``: what the last stage verified (-1: nothing); ``end``: why the request
    ends with it (:func:`~protocol.requests.stopping.end_reason`; '' while it goes on).
    ``root_id`` and ``children``: the draft service's id for a new root on a miss and
    the root's children as (token, node id) (-1 and none from a stage).  ``logprobs``:
    the verified token's, for a request that asked (the last stage; None otherwise).
    """

    token: int = -1
    root_id: int = -1
    children: tuple[tuple[int, int], ...] = ()
    end: str = ""
    logprobs: TokenLogprobs | None = None


@dataclass
class SpecStats:
    """One request's speculation figures, from the synchroniser's step schedule."""

    steps: int = 0  # pipeline steps of the request (all epochs)
    hits: int = 0  # verified tokens that were in the speculative tree
    misses: int = 0  # verified tokens that were not: each flushes the pipeline
    epochs: int = 0

    @classmethod
    def from_schedule(cls, sched: str) -> SpecStats:
        """Parse :meth:`Synchroniser.schedule`: '|' per epoch, then 'h'/'m'/'.' per step."""
        return cls(steps=sum(sched.count(c) for c in "hm."), hits=sched.count("h"),
                   misses=sched.count("m"), epochs=sched.count("|"))

    @property
    def verified(self) -> int:
        return self.hits + self.misses

    def to_dict(self) -> dict[str, int | float]:
        """The ``treepipe_stats`` extension field of a response."""
        v = self.verified
        return {"steps": self.steps, "hits": self.hits, "flushes": self.misses,
                "hit_rate": round(self.hits / v, 6) if v else 0.0,
                "tokens_per_step": round(v / self.steps, 6) if self.steps else 0.0,
                "epochs": self.epochs}


@dataclass(frozen=True)
class Join:
    """A request the scheduler lets join at the next step: its first chunk's rows
    (``head``, the room stage 1 has for it) and the steps its prefill takes."""

    rid: str
    head: int
    steps: int


@dataclass
class RequestState:
    """What a worker needs to (re)start a request."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: list[int]
    status: str
    epoch: int
    log: list[int]
    reason: str = ""
    layout_id: str = ""  # the stage layout its current epoch runs on (see join.lua)
    chunk: int = 0  # prompt rows per prefill step (0: the whole sequence in one step)
    head: int = 0  # rows of its first chunk, the room it joined into (0: a whole chunk)
    # its KV worst case: committed tokens at most and the tree width a stage holds (None:
    # stored by an earlier version, which kept only its blocks, kv_blocks); the budget
    # its gateway read and its gateway's own cap (None: none stored)
    kv_tokens: int | None = None
    kv_w: int | None = None
    kv_blocks: int = 0
    kv_budget: int = 0
    kv_cap: int | None = None

    def kv_need(self, stages: int) -> int:
        """The KV blocks it holds on a stage at most, in a pipeline of ``stages`` stages."""
        return kv_need(self.kv_tokens, self.kv_w, self.kv_blocks, stages)

    def committed(self) -> list[int]:
        """The sequence a (re)joining worker prefills: the prompt, and on a resume every
        logged token but the last (the last is the root of its first tree)."""
        return self.prompt + self.log[:-1] if self.log else list(self.prompt)

    def prefill_rows_total(self) -> int:
        """Rows of :meth:`committed`, without building it."""
        return len(self.prompt) + max(len(self.log) - 1, 0)

    def layout(self) -> PrefillLayout:
        """The chunks of its prefill (:mod:`protocol.scheduling.prefill`)."""
        return PrefillLayout(self.prefill_rows_total(), self.chunk, self.head)

    def prefill_chunks(self) -> int:
        """Chunks its committed sequence takes."""
        return self.layout().chunks()

    def prefill_steps(self, stages: int) -> int:
        """Steps its prefill takes in a pipeline of ``stages`` stages."""
        return self.layout().steps(stages)

    def prefill_chunk(self, step: int, stage: int) -> int | None:
        """The chunk stage ``stage`` (0-based) computes in prefill step ``step``, or None."""
        return self.layout().chunk_at(step, stage)

    def prefill_rows(self, index: int) -> tuple[int, int]:
        """The rows ``[a, b)`` of the committed sequence that chunk ``index`` holds."""
        return self.layout().bounds(index)


class Synchroniser:
    """Client of one pipeline's synchroniser state in Redis."""

    def __init__(self, url: str, pipeline: str, ttl_s: int = DEFAULT_TTL_S,
                 password: str | None = None):
        self.r = connect(url, password)
        self.pipeline, self.ttl_s = pipeline, ttl_s
        self.prefix = f"tp:{pipeline}"
        # reap_orphan reaps nothing before this (time.monotonic()): see hold_reaping
        self.reap_hold_until = 0.0
        self._start = self.r.register_script(_with_prelude("start"))
        self._arrive = self.r.register_script(_with_prelude("arrive"))
        self._cancel = self.r.register_script(_script("cancel"))
        self._join = self.r.register_script(_with_prelude("join"))
        # compare-and-delete in one step: a successor's heartbeat must survive
        self._leave = self.r.register_script(
            "local hb = redis.call('GET', KEYS[1]) "
            "if hb and cjson.decode(hb)['inc'] == ARGV[1] then redis.call('DEL', KEYS[1]) end")

    # ---- keys ------------------------------------------------------------------------
    def key(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    def req_key(self, rid: str, *parts: object) -> str:
        return self.key("req", rid, *parts)

    @property
    def ctl_prefix(self) -> str:
        return self.key("ctl") + ":"

    @property
    def hb_prefix(self) -> str:
        return self.key("hb") + ":"

    # ---- pipeline ----------------------------------------------------------------------
    def register(self, participants: Sequence[str]) -> None:
        """Name the workers of the step barrier (the launcher does this before starting them)."""
        self.r.set(self.key("participants"), json.dumps(list(participants)))
        self.r.setnx(self.key("epoch"), 0)

    def participants(self) -> list[str]:
        raw = self.r.get(self.key("participants"))
        return json.loads(raw) if raw else []

    def publish_curve(self, worker: str, loads: Mapping[int, Mapping[int, float]], last: bool,
                      plan: str = "") -> None:
        """Publish stage ``worker``'s measured forward seconds against the rows it computes,
        per count of requests packed in them (requests -> rows -> seconds; ``last``: it is
        the last stage, whose rows are roots, not levels; ``plan``: the layout it runs, so
        a re-planned pipeline never reads a curve of other layers)."""
        def pts(d: Mapping[int, float]) -> list[list[float]]:
            return [[int(n), float(t)] for n, t in sorted(d.items())]

        self.r.set(self.key("curve", worker), json.dumps(
            {"last": bool(last), "plan": plan,
             "loads": [[int(r), pts(d)] for r, d in sorted(loads.items())]}))

    def drop_curve(self, worker: str) -> None:
        """Remove ``worker``'s curve (a stage that measures none must not leave an old one)."""
        self.r.delete(self.key("curve", worker))

    def curves(self, names: Sequence[str], plan: str = ""
               ) -> dict[str, tuple[bool, dict[int, list[tuple[int, float]]]]]:
        """The published curves of ``names`` for ``plan`` (worker -> (last stage, requests
        -> [(rows, seconds)] by rows)); a worker without one, with one of another plan, or
        with one that does not parse is left out (the last logged)."""
        out: dict[str, tuple[bool, dict[int, list[tuple[int, float]]]]] = {}
        if not names:
            return out
        for name, raw in zip(names, self.r.mget([self.key("curve", n) for n in names]),
                             strict=True):
            if raw is None:
                continue
            try:
                d = json.loads(raw)
                if not 0 < len(d["loads"]) <= MAX_CURVE_LOADS:
                    raise ValueError(f"1-{MAX_CURVE_LOADS} counts of requests")
                loads = {int(r): _curve_points(p) for r, p in d["loads"]}
                if len(loads) < len(d["loads"]) or any(not 1 <= r <= MAX_CURVE_ROWS
                                                       for r in loads):
                    raise ValueError(f"distinct counts of requests in [1, {MAX_CURVE_ROWS}]")
                if str(d.get("plan", "")) != plan:
                    continue  # measured on another layout's layers
                out[name] = (bool(d["last"]), loads)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                log.warning("ignored the malformed forward curve of %s: %s", name, e)
        return out

    def layout_id(self) -> str:
        """Id of the stage layout the pipeline runs ('' when workers were started without one)."""
        raw = self.r.get(self.key("plan"))
        return raw.decode() if raw else ""

    def join(self, worker: str, layout_id: str, participants: Sequence[str] | None,
             startup: bool) -> tuple[str, str]:
        """Announce ``worker`` (running layout ``layout_id``); may set it and start a new epoch.

        Returns (IDLE | RUNNING | WAITING | RESUMED, plan id or new epoch): see join.lua.
        """
        return self._join_script(worker, layout_id, participants, startup, False, -1)

    def _join_script(self, worker: str, layout_id: str, participants: Sequence[str] | None,
                     startup: bool, force: bool, epoch: int) -> tuple[str, str]:
        """join.lua: a worker joins the pipeline, at its start and with every heartbeat;
        or a worker that waited too long for its input asks for a new epoch (``force``).

        Workers bring the plan (stage layout) they were started with, so a re-plan needs
        no control-plane call: a plan takes over only from one that cannot run, and only
        with more live workers (a re-plan's pods find the old plan's going away, while a
        lingering or restarting pod of a superseded plan cannot take a plan that is
        (nearly) up, and two partly-up plans do not take the pipeline from each other in
        turn).  Every running request (the batch and those waiting to join it) restarts
        from its token log under a new epoch once every participant of the plan has a
        live heartbeat reporting that plan; the requests cancelled in the batch get their
        end events then, as their barrier will never complete.

        Finished requests left in a batch with no running one are removed by the barrier
        completing now (a heartbeat that cleared them would lose their last schedule
        mark), except where that barrier never completes: a member restarts, a resume, a
        new plan or a fence (a pending epoch, or an epoch of another plan); and a batch
        that has held only finished requests for 20 s (STUCK_S), whatever the reason, is
        cleared rather than queue every later request behind it.

        KEYS: epoch, batch (set), participants, plan, joining (list), epoch plan, pending.
        ARGV: worker, plan id ('' = none), participants JSON ('' = keep), startup (0/1),
        ctl prefix, req key prefix, heartbeat prefix, force (0/1), caller's epoch (-1 =
        any).  Returns [status, detail]: IDLE (no running request; detail: the plan, or
        the new epoch when forced), RUNNING (nothing to do; the plan), WAITING (an epoch
        is due once every participant is up; the plan) or RESUMED (the new epoch).
        """
        res = self._join(keys=[self.key("epoch"), self.key("batch"), self.key("participants"),
                               self.key("plan"), self.key("joining"), self.key("eplan"),
                               self.key("pending")],
                         args=[worker, layout_id, json.dumps(list(participants))
                               if participants else "", int(startup), self.ctl_prefix,
                               self.req_key(""), self.hb_prefix, int(force), epoch])
        status, detail = (x.decode() if isinstance(x, bytes) else str(x) for x in res)
        if status == "RESUMED":
            # every participant beats with the plan (join.lua started the epoch only so):
            # their pools are saved for the times when one of them does not (kv_pool)
            plan = self.layout_id()
            pool = self._pools_now(self.participants(), plan)
            if pool is not None:
                self.r.hset(self.key("kvpool"), mapping={"plan": plan, "blocks": pool})
        return status, detail

    def waiting(self, beats: Mapping[str, Heartbeat] | None = None) -> list[str]:
        """Participants without a live heartbeat of the stored plan (loading, or down).

        ``beats`` is what :meth:`heartbeats` just returned, if the caller has it.
        """
        names = self.participants()
        return self._waiting(names, self.heartbeats(names) if beats is None else beats)

    def ready(self) -> bool:
        """Every participant has a live heartbeat, reporting the stored plan."""
        names = self.participants()
        return bool(names) and not self._waiting(names, self.heartbeats(names))

    def _waiting(self, names: list[str], beats: Mapping[str, Heartbeat]) -> list[str]:
        want = self.layout_id()
        # heartbeats and Redis keep the historic field name 'plan' for the layout id
        return [w for w in names if w not in beats or beats[w].plan != want]

    def epoch(self) -> int:
        return int(self.r.get(self.key("epoch")) or 0)

    def resume(self, epoch: int = -1) -> tuple[str, str]:
        """Ask for a new epoch: every running request restarts from its token log.

        ``epoch`` names the epoch the caller gave up on (an input that never came; -1:
        any); a caller whose epoch is already over changes nothing.  Without a running
        request this starts a fresh epoch, so nothing of an earlier run can commit.
        Like a joining worker's, the epoch starts once every participant is up.
        """
        return self._join_script("", "", None, False, True, epoch)

    # ---- requests (gateway side) -------------------------------------------------------
    def submit(self, rid: str, prompt: Sequence[int],
               params: SamplingParams | Mapping[str, Any], max_new: int,
               stop_ids: Sequence[int], slots: int = 1, chunk: int = 0,
               kv_width: int = 0, kv_budget: int = 0, kv_cap: int = 0) -> int:
        """Admit a request; returns its epoch.  It waits in the joining line until the
        scheduler (the draft service) lets it join the batch at a step barrier, its
        prompt in chunks of at most ``chunk`` rows a step (0: all in one step; see
        protocol/scheduling/prefill.py).  Raises Busy if ``slots`` requests are running
        or in line already, or if its worst case of KV blocks per stage (prompt +
        ``max_new`` committed rows and the tree levels of ``kv_width`` nodes a stage
        holds, at the pipeline's stage count now) does not fit beside theirs; TooBig if
        it exceeds a whole pool (:func:`~protocol.scheduling.scheduler.refuse_entry`).
        The pools are those the participants' heartbeats report now, within ``kv_cap``
        blocks (the gateway's own budget; 0: none), or ``kv_budget`` (the gateway's
        reading of both; 0: no budget) while a participant does not beat
        (:func:`~protocol.scheduling.kv_blocks.kv_limit`).

        Idempotent: a retry with the id of a request that is running (its first reply
        was lost with the connection) returns that request's epoch and writes nothing."""
        status, detail = self.admit(rid, prompt, params, max_new, stop_ids, slots, chunk,
                                    kv_width, kv_budget, kv_cap)
        if status == "BUSY":
            raise Busy(f"{slots} request(s) already running (one is {detail})")
        if status == "FULL":
            held, need, budget = detail.split("/")
            raise Busy(f"the running requests hold {held} of the {budget} KV blocks a "
                       f"stage has; this one needs {need}")
        if status == "TOOBIG":
            need, budget, stages = map(int, detail.split("/"))
            raise TooBig(need, budget, stages)
        if status == "NOPIPE":
            raise SyncError(f"pipeline {self.pipeline!r} has no registered workers")
        if status == "BAD":  # nothing was stored
            raise SyncError(f"request {rid} refused: {detail}")
        return int(detail)

    def admit(self, rid: str, prompt: Sequence[int],
              params: SamplingParams | Mapping[str, Any], max_new: int,
              stop_ids: Sequence[int], slots: int = 1, chunk: int = 0, kv_width: int = 0,
              kv_budget: int = 0, kv_cap: int = 0) -> tuple[str, str]:
        """:meth:`submit`'s answer as (status, detail): OK (detail: the epoch), BUSY,
        FULL, TOOBIG, NOPIPE or BAD (detail: why; nothing was written).

        The entry rule runs here, on what Redis holds as it reads it; start.lua then only
        stores the request and puts it in line.  The read and the write are one
        optimistic transaction (WATCH on the batch, the line and the layout): a request
        that another gateway puts in line in between makes this one read again.

        start.lua stores the request and puts it in the line; the scheduler (the draft
        service) lets it join at a step barrier (arrive.lua).  On an idle pipeline a new
        epoch starts with no request and this one first in line, so the scheduler decides
        at the epoch's first barrier.  KEYS: req, batch (set), epoch, participants, log,
        events, plan, joining (list), epoch plan, pending.  ARGV: rid, prompt (JSON),
        params (JSON), max_new, stop ids (JSON), ctl prefix, now_ms, req key prefix,
        ttl_s, chunk (prompt rows per prefill step; 0: the whole prompt in one step), kv
        width, kv budget, kv cap, kv blocks (its worst case and the budget its gateway
        read: stored for the scheduler).  Returns {'OK', epoch} (also, writing nothing, to
        a retry of a running request's admission) or {'BAD', why}, why naming the first
        bad argument or stored value; BAD writes nothing.  The script checks what nothing
        here checks (the id and keys, prompt, stop ids, now_ms, ttl_s, chunk and the stored
        epoch) and relies on this method for the rest: the sampling parameters, max_new
        and the kv numbers above, and the participant list (NOPIPE / BAD) in
        :meth:`_entry`, which the WATCH keeps as read until the script runs."""
        try:
            sp = params if isinstance(params, SamplingParams) else \
                SamplingParams.from_wire(params)
        except SamplingError as e:
            return ("BAD", f"params.{e.field} is out of range: {e}")
        except (TypeError, ValueError, AttributeError) as e:
            return ("BAD", f"params must be a JSON object of sampling parameters ({e})")
        for name, v, lo in (("max_new", max_new, 1), ("slots", slots, 1),
                            ("kv width", kv_width, 0), ("kv budget", kv_budget, 0),
                            ("kv cap", kv_cap, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                return ("BAD", f"{name} must be an integer >= {lo}, got {v!r}")
        watched = [self.key("batch"), self.key("joining"), self.key("participants"),
                   self.key("plan")]
        while True:
            with self.r.pipeline() as p:
                try:
                    p.watch(*watched)
                    refused, need = self._entry(rid, len(prompt) + max_new, slots, kv_width,
                                                kv_budget, kv_cap)
                    if refused is not None:
                        return refused
                    p.multi()
                    self._start(keys=[self.req_key(rid), self.key("batch"), self.key("epoch"),
                                      self.key("participants"), self.req_key(rid, "log"),
                                      self.req_key(rid, "ev"), self.key("plan"),
                                      self.key("joining"), self.key("eplan"),
                                      self.key("pending")],
                                args=[rid, json.dumps(list(prompt)),
                                      json.dumps(sp.to_wire()), max_new,
                                      json.dumps(list(stop_ids)), self.ctl_prefix,
                                      int(time.time() * 1000), self.req_key(""), self.ttl_s,
                                      chunk, kv_width, kv_budget, kv_cap, need],
                                client=p)
                    res = p.execute()[0]
                except redis.WatchError:
                    continue
            status, detail = (x.decode() if isinstance(x, bytes) else str(x) for x in res)
            return status, detail

    def _entry(self, rid: str, tokens: int, slots: int, kv_width: int, kv_budget: int,
               kv_cap: int) -> tuple[tuple[str, str] | None, int]:
        """The entry rule on the state now: a refusal (or None) and the request's worst
        case in KV blocks per stage.  A retry of a running request is never refused
        (start.lua answers it)."""
        # two round trips: what the rule reads first, then the running requests' worst
        # cases with the participants' heartbeats (the pools) and the saved pools
        first = self.r.pipeline(transaction=False)
        first.get(self.key("participants"))
        first.hget(self.req_key(rid), "status")
        first.smembers(self.key("batch"))
        first.lrange(self.key("joining"), 0, -1)
        first.get(self.key("plan"))
        raw, status, members, queued, plan_raw = first.execute()
        try:
            names = json.loads(raw) if raw else None
        except ValueError:
            names = []
        if names is None:
            return ("NOPIPE", ""), 0
        if not (isinstance(names, list) and names
                and all(isinstance(w, str) and w for w in names)):
            return ("BAD", "the stored participant list is not a JSON list of names; "
                           "restart the pipeline"), 0
        stages = max(len(names) - 1, 1)
        need = request_blocks(tokens, stages, kv_width)
        if status == b"running":
            return None, need
        rids = _in_flight_of(members, queued)
        live, held, pool = self._held_and_pool(rids, names, stages,
                                               plan_raw.decode() if plan_raw else "")
        budget = kv_limit(kv_budget, kv_cap, pool)
        refused = refuse_entry(held, need, slots=slots, budget=budget)
        if refused is None:
            return None, need
        status, detail = refused
        if status == "BUSY":
            detail = live[0]
        elif status == "TOOBIG":
            detail = f"{detail}/{stages}"
        return (status, detail), need

    def _held_and_pool(self, rids: Sequence[str], names: Sequence[str], stages: int,
                       plan: str) -> tuple[list[str], list[int], int | None]:
        """In one round trip: the requests of ``rids`` still running, their KV worst cases
        at ``stages`` stages, and the pipeline's pool (:meth:`kv_pool`)."""
        pipe = self.r.pipeline(transaction=False)
        for r in rids:
            pipe.hmget(self.req_key(r), "status", "kv_tokens", "kv_w", "kv_blocks")
        pipe.mget([self.key("hb", w) for w in names])
        pipe.hmget(self.key("kvpool"), "plan", "blocks")
        *held_raw, beats_raw, saved = pipe.execute()
        live, held = [], []
        for r, (st, tokens, w, blocks) in zip(rids, held_raw, strict=True):
            if st == b"running":  # a finished one leaves at the next barrier
                live.append(r)
                held.append(kv_need(_int_or_none(tokens), _int_or_none(w),
                                    _int_or_none(blocks) or 0, stages))
        pool = _pool_of(_beats(names, beats_raw), names, plan)
        return live, held, pool if pool is not None else _saved_pool(saved, plan)

    def renew_lease(self, rid: str) -> None:
        """The gateway streaming ``rid`` is alive (for :data:`LEASE_S` from now)."""
        self.renew_leases([rid])

    def renew_leases(self, rids: Collection[str]) -> None:
        """:meth:`renew_lease` of each of ``rids``, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.set(self.req_key(rid, "lease"), 1, px=int(LEASE_S * 1000))
        pipe.execute()

    def orphaned(self, rid: str) -> bool:
        """Whether ``rid`` runs with no gateway left to stream it: its lease lapsed.

        A request younger than a lease is never orphaned (its gateway may not have
        renewed yet).
        """
        pipe = self.r.pipeline()
        pipe.hmget(self.req_key(rid), "status", "created_ms")
        pipe.exists(self.req_key(rid, "lease"))
        (status, created), lease = pipe.execute()
        try:
            age_s = time.time() - int(created) / 1000
        except (TypeError, ValueError):
            return False
        return status == b"running" and not lease and age_s > 2 * LEASE_S

    def in_flight(self) -> list[str]:
        """Ids of the requests in the batch or waiting to join it (finished ones leave
        at the next barrier)."""
        pipe = self.r.pipeline()
        pipe.smembers(self.key("batch"))
        pipe.lrange(self.key("joining"), 0, -1)
        return _in_flight_of(*pipe.execute())

    def waits_beside_a_batch(self, rid: str) -> bool:
        """Whether running request ``rid`` has yet to join a batch in which a request
        runs: it waits for room (prefill rows, or KV blocks after a re-plan to more
        stages) that those requests give back as they end (or as their own gateways
        give up on them), so no commit for a while is no stall of its own."""
        pipe = self.r.pipeline()
        pipe.hmget(self.req_key(rid), "status", "joined")
        pipe.smembers(self.key("batch"))
        (status, joined), members = pipe.execute()
        if status != b"running" or int(joined or -1) >= 0 or rid.encode() in members:
            return False
        pipe = self.r.pipeline()
        for m in members:
            pipe.hget(self.req_key(m.decode()), "status")
        return b"running" in pipe.execute()

    def reap_orphan(self, own: Collection[str] = ()) -> list[str]:
        """Cancel the running requests whose gateway is gone; returns their ids.

        ``own``: requests the caller streams itself, never orphans (their lease may
        have lapsed while Redis was restarting and the caller could not renew it).
        """
        if time.monotonic() < self.reap_hold_until:
            return []
        reaped = []
        for rid in self.in_flight():
            if rid not in own and self.orphaned(rid):
                self.cancel(rid, "gateway lost")
                log.warning("cancelled request %s: its gateway stopped renewing its lease", rid)
                reaped.append(rid)
        return reaped

    def hold_reaping(self, seconds: float) -> None:
        """Reap no orphan for ``seconds`` from now (a hold already longer stays).

        A gateway that found Redis unreachable calls this: the other gateways' leases
        lapse in the same outage while those gateways wait it out (up to their
        ``sync_outage_s``), so a lapsed lease says nothing about a gateway being dead until
        they have had the time to reconnect and renew.
        """
        self.reap_hold_until = max(self.reap_hold_until, time.monotonic() + seconds)

    def cancel(self, rid: str, reason: str) -> str:
        """Stop a request at the next step boundary (one in the batch keeps the token its
        step verifies; its end event follows it).

        cancel.lua: one waiting to join ends now; one in the batch ends at the next
        barrier (arrive.lua), which still commits the token its step verifies (the
        in-process engine's cancel keeps the step it lands in too), so its end event
        follows that token ('ending' marks it due; join.lua sends it if the batch's
        barrier never completes).  KEYS: req, events, batch.  ARGV: reason, now_ms,
        request id.  Returns 'cancelled', or the status of a request no longer running
        ('gone': none)."""
        out = self._cancel(keys=[self.req_key(rid), self.req_key(rid, "ev"), self.key("batch")],
                           args=[reason, int(time.time() * 1000), rid])
        return out.decode() if isinstance(out, bytes) else str(out)

    def events(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Commit / end events of a request after ``last_id`` (blocks up to ``block_ms``,
        and at most :data:`BLOCK_MAX_S`: none yet is ``[]``, read again)."""
        # a Redis restart is waited out here (the log is persisted), not failed; one read
        # blocks at most BLOCK_MAX_S (a longer one would hit the socket timeout), and 0
        # (Redis's "for ever") is that too: the caller reads again
        block = min(block_ms, int(BLOCK_MAX_S * 1000)) or int(BLOCK_MAX_S * 1000)
        got = with_reconnect(lambda: self.r.xread({self.req_key(rid, "ev"): last_id},
                                                  block=block, count=256),
                             f"events of {rid}", EVENTS_RECONNECT_S)
        out = []
        for _stream, items in got or []:
            for eid, fields in items:
                out.append((eid.decode(), {k.decode(): v.decode() for k, v in fields.items()}))
        return out

    # ---- workers -----------------------------------------------------------------------
    def request(self, rid: str) -> RequestState:
        """The stored state and token log of a request."""
        (got,) = self.requests([rid])
        if isinstance(got, SyncError):
            raise got
        return got

    def requests(self, rids: Sequence[str]) -> list[RequestState | SyncError]:
        """:meth:`request` of each of ``rids`` in one round trip (the error in its place
        for one that is gone or cannot be read)."""
        pipe = self.r.pipeline()
        for rid in rids:
            pipe.hgetall(self.req_key(rid))
            pipe.lrange(self.req_key(rid, "log"), 0, -1)
        got = pipe.execute()
        out: list[RequestState | SyncError] = []
        for k, rid in enumerate(rids):
            try:
                out.append(_request_state(rid, got[2 * k], got[2 * k + 1]))
            except SyncError as e:
                out.append(e)
        return out

    def line(self, limit: int) -> list[str]:
        """The first ``limit`` ids in the line to join the batch, in order."""
        return [r.decode() for r in self.r.lrange(self.key("joining"), 0, limit - 1)]

    def fail(self, rid: str, why: str) -> str:
        """End a request a worker cannot run (its client gets an error, not tokens)."""
        return self.cancel(rid, f"{FAILED_PREFIX}{why}"[:300])

    def arrive(self, epoch: int, step: int, worker: str,
               reports: Mapping[str, Report] | None = None,
               joins: Sequence[Join] = ()) -> str:
        """Report step ``step`` of the batch finished, with one :class:`Report` per request
        the caller computed, and (the draft service, the scheduler) the requests that join
        at the next step; returns GO / WAIT / DUP / STALE.

        arrive.lua, the step barrier: one barrier per pipeline step carries every request
        in flight.  A participant arrives once per step (again: DUP; in an epoch that is
        over: STALE), with one entry per request it computed: the last stage the token it
        verified (committed now, with its commit event) and why the request ends with it,
        the draft service the root's children (token -> node id) and the id a new root
        gets on a miss.  The draft service, which runs the scheduler
        (protocol/scheduling/scheduler.py), also names the joiners, first in the joining
        line, each with its first chunk's rows (``head``) and the steps its prefill takes;
        the script decides nothing about them, it applies them in order (one no longer
        first in line, as the line moved since the scheduler read it, ends the list: it
        decides again at the next step).  When everyone has arrived (GO; before: WAIT),
        one verdict per request goes to every participant's control list in one message,
        with the joiners and whether requests still wait in line (``more``: the batch
        steps on, so the scheduler can let them in), and each request's outcome is
        appended to its :meth:`schedule`.

        KEYS: epoch, batch (set), joining (list), barrier, participants.
        ARGV: epoch, step, worker, ctl prefix, ttl_s, now_ms, req key prefix, reports
        (JSON object: rid -> [token (-1: none), root id (-1: not the draft), end ('eos' or
        'length' when the request ends with the token, else ''), child token, child id,
        child token, child id, ...]), joins (JSON list of [rid, head, prefill steps]),
        logprobs (JSON object: rid -> the verified token's logprobs, a string of at most
        1024 characters that goes unread into its commit event as 'lp'; the last stage
        sends one for the requests that asked, protocol/requests/logprobs.py; a malformed
        one is left off and the gateway names it missing).  Returns [status, detail]:
        STALE (detail: the current epoch), DUP ('0'), WAIT or GO (detail: arrivals so far).
        """
        payload = {rid: [r.token, r.root_id, r.end,
                         *(x for pair in r.children for x in pair)]
                   for rid, r in (reports or {}).items()}
        # apart from the reports: their list's tail is the children, and only requests
        # that asked for logprobs carry an entry (most steps send "{}")
        logprobs = {rid: r.logprobs.to_wire() for rid, r in (reports or {}).items()
                    if r.logprobs is not None and r.token >= 0}
        res = self._arrive(keys=[self.key("epoch"), self.key("batch"), self.key("joining"),
                                 self.key("bar", epoch, step), self.key("participants")],
                           args=[epoch, step, worker, self.ctl_prefix, self.ttl_s,
                                 int(time.time() * 1000), self.req_key(""),
                                 json.dumps(payload, separators=(",", ":")),
                                 json.dumps([[j.rid, j.head, j.steps] for j in joins],
                                            separators=(",", ":")),
                                 json.dumps(logprobs, separators=(",", ":"))])
        return res[0].decode()

    def kv_pool(self, names: Sequence[str], plan: str) -> int | None:
        """The smallest fixed KV pool in blocks that the participants ``names`` of layout
        ``plan`` report in their live heartbeats (0: none is fixed).  While one of them does
        not beat with this plan (a restarting stage, or the old plan's worker of that name
        on its way out), the pools the plan's resumed epoch started with (saved by
        :meth:`join`), or None if it has none."""
        pool = self._pools_now(names, plan)
        if pool is not None:
            return pool
        return _saved_pool(self.r.hmget(self.key("kvpool"), "plan", "blocks"), plan)

    def _pools_now(self, names: Sequence[str], plan: str) -> int | None:
        """:meth:`kv_pool` from the heartbeats alone (None: one does not beat with ``plan``)."""
        return _pool_of(self.heartbeats(names) if names else {}, names, plan)

    def spec_stats(self, rid: str) -> SpecStats:
        """The request's speculation figures so far, from :meth:`schedule`."""
        return SpecStats.from_schedule(self.schedule(rid))

    def schedule(self, rid: str) -> str:
        """The request's steps as arrive.lua recorded them: '|' starts an epoch (its
        prefill's last step, after a ':' for each chunk before it), then one of 'h' (hit),
        'm' (miss) or '.' (no token verified) per step."""
        raw = self.r.get(self.req_key(rid, "sched"))
        return raw.decode() if raw else ""

    def wait_ctl(self, worker: str, timeout_s: float) -> Control | None:
        """Next control message of ``worker``, parsed (None after ``timeout_s``).

        A message that does not parse is logged and dropped (None): one garbage
        entry in a control list must not take a worker down.
        """
        # BLPOP in slices under the socket timeout: a longer one would raise
        # redis.TimeoutError on a healthy, quiet list
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            got = self.r.blpop([self.key("ctl", worker)],
                               timeout=max(0.001, min(left, BLOCK_MAX_S)))
            if got or left <= BLOCK_MAX_S:
                break
        if not got:
            return None
        try:
            return parse_control(got[1])
        except ControlError as e:
            log.error("%s: dropped a bad control message %.200r: %s", worker, got[1], e)
            return None

    def pop_ctl(self, worker: str) -> Control | None:
        """The next control message of ``worker`` without waiting (None: none, or garbage)."""
        raw = self.r.lpop(self.key("ctl", worker))
        if raw is None:
            return None
        try:
            return parse_control(raw)
        except ControlError as e:
            log.error("%s: dropped a bad control message %.200r: %s", worker, raw, e)
            return None

    def ctl_pending(self, worker: str) -> bool:
        """Whether a control message waits (a worker checks while it waits for input)."""
        return bool(self.r.llen(self.key("ctl", worker)))

    def heartbeat(self, worker: str, beat: Heartbeat | Mapping[str, Any],
                  ttl_s: float = 5.0) -> None:
        """Report ``worker`` alive for ``ttl_s`` with ``beat`` (or its JSON form as it is:
        tests write malformed ones)."""
        raw = beat.to_json() if isinstance(beat, Heartbeat) else dict(beat)
        self.r.set(self.key("hb", worker), json.dumps(raw), px=int(ttl_s * 1000))

    def leave(self, worker: str, incarnation: str) -> None:
        """Drop ``worker``'s heartbeat at a clean exit, unless a successor already wrote one."""
        self._leave(keys=[self.key("hb", worker)], args=[incarnation])

    def heartbeats(self, names: Sequence[str] | None = None) -> dict[str, Heartbeat]:
        """Live workers (those whose heartbeat has not expired) and what they report (one
        that is not a JSON object counts as not beating).

        ``names``: the participants, when the caller has just read them.
        """
        names = self.participants() if names is None else list(names)
        return _beats(names, self.r.mget([self.key("hb", w) for w in names]) if names else [])

    def close(self) -> None:
        self.r.close()


def _request_state(rid: str, h: Mapping[bytes, bytes], log: Sequence[bytes]) -> RequestState:
    """A request's stored hash and token log, checked (SyncError: gone; BadRequestState:
    a field that does not parse)."""
    if not h:
        raise SyncError(f"request {rid} is gone (expired or never admitted)")
    try:
        d = {k.decode(): v.decode() for k, v in h.items()}
        st = RequestState(rid, json.loads(d["prompt"]), _sampling(d["params"]),
                          int(d["max_new"]), json.loads(d["stop"]), d["status"],
                          int(d["epoch"]), [int(x) for x in log], d.get("reason", ""),
                          d.get("plan", ""), int(d.get("chunk", 0)),
                          int(d.get("head", 0)), _opt_int(d, "kv_tokens"),
                          _opt_int(d, "kv_w"), int(d.get("kv_blocks", 0)),
                          int(d.get("kv_budget", 0)), _opt_int(d, "kv_cap"))
    except (KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
        raise BadRequestState(f"request {rid} has a malformed stored field: "
                              f"{type(e).__name__}: {e}") from None
    # the types first: a JSON object or string prompt must not reach the token check
    if not (isinstance(st.prompt, list) and isinstance(st.stop_ids, list)
            and st.prompt and st.max_new >= 1
            and st.chunk >= 0 and st.head >= 0
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in st.prompt + st.stop_ids)):
        raise BadRequestState(f"request {rid} has a malformed stored prompt, stop ids, "
                              "max_new, chunk or head")
    return st


def _sampling(raw: str) -> SamplingParams:
    """A stored request's sampling parameters, checked as the gateway checked them
    (ValueError or TypeError: not a JSON object of them, or one out of range)."""
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise TypeError(f"params must be a JSON object, got {type(d).__name__}")
    return SamplingParams.from_wire(d)


def kv_need(tokens: int | None, width: int | None, blocks: int, stages: int) -> int:
    """The KV blocks a request holds on a stage at most, at ``stages`` stages, from its
    stored worst case (committed ``tokens`` at most and tree ``width``), or the
    ``blocks`` an earlier version stored instead (a rolling upgrade has both)."""
    if tokens is None or width is None:
        return blocks
    return request_blocks(tokens, max(stages, 1), width)


def _in_flight_of(members: Iterable[bytes], queued: Iterable[bytes]) -> list[str]:
    """:meth:`Synchroniser.in_flight` from the batch set and the joining line as read."""
    return sorted(r.decode() for r in members) + [r.decode() for r in queued]


def _beats(names: Sequence[str], raws: Sequence[bytes | None]) -> dict[str, Heartbeat]:
    """The live heartbeats among ``raws`` (one per name; one that is not a JSON object
    counts as not beating)."""
    out = {}
    for w, raw in zip(names, raws, strict=True):
        try:
            hb = Heartbeat.from_json(json.loads(raw)) if raw else None
        except ValueError:
            hb = None
        if hb is not None:
            out[w] = hb
    return out


def _pool_of(beats: Mapping[str, Heartbeat], names: Sequence[str], plan: str) -> int | None:
    """The smallest fixed KV pool the participants ``names`` of ``plan`` report (0: none is
    fixed; None: one of them does not beat with ``plan``)."""
    pool = 0
    for w in names:
        hb = beats.get(w)
        if hb is None or hb.plan != plan:
            return None
        n = hb.kv.fixed_blocks if hb.kv is not None else 0
        if n > 0 and (pool == 0 or n < pool):
            pool = n
    return pool


def _saved_pool(saved: Sequence[bytes | None], plan: str) -> int | None:
    """The pools a resumed epoch of ``plan`` started with (``kvpool``'s plan and blocks)."""
    saved_plan, blocks = saved
    if saved_plan is not None and saved_plan.decode() == plan and blocks:
        return int(blocks)
    return None


def _int_or_none(raw: bytes | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _opt_int(d: Mapping[str, str], name: str) -> int | None:
    return int(d[name]) if name in d else None


def _curve_points(raw: Any) -> list[tuple[int, float]]:
    """One count's published [[rows, seconds], ...], checked, by rows (ValueError: not)."""
    pts = sorted((int(n), float(t)) for n, t in raw)
    if not 0 < len(pts) <= MAX_CURVE_POINTS or len({n for n, _ in pts}) < len(pts):
        raise ValueError(f"1-{MAX_CURVE_POINTS} points with distinct row counts")
    if any(not 1 <= n <= MAX_CURVE_ROWS or not 0 <= t < 1e4 for n, t in pts):
        raise ValueError(f"rows must be in [1, {MAX_CURVE_ROWS}] and seconds in [0, 1e4)")
    return pts
