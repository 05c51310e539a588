"""Fixtures of the rollout (node) tests: live in-process nodes. Model fixtures (``tiny_backend``,
``tiny_adapters``) are in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollout_helpers import LiveNode


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every rollout test decodes on one intra-op thread (tests/conftest.py)."""


@pytest.fixture
def live_node(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[Callable[..., LiveNode]]:
    """``live_node(backend=None, **NodeConfig fields)``: in-process nodes, stopped at teardown."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    nodes: list[LiveNode] = []

    def start(backend=None, **config) -> LiveNode:
        backend = backend or TorchBackend.from_pretrained(tiny_llama_dir)
        node = LiveNode(backend, tmp_path / f"node{len(nodes)}", **config)
        nodes.append(node)
        return node

    yield start
    for node in reversed(nodes):
        node.close()
