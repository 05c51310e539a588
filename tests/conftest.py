"""Fixtures shared by every test package: models on disk, service subprocesses, and real
certificates and credentials (``pki``, ``creds``)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from service_procs import Service, start_service

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Every master a test starts serves its dashboard on a free port, not on the default 8321
# (tests run in parallel); a test that wants another sets the flag or the variable itself.
os.environ.setdefault("GRIDRL_MASTER_DASHBOARD_PORT", "0")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama (hidden 64, vocab 512) with a word-level chat tokenizer."""
    from gridrl.models.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class ReservedPort(int):
    """A port number whose holding socket :meth:`release` closes (idempotent)."""

    _sock: socket.socket | None = None

    def release(self) -> int:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        return int(self)


@pytest.fixture
def reserved_port() -> Iterator[ReservedPort]:
    """A loopback port kept for this test: bound (never listening) until the test calls
    ``release()`` to start a server on it. Connecting to it meanwhile is refused. gRPC servers
    do not share ports (``SO_REUSEPORT`` is off, see gridrl.common.rpc.server.NO_REUSEPORT), so the
    holder lets go immediately before the bind instead of seconds before it, as a picked and
    closed port would. A server restarted on it after a kill binds it again on its own."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = ReservedPort(sock.getsockname()[1])
    port._sock = sock
    try:
        yield port
    finally:
        sock.close()


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
    from gridrl.engine.backends.torch.backend import TorchBackend

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

    from gridrl.engine.backends.torch.backend import TorchBackend

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchBackend.from_pretrained(smollm2_dir)
    torch.set_num_threads(before)


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


@dataclass(frozen=True)
class Pki:
    """Certificates made for the test session with ``gridrl.common.security.certs`` (the
    ``cryptography`` package): a CA; ``server`` for localhost, 127.0.0.1 and ::1; ``client``
    and ``node`` signed by the same CA; and ``rogue``, a certificate for localhost from another
    CA that nothing trusts."""

    root: Path

    def crt(self, name: str) -> str:
        return str(self.root / f"{name}.crt")

    def key(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    @property
    def ca(self) -> str:
        return str(self.root / "ca.crt")

    def tls(self, name: str | None, ca: bool = True):
        """``TlsFiles`` with ``name``'s certificate and key (None: none) and the CA."""
        from gridrl.common.security.tls import TlsFiles

        return TlsFiles(self.crt(name) if name else None, self.key(name) if name else None,
                        self.ca if ca else None)

    def flags(self, name: str | None, ca: bool = True) -> list[str]:
        """The same as ``--tls-*`` flags."""
        out = ["--tls-cert", self.crt(name), "--tls-key", self.key(name)] if name else []
        return out + (["--tls-ca", self.ca] if ca else [])


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    from gridrl.common.security.certs import make_ca, make_cert

    root = tmp_path_factory.mktemp("pki")
    make_ca(root)
    make_cert(root, "server", ["localhost", "127.0.0.1", "::1"])
    make_cert(root, "node", ["localhost", "127.0.0.1"])
    make_cert(root, "client", ["client.test"])
    rogue = root / "rogue"
    make_ca(rogue)
    make_cert(rogue, "rogue", ["localhost", "127.0.0.1"])
    for ext in ("crt", "key"):
        (root / f"rogue.{ext}").write_bytes((rogue / f"rogue.{ext}").read_bytes())
    (root / "rogue.key").chmod(0o600)
    return Pki(root)


@dataclass(frozen=True)
class Creds:
    """An authorized-tokens file minted with ``gridrl.common.security.minting.mint``: one credential per
    scope (ids ``node-1``, ``trainer-1``, ``reader``), their tokens and token files, and
    ``wrong``, a well-formed token the file does not list."""

    authorized: Path
    tokens: dict[str, str]
    files: dict[str, Path]

    def security(self, scope: str | None, tls=None, authorized: bool = False):
        """A client ``Security`` sending ``scope``'s token (None: no token)."""
        from gridrl.common.security.policy import Security
        from gridrl.common.security.tls import TlsFiles
        from gridrl.common.security.tokens import AuthorizedTokens

        return Security(tls=tls or TlsFiles(), token=self.tokens[scope] if scope else None,
                        authorized=AuthorizedTokens(self.authorized) if authorized else None)


@pytest.fixture(scope="session")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Creds:
    from gridrl.common.security.minting import mint
    from gridrl.common.security.tokens import new_token

    root = tmp_path_factory.mktemp("creds")
    authorized = root / "authorized_tokens"
    files = {}
    for scope, cid in (("node", "node-1"), ("trainer", "trainer-1"), ("read", "reader")):
        files[scope] = root / f"{scope}.token"
        mint(authorized, files[scope], scope, cid)
    files["wrong"] = root / "wrong.token"
    files["wrong"].write_text(new_token() + "\n")
    files["wrong"].chmod(0o600)
    tokens = {k: p.read_text().strip() for k, p in files.items()}
    return Creds(authorized, tokens, files)
