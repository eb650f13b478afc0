"""The local backend: ``treepipe up`` / ``treepipe down`` run a pipeline on this machine.

``up`` starts a supervisor that owns every process of the pipeline: a private
``redis-server`` on a free port (unless the manifest names an external Redis)
with a per-pipeline password in ``redis.secret`` (mode 0600; the workers read
it through ``$TREEPIPE_REDIS_PASSWORD_FILE``), fresh stage-link keys in ``link-keys/``
(mode 0700, files 0600; ``$TREEPIPE_LINK_KEYS``) and an append-only log in
``redis-data/`` (the supervisor restarts a dead server on the same port),
the stage workers, the draft service and the gateway, each logging to its own
file in the run folder ``<cache>/run/<name>/``.  The supervisor restarts a
worker that dies and moves the pipeline to a new epoch, so the running request
resumes from its token log.  ``--detach`` returns once the gateway is healthy
and prints its ``HOST:PORT``; ``down`` stops the supervisor and everything it
started.

Ownership: every process of a pipeline (the supervisor too) has a pid file
``<run>/pids/<who>.pid`` holding its pid *and its start time*, so ``down`` finds
the workers even after the supervisor was SIGKILLed and never signals a process
that merely got a recycled pid.  Workers and Redis also get SIGTERM from the
kernel when the supervisor dies (``PR_SET_PDEATHSIG``).  ``up`` refuses a fixed
gateway or HTTP port that something already listens on (a gRPC server sets
SO_REUSEPORT, so a second gateway would otherwise share the port and take some
of the first pipeline's requests) and a pipeline name whose old workers live on.

The cluster module is imported inside the functions that use it: it loads the
kubernetes client, which local commands never need.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.deploy.commands import config_of, local_endpoints, worker_commands
from orchestrator.deploy.host_fit import check_host_fit
from orchestrator.deploy.manifest import (
    DNS_LABEL,
    ManifestError,
    TreePipeline,
    load_manifest,
    with_stage_count,
)
from orchestrator.deploy.planner import Plan, Planned, plan_manifest, with_plan
from orchestrator.deploy.redis_server import (
    RedisServer,
    RedisServerError,
    free_port,
    free_ports,
    new_secret,
    port_in_use,
    write_secret,
)
from orchestrator.deploy.run_state import (
    STATE_FILE,
    STOPPED_FILE,
    PidRecord,
    Restarts,
    RunState,
    RunStateError,
    StopRecord,
    read_pid_record,
    read_stop_record,
    write_atomic,
)
from orchestrator.models.registry import cache_dir
from orchestrator.serving.auth import (
    API_KEY_FILE_ENV,
    TLS_CERT_FILE_ENV,
    TLS_KEY_FILE_ENV,
    is_loopback,
)
from orchestrator.serving.client import Client
from orchestrator.serving.gateway import SERVICE, SUPERVISOR_PID_ENV
from protocol.errors import RuntimeFailure, TreepipeError
from protocol.links.keys import LINK_KEYS_ENV, write_link_keys
from protocol.sync.synchroniser import (
    LOST,
    PASSWORD_FILE_ENV,
    Synchroniser,
    is_lost,
    participant_names,
)

log = logging.getLogger("treepipe.launcher")
TREEPIPE = [sys.executable, "-m", "orchestrator"]
# a worker that dies more than RESTART_LIMIT times within RESTART_WINDOW_S is crash
# looping and the supervisor stops the pipeline; an occasional death is restarted forever
RESTART_LIMIT = 5
RESTART_WINDOW_S = 300.0


def crash_looping(deaths: list[float], now: float, limit: int = RESTART_LIMIT,
                  window_s: float = RESTART_WINDOW_S) -> bool:
    """Whether the deaths (monotonic times) hold more than ``limit`` within ``window_s``."""
    return sum(1 for t in deaths if now - t < window_s) > limit


def recent(deaths: list[float], now: float, window_s: float = RESTART_WINDOW_S) -> list[float]:
    """The deaths still inside the window (what the budget counts)."""
    return [t for t in deaths if now - t < window_s]


def last_log_line(path: Path, limit: int = 64 * 1024) -> str:
    """The last non-empty line of a worker's log (its end only: a log may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def exit_cause(returncode: int | None, log_path: Path | None = None) -> str:
    """Why a worker ended, in words: the signal (SIGKILL is most often the kernel's OOM
    killer) or the exit code, with the last line of its log."""
    if returncode is None:
        cause = "still running"
    elif returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        cause = f"killed by {name}"
        if -returncode == signal.SIGKILL:
            cause += (" (most often the kernel's OOM killer: the machine ran out of memory; "
                      "check `treepipe plan` and dmesg)")
    else:
        cause = f"exit code {returncode}"
    last = last_log_line(log_path) if log_path is not None else ""
    return f"{cause}; last log line: {last}" if last else cause


