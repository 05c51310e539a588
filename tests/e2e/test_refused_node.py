"""A node whose credential the master refuses does not retry for ever looking "active": a real
master over mutual TLS with real credentials (``pki``, ``creds``), a real node process. From
the first refusal its health is NOT_SERVING; after ``--max-refusals`` refusals in a row it
exits 78 (EX_CONFIG, which its systemd unit does not restart), its last line the master's message (UNAUTHENTICATED for a credential the
master does not list, PERMISSION_DENIED for an address another credential holds)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_for

from gridrl.common.rpc.channel import dial

MAX_REFUSALS = 3


@pytest.fixture
def master(service_factory, pki, creds, tmp_path: Path):
    authorized = tmp_path / "authorized_tokens"
    shutil.copy(creds.authorized, authorized)  # a test may mint into its copy
    svc = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                           "--metrics-port", "-1", "--store", ":memory:", *pki.flags("server"),
                           "--authorized-tokens", str(authorized)], "master")
    svc.authorized = authorized
    return svc


def _node(service_factory, master, pki, token_file: Path, tiny_llama_dir: Path,
          tmp_path: Path, *extra: str):
    return service_factory(["gridrl-rollout", "serve", "--model", str(tiny_llama_dir),
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads", "1",
                            "--master", master.address, "--adapter-root",
                            str(tmp_path / "adapters"), *pki.flags("node"),
                            "--authorized-tokens", str(master.authorized),
                            "--auth-token-file", str(token_file),
                            "--max-refusals", str(MAX_REFUSALS), *extra], "node")


def _health(address: str, pki, creds) -> int | None:
    """The node's overall health status over its mutual TLS (None once it stopped answering)."""
    with dial(address, creds.security(None, pki.tls("client"))) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5).status
        except grpc.RpcError:
            return None


def _exit_line(node) -> str:
    try:
        node.proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail("the refused node did not exit:\n" + node.log())
    assert node.proc.returncode == 78, node.log()  # EX_CONFIG: systemd does not restart it
    return node.log().strip().splitlines()[-1]


def test_an_unknown_credential_turns_the_node_not_serving_then_it_exits(
        service_factory, master, pki, creds, tiny_llama_dir: Path, tmp_path: Path) -> None:
    node = _node(service_factory, master, pki, creds.files["wrong"], tiny_llama_dir, tmp_path)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    # NOT_SERVING from the first refusal (the node stops answering after the last one)
    wait_for(lambda: _health(node.address, pki, creds) in (not_serving, None), timeout_s=60,
             what="health NOT_SERVING", every_s=0.2)
    line = _exit_line(node)
    assert line.startswith(f"error: the master at {master.address} refused this node's "
                           f"credential {MAX_REFUSALS} times in a row: register failed: "
                           "UNAUTHENTICATED: RegistryService/RegisterNode: credential not "
                           "recognised"), line
    assert node.log().count("register failed: UNAUTHENTICATED") >= 1
    assert "refuses this node" in node.log() and "health NOT_SERVING" in node.log()


def test_an_address_another_credential_holds_is_permission_denied_then_exit(
        service_factory, master, pki, creds, tiny_llama_dir: Path, tmp_path: Path) -> None:
    from gridrl.common.security.minting import mint

    token = tmp_path / "bound.token"  # a node credential bound to another address
    mint(master.authorized, token, "node", "node-elsewhere", address="127.0.0.1:1")
    node = _node(service_factory, master, pki, token, tiny_llama_dir, tmp_path)
    line = _exit_line(node)
    assert line.startswith(f"error: the master at {master.address} refused this node's "
                           f"credential {MAX_REFUSALS} times in a row: register failed: "
                           "PERMISSION_DENIED: "), line
    assert "node-elsewhere" in line, line


def test_a_refusal_that_heals_turns_the_node_serving_again(
        service_factory, master, pki, creds, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``--max-refusals 0`` retries for ever: a credential added to the master's file while
    the node waits (the master re-reads it) is accepted, and the node serves again."""
    from gridrl.common.security.minting import mint

    token = tmp_path / "late.token"
    staged = tmp_path / "staged_tokens"  # minted elsewhere, copied in later
    mint(staged, token, "node", "node-late")
    node = _node(service_factory, master, pki, token, tiny_llama_dir, tmp_path,
                 "--max-refusals", "0")
    not_serving, serving = (health_pb2.HealthCheckResponse.NOT_SERVING,
                            health_pb2.HealthCheckResponse.SERVING)
    wait_for(lambda: _health(node.address, pki, creds) == not_serving, timeout_s=60,
             what="health NOT_SERVING", alive=node, every_s=0.2)
    new_line = [ln for ln in staged.read_text().splitlines() if "node-late" in ln]
    with master.authorized.open("a") as f:
        f.write("\n".join(new_line) + "\n")
    wait_for(lambda: _health(node.address, pki, creds) == serving, timeout_s=60,
             what="health SERVING again", alive=node, every_s=0.2)
    assert node.proc.poll() is None
