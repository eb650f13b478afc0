"""What a local pipeline's supervisor leaves in its run folder, as typed records.

The supervisor (``treepipe up``) writes ``state.json`` (:class:`RunState`), one
``pids/<who>.pid`` per process (:class:`PidRecord`) and, when it stops a crash-looping
pipeline, ``stopped.json`` (:class:`StopRecord`); ``treepipe status``, ``down``,
``scale``, ``top`` and ``serve`` read them in other processes.  Each record is
validated as it is read, so a file cut short by a crash, written by another version
or edited by hand never reaches the code as a half-filled dict:

* a malformed state file is a :class:`RunStateError`, one line naming the file and
  the fix (``treepipe down NAME`` clears it);
* a malformed pid or stop file reads as absent (:func:`read_pid_record` gives None):
  it can name no process we could safely signal.

Fields added after the first release have defaults, so the state of a supervisor that
an older treepipe started still reads.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import TreepipeError

STATE_FILE = "state.json"
STOPPED_FILE = "stopped.json"  # why the supervisor stopped a pipeline, kept after the stop


class RunStateError(TreepipeError):
    """A run folder's state file that cannot be read as a :class:`RunState`."""


class _Record(BaseModel):
    # strict: a pid written as "123" or true is a hand edit or another program's file,
    # not something to coerce; unknown keys are ignored so a newer writer's file reads
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class Restarts(_Record):
    """How often the supervisor restarted one worker, and why it last ended."""

    total: int = Field(ge=0)
    in_window: int = Field(ge=0)  # deaths inside the restart budget's window
    last_exit: str = ""


class RunState(_Record):
    """``state.json``: where a running local pipeline's processes are and how to reach it."""

    supervisor_pid: int = Field(gt=0)
    redis: str  # the synchroniser's address (no password: that is in redis_secret)
    endpoint: str  # HOST:PORT a client on this machine reaches the gateway's gRPC at
    stages: tuple[tuple[int, int], ...]  # each stage's [start, end) layers
    procs: dict[str, int]  # worker name -> pid
    name: str = ""  # metadata.name (the run folder's name too)
    manifest: str = ""  # the manifest file ``up`` ran (``scale`` re-reads it)
    # None: written by a supervisor older than the start-time check
    supervisor_start: str | None = None
    redis_secret: str | None = None  # the password file; None for an external Redis
    redis_pid: int | None = None  # the embedded redis-server; None for an external one
    link_keys: str = ""  # the folder of the stage links' keys
    health: str = ""  # where `up --detach` probes health; "" means the endpoint
    gateway_port: int = Field(default=0, ge=0)  # the gRPC port; 0 in older state files
    restarts: dict[str, Restarts] = Field(default_factory=dict)

    def to_json(self) -> str:
        """The file's text (indented: a person reads it when something went wrong)."""
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str, path: Path) -> RunState:
        """Parse and check a state file's text; a :class:`RunStateError` names ``path``."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            name = path.parent.name
            raise RunStateError(
                f"{path} is not a state file this treepipe can read ({_first_error(e)}): "
                f"it was cut short by a crash, written by another treepipe version or "
                f"edited; run treepipe down {name} to stop what it started and clear it, "
                f"then treepipe up -f FILE") from None

    @property
    def health_endpoint(self) -> str:
        """Where to ask whether the gateway serves: its plaintext probe, else itself."""
        return self.health or self.endpoint

    def serves_port(self, port: int) -> bool:
        """Whether this pipeline's gateway serves gRPC on local ``port``."""
        if self.gateway_port:
            return self.gateway_port == port
        # a state from before gateway_port: its endpoint is the only record of the port
        return self.endpoint.rpartition(":")[2] == str(port)

    def pid_record(self) -> PidRecord | None:
        """The supervisor as a pid record, None when this state has no start time."""
        if self.supervisor_start is None:
            return None
        return PidRecord(pid=self.supervisor_pid, start=self.supervisor_start)


class PidRecord(_Record):
    """``pids/<who>.pid``: one process, named by its pid *and* its start time."""

    pid: int = Field(gt=0)
    # when the process started (launcher.process_start); None: it was gone when written
    start: str | None
    argv: tuple[str, ...] = ()  # its first words, for a person looking at the folder

    def to_json(self) -> str:
        """The file's text."""
        return self.model_dump_json()


class StopRecord(_Record):
    """``stopped.json``: the worker whose crash loop made the supervisor stop the pipeline."""

    worker: str
    cause: str
    deaths: int = 0

    def to_json(self) -> str:
        """The file's text."""
        return self.model_dump_json()


def read_pid_record(path: Path) -> PidRecord | None:
    """The record in a pid file; None when it is unreadable or malformed (a stale or
    hand-edited file names no process that may be signalled)."""
    try:
        return PidRecord.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def read_stop_record(path: Path) -> StopRecord | None:
    """The record in a stop file; None when there is none or it is malformed."""
    try:
        return StopRecord.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader sees the old or the new file,
    never half of one (a crash mid-write leaves only the ``.tmp``)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _first_error(e: ValidationError) -> str:
    """One line for what pydantic found: the first problem, and how many more."""
    errs = e.errors()
    first = errs[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" and {len(errs) - 1} more" if len(errs) > 1 else ""
    return f"{where + ': ' if where else ''}{first['msg']}{more}"
