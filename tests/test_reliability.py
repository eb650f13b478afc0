"""`treepipe up` survives the loss of its Redis: SIGKILL redis-server mid-request, the
supervisor restarts it on the same port from its append-only log, the workers wait it
out (no crash) and the request finishes with exactly plain decoding's tokens.  The
same pipeline checks the secret: a 0600 file, on no process's command line."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

from orchestrator.deploy.launcher import pid_alive, read_state, state_sync
from orchestrator.serving.client import Client
from stages.speculation.engine import PipelineEngine
from tests.runtime_harness import (
    tiny_manifest,
    tiny_model_folder,
    treepipe,
    treepipe_cache,
)
from tests.tiny_models import PROMPT, target_shards


def test_redis_sigkill_mid_request_is_a_pause(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path / "model")
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(tiny_manifest("redisloss", model))
    with treepipe_cache(tmp_path / "cache") as env:
        try:
            res = treepipe("up", "-f", str(manifest), "--detach", env=env)
            assert res.returncode == 0, res.stderr
            st = read_state("redisloss")
            assert st is not None
            secret = Path(st.redis_secret)
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600
            password = secret.read_text().strip()
            assert password and password not in st.redis
            ps = subprocess.run(["ps", "-ww", "-eo", "args="], capture_output=True,
                                text=True).stdout
            assert "redis-server" in ps and password not in ps

            sync = state_sync(st, "redisloss")
            old_redis = st.redis_pid
            out: dict[str, object] = {}

            def run() -> None:
                with Client(st.endpoint) as c:
                    out["c"] = c.generate(temperature=0,
                                          prompt_ids=PROMPT, max_tokens=120, timeout_s=240)

            t = threading.Thread(target=run)
            t.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # kill once the request has committed tokens
                active = sync.in_flight()
                if active and sync.r.llen(sync.req_key(active[0], "log")) >= 10:
                    break
                time.sleep(0.05)
            assert sync.in_flight(), "the request finished before the kill"
            os.kill(old_redis, signal.SIGKILL)
            t.join(300)
            assert not t.is_alive()
            ar = PipelineEngine(target_shards(1)).generate(PROMPT, 120, method="ar").tokens
            assert out["c"].tokens == ar  # type: ignore[attr-defined]
            now = read_state("redisloss")
            assert now is not None and now.redis_pid != old_redis
            assert pid_alive(now.redis_pid)
            # a pause, not a crash: every worker is the one started first
            assert now.procs == st.procs
        finally:
            treepipe("down", "-f", str(manifest), env=env)


def test_restart_budget_is_a_rate() -> None:
    """An occasional death is restarted forever; a crash loop is stopped."""
    from orchestrator.deploy.launcher import RESTART_LIMIT, RESTART_WINDOW_S, crash_looping, recent

    # one death an hour for a week: never a crash loop, whatever the total
    deaths: list[float] = []
    for hour in range(24 * 7):
        now = hour * 3600.0
        deaths = [*recent(deaths, now), now]
        assert not crash_looping(deaths, now)
    assert len(deaths) == 1  # the window forgets the old ones
    # RESTART_LIMIT deaths in the window are allowed; one more is a loop
    burst = [1000.0 + i for i in range(RESTART_LIMIT)]
    assert not crash_looping(burst, burst[-1])
    assert crash_looping([*burst, burst[-1] + 1], burst[-1] + 1)
    # the same deaths spread wider than the window are not
    spread = [i * RESTART_WINDOW_S / RESTART_LIMIT for i in range(RESTART_LIMIT + 1)]
    assert not crash_looping(spread, spread[-1])


# test_cancel_then_request_never_stalls_the_next_request is in tests/test_runtime.py, on
# the pipeline of its configuration (3 stages, zmq, n-gram) that file starts anyway.


def test_a_finished_requests_late_verdict_does_not_interrupt_the_next_step() -> None:
    """The root of the cancel race: a verdict of the cancelled request, queued while the
    worker already waits for the next request's prefill, is dropped, not an interruption
    (before, the wait ended, the prefill was lost and the request stalled)."""
    import json
    import uuid

    import torch

    from orchestrator.deploy.redis_server import RedisServer, free_port
    from protocol.links.messages import Nodes
    from protocol.links.transport import open_inbox, open_outbox
    from protocol.sync.synchroniser import Synchroniser
    from stages.runtime.participant import Interrupted, Participant

    with RedisServer() as server:
        addr = f"127.0.0.1:{free_port()}"
        inbox, outbox = open_inbox("zmq", addr), open_outbox("zmq", addr)
        sync = Synchroniser(server.url, f"c{uuid.uuid4().hex[:6]}")
        worker = Participant("stage1", sync, inbox, input_timeout_s=30.0)
        worker.dim, worker.dtype = 8, torch.float32
        worker.epoch, worker.step, worker.joining = 3, 0, ("next",)
        late = {"op": "step", "epoch": 2, "step": 7, "v": [["cancelled", 5, -1, -1, True]],
                "join": []}
        sync.r.rpush(sync.key("ctl", "stage1"), json.dumps(late))
        empty = torch.zeros(0, dtype=torch.long)
        threading.Timer(0.3, lambda: outbox.send_nodes([Nodes(
            "prefill", "next", 3, 0, empty, empty, empty, torch.ones(2, 8))])).start()
        got = worker.expect("next", "prefill", 0)
        assert (got.req, got.epoch, got.step) == ("next", 3, 0)
        assert sync.epoch() == 0  # no input timeout, no new epoch
        # a message that concerns this worker (a new epoch's start) still interrupts
        sync.r.rpush(sync.key("ctl", "stage1"),
                     json.dumps({"op": "start", "reqs": ["next"], "epoch": 4}))
        try:
            worker.expect("next", "hidden", 1)
            raise AssertionError("a start of a newer epoch must interrupt the wait")
        except Interrupted:
            assert worker.next_ctl is not None and worker.next_ctl.epoch == 4
        outbox.close()
        inbox.close()


def test_the_docs_describe_the_local_redis_as_it_runs(tmp_path: Path) -> None:
    """Issue 41 item 8: docs/runtime.md said the local Redis ran without persistence while
    it kept an append-only log.  The docs name the settings `up`'s Redis is given."""
    import re

    from orchestrator.deploy.redis_server import RedisServer
    from protocol.sync.synchroniser import DEFAULT_TTL_S

    docs = (Path(__file__).parents[1] / "docs" / "runtime.md").read_text()
    bullet = docs[docs.index("- **Redis.**"):]
    bullet = " ".join(bullet[:bullet.index("\n- ")].split())
    config = RedisServer(data_dir=tmp_path / "redis-data").config().splitlines()
    for setting in ("appendonly yes", "appendfsync everysec"):
        assert setting in config and f"`{setting}`" in bullet, setting
    assert "without persistence" not in docs
    assert DEFAULT_TTL_S == 3600 and re.search(r"expires an hour after the\s+request's last",
                                               docs)
