"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors, many steps: a second intra-op thread only adds overhead (on a busy 2-core machine, each small
    matmul gets ~50x slower). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread_and_private_cache(tmp_path, monkeypatch):
    """One torch thread and a data cache of the test's own (``ZOO_CACHE`` in ``tmp_path``), for tests that train
    tiny runs in-process. Use with ``pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")``."""
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
