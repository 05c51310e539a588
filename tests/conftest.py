"""Fixtures shared by every test package: models on disk and service subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama (hidden 64, vocab 512) with a word-level chat tokenizer."""
    from gridrl.models.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Decode on one intra-op thread: on a machine whose cores are shared with other jobs,
    OpenMP's barriers make 2 threads up to 100x slower on these small matrices. (The engine
    and rollout tests use it for every test, through an autouse fixture of their conftest.)"""
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


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random peft LoRA adapters for the tiny llama: ``a`` (all linear layers, r 4),
    ``b`` (q_proj/v_proj, r 8)."""
    from engine_helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a": make_peft_adapter(tiny_llama_dir, root / "a", seed=1),
        "b": make_peft_adapter(tiny_llama_dir, root / "b", seed=2, targets=["q_proj", "v_proj"],
                               rank=8, alpha=16),
    }


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the gridrl cache."""
    from gridrl.models import resolve_model

    return Path(resolve_model("smollm2-135m-instruct", progress=False))


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_dir: Path):
    """A TorchBackend on the bundled model (one per test module), decoding on one thread."""
    import torch

    from gridrl.engine.backends.torch import TorchBackend

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchBackend.from_pretrained(smollm2_dir)
    torch.set_num_threads(before)


class Service:
    """A gridrl service started as a subprocess; ``address`` comes from its --ready-file."""

    def __init__(self, proc: subprocess.Popen, info: dict, log_path: Path) -> None:
        self.proc = proc
        self.info = info
        self.address: str = info["address"]
        self.metrics_port: int = info["metrics_port"]
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(argv: list[str], tmp_path: Path, name: str, timeout: float = 120,
                  env: dict[str, str] | None = None) -> Service:
    """Run ``argv + ['--ready-file', F]`` and wait until F appears (the server is bound)."""
    ready = tmp_path / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    cmd = [str(BIN / argv[0]), *argv[1:], "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} not ready in {timeout}s:\n{log_path.read_text()}")
        time.sleep(0.1)
    return Service(proc, json.loads(ready.read_text()), log_path)


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator:
    """Start services with ``service_factory(argv, name)``; all are stopped at teardown."""
    started: list[Service] = []

    def factory(argv: list[str], name: str, **kw) -> Service:
        svc = start_service(argv, tmp_path, name, **kw)
        started.append(svc)
        return svc

    yield factory
    for svc in reversed(started):
        svc.stop()
