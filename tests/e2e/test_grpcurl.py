"""The real ``grpcurl`` binary against the real servers: reflection lists and describes each
gridrl service next to health and reflection, ``grpc.health.v1.Health/Check`` answers
SERVING, and one JSON call per service goes through (what an operator does by hand). The
master runs with mutual TLS and scoped credentials, as across machines: grpcurl presents a
client certificate and a bearer token, and a plaintext grpcurl is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from waiting import wait_for

BIN = Path(sys.executable).parent
GRPCURL = BIN / "grpcurl"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
HEALTH = "grpc.health.v1.Health"


PLAINTEXT = ("-plaintext",)


def grpcurl(*args: str, check: bool = True, timeout: float = 60,
            transport: tuple[str, ...] = PLAINTEXT) -> subprocess.CompletedProcess:
    """Run ``grpcurl TRANSPORT ARGS`` (``-plaintext``, or ``-cacert``/``-cert``/``-key`` for
    TLS); with ``check``, fail the test on a non-zero exit."""
    proc = subprocess.run([str(GRPCURL), *transport, "-max-time", "30", *args],
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"grpcurl {' '.join(args)} exited {proc.returncode}:\n"
                                      f"{proc.stdout}{proc.stderr}")
    return proc


def call(address: str, method: str, request: dict | None = None,
         headers: tuple[str, ...] = (), transport: tuple[str, ...] = PLAINTEXT) -> dict:
    """``grpcurl -d JSON ADDRESS METHOD``, the response parsed (grpcurl 1.8 prints the
    proto field names, snake_case; 64-bit integers as strings)."""
    args = [a for h in headers for a in ("-H", h)]
    proc = grpcurl(*args, "-d", json.dumps(request or {}), address, method, transport=transport)
    return json.loads(proc.stdout)


def check_reflection_and_health(address: str, service: str, rpcs: set[str],
                                transport: tuple[str, ...] = PLAINTEXT) -> None:
    """``list`` shows the service, health and reflection; ``describe`` shows its RPCs, each
    with its comment from the .proto; Health/Check answers SERVING overall and for the
    service. None of it needs a credential."""
    listed = set(grpcurl(address, "list", transport=transport).stdout.split())
    assert {service, HEALTH, REFLECTION} <= listed, listed
    described = grpcurl(address, "describe", service, transport=transport).stdout
    assert f"{service} is a service" in described, described
    lines = described.splitlines()
    assert {line.split()[1].split("(")[0] for line in lines
            if line.strip().startswith("rpc ")} == rpcs, described
    assert lines[1].startswith("// "), described  # the service's own comment
    for i, line in enumerate(lines):  # reflection serves the comments (common/reflection.py)
        if line.strip().startswith("rpc "):
            assert lines[i - 1].strip().startswith("// "), f"undocumented: {line}\n{described}"
    methods = set(grpcurl(address, "list", service, transport=transport).stdout.split())
    assert methods == {f"{service}.{rpc}" for rpc in rpcs}, methods
    assert call(address, f"{HEALTH}/Check", transport=transport) == {"status": "SERVING"}
    assert call(address, f"{HEALTH}/Check", {"service": service},
                transport=transport) == {"status": "SERVING"}
    unknown = grpcurl("-d", '{"service": "no.such.Service"}', address, f"{HEALTH}/Check",
                      check=False, transport=transport)
    assert unknown.returncode != 0 and "NotFound" in unknown.stderr, unknown.stderr


def test_grpcurl_binary_is_installed() -> None:
    out = subprocess.run([str(GRPCURL), "-version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "1.8.6" in out.stdout + out.stderr


def test_master_through_grpcurl_over_mutual_tls(service_factory, pki, creds) -> None:
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "", *pki.flags("server"),
                              "--authorized-tokens", str(creds.authorized)], "master")
    address = master.address
    tls = ("-cacert", pki.ca, "-cert", pki.crt("client"), "-key", pki.key("client"))
    # Reflection and health stay open without a token (systemd probes, operators), not
    # without a client certificate: mutual TLS comes first.
    check_reflection_and_health(address, "gridrl.v1.RegistryService",
                                {"RegisterNode", "Heartbeat", "ListNodes", "WatchNodes",
                                 "DeregisterNode"}, transport=tls)
    # Refused: plaintext, TLS without a client certificate, a certificate of another CA.
    for transport in (PLAINTEXT, ("-cacert", pki.ca),
                      ("-cacert", pki.ca, "-cert", pki.crt("rogue"), "-key", pki.key("rogue"))):
        refused = grpcurl("-connect-timeout", "5", address, "list", check=False,
                          transport=transport)
        assert refused.returncode != 0, refused.stdout
        assert "Failed to dial target host" in refused.stderr, (transport, refused.stderr)
    denied = grpcurl("-d", "{}", address, "gridrl.v1.RegistryService/ListNodes", check=False,
                     transport=tls)
    assert denied.returncode != 0 and "Unauthenticated" in denied.stderr, denied.stderr
    read = (f"authorization: Bearer {creds.tokens['read']}",)
    node_auth = (f"authorization: Bearer {creds.tokens['node']}",)
    assert call(address, "gridrl.v1.RegistryService/ListNodes", headers=read,
                transport=tls) == {}

    node = {"address": "127.0.0.1:50999", "role": "NODE_ROLE_ROLLOUT", "backend": "BACKEND_TORCH",
            "adapter_format": "ADAPTER_FORMAT_PEFT", "capacity": 8,
            "base_model": {"model_id": "tiny", "architecture": "llama", "num_layers": 2}}
    denied = grpcurl("-H", read[0], "-d", json.dumps({"node": node}), address,
                     "gridrl.v1.RegistryService/RegisterNode", check=False, transport=tls)
    assert denied.returncode != 0 and "PermissionDenied" in denied.stderr, denied.stderr
    assert "credential 'reader' has scope read; this RPC needs scope node" in denied.stderr
    registered = call(address, "gridrl.v1.RegistryService/RegisterNode", {"node": node},
                      headers=node_auth, transport=tls)
    assert registered["node_id"] and registered["heartbeat_interval"].endswith("s")
    listed = call(address, "gridrl.v1.RegistryService/ListNodes", {"role": "NODE_ROLE_ROLLOUT"},
                  headers=read, transport=tls)
    [record] = listed["nodes"]
    assert record["node_id"] == registered["node_id"]
    assert record["info"]["address"] == "127.0.0.1:50999"
    assert record["info"]["backend"] == "BACKEND_TORCH"
    assert record["status"] == "NODE_STATUS_HEALTHY"
    # The same record through the project's own client, over mutual TLS with a read token.
    out = subprocess.run([str(BIN / "gridrl-master"), "nodes", "--address", address, "--json",
                          *pki.flags("client"), "--auth-token-file", str(creds.files["read"])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "127.0.0.1:50999" in out.stdout
    # and a plaintext client against the TLS server fails cleanly: one line, with the fix
    out = subprocess.run([str(BIN / "gridrl-master"), "nodes", "--address", address,
                          "--auth-token-file", str(creds.files["read"]), "--timeout", "5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.startswith("error: UNAVAILABLE: ") and out.stderr.count("\n") == 1
    assert "if it serves TLS, give --tls-ca" in out.stderr, out.stderr
    call(address, "gridrl.v1.RegistryService/DeregisterNode",
         {"node_id": registered["node_id"]}, headers=node_auth, transport=tls)
    assert call(address, "gridrl.v1.RegistryService/ListNodes", headers=read,
                transport=tls) == {}


def test_a_certificate_bound_token_through_grpcurl(service_factory, pki, tmp_path: Path) -> None:
    """grpcurl with a token bound to one client certificate (``gridrl-auth mint --cert``): the
    master answers it with that certificate, and refuses it with another certificate the same
    CA signed (the token seen by another machine of the cluster)."""
    authorized = tmp_path / "authorized_tokens"
    out = subprocess.run([str(BIN / "gridrl-auth"), "mint", "--authorized-tokens",
                          str(authorized), "--scope", "read", "--id", "ops", "--cert",
                          pki.crt("client"), "--out", str(tmp_path / "ops.token")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "", *pki.flags("server"),
                              "--authorized-tokens", str(authorized)], "master")
    header = ("-H", "authorization: Bearer " + (tmp_path / "ops.token").read_text().strip())
    own = ("-cacert", pki.ca, "-cert", pki.crt("client"), "-key", pki.key("client"))
    other = ("-cacert", pki.ca, "-cert", pki.crt("node"), "-key", pki.key("node"))
    method = "gridrl.v1.RegistryService/ListNodes"
    assert call(master.address, method, headers=header[1:], transport=own) == {}
    refused = grpcurl(*header, "-d", "{}", master.address, method, check=False, transport=other)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    assert "credential 'ops' is bound to another client certificate" in refused.stderr


def test_rollout_node_through_grpcurl(service_factory, tiny_llama_dir: Path) -> None:
    node = service_factory(["gridrl-rollout", "serve", "--backend", "torch",
                            "--model", str(tiny_llama_dir), "--listen", "127.0.0.1:0",
                            "--metrics-port", "-1", "--threads", "1"], "rollout")
    address = node.address
    check_reflection_and_health(address, "gridrl.v1.RolloutService",
                                {"Generate", "PushAdapter", "ReloadAdapter", "GetNodeInfo",
                                 "FetchAdapter", "ReadAdapter"})
    info = call(address, "gridrl.v1.RolloutService/GetNodeInfo")["info"]
    assert info["backend"] == "BACKEND_TORCH"
    assert info["role"] == "NODE_ROLE_ROLLOUT"
    assert info["base_model"]["num_layers"] == 2
    assert int(info["capacity"]) >= 1
    response = call(address, "gridrl.v1.RolloutService/Generate",
                    {"prompt_text": "reverse the words: a b c", "apply_chat_template": True,
                     "sampling": {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": "7"}})
    samples = response["samples"]
    assert len(samples) == 2
    for sample in samples:
        assert 1 <= len(sample["token_ids"]) <= 4
        assert len(sample["logprobs"]) == len(sample["token_ids"])
        assert all(lp <= 0 for lp in sample["logprobs"])
    bad = grpcurl("-d", json.dumps({"prompt_text": "x", "sampling": {"max_tokens": 4, "top_p": 1.5}}),
                  address, "gridrl.v1.RolloutService/Generate", check=False)
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "top_p" in bad.stderr


def test_trainer_through_grpcurl(service_factory, tiny_llama_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer = service_factory(
        ["gridrl-trainer", "run", "--model", str(tiny_llama_dir), "--rollout", "local",
         "--steps", "1000", "--group-size", "2", "--max-tokens", "4", "--eval-tasks", "1",
         "--eval-every", "1000", "--checkpoint-every", "1000", "--run-name", "grpcurl-e2e",
         "--run-dir", str(run_dir), "--device", "cpu", "--listen", "127.0.0.1:0",
         "--metrics-port", "-1"], "trainer", env={"OMP_NUM_THREADS": "1"})
    address = trainer.address
    check_reflection_and_health(address, "gridrl.v1.TrainerService", {"GetRunStatus", "WatchRun"})
    # Until the model is loaded the status is empty; then the run fills it in.

    def stepped() -> dict | None:
        status = call(address, "gridrl.v1.TrainerService/GetRunStatus")
        return status if int(status.get("step", 0)) >= 1 else None

    status = wait_for(stepped, timeout_s=180, what="the run's first step", alive=trainer,
                      every_s=0.5)
    assert status["run_name"] == "grpcurl-e2e"
    assert status["run_dir"] == str(run_dir)
    assert status["state"] == "RUN_STATE_RUNNING", status
    assert status["model_id"] == str(tiny_llama_dir)
    assert status["total_steps"] == "1000"
    report = status["last_report"]
    assert int(report["step"]) >= 1 and int(report["policy_version"]) >= 1, report