def stopped_cause(name: str) -> str | None:
    """Why the supervisor last stopped pipeline ``name`` by itself (a crash loop), if it did."""
    rec = read_stop_record(run_dir(name) / STOPPED_FILE)
    return f"{rec.worker} was crash looping ({rec.cause})" if rec else None


def run_dir(name: str) -> Path:
    """Folder with the state file and the logs of a local pipeline."""
    return cache_dir() / "run" / name


def read_state(name: str) -> RunState | None:
    """The state a running supervisor wrote, None when there is none; a
    :class:`RunStateError` (one line: the file and the fix) when it is malformed."""
    path = run_dir(name) / STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise RunStateError(f"cannot read {path} ({e}); run treepipe down {name} to clear "
                            "it, then treepipe up -f FILE") from None
    return RunState.from_json(text, path)


def read_state_or_none(name: str) -> RunState | None:
    """:func:`read_state`, a malformed file reading as absent: for the callers to whom a
    broken state file means only "no running pipeline to tell about" (an error message
    being built, another pipeline's folder)."""
    try:
        return read_state(name)
    except RunStateError:
        return None


CLI_REDIS_TIMEOUT_S = 5.0  # a command's Redis call waits this long on a paused Redis


def state_sync(st: RunState, name: str,
               timeout_s: float | None = CLI_REDIS_TIMEOUT_S) -> Synchroniser:
    """A synchroniser client of a running pipeline, authenticated with its secret file.

    Its calls give up after ``timeout_s`` (a redis.TimeoutError): a command run while
    Redis is paused (SIGSTOP, a stalled disk) must end with an error, not hang.
    """
    secret = st.redis_secret
    try:
        password = Path(secret).read_text().strip() if secret else None
    except OSError as e:
        raise RuntimeFailure(f"cannot read the Redis secret of pipeline {name!r} ({secret}: "
                             f"{e.strerror}); was its run folder removed? run treepipe down "
                             f"{name} and up again") from None
    sync = Synchroniser(st.redis, name, password=password)
    if timeout_s is not None:  # no connection exists yet: every one gets the timeouts
        sync.r.connection_pool.connection_kwargs.update(socket_timeout=timeout_s,
                                                         socket_connect_timeout=timeout_s)
    return sync


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """preexec_fn of a worker or Redis: SIGTERM when the supervisor ``parent`` dies, even by
    SIGKILL, so no process keeps serving a pipeline nobody owns (Linux; elsewhere a no-op)."""

    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the supervisor died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (any process: see :func:`owns` for *ours*)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HAS_PROC = Path("/proc/self/stat").exists()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (an opaque string), None when it is gone or a zombie.

    With the pid it names one process: a pid the kernel hands out again comes with
    another start time (clock ticks since boot, plus the boot's id, from /proc).
    """
    if not _HAS_PROC:  # macOS: ps has the start time to the second
        out = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True,
                             text=True).stdout.strip()
        return out or None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone (or going: ESRCH while reading)
        return None
    # fields after the command name, which is in parentheses and may hold anything
    fields = stat.rpartition(")")[2].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: nothing left to stop
        return None
    return f"{_boot_id()}:{fields[19]}"  # field 22 of proc(5): starttime


def owns(rec: PidRecord) -> bool:
    """Whether the process a pid file names still runs (same pid *and* start time)."""
    return rec.start is not None and process_start(rec.pid) == rec.start


def pid_path(folder: Path, who: str) -> Path:
    """The pid file of process ``who`` of a run folder."""
    return folder / "pids" / f"{who}.pid"


def write_pid_file(folder: Path, who: str, pid: int, argv: list[str]) -> None:
    """Record process ``who`` (pid, start time, command) for ``down`` (atomic replace)."""
    path = pid_path(folder, who)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = PidRecord(pid=pid, start=process_start(pid), argv=tuple(argv[:8]))
    write_atomic(path, rec.to_json())


def read_pid_files(folder: Path) -> dict[str, PidRecord]:
    """Every pid file of a run folder, by process name (unreadable or malformed ones are
    skipped: they name no process that may be signalled)."""
    out: dict[str, PidRecord] = {}
    for f in sorted((folder / "pids").glob("*.pid")):
        if (rec := read_pid_record(f)) is not None:
            out[f.stem] = rec
    return out


def live_processes(folder: Path) -> dict[str, PidRecord]:
    """The processes of a run folder's pid files that still run (identity checked)."""
    return {who: rec for who, rec in read_pid_files(folder).items() if owns(rec)}


def supervisor_alive(st: RunState) -> bool:
    """Whether the supervisor that wrote state ``st`` still runs (not a recycled pid)."""
    rec = st.pid_record()
    if rec is not None:
        return owns(rec)
    return pid_alive(st.supervisor_pid)  # a state file from an older supervisor


def _load(path: str) -> TreePipeline:
    """A backend: local manifest, schema-checked only (enough to name the pipeline)."""
    try:
        m = load_manifest(path)
    except ManifestError as e:
        raise TreepipeError(str(e)) from None
    if m.spec.backend != "local":
        raise TreepipeError(f"{path}: spec.backend is {m.spec.backend!r}; treepipe up runs "
                            "backend: local (apply a kubernetes manifest with kubectl apply -f)")
    return m


def up_detached(path: str) -> str:
    """``treepipe up -f PATH --detach`` in a child process (its output stays out of the
    caller's stdout); returns the gateway's gRPC endpoint."""
    res = subprocess.run([*TREEPIPE, "up", "-f", path, "--detach"], capture_output=True,
                         text=True)
    if res.returncode:
        why = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise TreepipeError(f"treepipe up -f {path} failed: {why}")
    return res.stdout.strip().splitlines()[-1]


def down_detached(path: str) -> None:
    """``treepipe down -f PATH`` in a child process, quietly (a pipeline not up is fine)."""
    subprocess.run([*TREEPIPE, "down", "-f", path], capture_output=True)


def load_planned(path: str) -> Planned:
    """A backend: local manifest and its plan (computed once, here)."""
    m = _load(path)
    try:
        planned = with_plan(m, path)
        check_host_fit(m, planned.plan)  # what would only OOM or crash-loop under up
    except ManifestError as e:
        raise TreepipeError(e.message_with_origin(path)) from None
    return planned


@dataclass
class Supervisor:
    """Starts, watches and stops the processes of one local pipeline."""

    m: TreePipeline
    p: Plan  # m's plan, computed once when the manifest was loaded
    folder: Path
    manifest_path: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # over the pipeline's life
    deaths: dict[str, list[float]] = field(default_factory=dict)  # inside the window
    causes: dict[str, str] = field(default_factory=dict)  # why each worker last ended
    redis: RedisServer | None = None
    stopping: bool = False
    redis_restarts: int = 0
    health_port: int = 0  # the gateway's plaintext health-only port (TLS gateways only)
    # where the workers meet, kept from start() for the workers a re-plan starts
    redis_url: str = ""
    gateway_port: int = 0

    @property
    def name(self) -> str:
        return self.m.metadata.name

    def commands(self, redis_url: str, gateway_port: int) -> dict[str, list[str]]:
        """Command line of every process of the pipeline (orchestrator/deploy/commands.py),
        and the pipeline config file they name (written here)."""
        # distinct ports that nothing listens on (a link sharing a port would mix levels)
        # and the draft service's token-channel inbox (used with early-exit recovery)
        ports = free_ports(len(self.p.stages) + 1, avoid=(gateway_port,))
        g = self.m.spec.gateway
        # one file per layout: after a re-plan the gateway (not restarted) and its restarts
        # keep reading the config they started with, as their command line is kept
        config = self.folder / f"config-{self.p.layout_id}.json"
        write_atomic(config, config_of(self.m, self.p).to_json())
        at = local_endpoints(redis_url, ports[:-1], gateway_port, gateway_host(self.m),
                             g.insecure, str(config), draft_port=ports[-1])
        if self.health_port:  # a TLS gateway: `up --detach` probes a plaintext health port
            at = replace(at, gateway_health_listen=f"127.0.0.1:{self.health_port}")
        return {n: [*TREEPIPE, *args] for n, args in worker_commands(self.m, self.p, at).items()}

    def spawn(self, name: str) -> None:
        logf = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # many processes share this machine's cores: one thread each unless told otherwise
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.redis:  # the password by file, never on the command line
            env[PASSWORD_FILE_ENV] = str(self.secret_path)
        env[LINK_KEYS_ENV] = str(self.link_keys_path)  # the links' keys, by file as well
        # who to watch: a child whose parent is no longer this pid lost its supervisor
        # (the backstop of PR_SET_PDEATHSIG; see serving/gateway.watch_supervisor)
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        self.procs[name] = subprocess.Popen(self.argv[name], stdout=logf,
                                            stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=_die_with_parent(os.getpid()))
        logf.close()
        write_pid_file(self.folder, name, self.procs[name].pid, self.argv[name])

    def record_redis(self) -> None:
        """The pid file of the (re)started redis-server."""
        if self.redis and self.redis.proc:
            write_pid_file(self.folder, "redis", self.redis.proc.pid,
                           [str(a) for a in self.redis.proc.args])

    @property
    def secret_path(self) -> Path:
        return self.folder / "redis.secret"

    @property
    def link_keys_path(self) -> Path:
        return self.folder / "link-keys"

    def start(self) -> RunState:
        """Start Redis and every process; returns the state written to ``state.json``."""
        s = self.m.spec
        bounds = [st.layers for st in self.p.stages]
        secret: str | None = None
        if s.synchronizer.mode == "embedded":
            secret = new_secret()
            write_secret(self.secret_path, secret)
            data = self.folder / "redis-data"
            # a fresh pipeline: an earlier run's log would bring back its requests
            for f in data.glob("**/*") if data.exists() else []:
                if f.is_file():
                    f.unlink()
            self.redis = RedisServer(log_path=self.folder / "redis.log", password=secret,
                                     data_dir=data,
                                     preexec_fn=_die_with_parent(os.getpid())).start()
            self.record_redis()
            url = self.redis.address
        else:
            url = s.synchronizer.url or ""
        # new keys per run: only this run's workers can reach each other's inboxes
        write_link_keys(self.link_keys_path, (s.transport,))
        sync = Synchroniser(url, self.name, password=secret)
        sync.register(participant_names(len(bounds)))
        sync.resume()  # a fresh epoch: nothing left from an earlier run can commit
        port = s.gateway.port or free_port()
        if os.environ.get(TLS_CERT_FILE_ENV):  # the gateway serves TLS (it reads the env)
            self.health_port = free_port()
        self.redis_url, self.gateway_port = url, port
        self.argv = self.commands(url, port)
        for n in self.argv:
            self.spawn(n)
        return RunState(
            name=self.name, supervisor_pid=os.getpid(),
            supervisor_start=process_start(os.getpid()), redis=url,
            redis_secret=str(self.secret_path) if secret else None,
            redis_pid=self.redis_pid(), link_keys=str(self.link_keys_path),
            manifest=str(self.manifest_path), endpoint=client_endpoint(self.m, port),
            # where `up --detach` asks for health: the gateway, or its plaintext probe
            health=(f"127.0.0.1:{self.health_port}" if self.health_port
                    else client_endpoint(self.m, port)),
            gateway_port=port, stages=tuple(bounds), procs=self.pids())

    def redis_pid(self) -> int | None:
        """The embedded redis-server's pid, None for an external Redis."""
        return self.redis.proc.pid if self.redis and self.redis.proc else None

    def pids(self) -> dict[str, int]:
        """Every worker's pid, by name."""
        return {n: p.pid for n, p in self.procs.items()}

    def restart_counts(self) -> dict[str, Restarts]:
        """Every restarted worker's restarts, for ``treepipe status``."""
        return {n: Restarts(total=k, in_window=len(self.deaths.get(n, [])),
                            last_exit=self.causes.get(n, ""))
                for n, k in self.restarts.items()}

    def current(self, state: RunState) -> RunState:
        """``state`` with the processes and restarts as they are now."""
        return state.model_copy(update={"procs": self.pids(), "redis_pid": self.redis_pid(),
                                        "restarts": self.restart_counts()})

    def scale(self, planned: Planned) -> list[tuple[int, int]]:
        """Re-plan to a manifest's stages: stop draft and stages, start the new ones.

        The running request stops at a step boundary (a worker finishes or drops its
        step on SIGTERM).  The new workers carry the new layout id: the first to start
        takes the pipeline over (the old workers are gone) and once the last one is
        up a new epoch starts, in which the request resumes from its token log
        (protocol/sync/lua/join.lua), exactly as on Kubernetes, where nothing but the
        pods themselves does this.
        """
        bounds = [st.layers for st in planned.plan.stages]
        workers = [n for n in self.procs if n != "gateway"]
        for n in workers:
            self.procs[n].terminate()
        for n in workers:
            proc = self.procs.pop(n)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pid_path(self.folder, n).unlink(missing_ok=True)  # a smaller plan has no stage3
        log.info("the old workers stopped; starting the new plan's")
        self.m, self.p = planned
        argv = self.commands(self.redis_url, self.gateway_port)
        self.argv = {**argv, "gateway": self.argv["gateway"]}
        for n in argv:
            if n != "gateway":
                self.spawn(n)
        return bounds

    def watch_once(self) -> bool:
        """Restart dead workers; False when the pipeline cannot go on.

        A restarted worker rejoins by itself: once it is up it starts a new epoch and
        the running request resumes from its token log (protocol/sync/lua/join.lua).
        """
        if self.redis and not self.redis.alive() and not self.stopping:
            # same port, password and data dir: the workers reconnect by themselves and
            # the append-only log brings the running request back
            self.redis_restarts += 1
            log.warning("redis-server exited with %s; restarting it on port %d (restart %d)",
                        self.redis.proc.returncode if self.redis.proc else None,
                        self.redis.port, self.redis_restarts)
            try:
                self.redis.start()
            except RedisServerError as e:
                log.error("%s", e)
                return False
            self.record_redis()
        for n, p in list(self.procs.items()):
            if p.poll() is None or self.stopping:
                continue
            self.restarts[n] = self.restarts.get(n, 0) + 1
            now = time.monotonic()
            self.deaths[n] = [*recent(self.deaths.get(n, []), now), now]
            cause = exit_cause(p.returncode, self.folder / f"{n}.log")
            self.causes[n] = cause
            if crash_looping(self.deaths[n], now):
                log.error("%s is crash looping: it died %d times within %.0f s, the last "
                          "time %s; stopping the pipeline, see %s.log", n,
                          len(self.deaths[n]), RESTART_WINDOW_S, cause, n)
                # kept after the stop, for `treepipe status` and `up --detach`
                write_atomic(self.folder / STOPPED_FILE, StopRecord(
                    worker=n, cause=cause, deaths=len(self.deaths[n])).to_json())
                return False
            log.warning("%s ended, %s; restarting it (restart %d)", n, cause, self.restarts[n])
            self.spawn(n)
        return True

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis:
            self.redis.stop()
        for n in [*self.procs, "redis"]:  # all reaped: nothing left for `down` to find
            pid_path(self.folder, n).unlink(missing_ok=True)


def supervise(planned: Planned, manifest_path: Path) -> int:
    """Run the pipeline in this process until SIGTERM (the body of ``treepipe up``)."""
    m = planned.manifest
    folder = run_dir(m.metadata.name)
    folder.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s supervisor %(levelname)s %(message)s")
    sup = Supervisor(m, planned.plan, folder, manifest_path.resolve())
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    state_path = folder / STATE_FILE
    # first of all: `down` finds a supervisor that is still starting its workers
    write_pid_file(folder, "supervisor", os.getpid(), sys.argv)
    code = 0
    try:
        state = sup.start()
        write_atomic(state_path, state.to_json())
        log.info("pipeline %s: gateway on %s, logs in %s", m.metadata.name, state.endpoint,
                 folder)
        while not stop:
            if (want := take_scale_request(folder)) is not None:
                # logged before and after, so a re-plan that stalls shows where
                log.info("re-planning to %d stages (layout %s): stopping the workers",
                         len(want.plan.stages), want.plan.layout_id)
                bounds = sup.scale(want)
                log.info("scaled to %d stages %s", len(bounds), bounds)
                state = state.model_copy(update={"stages": tuple(bounds)})
                write_atomic(state_path, state.to_json())
            if not sup.watch_once():
                code = 1
                break
            if (now := sup.current(state)) != state:
                state = now
                write_atomic(state_path, state.to_json())
            time.sleep(0.2)
    finally:
        sup.stop()
        state_path.unlink(missing_ok=True)
        pid_path(folder, "supervisor").unlink(missing_ok=True)
    return code


SCALE_FILE = "scale.json"  # `treepipe scale` asks the supervisor to re-plan through it


class ScaleRequest(BaseModel):
    """``scale.json``: the re-planned manifest, typed, and the layout id ``treepipe scale``
    planned for it (the supervisor's plan of it must come out the same)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest: TreePipeline
    layout_id: str = Field(min_length=1, max_length=64)

    def to_json(self) -> str:
        """The file's text (the manifest camelCase, as in YAML)."""
        return self.model_dump_json(by_alias=True, exclude_none=True)


def take_scale_request(folder: Path) -> Planned | None:
    """The plan a ``scale.json`` asks for, consuming the file; None when there is none.

    A file the supervisor cannot plan (cut short, hand-written, another plan's) is logged
    and dropped: the pipeline keeps running as it is, and ``scale`` times out naming
    supervisor.log.
    """
    path = folder / SCALE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    finally:
        path.unlink(missing_ok=True)
    try:
        req = ScaleRequest.model_validate_json(text)
        planned = with_plan(req.manifest, str(path))
    except (ValidationError, ManifestError) as e:
        log.error("ignoring %s: not a re-plan request (%s)", path, str(e).splitlines()[0])
        return None
    if planned.plan.layout_id != req.layout_id:  # planned by another treepipe version
        log.error("ignoring %s: not a re-plan request (its layout %s plans as %s here)", path,
                  req.layout_id, planned.plan.layout_id)
        return None
    return planned


def _start_failed(log_path: Path) -> TreepipeError:
    """The error for a supervisor that died while starting: the last lines of its log."""
    cause = stopped_cause(log_path.parent.name)
    if cause:
        return RuntimeFailure(f"the pipeline failed to start: {cause} (logs in "
                              f"{log_path.parent})")
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return RuntimeFailure(f"the pipeline failed to start: {' | '.join(tail)} "
                          f"(logs in {log_path.parent})")


class Progress:
    """One stderr line each time the set of workers still coming up changes."""

    def __init__(self, sync: Synchroniser | None):
        self.sync, self.t0, self.last = sync, time.monotonic(), None

    def poll(self) -> None:
        if self.sync is None:
            return
        try:
            waiting = self.sync.waiting()
        except Exception:  # noqa: BLE001 - Redis not up yet; the next poll says more
            return
        if waiting != self.last:
            self.last = waiting
            what = f"waiting for {', '.join(waiting)}" if waiting else "every worker is up"
            print(f"{what} ({time.monotonic() - self.t0:.0f} s)", file=sys.stderr, flush=True)


def wait_healthy(endpoint: str, supervisor: subprocess.Popen[bytes] | None, log_path: Path,
                 timeout_s: float, sync: Synchroniser | None = None) -> None:
    """Block until the gateway says its pipeline is SERVING (every worker is up)."""

    deadline = time.monotonic() + timeout_s
    progress = Progress(sync)
    with Client(endpoint) as c:
        while time.monotonic() < deadline:
            if supervisor is not None and supervisor.poll() is not None:
                raise _start_failed(log_path)
            progress.poll()
            try:
                if c.health(SERVICE, timeout_s=1.0) == "SERVING":
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.3)
    st = read_state_or_none(log_path.parent.name)
    ended = [f"{n} restarted {r.total}x, last {r.last_exit}"
             for n, r in (st.restarts if st else {}).items() if r.last_exit]
    raise RuntimeFailure(f"the gateway at {endpoint} was not healthy within {timeout_s:.0f} s"
                         + (f" ({'; '.join(ended)})" if ended else "")
                         + f"; see the logs in {log_path.parent}")


