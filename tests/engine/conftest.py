"""Fixtures of the engine (backend-level) tests; model fixtures (``tiny_llama_dir``,
``tiny_backend``, ``tiny_adapters``, ``smollm2_dir``) are in tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every engine test decodes on one intra-op thread (tests/conftest.py)."""
