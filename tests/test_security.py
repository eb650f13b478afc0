"""Redis is authenticated by default: without the pipeline's secret nothing can change a
request (issue 12's injections: an XADD into the event stream, the arrive and cancel
scripts), and the secret is on no command line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.deploy.redis_server import RedisServer
from protocol.sync.synchroniser import Report, SyncError, Synchroniser, check_redis_url
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import Pipeline, tiny_model_folder
from tests.tiny_models import PROMPT, TARGET, target_shards


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


def test_redis_refuses_a_client_without_the_secret(server: RedisServer) -> None:
    anon = redis.Redis.from_url(server.address)
    for cmd in (("SET", "k", "v"), ("XADD", "tp:x:req:r:ev", "*", "tok", "1"),
                ("EVAL", "return 1", "0")):
        with pytest.raises(redis.AuthenticationError):
            anon.execute_command(*cmd)
    wrong = redis.Redis(port=server.port, password="not-the-secret")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(server.url).ping()  # the secret opens it


def test_redis_server_secret_is_not_on_its_command_line(server: RedisServer) -> None:
    assert server.proc is not None
    args = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(server.proc.pid)],
                          capture_output=True, text=True, check=True).stdout
    assert "redis-server" in args and server.password not in args


@pytest.mark.parametrize("url", ["notaurl", "http://h:1/0", "redis://h:99999/0", "redis://"])
def test_bad_redis_urls_get_a_one_line_error(url: str) -> None:
    with pytest.raises(SyncError) as e:
        check_redis_url(url)
    assert "\n" not in str(e.value) and "redis://HOST:PORT/DB" in str(e.value)
    with pytest.raises(SyncError):
        Synchroniser(url, "p")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    model = tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")
    p = Pipeline(str(model), 3, "zmq", "ngram", 4, 2,
                 log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield p.start(TARGET.n_layers)
    finally:
        p.stop()


def test_injections_without_the_secret_fail_and_the_request_stays_lossless(
        pipeline: Pipeline) -> None:
    assert pipeline.redis is not None
    refused: list[str] = []

    def inject() -> None:
        rid, name = pipeline.last_rid, pipeline.name
        # the attacker knows the key layout and the pipeline name, not the password
        anon = Synchroniser(pipeline.redis.address, name, password="")  # type: ignore[union-attr]
        attempts = {
            "xadd": lambda: anon.r.xadd(anon.req_key(rid, "ev"), {"i": 5, "tok": 1}),
            "arrive": lambda: anon.arrive(0, 5, "stage2", {rid: Report(token=1)}),
            "cancel": lambda: anon.cancel(rid, "injected"),
            "start": lambda: anon.submit("evil", [1, 2], {}, 4, []),
        }
        for what, fn in attempts.items():
            try:
                fn()
            except redis.AuthenticationError:
                refused.append(what)

    got = pipeline.generate(PROMPT, 40, at=(5, inject))
    assert refused == ["xadd", "arrive", "cancel", "start"]
    assert got == PipelineEngine(target_shards(1)).generate(PROMPT, 40, method="ar").tokens
    # and no worker has the password on its command line
    for proc in pipeline.procs.values():
        args = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert pipeline.redis.password not in args and "--redis" in args
