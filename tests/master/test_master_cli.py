"""``gridrl-master`` as users run it: serve (subprocess), nodes (table / JSON), SIGTERM,
a store that survives a crash, light imports, flag validation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
from click.testing import CliRunner
from master_helpers import node_info
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.master.cli import main
from gridrl.master.config import Liveness
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

BIN = f"{sys.prefix}/bin/gridrl-master"


def serve_argv(*extra: str) -> list[str]:
    return ["gridrl-master", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
            "--store", "", *extra]


def stub(address: str) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(dial(address))


def register(s, info) -> str:
    return s.RegisterNode(registry_pb2.RegisterNodeRequest(node=info), timeout=10).node_id


def test_nodes_table_and_json(service_factory) -> None:
    master = service_factory(serve_argv("--unhealthy-after", "30"), "master",
                             env={"GRIDRL_MASTER_HEARTBEAT_INTERVAL": "0.5"})
    s = stub(master.address)
    response = s.RegisterNode(registry_pb2.RegisterNodeRequest(
        node=node_info("10.0.0.1:6000", model="smollm2-135m", adapter=("gsm8k", 12))), timeout=10)
    assert response.heartbeat_interval.ToNanoseconds() == 500_000_000  # from the env variable
    register(s, node_info("10.0.0.2:6000", backend=common_pb2.BACKEND_MLX, model="smollm2-135m"))
    trainer = register(s, node_info("10.0.0.9:6100", role=common_pb2.NODE_ROLE_TRAINER,
                                    backend=0, model="smollm2-135m"))
    s.Heartbeat(registry_pb2.HeartbeatRequest(node_id=trainer,
                                              status=common_pb2.NODE_STATUS_DRAINING), timeout=10)

    # The table, through the installed console script.
    out = subprocess.run([BIN, "nodes", "--address", master.address], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    lines = out.splitlines()
    header = next(line for line in lines if "ADDRESS" in line)
    for column in ("ADDRESS", "ROLE", "BACKEND", "MODEL", "ADAPTER", "STATUS", "LAST SEEN"):
        assert column in header
    rows = [line.split() for line in lines if "10.0.0." in line]
    assert [r[:6] for r in rows] == [
        ["10.0.0.1:6000", "rollout", "torch", "smollm2-135m", "gsm8k@v12", "healthy"],
        ["10.0.0.2:6000", "rollout", "mlx", "smollm2-135m", "base", "healthy"],
        ["10.0.0.9:6100", "trainer", "-", "smollm2-135m", "base", "draining"],
    ]
    assert all("ago)" in line for line in lines if "10.0.0." in line)
    assert "3 node(s)" in out

    runner = CliRunner()
    result = runner.invoke(main, ["nodes", "--master", master.address, "--json"])
    assert result.exit_code == 0, result.output
    nodes = json.loads(result.output)["nodes"]
    assert [n["info"]["address"] for n in nodes] == ["10.0.0.1:6000", "10.0.0.2:6000",
                                                      "10.0.0.9:6100"]
    first = nodes[0]
    assert first["node_id"] == response.node_id
    assert first["info"]["adapter"] == {"name": "gsm8k", "version": "12"}
    assert (first["info"]["role"], first["info"]["backend"], first["status"]) == (
        "NODE_ROLE_ROLLOUT", "BACKEND_TORCH", "NODE_STATUS_HEALTHY")
    assert first["load"] == 0 and first["last_seen"].endswith("Z")

    result = runner.invoke(main, ["nodes", "--address", master.address, "--json",
                                  "--role", "rollout", "--backend", "mlx"])
    assert [n["info"]["address"] for n in json.loads(result.output)["nodes"]] == ["10.0.0.2:6000"]
    result = runner.invoke(main, ["nodes", "--status", "draining"],
                           env={"GRIDRL_MASTER_ADDRESS": master.address})
    assert result.exit_code == 0 and "10.0.0.9:6100" in result.output
    assert "10.0.0.1:6000" not in result.output and "1 node(s)" in result.output
    result = runner.invoke(main, ["nodes", "--address", master.address, "--json",
                                  "--model", "other"])
    assert json.loads(result.output) == {"nodes": []}


def test_nodes_reports_rpc_errors(reserved_port) -> None:
    result = CliRunner().invoke(main, ["nodes", "--address", f"127.0.0.1:{reserved_port}",
                                       "--timeout", "2"])
    assert result.exit_code == 1
    assert result.output.startswith("error: UNAVAILABLE: ")


def test_sigterm_exits_zero_promptly_with_open_watch(service_factory, tmp_path) -> None:
    store = tmp_path / "state" / "master.sqlite"
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", str(store)], "master")
    s = stub(master.address)
    register(s, node_info("10.0.0.1:6000"))
    watch = s.WatchNodes(registry_pb2.WatchNodesRequest())
    assert next(watch).type == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT
    t0 = time.monotonic()
    master.proc.send_signal(signal.SIGTERM)
    assert master.proc.wait(10) == 0
    assert time.monotonic() - t0 < 3, master.log()
    events = list(watch)  # the stream ended cleanly, not with an error
    assert [e.type for e in events] == [registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END]
    assert "master stopped" in master.log()
    assert store.exists()


def test_store_survives_a_crash(service_factory, tmp_path, reserved_port) -> None:
    store = str(tmp_path / "master.sqlite")
    listen = f"127.0.0.1:{reserved_port.release()}"  # the same port after the crash
    argv = ["gridrl-master", "serve", "--listen", listen, "--metrics-port", "-1",
            "--store", store]
    first = service_factory(argv, "first")
    s = stub(first.address)
    node_id = register(s, node_info("10.0.0.1:6000", adapter=("run", 3)))
    first.stop(signal.SIGKILL)  # no flush, no goodbye
    second = service_factory(argv, "second")
    assert second.address == first.address
    s = stub(second.address)
    (record,) = s.ListNodes(registry_pb2.ListNodesRequest(), timeout=10).nodes
    assert (record.node_id, record.info.adapter.version) == (node_id, 3)
    s.Heartbeat(registry_pb2.HeartbeatRequest(node_id=node_id), timeout=10)  # known at once
    assert "restored 1 node(s)" in second.log()


def test_bad_flags_are_usage_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--store", "", "--heartbeat-interval", "5",
                                  "--unhealthy-after", "2"])
    assert result.exit_code == 2
    assert "need --heartbeat-interval (5.0) < --unhealthy-after (2.0) < --expire-after" in (
        result.output)
    result = runner.invoke(main, ["serve", "--store", "", "--heartbeat-interval", "0"])
    assert result.exit_code == 2 and "--heartbeat-interval" in result.output
    result = runner.invoke(main, ["serve", "--store", "", "--listen", "nohost"])
    assert result.exit_code == 2
    assert "listen: 'nohost' is not host:port" in result.output


def test_help_is_instant_and_shows_every_env_variable() -> None:
    t0 = time.monotonic()
    out = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    assert time.monotonic() - t0 < 5
    for env in ("GRIDRL_MASTER_LISTEN", "GRIDRL_MASTER_METRICS_PORT",
                "GRIDRL_AUTHORIZED_TOKENS", "GRIDRL_TLS_CERT", "GRIDRL_TLS_KEY", "GRIDRL_TLS_CA",
                "GRIDRL_MASTER_INSECURE", "GRIDRL_MASTER_LOG_LEVEL", "GRIDRL_MASTER_READY_FILE", "GRIDRL_MASTER_STORE",
                "GRIDRL_MASTER_HEARTBEAT_INTERVAL", "GRIDRL_MASTER_UNHEALTHY_AFTER",
                "GRIDRL_MASTER_EXPIRE_AFTER"):
        assert env in out
    out = subprocess.run([BIN, "nodes", "--help"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    for env in ("GRIDRL_MASTER_ADDRESS", "GRIDRL_AUTH_TOKEN_FILE", "GRIDRL_AUTH_TOKEN",
                "GRIDRL_TLS_CA", "GRIDRL_TLS_CERT", "GRIDRL_TLS_KEY", "GRIDRL_MASTER_NODES_JSON",
                "GRIDRL_MASTER_NODES_ROLE", "GRIDRL_MASTER_NODES_BACKEND",
                "GRIDRL_MASTER_NODES_MODEL", "GRIDRL_MASTER_NODES_STATUS",
                "GRIDRL_MASTER_NODES_TIMEOUT"):
        assert env in out


def test_master_never_imports_tensor_libraries() -> None:
    code = ("import sys, gridrl.master.cli, gridrl.master.server; "
            "print(sorted(m for m in ('torch', 'mlx', 'numpy', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_credentials_are_required_when_authorized_tokens_are_given(service_factory,
                                                                   creds) -> None:
    master = service_factory(serve_argv("--authorized-tokens", str(creds.authorized)), "master")
    try:
        stub(master.address).ListNodes(registry_pb2.ListNodesRequest(), timeout=10)
        raise AssertionError("expected UNAUTHENTICATED")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    runner = CliRunner()
    result = runner.invoke(main, ["nodes", "--address", master.address])
    assert result.exit_code == 1 and result.output.startswith("error: UNAUTHENTICATED")
    result = runner.invoke(main, ["nodes", "--address", master.address, "--json",
                                  "--auth-token-file", str(creds.files["read"])])
    assert result.exit_code == 0 and json.loads(result.output) == {"nodes": []}
    # containers: the token itself in the environment
    result = runner.invoke(main, ["nodes", "--address", master.address, "--json"],
                           env={"GRIDRL_AUTH_TOKEN": creds.tokens["trainer"]})
    assert result.exit_code == 0 and json.loads(result.output) == {"nodes": []}
    result = runner.invoke(main, ["nodes", "--address", master.address, "--json"],
                           env={"GRIDRL_AUTH_TOKEN_FILE": str(creds.files["node"])})
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: PERMISSION_DENIED: RegistryService/ListNodes: "
                                    "credential 'node-1' has scope node; this RPC needs "
                                    "scope read"), result.output


def test_a_token_value_on_the_command_line_is_refused(creds) -> None:
    runner = CliRunner()
    for argv in (["nodes", "--auth-token", creds.tokens["read"]],
                 ["serve", *serve_argv()[2:], "--auth-token", creds.tokens["read"]]):
        result = runner.invoke(main, argv)
        assert result.exit_code == 2, result.output
        assert "Invalid value for --auth-token: a token given as a value shows in `ps`" \
            in result.output and "--auth-token-file FILE" in result.output
        assert creds.tokens["read"] not in result.output
    # a server reads credentials from --authorized-tokens; a token variable alone would have
    # protected it before, so it is refused rather than silently ignored
    result = runner.invoke(main, ["serve", *serve_argv()[2:]],
                           env={"GRIDRL_AUTH_TOKEN": creds.tokens["read"]})
    assert result.exit_code == 2 and "GRIDRL_AUTH_TOKEN is set, but a server checks the " \
        "credentials listed in --authorized-tokens" in result.output, result.output


def test_nodes_json_is_live_and_lists_the_trainer(tmp_path) -> None:
    """``nodes --json`` shows each node's uptime and stored adapters as of its last heartbeat
    (not its registration), and a trainer given --master is listed under ``--role trainer``
    with its run's adapter (issue 20)."""
    from gridrl.common.registration import NodeRegistrar
    from gridrl.master.server import Master
    from gridrl.trainer.fleet.listing import register_trainer
    from gridrl.trainer.report.status import RunStatus

    master = Master("127.0.0.1:0", store_path="", liveness=Liveness(0.2, 5.0, 10.0))
    master.start()
    state = {"uptime": 1.0, "stored": [common_pb2.AdapterRef(name="run", version=1)],
             "sequence": 100}

    def info() -> common_pb2.NodeInfo:
        i = node_info("127.0.0.1:6001", adapter=("run", 1))
        i.uptime_s, i.sequence = state["uptime"], state["sequence"]
        i.stored_adapters.extend(state["stored"])
        return i

    node = NodeRegistrar(master.address, info, retry_interval_s=0.1)
    status = RunStatus()
    status.begin("my-run", str(tmp_path), total_steps=3, model_id="tiny")
    trainer = register_trainer(master.address, "127.0.0.1:6100", status, "tiny")

    def listing(*args: str) -> list[dict]:
        out = CliRunner().invoke(main, ["nodes", "--master", master.address, "--json", *args])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["nodes"]

    try:
        node.start()
        wait_for(lambda: len(listing()) >= 2, timeout_s=30, what="both registrants listed",
                 every_s=0.1)
        state.update(uptime=61.5, sequence=200,
                     stored=[common_pb2.AdapterRef(name="run", version=v) for v in (1, 2)])
        wait_for(lambda: listing("--role", "rollout")[0]["info"].get("uptime_s") == 61.5,
                 timeout_s=30, what="the node's updated info listed", every_s=0.1)
        (rollout,) = listing("--role", "rollout")
        assert rollout["info"]["stored_adapters"] == [{"name": "run", "version": "1"},
                                                      {"name": "run", "version": "2"}]
        assert rollout["info"]["sequence"] == "200"
        (listed,) = listing("--role", "trainer")
        assert listed["info"]["address"] == "127.0.0.1:6100"
        assert listed["info"]["adapter"]["name"] == "my-run"
        assert listed["info"]["base_model"]["model_id"] == "tiny"
        first = listed["info"]["uptime_s"]
        wait_for(lambda: listing("--role", "trainer")[0]["info"]["uptime_s"] != first,
                 timeout_s=30, what="the trainer's next heartbeat", every_s=0.1)  # heartbeats
    finally:
        trainer.stop(deregister=True)
        node.stop(deregister=True)
        master.stop(grace_s=0)
