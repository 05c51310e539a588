"""Fixtures shared by every test package: models on disk and service subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
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
def reserved_port() -> Iterator[int]:
    """A loopback port kept for this test: bound (SO_REUSEPORT, never listening) until the
    test ends. A server started on it, restarted on it after a kill, or a client refused on it
    never meets another process's socket, unlike a port picked, closed and bound again later
    (anyone may take it in between). gRPC servers set SO_REUSEPORT, so they bind it alongside;
    while none listens, connecting to it is refused."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the gridrl cache."""
    from gridrl.models import resolve_model

    return Path(resolve_model("smollm2-135m-instruct", progress=False))


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