def _listing(procs: dict[str, PidRecord]) -> str:
    return ", ".join(f"{who} pid {rec.pid}" for who, rec in procs.items())


def port_owner(port: int) -> str:
    """Who listens on a local port, as far as the run folders tell."""
    for state in sorted((cache_dir() / "run").glob(f"*/{STATE_FILE}")):
        name = state.parent.name  # another pipeline's broken state is not this one's error
        st = read_state_or_none(name)
        if st and st.serves_port(port) and supervisor_alive(st):
            return f"pipeline {name!r} serves there; treepipe down {name} stops it"
    return "another program listens there"


def gateway_host(m: TreePipeline) -> str:
    """The address a local gateway binds (gateway.host, else loopback only)."""
    return m.spec.gateway.host or "127.0.0.1"


def client_endpoint(m: TreePipeline, port: int) -> str:
    """HOST:PORT a client on this machine reaches a local gateway at."""
    host = gateway_host(m)
    if host in ("0.0.0.0", "::", "") or is_loopback(f"{host}:0"):
        host = "127.0.0.1"  # a wildcard bind answers on loopback too
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_plaintext_host(m: TreePipeline, manifest: str, flag: str = "spec.gateway.host",
                         insecure_flag: str = "spec.gateway.insecure: true") -> None:
    """Refuse a local gateway on a non-loopback host without TLS or an explicit insecure:
    the gateway would refuse it itself, as a crash loop (auth.check_plaintext)."""
    host = gateway_host(m)
    if (is_loopback(f"{host}:0") or m.spec.gateway.insecure
            or os.environ.get(TLS_CERT_FILE_ENV)):
        return
    raise TreepipeError(f"{manifest}: {flag} {host}: refusing to serve the API in plaintext "
                        f"beyond this machine (others could read and change requests); set "
                        f"${TLS_CERT_FILE_ENV} and ${TLS_KEY_FILE_ENV}, keep 127.0.0.1, or "
                        f"pass {insecure_flag} if TLS ends at a proxy in front (with an API "
                        f"key: ${API_KEY_FILE_ENV})")


