"""Who owns a local pipeline's ports and processes (issue 12, "Trust and resilience").

* ``treepipe up`` refuses a fixed gateway/HTTP port that something listens on: a gRPC
  server binds with SO_REUSEPORT, so a second gateway used to start on the same port
  and take some of the first pipeline's requests.
* Every process has a pid file with its start time: ``treepipe down NAME`` stops what a
  SIGKILLed supervisor left running and never signals a process that only got a
  recycled pid.
* A SIGKILLed supervisor takes its workers and Redis with it (``PR_SET_PDEATHSIG``).

Only the last test starts a pipeline (one stage of the tiny model).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.cli.main import main
from orchestrator.deploy.launcher import (
    live_processes,
    owns,
    process_start,
    read_state,
    run_dir,
    write_pid_file,
)
from orchestrator.deploy.run_state import PidRecord, RunState
from tests.runtime_harness import tiny_manifest, tiny_model_folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache: run folders of this test only."""
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("ownership") / "model")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    """Stand-ins for workers: processes this test starts (and reaps) itself."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def sleeper(procs: list[subprocess.Popen]) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "60"])
    procs.append(p)
    return p


def manifest(tmp_path: Path, model: Path, name: str, gateway: str = "port: 0") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(tiny_manifest(name, model, stages=1).replace("port: 0", gateway))
    return path


def one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_process_start_names_one_process(sleepers: list[subprocess.Popen]) -> None:
    p = sleeper(sleepers)
    start = process_start(p.pid)
    assert start and process_start(p.pid) == start
    assert owns(PidRecord(pid=p.pid, start=start))
    assert not owns(PidRecord(pid=p.pid, start=start + "0"))  # a recycled pid: another start
    # a record without a start time, or with no pid, names no process of ours
    assert not owns(PidRecord(pid=p.pid, start=None))
    with pytest.raises(ValidationError):
        PidRecord.model_validate({"pid": "x", "start": start})
    p.kill()
    time.sleep(0.2)  # not reaped yet: a zombie, nothing left to stop
    assert process_start(p.pid) is None and not owns(PidRecord(pid=p.pid, start=start))


def test_down_stops_what_a_killed_supervisor_left_and_spares_a_recycled_pid(
        cache: Path, sleepers: list[subprocess.Popen], capsys: pytest.CaptureFixture) -> None:
    folder = run_dir("orphans")
    stage, redis, stranger = sleeper(sleepers), sleeper(sleepers), sleeper(sleepers)
    write_pid_file(folder, "stage0", stage.pid, ["treepipe", "stage"])
    write_pid_file(folder, "redis", redis.pid, ["redis-server", "-"])
    # the supervisor's pid file names a process that is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / "pids" / "supervisor.pid").write_text(json.dumps({"pid": dead.pid, "start": "1"}))
    # the draft's pid was recycled: same pid, another process (started at another time)
    (folder / "pids" / "draft.pid").write_text(json.dumps(
        {"pid": stranger.pid, "start": process_start(stranger.pid) + "0"}))
    (folder / "state.json").write_text(json.dumps(
        {"name": "orphans", "supervisor_pid": dead.pid, "supervisor_start": "1",
         "endpoint": "127.0.0.1:1", "procs": {"stage0": stage.pid, "draft": stranger.pid}}))
    assert set(live_processes(folder)) == {"stage0", "redis"}

    assert main(["down", "orphans"]) == 0
    line = one_line(capsys)
    assert "supervisor was gone" in line and f"stage0 pid {stage.pid}" in line
    assert stage.wait(5) == -signal.SIGTERM and redis.wait(5) == -signal.SIGTERM
    assert stranger.poll() is None  # never signalled
    assert not (folder / "state.json").exists() and not list((folder / "pids").iterdir())

    assert main(["down", "orphans"]) == 0
    assert "is not running" in one_line(capsys)


def test_down_takes_a_name_or_a_file(cache: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["down"]) == 2
    assert "NAME or -f FILE" in one_line(capsys)
    assert main(["down", "../etc"]) == 2
    assert "not a pipeline name" in one_line(capsys)
    assert main(["down", "nothing-here"]) == 0
    assert "is not running" in one_line(capsys)


@pytest.mark.parametrize("key", ["port", "httpPort"])
def test_up_refuses_a_port_in_use(key: str, cache: Path, model: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as held:
        # what a gRPC gateway does: SO_REUSEPORT would let a second one share the port
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        gateway = f"port: {port}" if key == "port" else f"port: 0\n    httpPort: {port}"
        path = manifest(tmp_path, model, "busy", gateway)
        assert main(["up", "-f", str(path), "--detach", "--timeout", "5"]) == 2
        line = one_line(capsys)
        assert f"spec.gateway.{key} {port} is already in use" in line, line
        assert "another program listens there" in line and "0 picks one" in line
        assert not (run_dir("busy") / "pids").exists()  # nothing was started

        if key == "port":  # a pipeline of ours on that port is named, with its `down`
            other = run_dir("other")
            other.mkdir(parents=True)
            (other / "state.json").write_text(RunState(
                name="other", supervisor_pid=os.getpid(),
                supervisor_start=process_start(os.getpid()), redis="127.0.0.1:1",
                endpoint=f"127.0.0.1:{port}", gateway_port=port, stages=((0, 2),),
                procs={}).to_json())
            assert main(["up", "-f", str(path)]) == 2
            assert "pipeline 'other' serves there; treepipe down other" in one_line(capsys)


def test_up_refuses_same_gateway_and_http_port(cache: Path, model: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    path = manifest(tmp_path, model, "twice", "port: 50999\n    httpPort: 50999")
    assert main(["up", "-f", str(path)]) == 2
    assert "are both 50999" in one_line(capsys)


def test_up_refuses_while_an_earlier_runs_processes_live(
        cache: Path, model: Path, tmp_path: Path, sleepers: list[subprocess.Popen],
        capsys: pytest.CaptureFixture) -> None:
    stage = sleeper(sleepers)
    write_pid_file(run_dir("left"), "stage0", stage.pid, ["treepipe", "stage"])
    assert main(["up", "-f", str(manifest(tmp_path, model, "left"))]) == 2
    line = one_line(capsys)
    assert f"stage0 pid {stage.pid}" in line and "treepipe down left" in line


def test_a_sigkilled_supervisor_takes_every_process_with_it(
        cache: Path, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The one pipeline of this file: SIGKILL its supervisor, every worker and Redis exit
    by themselves, and ``down NAME`` then only tidies up."""
    path = manifest(tmp_path, model, "orphaned")
    try:
        # in process (the supervisor is a child anyway): no second start of the CLI
        assert main(["up", "-f", str(path), "--detach"]) == 0
        st = read_state("orphaned")
        assert st is not None
        procs = live_processes(run_dir("orphaned"))
        assert set(procs) == {"supervisor", "redis", "draft", "stage0", "gateway"}
        assert {w: r.pid for w, r in procs.items() if w in st.procs} == st.procs
        assert procs["redis"].pid == st.redis_pid
        assert procs["supervisor"].pid == st.supervisor_pid

        os.kill(st.supervisor_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(owns(r) for r in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w, r in procs.items() if owns(r)], "outlived the supervisor"

        capsys.readouterr()
        assert main(["down", "orphaned"]) == 0
        assert "is not running" in one_line(capsys)
        assert read_state("orphaned") is None
        assert not list((run_dir("orphaned") / "pids").iterdir())
    finally:
        if read_state("orphaned") or live_processes(run_dir("orphaned")):
            main(["down", "orphaned"])


def test_grpc_servers_own_their_port() -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second gateway (or link inbox)
    on a port in use would then share its connections and steal requests.  Ours fail."""
    from orchestrator.serving.gateway import Gateway
    from protocol import treepipe_pb2_grpc
    from protocol.links.transport import TransportError, open_inbox

    first = Gateway(treepipe_pb2_grpc.InferenceServicer(), "127.0.0.1:0", max_workers=2).start()
    try:
        with pytest.raises(OSError, match="cannot listen"):
            Gateway(treepipe_pb2_grpc.InferenceServicer(), f"127.0.0.1:{first.port}",
                    max_workers=2)
    finally:
        first.stop(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox = open_inbox("grpc", f"127.0.0.1:{port}", insecure=True)
    try:
        with pytest.raises(TransportError, match="cannot bind"):
            open_inbox("grpc", f"127.0.0.1:{port}", insecure=True)
    finally:
        inbox.close()
