"""Fixtures of the fuzz suite: one live cluster (master, torch node on the tiny llama, trainer
status server) per module, and the deterministic hypothesis profile.

The ``ci`` profile (loaded here, so ``make test`` uses it) is derandomized with no example
database: every run tries the same cases in the same order. ``bench/fuzz.py`` runs the same
strategies for many more cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzkit import Cluster
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Decode on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    """A started :class:`fuzzkit.Cluster`, serving ``fuzz`` v1; stopped after the module."""
    c = Cluster(tiny_llama_dir, tmp_path_factory.mktemp("fuzz"))
    yield c
    c.close()
