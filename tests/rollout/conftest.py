"""Fixtures of the rollout tests: torch backends on the tiny random llama and live nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollout_helpers import LiveNode, make_peft_adapter


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Decode on one intra-op thread: on a machine whose cores are shared with other jobs,
    OpenMP's barriers make 2 threads up to 100x slower on these small matrices."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["lean", "transformers"])
def tiny_backend(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """A fresh TorchBackend on the tiny llama (about 50 ms to load), once with each forward:
    the lean llama forward (adapters as LoRA factors) and the transformers forward (adapters
    merged into weight copies)."""
    from gridrl.engine.backends.torch import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir, lean=request.param == "lean")
    assert backend.forward_kind == request.param
    return backend


@pytest.fixture
def live_node(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[Callable[..., LiveNode]]:
    """``live_node(backend=None, **NodeConfig fields)``: in-process nodes, stopped at teardown."""
    from gridrl.engine.backends.torch import TorchBackend

    nodes: list[LiveNode] = []

    def start(backend=None, **config) -> LiveNode:
        backend = backend or TorchBackend.from_pretrained(tiny_llama_dir)
        node = LiveNode(backend, tmp_path / f"node{len(nodes)}", **config)
        nodes.append(node)
        return node

    yield start
    for node in reversed(nodes):
        node.close()


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random peft LoRA adapters for the tiny llama: ``a`` (all linear layers, r 4),
    ``b`` (q_proj/v_proj, r 8)."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a": make_peft_adapter(tiny_llama_dir, root / "a", seed=1),
        "b": make_peft_adapter(tiny_llama_dir, root / "b", seed=2, targets=["q_proj", "v_proj"],
                               rank=8, alpha=16),
    }
