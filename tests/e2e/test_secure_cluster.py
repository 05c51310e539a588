"""A cluster as across machines, through the real CLIs only: ``gridrl-auth`` makes the CA,
the certificates and the scoped credentials; the master, a torch rollout node (tiny llama) and
the trainer run with mutual TLS; the trainer trains a few steps, pushing its adapter to the
node; read-only clients see it all. Plus what the CLIs refuse: listening beyond loopback
unprotected, a token on the command line, a second server on a taken port."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.common.security.policy import Security
from gridrl.common.security.tls import TlsFiles
from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _auth(*argv: str) -> None:
    proc = _run("gridrl-auth", *argv)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_master_node_and_trainer_train_over_mutual_tls_with_scoped_credentials(
        service_factory, tiny_llama_dir: Path, tmp_path: Path) -> None:
    pki, keys = tmp_path / "pki", tmp_path / "keys"
    authorized = str(keys / "authorized_tokens")
    _auth("ca", "--dir", str(pki))
    for name in ("master", "node", "trainer", "ops"):
        _auth("cert", "--dir", str(pki), name, "--host", "127.0.0.1", "--host", "localhost")
    keys.mkdir()
    for cid, scope in (("node-a", "node"), ("trainer", "trainer"), ("ops", "read")):
        bind = ["--cert", str(pki / "trainer.crt")] if scope == "trainer" else []
        _auth("mint", "--authorized-tokens", authorized, "--scope", scope, "--id", cid, *bind,
              "--out", str(keys / f"{cid}.token"))

    def tls(name: str) -> list[str]:
        return ["--tls-cert", str(pki / f"{name}.crt"), "--tls-key", str(pki / f"{name}.key"),
                "--tls-ca", str(pki / "ca.crt")]

    ops = [*tls("ops"), "--auth-token-file", str(keys / "ops.token")]
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", str(tmp_path / "m.sqlite"),
                              *tls("master"), "--authorized-tokens", authorized], "master")
    node = service_factory(["gridrl-rollout", "serve", "--backend", "torch",
                            "--model", str(tiny_llama_dir), "--listen", "127.0.0.1:0",
                            "--metrics-port", "-1", "--threads", "1", "--master", master.address,
                            "--adapter-root", str(tmp_path / "adapters"), *tls("node"),
                            "--authorized-tokens", authorized,
                            "--auth-token-file", str(keys / "node-a.token")], "node")

    def listed() -> list:
        out = _run("gridrl-master", "nodes", "--master", master.address, "--json", *ops)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["nodes"]

    nodes = wait_for(listed, timeout_s=60, what="the master to list the node", alive=node,
                     every_s=0.3)
    assert [n["info"]["address"] for n in nodes] == [node.address], (nodes, node.log())
    assert "credential 'node-a' holds" in master.log()

    run_dir = tmp_path / "run"
    trainer = subprocess.run(
        [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir), "--master",
         master.address, "--steps", "3", "--group-size", "2", "--max-tokens", "4",
         "--eval-every", "3", "--eval-tasks", "2", "--checkpoint-every", "3",
         "--run-name", "secure-e2e", "--run-dir", str(run_dir), "--device", "cpu",
         "--threads", "1", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
         "--node-wait-s", "60", *tls("trainer"), "--authorized-tokens", authorized,
         "--auth-token-file", str(keys / "trainer.token")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    steps = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    last = next(r for r in steps if r.get("step") == 3)  # the sync is in the step's record
    assert (last["policy_version"], last["nodes_synced"]) == (3, 1), last
    assert "mutual TLS" in trainer.stdout + trainer.stderr  # its TrainerService too
    # the trainer listed itself with its own credential (role trainer), then left
    assert "register failed" not in trainer.stdout + trainer.stderr
    assert re.search(r"registered 127\.0\.0\.1:\d+ as n-[0-9a-f]+ \(trainer\)", master.log())
    assert re.search(r"credential 'trainer' holds 127\.0\.0\.1:\d+", master.log())
    assert not re.search(r"gridrl_[A-Za-z0-9_-]{43}", (run_dir / "config.json").read_text())

    # The node serves the pushed adapter; a read-only client sees it but may not switch it.
    info = _run("gridrl-rollout", "info", "--address", node.address, "--json", *ops)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["info"]["adapter"] == {"name": "secure-e2e", "version": "3"}
    refused = _run("gridrl-rollout", "reload-adapter", "--address", node.address, "--base", *ops)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: PERMISSION_DENIED: RolloutService/ReloadAdapter: "
                                     "credential 'ops' has scope read"), refused.stderr
    # nor may the node's own credential push to it, or register another address
    node_creds = Security(tls=TlsFiles(str(pki / "node.crt"), str(pki / "node.key"),
                                       str(pki / "ca.crt")),
                          token=(keys / "node-a.token").read_text().strip())
    with dial(node.address, node_creds) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with pytest.raises(Exception) as e:
            stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(base_model=True), timeout=10)
    assert "credential 'node-a' has scope node" in e.value.details()
    # The node sees the trainer's token on every call, but the token is bound to the trainer's
    # certificate: with the node's certificate it switches nothing (the real CLI, as the
    # node's machine would run it); with the trainer's it does.
    stolen = ["--auth-token-file", str(keys / "trainer.token")]
    refused = _run("gridrl-rollout", "reload-adapter", "--address", node.address, "--base",
                   *tls("node"), *stolen)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: UNAUTHENTICATED: RolloutService/ReloadAdapter: "
                                     "credential 'trainer' is bound to another client "
                                     "certificate"), refused.stderr
    info = _run("gridrl-rollout", "info", "--address", node.address, "--json", *ops)
    assert json.loads(info.stdout)["info"]["adapter"]["version"] == "3"
    switched = _run("gridrl-rollout", "reload-adapter", "--address", node.address, "--base",
                    *tls("trainer"), *stolen)
    assert switched.returncode == 0, switched.stderr
    # Unprotected clients get nowhere, with a one-line error saying why.
    plain = _run("gridrl-master", "nodes", "--master", master.address, "--timeout", "5",
                 "--auth-token-file", str(keys / "ops.token"))
    assert plain.returncode == 1 and plain.stderr.count("\n") == 1, plain.stderr
    assert "if it serves TLS, give --tls-ca" in plain.stderr
    no_cert = _run("gridrl-master", "nodes", "--master", master.address, "--timeout", "5",
                   "--tls-ca", str(pki / "ca.crt"), "--auth-token-file", str(keys / "ops.token"))
    assert no_cert.returncode == 1 and "a mutual-TLS server refuses clients without a " \
        "--tls-cert/--tls-key its CA signed" in no_cert.stderr, no_cert.stderr


def test_servers_refuse_to_listen_beyond_loopback_unprotected(tmp_path: Path, pki,
                                                              creds) -> None:
    """Each ``serve``/``run`` says why and what to add, before loading anything; --insecure,
    or TLS and credentials, let it start."""
    commands = {
        "gridrl-master": ["serve", "--store", "", "--metrics-port", "-1"],
        "gridrl-rollout": ["serve", "--model", "no-such-model-is-loaded"],
        "gridrl-trainer": ["run", "--model", "no-such-model-is-loaded"],
    }
    for script, argv in commands.items():
        proc = _run(script, *argv, "--listen", "0.0.0.0:0", timeout=60)
        assert proc.returncode == 2, (script, proc.stdout, proc.stderr)
        message = " ".join(proc.stderr.split())
        assert ("--listen: 0.0.0.0 is reachable from other machines but the server has no TLS "
                "(--tls-cert and --tls-key; --tls-ca for mutual TLS) and no credentials "
                "(--authorized-tokens)") in message, (script, message)
        assert "or pass --insecure to run unprotected anyway" in message
        proc = _run(script, *argv, "--listen", "0.0.0.0:0", *pki.flags("server"), timeout=60)
        assert proc.returncode == 2 and "has no credentials (--authorized-tokens)" in \
            " ".join(proc.stderr.split()), (script, proc.stderr)
    for extra in (["--insecure"], [*pki.flags("server"), "--authorized-tokens",
                                   str(creds.authorized)]):
        ready = tmp_path / "ready.json"
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen([str(BIN / "gridrl-master"), "serve", "--store", "",
                                 "--metrics-port", "-1", "--listen", "0.0.0.0:0", *extra,
                                 "--ready-file", str(ready)], stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda ready=ready, proc=proc: ready.exists() or proc.poll() is not None,
                     timeout_s=60,
                     what="the master to be ready", every_s=0.1)
            assert proc.poll() is None, proc.stderr.read()
        finally:
            proc.terminate()
            assert proc.wait(30) == 0


def test_a_second_server_on_a_taken_port_exits_with_one_line(service_factory) -> None:
    first = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0", "--store", "",
                             "--metrics-port", "-1"], "first")
    proc = _run("gridrl-master", "serve", "--listen", first.address, "--store", "",
                "--metrics-port", "-1", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: Invalid value for --listen: {first.address} is already in use by the "
            "master (gridrl-master serve); stop it or give another port (0: any free port)"
            in proc.stderr)


def _client_commands() -> list[tuple[str, list[str]]]:
    """Every command taking client credentials (it has --auth-token-file)."""
    from importlib.metadata import entry_points

    out = []
    for ep in entry_points(group="console_scripts"):
        if not ep.name.startswith("gridrl-"):
            continue
        group = ep.load()
        for name, command in getattr(group, "commands", {}).items():
            if any("--auth-token-file" in p.opts for p in command.params):
                out.append((ep.value, [name]))
    return out


def test_no_command_takes_a_token_on_its_command_line(creds) -> None:
    commands = _client_commands()
    names = {(e.split(":")[0], argv[0]) for e, argv in commands}
    assert {("gridrl.master.cli", "nodes"), ("gridrl.rollout.cli", "generate"),
            ("gridrl.rollout.cli", "push-adapter"), ("gridrl.rollout.cli", "reload-adapter"),
            ("gridrl.rollout.cli", "info"), ("gridrl.rollout.cli", "serve"),
            ("gridrl.trainer.cli", "run"), ("gridrl.trainer.cli", "status")} <= names, names
    from importlib import import_module

    for entry, argv in commands:
        module, attr = entry.split(":")
        group = getattr(import_module(module), attr)
        result = CliRunner().invoke(group, [*argv, "--auth-token", creds.tokens["read"]])
        assert result.exit_code == 2, (argv, result.output)
        assert "Invalid value for --auth-token: a token given as a value shows in `ps`" in \
            " ".join(result.output.split()), (argv, result.output)
        assert creds.tokens["read"] not in result.output


def test_certificates_made_with_the_readme_openssl_recipe_work(tmp_path: Path) -> None:
    """The README's openssl commands, run as written, give certificates the servers and
    clients accept (mutual TLS), independently of gridrl-auth's own generator."""
    readme = (REPO / "README.md").read_text()
    recipe = re.search(r"<!-- openssl-recipe -->\n```\n(.*?)```", readme, re.S)
    assert recipe, "README.md has no openssl recipe block"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe.group(1)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from gridrl.common.rpc.server import GrpcServer
    from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

    class _T(trainer_pb2_grpc.TrainerServiceServicer):
        def GetRunStatus(self, request, context):
            return trainer_pb2.GetRunStatusResponse(run_name="ok")

    files = {p.name for p in tmp_path.iterdir()}
    assert {"ca.crt", "ca.key", "master.crt", "master.key", "client.crt", "client.key"} <= files
    server = GrpcServer("127.0.0.1:0", security=Security(tls=TlsFiles(
        str(tmp_path / "master.crt"), str(tmp_path / "master.key"), str(tmp_path / "ca.crt"))),
        grace_s=0)
    server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, _T(),
               trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name)
    server.start()
    try:
        client = Security(tls=TlsFiles(str(tmp_path / "client.crt"), str(tmp_path / "client.key"),
                                       str(tmp_path / "ca.crt")).check("client"))
        with dial(server.address, client) as channel:
            got = trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                trainer_pb2.GetRunStatusRequest(), timeout=10)
        assert got.run_name == "ok"
    finally:
        server.stop(0)
