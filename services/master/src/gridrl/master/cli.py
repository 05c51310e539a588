"""``gridrl-master``: serve the registry, or print it.

    gridrl-master serve [--listen 127.0.0.1:50050] [--store ~/.local/state/gridrl/master.sqlite]
        [--tls-cert C --tls-key K --tls-ca CA --authorized-tokens FILE]
    gridrl-master nodes --master 127.0.0.1:50050 [--json] [--role rollout]
        [--tls-ca CA --tls-cert C --tls-key K --auth-token-file FILE]

Imports stay light (click, grpc, protobuf): ``--help`` is instant and the master never loads
torch, mlx or numpy.
"""

from __future__ import annotations

import sys

import click

from gridrl.common.address import parse_listen, port_in_use
from gridrl.common.cli import (
    address_option,
    bad_parameter,
    client_security_options,
    env_option,
    exit_on_rpc_error,
    print_json,
    renamed_option,
    server_options,
    setup_logging,
    write_ready_file,
)
from gridrl.common.errors import StatusError
from gridrl.common.security.policy import Security
from gridrl.common.settings import click_options, from_params
from gridrl.master.config import ENV_PREFIX, DashboardSettings, Liveness
from gridrl.master.store import default_store_path


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gridrl master: the registry of rollout nodes and trainers."""


@main.command()
@server_options("master", listen="127.0.0.1:50050", metrics_port=9400)
@env_option("--store", env="GRIDRL_MASTER_STORE", default=default_store_path(),
            help="sqlite file the registrations persist to ('' or ':memory:': none).")
@click_options(Liveness, ENV_PREFIX)
@click_options(DashboardSettings, ENV_PREFIX)
def serve(listen: str, metrics_port: int, security: Security, log_level: str,
          ready_file: str | None, store: str, **params: float) -> None:
    """Serve RegistryService, RunReportService and the dashboard until SIGTERM/SIGINT."""
    try:
        liveness = from_params(Liveness, params)
        dashboard_port = from_params(DashboardSettings, params).dashboard_port
    except StatusError as e:
        raise bad_parameter(e) from None
    host = parse_listen(listen, "--listen")[0]
    if port_in_use(host, dashboard_port):
        raise click.BadParameter(f"port {dashboard_port} is already in use on {host}; give "
                                 "another port (0: any free port, -1: no dashboard)",
                                 param_hint="--dashboard-port")
    setup_logging(log_level)
    from gridrl.master.server import Master

    try:
        master = Master(listen, metrics_port=metrics_port, security=security,
                        store_path=store, liveness=liveness,
                        dashboard_port=dashboard_port)
    except StatusError as e:
        raise click.BadParameter(e.message, param_hint="--listen") from e
    except Exception as e:  # sqlite3.Error, OSError
        raise click.BadParameter(str(e), param_hint="--store") from e
    try:
        master.start()
    except OSError as e:  # the port is taken (servers never share one)
        master.stop(grace_s=0)
        raise click.UsageError(str(e)) from None
    write_ready_file(ready_file, master.address, master.port, master.metrics_port,
                     dashboard_port=master.dashboard_port,
                     dashboard_url=master.dashboard.url if master.dashboard else None)
    master.wait()


@main.command()
@address_option("--master", "--address", "address", env="GRIDRL_MASTER_ADDRESS",
            default="127.0.0.1:50050",
            help="host:port of the master (--master, as the other services call it).")
@client_security_options
@env_option("--json", "as_json", env="GRIDRL_MASTER_NODES_JSON", is_flag=True, default=False,
            help="Print {\"nodes\": [...]} as JSON instead of a table.")
@env_option("--role", env="GRIDRL_MASTER_NODES_ROLE", default=None, show_default=False,
            type=click.Choice(["rollout", "trainer"]), help="Only nodes with this role.")
@env_option("--backend", env="GRIDRL_MASTER_NODES_BACKEND", default=None, show_default=False,
            type=click.Choice(["torch", "mlx", "vllm"]), help="Only nodes with this backend.")
@env_option("--model", env="GRIDRL_MASTER_NODES_MODEL", default=None, show_default=False,
            help="Only nodes serving this base model id.")
@env_option("--status", env="GRIDRL_MASTER_NODES_STATUS", default=None, show_default=False,
            type=click.Choice(["healthy", "unhealthy", "draining"]),
            help="Only nodes with this status.")
@env_option("--timeout-s", "timeout", env="GRIDRL_MASTER_NODES_TIMEOUT_S", default=10.0,
            type=float, help="Seconds to wait for the master.")
@renamed_option("--timeout", "timeout", env="GRIDRL_MASTER_NODES_TIMEOUT", type=float)
@exit_on_rpc_error
def nodes(address: str, security: Security, as_json: bool, role: str | None,
          backend: str | None, model: str | None, status: str | None, timeout: float) -> None:
    """Print the registry: address, role, backend, model, adapter, status, last seen."""
    from gridrl.common.rpc.channel import dial
    from gridrl.master.display import nodes_json, nodes_table
    from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc
    from gridrl.v1.enums import enum_value

    request = registry_pb2.ListNodesRequest(
        role=enum_value(common_pb2.NodeRole, role or ""),
        backend=enum_value(common_pb2.Backend, backend or ""), model_id=model or "",
        status=enum_value(common_pb2.NodeStatus, status or ""))
    channel = dial(address, security)
    try:
        response = registry_pb2_grpc.RegistryServiceStub(channel).ListNodes(request,
                                                                            timeout=timeout)
    finally:
        channel.close()
    if as_json:
        print_json(nodes_json(list(response.nodes)))
        return
    from rich.console import Console

    # Off a terminal (pipes, CliRunner) rows must not be cut at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 400)
    console.print(nodes_table(list(response.nodes)))


if __name__ == "__main__":
    main()
