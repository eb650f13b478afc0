"""The local launcher's run folder as typed records (issue 42, "Typed boundaries").

``state.json``, the pid files and ``stopped.json`` cross from the supervisor to every
``treepipe status/down/scale/top`` process.  A file cut short by a crash, left by an
older treepipe or edited by hand must end a command in one line that names the file
and the fix (the state), or read as absent where that is safe (a pid or stop file);
``down`` clears what is broken.  No pipeline is started here: the records, the
commands that read them and a live pid standing in for the supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.cli.top import Top
from orchestrator.deploy.launcher import (
    SCALE_FILE,
    live_processes,
    port_owner,
    process_start,
    read_pid_files,
    read_state,
    run_dir,
    stopped_cause,
    supervisor_alive,
    take_scale_request,
    write_pid_file,
)
from orchestrator.deploy.run_state import (
    STATE_FILE,
    STOPPED_FILE,
    PidRecord,
    Restarts,
    RunState,
    RunStateError,
    StopRecord,
)

NAME = "typed"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache: run folders of this test only."""
    monkeypatch.setenv("TREEPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A stand-in worker this test starts and reaps itself."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def state(**changes: object) -> RunState:
    """A state as a supervisor (this process) writes it."""
    me = os.getpid()
    base = RunState(name=NAME, supervisor_pid=me, supervisor_start=process_start(me),
                    redis="127.0.0.1:1", redis_secret="/x/redis.secret", redis_pid=me,
                    link_keys="/x/link-keys", manifest="/x/p.yaml", endpoint="127.0.0.1:50999",
                    health="127.0.0.1:50999", gateway_port=50999, stages=((0, 2), (2, 4)),
                    procs={"stage0": me, "gateway": me},
                    restarts={"stage0": Restarts(total=2, in_window=1, last_exit="exit code 3")})
    return base.model_copy(update=changes)


def write_state(text: str) -> Path:
    folder = run_dir(NAME)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE_FILE).write_text(text)
    return folder / STATE_FILE


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_state_reads_back_as_written(cache: Path) -> None:
    st = state()
    write_state(st.to_json())
    assert read_state(NAME) == st
    assert supervisor_alive(st)
    # the JSON on disk keeps its keys: older readers and people read the same file
    raw = json.loads(st.to_json())
    assert raw["procs"] == {"stage0": os.getpid(), "gateway": os.getpid()}
    assert raw["stages"] == [[0, 2], [2, 4]] and raw["restarts"]["stage0"]["total"] == 2


def test_an_older_supervisors_state_still_reads(cache: Path) -> None:
    """Keys added since (start time, health probe, port, restarts, link keys) default."""
    write_state(json.dumps({"name": NAME, "supervisor_pid": os.getpid(),
                            "redis": "127.0.0.1:1", "redis_secret": None,
                            "manifest": "/x/p.yaml", "endpoint": "127.0.0.1:50999",
                            "stages": [[0, 4]], "procs": {"gateway": os.getpid()},
                            "some_future_key": 1}))
    st = read_state(NAME)
    assert st is not None and st.supervisor_start is None and st.restarts == {}
    assert supervisor_alive(st)  # by pid alone, as before start times were recorded
    assert st.health_endpoint == "127.0.0.1:50999"
    assert st.serves_port(50999) and not st.serves_port(5099)


BROKEN = {
    "cut short": '{"supervisor_pid": 12, "redis": "127.0.',
    "empty": "",
    "not an object": "[1, 2]",
    "pid as text": json.dumps({**json.loads(state().to_json()), "supervisor_pid": "12"}),
    "no procs": json.dumps({k: v for k, v in json.loads(state().to_json()).items()
                            if k != "procs"}),
    "three-ended stage": json.dumps({**json.loads(state().to_json()), "stages": [[0, 1, 2]]}),
    "negative restarts": json.dumps({**json.loads(state().to_json()),
                                     "restarts": {"stage0": {"total": -1, "in_window": 0}}}),
}


@pytest.mark.parametrize("text", BROKEN.values(), ids=BROKEN.keys())
def test_a_malformed_state_is_one_line_naming_the_file_and_the_fix(
        cache: Path, text: str) -> None:
    path = write_state(text)
    with pytest.raises(RunStateError) as err:
        read_state(NAME)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and f"treepipe down {NAME}" in msg


def test_an_unreadable_state_is_one_line(cache: Path) -> None:
    write_state("")
    (run_dir(NAME) / STATE_FILE).write_bytes(b"\xff\xfe")  # not UTF-8: no JSON either
    with pytest.raises(RunStateError, match=f"treepipe down {NAME}"):
        read_state(NAME)


@pytest.mark.parametrize("command", [["status", NAME, "--backend", "local"],
                                     ["status", NAME, "--backend", "local", "--json"],
                                     ["scale", NAME, "--stages", "2", "--backend", "local"]])
