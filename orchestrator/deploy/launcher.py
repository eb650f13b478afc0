"""The local backend: ``treepipe up`` / ``treepipe down`` run a pipeline on this machine.

``up`` starts a supervisor that owns every process of the pipeline: a private
``redis-server`` on a free port (unless the manifest names an external Redis)
with a per-pipeline password in ``redis.secret`` (mode 0600; the workers read
it through ``$TREEPIPE_REDIS_PASSWORD_FILE``) and an append-only log in
``redis-data/`` (the supervisor restarts a dead server on the same port),
the stage workers, the draft service and the gateway, each logging to its own
file in the run folder ``<cache>/run/<name>/``.  The supervisor restarts a
worker that dies and moves the pipeline to a new epoch, so the running request
resumes from its token log.  ``--detach`` returns once the gateway is healthy
and prints its ``HOST:PORT``; ``down`` stops the supervisor and everything it
started.

The cluster module is imported inside the functions that use it: it loads the
kubernetes client, which local commands never need.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.deploy.commands import local_endpoints, worker_commands
from orchestrator.deploy.manifest import (
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
    new_secret,
    write_secret,
)
from orchestrator.models.registry import cache_dir
from orchestrator.serving.client import Client
from orchestrator.serving.gateway import SERVICE
from protocol.errors import TreepipeError
from protocol.sync.synchroniser import PASSWORD_FILE_ENV, Synchroniser, participant_names

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


def run_dir(name: str) -> Path:
    """Folder with the state file and the logs of a local pipeline."""
    return cache_dir() / "run" / name


def read_state(name: str) -> dict[str, Any] | None:
    """The state a running supervisor wrote, or None."""
    path = run_dir(name) / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def state_sync(st: dict[str, Any], name: str) -> Synchroniser:
    """A synchroniser client of a running pipeline, authenticated with its secret file."""
    secret = st.get("redis_secret")
    password = Path(secret).read_text().strip() if secret else None
    return Synchroniser(st["redis"], name, password=password)


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn of a worker: SIGTERM when the supervisor dies, even by SIGKILL, so no
    worker keeps serving a pipeline nobody owns (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _load_planned(path: str) -> Planned:
    """A backend: local manifest and its plan (computed once, here)."""
    m = _load(path)
    try:
        return with_plan(m, path)
    except ManifestError as e:
        raise TreepipeError(str(e)) from None


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
    redis: RedisServer | None = None
    stopping: bool = False
    redis_restarts: int = 0

    @property
    def name(self) -> str:
        return self.m.metadata.name

    def commands(self, redis_url: str, gateway_port: int) -> dict[str, list[str]]:
        """Command line of every process of the pipeline (orchestrator/deploy/commands.py)."""
        ports = [free_port() for _ in self.p.stages]
        at = local_endpoints(redis_url, ports, gateway_port)
        return {n: [*TREEPIPE, *args] for n, args in worker_commands(self.m, self.p, at).items()}

    def spawn(self, name: str) -> None:
        logf = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # many processes share this machine's cores: one thread each unless told otherwise
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.redis:  # the password by file, never on the command line
            env[PASSWORD_FILE_ENV] = str(self.secret_path)
        self.procs[name] = subprocess.Popen(self.argv[name], stdout=logf,
                                            stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=_die_with_parent)
        logf.close()

    @property
    def secret_path(self) -> Path:
        return self.folder / "redis.secret"

    def start(self) -> dict[str, Any]:
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
                                     data_dir=data).start()
            url = self.redis.address
        else:
            url = s.synchronizer.url or ""
        sync = Synchroniser(url, self.name, password=secret)
        sync.register(participant_names(len(bounds)))
        sync.resume()  # a fresh epoch: nothing left from an earlier run can commit
        port = s.gateway.port or free_port()
        self.argv = self.commands(url, port)
        for n in self.argv:
            self.spawn(n)
        return {"name": self.name, "supervisor_pid": os.getpid(), "redis": url,
                "redis_secret": str(self.secret_path) if secret else None,
                "redis_pid": self.redis.proc.pid if self.redis and self.redis.proc else None,
                "manifest": str(self.manifest_path),
                "endpoint": f"127.0.0.1:{port}", "stages": [list(b) for b in bounds],
                "procs": {n: p.pid for n, p in self.procs.items()}}

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
        self.m, self.p = planned
        redis_url = self.argv["gateway"][self.argv["gateway"].index("--redis") + 1]
        port = int(self.argv["gateway"][self.argv["gateway"].index("--listen") + 1]
                   .rsplit(":", 1)[1])
        argv = self.commands(redis_url, port)
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
        for n, p in list(self.procs.items()):
            if p.poll() is None or self.stopping:
                continue
            self.restarts[n] = self.restarts.get(n, 0) + 1
            now = time.monotonic()
            self.deaths[n] = [*recent(self.deaths.get(n, []), now), now]
            if crash_looping(self.deaths[n], now):
                log.error("%s is crash looping: it died %d times within %.0f s (exit code "
                          "%s); stopping the pipeline, see %s.log", n, len(self.deaths[n]),
                          RESTART_WINDOW_S, p.returncode, n)
                return False
            log.warning("%s exited with %s; restarting it (restart %d)", n, p.returncode,
                        self.restarts[n])
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
    state_path = folder / "state.json"
    code = 0
    try:
        state = sup.start()
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(state_path)
        log.info("pipeline %s: gateway on %s, logs in %s", m.metadata.name, state["endpoint"],
                 folder)
        scale_path = folder / "scale.json"
        while not stop:
            if scale_path.exists():
                want = json.loads(scale_path.read_text())
                scale_path.unlink()
                bounds = sup.scale(plan_manifest(want["manifest"]))
                log.info("scaled to %d stages %s", len(bounds), bounds)
                state["stages"] = [list(b) for b in bounds]
            if not sup.watch_once():
                code = 1
                break
            pids = {n: p.pid for n, p in sup.procs.items()}
            redis_pid = sup.redis.proc.pid if sup.redis and sup.redis.proc else None
            restarts = {n: {"total": k, "in_window": len(sup.deaths.get(n, []))}
                        for n, k in sup.restarts.items()}
            if (pids != state["procs"] or redis_pid != state["redis_pid"]
                    or restarts != state.get("restarts")):
                state["procs"], state["redis_pid"] = pids, redis_pid
                state["restarts"] = restarts
                tmp.write_text(json.dumps(state, indent=1))
                tmp.replace(state_path)
            time.sleep(0.2)
    finally:
        sup.stop()
        state_path.unlink(missing_ok=True)
    return code


def _start_failed(log_path: Path) -> TreepipeError:
    """The error for a supervisor that died while starting: the last lines of its log."""
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return TreepipeError(f"the pipeline failed to start: {' | '.join(tail)} "
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
    raise TreepipeError(f"the gateway at {endpoint} was not healthy within {timeout_s:.0f} s; "
                        f"see the logs in {log_path.parent}")


def cmd_up(a: argparse.Namespace) -> int:
    """``treepipe up -f FILE [--detach]``."""
    planned = _load_planned(a.file)
    m = planned.manifest
    name = m.metadata.name
    st = read_state(name)
    if st and pid_alive(int(st["supervisor_pid"])):
        raise TreepipeError(f"pipeline {name!r} is already up at {st['endpoint']}; "
                            f"run treepipe down -f {a.file} first")
    if not a.detach:
        return supervise(planned, Path(a.file))
    folder = run_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.json").unlink(missing_ok=True)
    log_path = folder / "supervisor.log"
    with open(log_path, "ab") as logf:
        sup = subprocess.Popen([*TREEPIPE, "up", "-f", str(Path(a.file).resolve())],
                               stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + a.timeout
    while (st := read_state(name)) is None:
        if sup.poll() is not None or time.monotonic() > deadline:
            raise _start_failed(log_path)
        time.sleep(0.2)
    wait_healthy(st["endpoint"], sup, log_path, max(1.0, deadline - time.monotonic()),
                 state_sync(st, name))
    print(st["endpoint"])
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    """``treepipe down -f FILE``."""
    m = _load(a.file)
    st = read_state(m.metadata.name)
    if not st or not pid_alive(int(st["supervisor_pid"])):
        print(f"pipeline {m.metadata.name!r} is not running", file=sys.stderr)
        return 0
    os.kill(int(st["supervisor_pid"]), signal.SIGTERM)
    deadline = time.monotonic() + 30
    pids = [int(st["supervisor_pid"]), *map(int, st["procs"].values()),
            *([int(st["redis_pid"])] if st.get("redis_pid") else [])]
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in pids:
        if pid_alive(p):
            os.kill(p, signal.SIGKILL)
    print(f"pipeline {m.metadata.name!r} stopped", file=sys.stderr)
    return 0


def _running(name: str) -> dict[str, Any]:
    st = read_state(name)
    if not st or not pid_alive(int(st["supervisor_pid"])):
        raise TreepipeError(f"no local pipeline {name!r} is running; start it with treepipe up "
                            "-f FILE (a TreePipeline in a cluster: --backend kubernetes)")
    return st


def cmd_scale(a: argparse.Namespace) -> int:
    """``treepipe scale NAME --stages N`` for a local pipeline: returns once the new
    workers are all up (the running request then resumes from its token log)."""
    st = _running(a.name)
    data = with_stage_count(_load(st["manifest"]).to_yaml_dict(), a.stages)
    try:
        p = plan_manifest(data, f"--stages {a.stages}").plan
    except ManifestError as e:
        raise TreepipeError(str(e)) from None
    bounds = [s.layers for s in p.stages]
    shown = [list(b) for b in bounds]  # as `treepipe status` prints them
    folder = run_dir(a.name)
    tmp = folder / "scale.tmp"
    tmp.write_text(json.dumps({"manifest": data}))
    tmp.replace(folder / "scale.json")
    if getattr(a, "no_wait", False):
        print(f"pipeline {a.name!r}: re-planning to {len(bounds)} stages {shown}")
        return 0
    sync = state_sync(st, a.name)
    progress = Progress(sync)
    want = p.layout_id
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        now = read_state(a.name)
        if now and now["stages"] == [list(b) for b in bounds] and not (
                folder / "scale.json").exists():
            progress.poll()
            if sync.layout_id() == want and sync.ready():
                print(f"pipeline {a.name!r}: {len(bounds)} stages {shown}")
                return 0
        time.sleep(0.2)
    raise TreepipeError(f"pipeline {a.name!r} did not re-plan within {a.timeout:.0f} s; see "
                        f"{folder}/supervisor.log")


def cmd_status(a: argparse.Namespace) -> int:
    """``treepipe status NAME`` for a local pipeline."""
    st = _running(a.name)
    sync = state_sync(st, a.name)
    beats = sync.heartbeats()
    # "plan" (output key and heartbeat field) holds the layout id, the workers' --plan
    out = {"name": a.name, "endpoint": st["endpoint"], "epoch": sync.epoch(),
           "plan": sync.layout_id(), "stages": st["stages"], "waiting": sync.waiting(beats),
           "restart_budget": {"limit": RESTART_LIMIT, "window_s": RESTART_WINDOW_S},
           "processes": {n: {"pid": pid, "alive": pid_alive(int(pid)),
                             "restarts": st.get("restarts", {}).get(n, {}).get("total", 0),
                             "restarts_in_window": st.get("restarts", {}).get(n, {}).get(
                                 "in_window", 0), **beats.get(n, {})}
                         for n, pid in st["procs"].items()}}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{a.name}: gateway {out['endpoint']}, epoch {out['epoch']}, plan {out['plan']}, "
          f"{len(out['stages'])} stages {out['stages']}")
    if out["waiting"]:
        print(f"  not ready: waiting for {', '.join(out['waiting'])}")
    for n, p in out["processes"].items():
        hb = "heartbeat ok" if n in beats else ("-" if n == "gateway" else "no heartbeat")
        if n in beats and beats[n].get("plan", "") != out["plan"]:
            hb += f" (plan {beats[n].get('plan') or '-'}, not the pipeline's)"
        print(f"  {n:8s} pid {p['pid']:>7} {'alive' if p['alive'] else 'DEAD':5s} {hb}"
              + (f", request {p['req']} step {p['step']}" if p.get("req") else "")
              + (f", restarted {p['restarts']}x ({p['restarts_in_window']}/{RESTART_LIMIT} "
                 f"in {RESTART_WINDOW_S:.0f} s)" if p["restarts"] else ""))
    return 0


def add_launcher_parsers(sub: Any) -> None:
    """Register ``treepipe up`` and ``treepipe down``."""
    u = sub.add_parser("up", help="run a backend: local pipeline on this machine")
    u.add_argument("-f", "--file", required=True, help="TreePipeline manifest (YAML)")
    u.add_argument("--detach", action="store_true",
                   help="return once the gateway is healthy; print its HOST:PORT")
    u.add_argument("--timeout", type=float, default=600.0,
                   help="seconds --detach waits for the pipeline to become healthy")
    u.set_defaults(func=cmd_up)
    d = sub.add_parser("down", help="stop a local pipeline started by treepipe up")
    d.add_argument("-f", "--file", required=True, help="TreePipeline manifest (YAML)")
    d.set_defaults(func=cmd_down)
    s = sub.add_parser("scale", help="change the stage count of a running pipeline "
                                     "(local, or a TreePipeline in a cluster)")
    s.add_argument("name", help="metadata.name of the pipeline")
    s.add_argument("--stages", type=int, required=True, help="new stage count")
    s.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the new stages to be up")
    _backend_args(s, scale=True)
    s.set_defaults(func=_by_backend(cmd_scale, "cmd_scale_cluster"))
    t = sub.add_parser("status", help="stages, epoch and health of a pipeline "
                                      "(local, or a TreePipeline in a cluster)")
    t.add_argument("name", help="metadata.name of the pipeline")
    t.add_argument("--json", action="store_true")
    _backend_args(t, scale=False)
    t.set_defaults(func=_by_backend(cmd_status, "cmd_status_cluster"))


def _backend_args(p: argparse.ArgumentParser, scale: bool) -> None:
    from orchestrator.deploy.cluster import add_cluster_args

    p.add_argument("--backend", choices=("local", "kubernetes"), default=None,
                   help="where the pipeline runs (default: local when `treepipe up` runs "
                        "NAME on this machine, else kubernetes when credentials exist)")
    add_cluster_args(p, scale=scale)


def choose_backend(asked: str | None, local_running: bool, kube_credentials: bool) -> str:
    """The backend a scale/status command addresses: as asked, else the one that has it."""
    if asked:
        return asked
    return "kubernetes" if kube_credentials and not local_running else "local"


def _by_backend(local: Any, cluster_fn: str) -> Any:
    def run(a: argparse.Namespace) -> int:
        from orchestrator.deploy import cluster

        st = read_state(a.name)
        local_running = bool(st) and pid_alive(int(st["supervisor_pid"]))
        backend = choose_backend(a.backend, local_running, cluster.kube_credentials_available())
        if backend == "kubernetes":
            return int(getattr(cluster, cluster_fn)(a))
        if a.namespace or a.context:
            raise TreepipeError("-n/--namespace and --context address a cluster; the local "
                                f"pipeline {a.name!r} takes neither (or pass --backend kubernetes)")
        return int(local(a))

    return run