def check_ports(m: TreePipeline, manifest: str) -> None:
    """Refuse fixed gateway/HTTP ports that something already listens on (one line each).

    A gRPC server binds with SO_REUSEPORT, so a second gateway on a busy port would start
    fine and then take a share of the other pipeline's connections.
    """
    g = m.spec.gateway
    fixed = [(key, port) for key, port in (("spec.gateway.port", g.port),
                                           ("spec.gateway.httpPort", g.http_port)) if port]
    if len(fixed) == 2 and fixed[0][1] == fixed[1][1]:
        raise TreepipeError(f"{manifest}: spec.gateway.port and spec.gateway.httpPort are both "
                            f"{g.port}; give them different ports (0 picks a free one)")
    host = gateway_host(m)
    check_plaintext_host(m, manifest)
    for key, port in fixed:
        if port_in_use(port, host if host not in ("::",) else "127.0.0.1"):
            raise TreepipeError(f"{manifest}: {key} {port} is already in use on {host} "
                                f"({port_owner(port)}); stop it, or set {key} to a free port "
                                "(0 picks one)")


def up_local(file: str, detach: bool = False, timeout: float = 600.0) -> int:
    """``treepipe up -f FILE [--detach]``."""
    planned = load_planned(file)
    m = planned.manifest
    name = m.metadata.name
    st = read_state(name)
    if st and supervisor_alive(st):
        raise TreepipeError(f"pipeline {name!r} is already up at {st.endpoint}; "
                            f"run treepipe down {name} first")
    left = live_processes(run_dir(name))
    if "supervisor" in left:
        raise TreepipeError(f"pipeline {name!r} is starting (supervisor pid "
                            f"{left['supervisor'].pid}); run treepipe down {name} first")
    if left:  # a SIGKILLed supervisor's workers: a second set would fight them for Redis
        raise TreepipeError(f"pipeline {name!r} still has processes of a run whose supervisor "
                            f"died ({_listing(left)}); run treepipe down {name} first")
    check_ports(m, file)
    (run_dir(name) / STOPPED_FILE).unlink(missing_ok=True)  # a new run, a new story
    if not detach:
        return supervise(planned, Path(file))
    folder = run_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE_FILE).unlink(missing_ok=True)
    log_path = folder / "supervisor.log"
    with open(log_path, "ab") as logf:
        sup = subprocess.Popen([*TREEPIPE, "up", "-f", str(Path(file).resolve())],
                               stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while (st := read_state(name)) is None:
        if sup.poll() is not None or time.monotonic() > deadline:
            raise _start_failed(log_path)
        time.sleep(0.2)
    wait_healthy(st.health_endpoint, sup, log_path, max(1.0, deadline - time.monotonic()),
                 state_sync(st, name))
    print(st.endpoint)
    return 0


def send_signal(rec: PidRecord, sig: int) -> None:
    """Signal the process a pid file names, if it is still that process."""
    pid = rec.pid
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, macOS) or already gone
        if owns(rec):
            _unless_gone(lambda: os.kill(pid, sig))
        return
    try:
        # the fd pins the process: checked, then signalled, a recycled pid is never hit
        if owns(rec):
            _unless_gone(lambda: signal.pidfd_send_signal(fd, sig))
    finally:
        os.close(fd)