def test_commands_on_a_malformed_state_end_in_one_line(
        cache: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    path = write_state(BROKEN["cut short"])
    assert main(command) == 2
    line = one_line(capsys)
    assert line.startswith("treepipe: error:") and str(path) in line
    assert f"treepipe down {NAME}" in line


def test_top_on_a_malformed_state_names_the_file(cache: Path) -> None:
    path = write_state(BROKEN["pid as text"])
    with pytest.raises(RunStateError, match=str(path)):
        Top(NAME, None, 1.0)


def test_down_clears_a_malformed_state_and_pid_files(
        cache: Path, capsys: pytest.CaptureFixture[str], sleeper: subprocess.Popen) -> None:
    """``down`` is the fix the error names: it stops what the pid files still name and
    removes the files that name nothing."""
    folder = run_dir(NAME)
    write_state(BROKEN["cut short"])
    write_pid_file(folder, "stage0", sleeper.pid, ["sleep", "60"])
    pids = folder / "pids"
    (pids / "draft.pid").write_text('{"pid": 12')  # cut short
    (pids / "redis.pid").write_text(json.dumps({"pid": "x", "start": "1"}))
    (pids / "gateway.pid").write_text(json.dumps({"pid": 0, "start": "1"}))
    (pids / "supervisor.pid").write_text(json.dumps({"start": "1"}))
    assert set(read_pid_files(folder)) == {"stage0"}  # the broken ones name nothing
    assert set(live_processes(folder)) == {"stage0"}

    assert main(["down", NAME]) == 0
    line = one_line(capsys)
    assert "supervisor was gone" in line and f"stage0 pid {sleeper.pid}" in line
    assert sleeper.wait(5) != 0
    assert not (folder / STATE_FILE).exists() and not list(pids.iterdir())
    assert main(["down", NAME]) == 0 and "is not running" in one_line(capsys)


def test_down_leaves_a_malformed_state_to_its_live_supervisor(cache: Path) -> None:
    """A supervisor still runs (its pid file says so): the broken state is its to remove
    when it stops, not the reader's (here: a state that cannot name the supervisor)."""
    from orchestrator.deploy.launcher import _forget

    folder = run_dir(NAME)
    write_state(BROKEN["cut short"])
    write_pid_file(folder, "supervisor", os.getpid(), ["treepipe", "up"])
    _forget(folder)
    assert (folder / STATE_FILE).exists() and (folder / "pids" / "supervisor.pid").exists()


def test_a_pid_record_names_one_process(sleeper: subprocess.Popen, tmp_path: Path) -> None:
    write_pid_file(tmp_path, "stage0", sleeper.pid, ["sleep", "60", *["x"] * 10])
    rec = read_pid_files(tmp_path)["stage0"]
    assert rec == PidRecord(pid=sleeper.pid, start=process_start(sleeper.pid),
                            argv=("sleep", "60", *["x"] * 6))
    assert PidRecord.model_validate_json(rec.to_json()) == rec


def test_another_pipelines_malformed_state_does_not_break_port_owner(cache: Path) -> None:
    other = run_dir("other")
    other.mkdir(parents=True)
    (other / STATE_FILE).write_text("{")
    assert port_owner(50999) == "another program listens there"
    write_state(state().to_json())
    assert port_owner(50999).startswith(f"pipeline {NAME!r} serves there")
    # a state from before gateway_port: its endpoint names the port
    write_state(state(gateway_port=0).to_json())
    assert port_owner(50999).startswith(f"pipeline {NAME!r} serves there")
    assert port_owner(50998) == "another program listens there"


def test_a_malformed_stop_record_reads_as_none(cache: Path) -> None:
    folder = run_dir(NAME)
    folder.mkdir(parents=True)
    (folder / STOPPED_FILE).write_text(StopRecord(worker="stage1", cause="exit code 3",
                                                  deaths=6).to_json())
    assert stopped_cause(NAME) == "stage1 was crash looping (exit code 3)"
    (folder / STOPPED_FILE).write_text('{"worker": "stage1"}')
    assert stopped_cause(NAME) is None


def test_a_malformed_scale_request_is_dropped_not_fatal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor reads ``scale.json`` in its loop: a bad one must not end it."""
    assert take_scale_request(tmp_path) is None
    for text in ['{"manifest": ', '{"stages": 2}', '{"manifest": {"kind": "Nope"}}']:
        (tmp_path / SCALE_FILE).write_text(text)
        with caplog.at_level(logging.ERROR, logger="treepipe.launcher"):
            assert take_scale_request(tmp_path) is None
        assert not (tmp_path / SCALE_FILE).exists()
        assert "not a re-plan request" in caplog.text
