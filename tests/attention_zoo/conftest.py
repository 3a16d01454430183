"""Fixtures shared by the attention_zoo tests."""

from __future__ import annotations

import pytest

from attention_zoo import registry


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry for the test: the cores it registers are gone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