def _unless_gone(fn: Callable[[], object]) -> None:
    """Run ``fn`` (a kill), ignoring a process that exited meanwhile."""
    try:
        fn()
    except ProcessLookupError:
        pass


def stop_processes(procs: dict[str, PidRecord], grace_s: float) -> None:
    """SIGTERM each process, SIGKILL those still running after ``grace_s``."""
    for rec in procs.values():
        send_signal(rec, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(owns(r) for r in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for rec in procs.values():
        send_signal(rec, signal.SIGKILL)


def _down_name(name: str | None, file: str | None) -> str:
    """The pipeline ``down`` stops: NAME, or the name in -f FILE."""
    if bool(name) == bool(file):
        raise TreepipeError("treepipe down takes the pipeline's NAME or -f FILE (one of them)")
    if file:
        return _load(file).metadata.name
    if not re.fullmatch(DNS_LABEL, name):
        raise TreepipeError(f"{name!r} is not a pipeline name (metadata.name, a DNS label "
                            "such as my-pipeline)")
    return str(name)


def _forget(folder: Path) -> None:
    """Remove the state and pid files of processes that are gone (and malformed ones:
    they name nothing that could still be stopped)."""
    live = live_processes(folder)
    for f in (folder / "pids").glob("*.pid"):
        if f.stem not in live:
            f.unlink(missing_ok=True)
    try:
        st = read_state(folder.name)
        gone = st is not None and not supervisor_alive(st)
    except RunStateError:
        gone = "supervisor" not in live  # a live supervisor removes its own when it stops
    if gone:
        (folder / STATE_FILE).unlink(missing_ok=True)


def down_local(name: str | None = None, file: str | None = None) -> int:
    """``treepipe down NAME`` / ``down -f FILE``: stop the supervisor and, from their pid
    files, whatever it left running (all of it when the supervisor was SIGKILLed)."""
    name = _down_name(name, file)
    folder = run_dir(name)
    st = read_state_or_none(name)  # down is the fix for a broken state: the pid files rule
    procs = live_processes(folder)
    sup = procs.pop("supervisor", None)
    if sup is None and not procs and st and supervisor_alive(st):
        sup = PidRecord(pid=st.supervisor_pid, start=process_start(st.supervisor_pid))
    if sup is None and not procs:
        _forget(folder)
        print(f"pipeline {name!r} is not running", file=sys.stderr)
        return 0
    if sup is not None:  # it stops its own children, then exits
        stop_processes({"supervisor": sup}, grace_s=30)
        procs = {w: r for w, r in live_processes(folder).items() if w != "supervisor"}
    left = dict(procs)
    # workers before Redis: they stop at a step boundary, which needs Redis
    stop_processes({w: r for w, r in procs.items() if w != "redis"}, grace_s=10)
    stop_processes({w: r for w, r in procs.items() if w == "redis"}, grace_s=5)
    _forget(folder)
    if sup is None:
        print(f"pipeline {name!r}: its supervisor was gone; stopped what it left running "
              f"({_listing(left)})", file=sys.stderr)
    else:
        print(f"pipeline {name!r} stopped" + (f" (and what its supervisor left: "
                                                f"{_listing(left)})" if left else ""),
              file=sys.stderr)
    return 0


def running_state(name: str) -> RunState:
    """The state of the running local pipeline ``name`` (one-line errors otherwise)."""
    st = read_state(name)
    if not st or not supervisor_alive(st):
        cause = stopped_cause(name)
        if cause:
            raise RuntimeFailure(f"local pipeline {name!r} is not running: its supervisor "
                                 f"stopped it because {cause}; fix that and run treepipe up "
                                 f"-f FILE again")
        raise TreepipeError(f"no local pipeline {name!r} is running; start it with treepipe up "
                            "-f FILE (a TreePipeline in a cluster: --backend kubernetes)")
    return st


def scale_local(name: str, stages: int, timeout: float = 300.0, wait: bool = True) -> int:
    """``treepipe scale NAME --stages N`` for a local pipeline: returns once the new
    workers are all up (the running request then resumes from its token log)."""
    st = running_state(name)
    if not st.manifest:  # a hand-written state: nothing names the manifest to re-plan
        raise TreepipeError(f"{run_dir(name) / STATE_FILE} names no manifest; run treepipe "
                            f"down {name} and up -f FILE, then scale")
    data = with_stage_count(_load(st.manifest).to_yaml_dict(), stages)
    try:
        planned = plan_manifest(data, f"--stages {stages}")
        check_host_fit(planned.manifest, planned.plan)
    except ManifestError as e:
        raise TreepipeError(e.message_with_origin(f"--stages {stages}")) from None
    p = planned.plan
    bounds = [s.layers for s in p.stages]
    shown = [list(b) for b in bounds]  # as `treepipe status` prints them
    folder = run_dir(name)
    write_atomic(folder / SCALE_FILE, ScaleRequest(manifest=planned.manifest,
                                                   layout_id=p.layout_id).to_json())
    if not wait:
        print(f"pipeline {name!r}: re-planning to {len(bounds)} stages {shown}")
        return 0
    sync = state_sync(st, name)
    progress = Progress(sync)
    want = p.layout_id
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = read_state(name)
        if now and list(now.stages) == [tuple(b) for b in bounds] and not (
                folder / SCALE_FILE).exists():
            progress.poll()
            try:
                if sync.layout_id() == want and sync.ready():
                    print(f"pipeline {name!r}: {len(bounds)} stages {shown}")
                    return 0
            except LOST as e:
                # Redis restarting (the supervisor brings it back from its log) or paused:
                # the re-plan goes on, so keep waiting for it
                if not is_lost(e):
                    raise
        elif not supervisor_alive(now or st):
            raise RuntimeFailure(f"pipeline {name!r} stopped while re-planning"
                                 + (f": {c}" if (c := stopped_cause(name)) else "")
                                 + f"; see {folder}/supervisor.log")
        time.sleep(0.2)
    raise RuntimeFailure(f"pipeline {name!r} did not re-plan within {timeout:g} s; see "
                         f"{folder}/supervisor.log")


def status_local(name: str, as_json: bool = False) -> int:
    """``treepipe status NAME`` for a local pipeline."""
    st = running_state(name)
    sync = state_sync(st, name)
    beats = sync.heartbeats()
    # "plan" (output key and heartbeat field) holds the layout id, the workers' --plan
    http = (sync.r.get(sync.key("gateway", "http")) or b"").decode() or None
    none = Restarts(total=0, in_window=0)
    out = {"name": name, "endpoint": st.endpoint, "http": http, "epoch": sync.epoch(),
           "plan": sync.layout_id(), "stages": [list(b) for b in st.stages],
           "waiting": sync.waiting(beats),
           "restart_budget": {"limit": RESTART_LIMIT, "window_s": RESTART_WINDOW_S},
           "processes": {n: {"pid": pid, "alive": pid_alive(pid),
                             "restarts": st.restarts.get(n, none).total,
                             "restarts_in_window": st.restarts.get(n, none).in_window,
                             "last_exit": st.restarts.get(n, none).last_exit,
                             **(beats[n].to_json() if n in beats else {})}
                         for n, pid in st.procs.items()}}
    if as_json:
        print(json.dumps(out))
        return 0
    print(f"{name}: gateway {out['endpoint']}"
          + (f" (OpenAI API and /metrics: http://{http})" if http else "")
          + f", epoch {out['epoch']}, plan {out['plan']}, "
          f"{len(out['stages'])} stages {out['stages']}  (live view: treepipe top {name})")
    if out["waiting"]:
        print(f"  not ready: waiting for {', '.join(out['waiting'])}")
    for n, p in out["processes"].items():
        hb = "heartbeat ok" if n in beats else ("-" if n == "gateway" else "no heartbeat")
        if n in beats and beats[n].plan != out["plan"]:
            hb += f" (plan {beats[n].plan or '-'}, not the pipeline's)"
        print(f"  {n:8s} pid {p['pid']:>7} {'alive' if p['alive'] else 'DEAD':5s} {hb}"
              + (f", request {p['req']} step {p['step']}" if p.get("req") else "")
              + (f", restarted {p['restarts']}x ({p['restarts_in_window']}/{RESTART_LIMIT} "
                 f"in {RESTART_WINDOW_S:.0f} s)" if p["restarts"] else "")
              + (f", last ended: {p['last_exit']}" if p["last_exit"] else ""))
    return 0






def choose_backend(asked: str | None, local_running: bool, kube_credentials: bool) -> str:
    """The backend a scale/status command addresses: as asked, else the one that has it."""
    if asked:
        return asked
    return "kubernetes" if kube_credentials and not local_running else "local"


