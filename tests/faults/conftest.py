"""Fixtures of the fault tests (real processes, SIGKILL)."""

from __future__ import annotations

import pytest
from faultkit import Cluster


@pytest.fixture
def cluster(service_factory, tmp_path, tiny_llama_dir) -> Cluster:
    """Starts masters, rollout nodes and trainers on the tiny llama; all stopped at teardown."""
    def start(argv, name, **kw):
        kw.setdefault("timeout", 300)  # a loaded 2-core machine loads models slowly
        return service_factory(argv, name, **kw)

    return Cluster(start, tmp_path, tiny_llama_dir)
