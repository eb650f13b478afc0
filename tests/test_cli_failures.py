"""The CLI on failures: one line, exit 2 for usage and 1 at run time, never a traceback.

A real redis-server stands in for a pipeline's (a state file points `status` and `scale`
at it, as `treepipe up` would), so a pause (SIGSTOP) and a restart are the real thing;
the workers are left out: these commands only read Redis and the run folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.deploy.launcher import (
    RESTART_LIMIT,
    STOPPED_FILE,
    Supervisor,
    exit_cause,
    load_planned,
)
from orchestrator.deploy.manifest import with_stage_count
from orchestrator.deploy.planner import plan_manifest
from orchestrator.deploy.redis_server import RedisServer
from protocol.sync.synchroniser import Synchroniser, participant_names

LOCAL = Path(__file__).resolve().parent.parent / "manifests" / "examples" / "local.yaml"
NAME = "local"  # metadata.name of LOCAL


def cli(*args: str, cache: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TREEPIPE_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def one_line(cp: subprocess.CompletedProcess[str], rc: int, *needles: str) -> str:
    assert cp.returncode == rc, (cp.returncode, cp.stdout, cp.stderr)
    assert "Traceback" not in cp.stderr, cp.stderr
    lines = [ln for ln in cp.stderr.strip().splitlines() if ln.startswith("treepipe: error")]
    assert len(lines) == 1, cp.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def fake_up(tmp_path: Path) -> Iterator[tuple[Path, RedisServer, Path]]:
    """A run folder as `treepipe up -f local.yaml` leaves it, with a real Redis (with its
    log on disk, as the launcher runs it) and this test process as the supervisor."""
    cache = tmp_path / "cache"
    folder = cache / "run" / NAME
    folder.mkdir(parents=True)
    server = RedisServer(data_dir=tmp_path / "redis-data").start()
    secret = folder / "redis.secret"
    secret.write_text(server.password)
    _, p = load_planned(LOCAL)
    sync = Synchroniser(server.url, NAME)
    sync.register(participant_names(len(p.stages)))
    sync.r.set(sync.key("plan"), p.layout_id)
    sync.close()
    state = {"redis": server.address, "redis_secret": str(secret), "endpoint": "127.0.0.1:9",
             "stages": [list(s.layers) for s in p.stages], "procs": {},
             "supervisor_pid": os.getpid(), "manifest": str(LOCAL), "redis_pid": None}
    (folder / "state.json").write_text(json.dumps(state))
    try:
        yield cache, server, folder
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def test_status_while_redis_is_paused_ends_in_one_line(fake_up) -> None:
    cache, server, _ = fake_up
    assert cli("status", NAME, "--backend", "local", cache=cache).returncode == 0
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        cp = cli("status", NAME, "--backend", "local", cache=cache, timeout=60)
        took = time.monotonic() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    one_line(cp, 1, "Redis did not answer", "try again")
    assert took < 30, took  # a bounded wait, not a hang


def test_status_names_a_workers_last_exit_cause(fake_up) -> None:
    cache, _, folder = fake_up
    state = json.loads((folder / "state.json").read_text())
    state["procs"] = {"stage1": os.getpid()}
    state["restarts"] = {"stage1": {"total": 2, "in_window": 1,
                                    "last_exit": "exit code 3; last log line: boom"}}
    (folder / "state.json").write_text(json.dumps(state))
    cp = cli("status", NAME, "--backend", "local", cache=cache)
    assert cp.returncode == 0, cp.stderr
    assert "restarted 2x (1/5 in 300 s), last ended: exit code 3; last log line: boom" in cp.stdout
    cp = cli("status", NAME, "--backend", "local", "--json", cache=cache)
    assert json.loads(cp.stdout)["processes"]["stage1"]["last_exit"].startswith("exit code 3")


def test_status_with_redis_gone_ends_in_one_line(fake_up) -> None:
    cache, server, _ = fake_up
    server.stop()
    one_line(cli("status", NAME, "--backend", "local", cache=cache), 1, "Redis did not answer")


def test_scale_waits_out_a_redis_restart(fake_up) -> None:
    """The supervisor's part (re-plan, Redis restarted from its log, new workers beating)
    is played by a thread; `scale` must keep waiting through the restart."""
    cache, server, folder = fake_up
    data = with_stage_count(load_planned(LOCAL).manifest.to_yaml_dict(), 2)
    p = plan_manifest(data).plan
    names = participant_names(len(p.stages))

    def supervisor() -> None:
        deadline = time.monotonic() + 60
        while not (folder / "scale.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (folder / "scale.json").unlink()
        state = json.loads((folder / "state.json").read_text())
        state["stages"] = [list(s.layers) for s in p.stages]
        (folder / "state.json").write_text(json.dumps(state))
        server.stop()  # scale is polling now: its calls fail until Redis is back
        time.sleep(1.5)
        server.start()
        sync = Synchroniser(server.url, NAME)
        sync.register(names)
        sync.r.set(sync.key("plan"), p.layout_id)
        for w in names:
            sync.heartbeat(w, {"pid": 1, "inc": w, "plan": p.layout_id}, ttl_s=60)
        sync.close()

    t = threading.Thread(target=supervisor, daemon=True)
    t.start()
    cp = cli("scale", NAME, "--stages", "2", "--backend", "local", "--timeout", "60",
             cache=cache)
    t.join(10)
    assert cp.returncode == 0, cp.stderr
    assert "Traceback" not in cp.stderr and "2 stages" in cp.stdout, (cp.stdout, cp.stderr)


@pytest.mark.parametrize("args,needle", [
    (["scale", NAME, "--stages", "2", "--timeout", "nan"], "--timeout"),
    (["scale", NAME, "--stages", "2", "--timeout", "-1"], "--timeout"),
    (["scale", NAME, "--stages", "0"], "--stages"),
    (["scale", NAME, "--stages", "two"], "--stages"),
    (["chaos", "-f", str(LOCAL), "--deadline", "inf"], "--deadline"),
    (["chaos", "-f", str(LOCAL), "--kill-prob", "nan"], "--kill-prob"),
    (["up", "-f", str(LOCAL), "--timeout", "0"], "--timeout"),
])
def test_bad_numbers_are_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    cp = cli(*args, cache=tmp_path)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    assert needle in cp.stderr.strip().splitlines()[-1], cp.stderr


def test_a_workers_exit_cause_names_the_signal_or_code_and_its_last_log_line(
        tmp_path: Path) -> None:
    log = tmp_path / "stage0.log"
    log.write_text("loading\nRuntimeError: boom\n\n")
    assert exit_cause(3, log) == "exit code 3; last log line: RuntimeError: boom"
    assert exit_cause(-signal.SIGKILL).startswith("killed by SIGKILL (most often the kernel's "
                                                  "OOM killer")
    assert exit_cause(-signal.SIGSEGV, tmp_path / "none.log") == "killed by SIGSEGV"


def test_a_crash_loop_is_reported_with_its_cause_after_the_stop(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = cache / "run" / NAME
    folder.mkdir(parents=True)
    m, p = load_planned(LOCAL)
    sup = Supervisor(m, p, folder, LOCAL)
    (folder / "stage1.log").write_text("allocating the KV pool\n")
    sup.procs["stage1"] = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    sup.procs["stage1"].wait()
    sup.deaths["stage1"] = [time.monotonic()] * RESTART_LIMIT  # this death is one too many
    assert sup.watch_once() is False
    rec = json.loads((folder / STOPPED_FILE).read_text())
    assert rec["worker"] == "stage1" and "SIGKILL" in rec["cause"], rec
    assert "last log line: allocating the KV pool" in rec["cause"]
    # no state file: the pipeline is down, and status says why
    one_line(cli("status", NAME, "--backend", "local", cache=cache), 1,
             "stage1 was crash looping (killed by SIGKILL", "allocating the KV pool")


# A stage that the kernel OOM-kills as it allocates its KV pool, every time it starts:
# a sitecustomize on the children's PYTHONPATH SIGKILLs stage1 after one log line, before
# it imports anything (so a death costs a Python start-up, not a model load).
OOM_STAGE = """\
import os, signal, sys
if sys.argv[1:4] == ["stage", "--name", "stage1"]:
    print("allocating the KV pool", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_up_detach_names_a_crash_loops_cause(tmp_path: Path) -> None:
    """Issue 41: under `up --detach` stages OOM-killed again and again used to end in a
    bare timeout after 150 s.  A real supervisor now stops the crash loop, and `up
    --detach` and `status` each say in one line which worker it was and why."""
    from tests.runtime_harness import tiny_manifest, tiny_model_folder

    manifest = tmp_path / "oom.yaml"
    manifest.write_text(tiny_manifest("oom", tiny_model_folder(tmp_path / "model"), stages=2))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(OOM_STAGE)
    env = dict(os.environ, TREEPIPE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(hook), str(Path(__file__).parents[1])]))
    try:
        t0 = time.monotonic()
        cp = subprocess.run([sys.executable, "-m", "orchestrator", "up", "-f", str(manifest),
                             "--detach", "--timeout", "120"], capture_output=True, text=True,
                            timeout=180, env=env)
        took = time.monotonic() - t0
        line = one_line(cp, 1, "failed to start: stage1 was crash looping (killed by SIGKILL",
                        "OOM killer", "last log line: allocating the KV pool")
        assert took < 60, (took, line)  # the crash loop, not the 120 s timeout
        cp = subprocess.run([sys.executable, "-m", "orchestrator", "status", "oom"],
                            capture_output=True, text=True, timeout=60, env=env)
        one_line(cp, 1, "stage1 was crash looping (killed by SIGKILL", "allocating the KV pool")
    finally:
        subprocess.run([sys.executable, "-m", "orchestrator", "down", "oom"], env=env,
                       capture_output=True, timeout=60)
    # the supervisor took every process down with it
    left = [p for p in (tmp_path / "cache" / "run" / "oom" / "pids").glob("*.pid")]
    assert not left, left
