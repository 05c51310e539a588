"""Fixtures of the engine (backend-level) tests; model fixtures (``tiny_llama_dir``,
``tiny_backend``, ``tiny_adapters``, ``smollm2_dir``) are in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every engine test decodes on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(params=["torch-lean", "torch-transformers",
                        pytest.param("mlx", marks=pytest.mark.mlx)])
def backend(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """A fresh backend on the tiny llama, once per implementation: torch with the lean forward
    and with the transformers forward, and MLX on the CPU (marked ``mlx``)."""
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
        from gridrl.engine.backends.mlx.backend import MlxBackend

        return MlxBackend.from_pretrained(tiny_llama_dir, device="cpu")
    from gridrl.engine.backends.torch.backend import TorchBackend

    return TorchBackend.from_pretrained(tiny_llama_dir, lean=request.param == "torch-lean")
