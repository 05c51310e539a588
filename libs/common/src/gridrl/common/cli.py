"""click helpers: every flag readable from an environment variable, shown in ``--help``.

    @click.command()
    @env_option("--listen", env="GRIDRL_MASTER_LISTEN", default="0.0.0.0:50050", help="...")

Precedence: command-line flag > environment variable > default (click's own rule).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click
import grpc
from google.protobuf.json_format import MessageToDict

ENV_PREFIX = "GRIDRL_"


def env_option(*decls: str, env: str, **kwargs: Any) -> Callable[[Any], Any]:
    """``click.option`` with ``envvar=env`` shown in ``--help``. ``env`` must start GRIDRL_."""
    if not env.startswith(ENV_PREFIX):
        raise ValueError(f"environment variable {env!r} must start with {ENV_PREFIX}")
    kwargs.setdefault("show_default", True)
    return click.option(*decls, envvar=env, show_envvar=True, **kwargs)


def server_options(service: str, listen: str, metrics_port: int) -> Callable[[Any], Any]:
    """The flags every ``serve`` command takes: --listen, --metrics-port, --auth-token,
    --log-level, with ``GRIDRL_<SERVICE>_...`` / ``GRIDRL_AUTH_TOKEN`` variables."""
    s = service.upper()

    def decorate(f: Any) -> Any:
        f = env_option("--ready-file", env=f"GRIDRL_{s}_READY_FILE", default=None,
                       type=click.Path(dir_okay=False), show_default=False,
                       help="Once serving, write JSON {address, port, metrics_port, pid} here "
                            "(for supervisors and tests that bind port 0).")(f)
        f = env_option("--log-level", env=f"GRIDRL_{s}_LOG_LEVEL", default="info",
                       type=click.Choice(["debug", "info", "warning", "error"]),
                       help="Logging level.")(f)
        f = auth_option(f)
        f = env_option("--metrics-port", env=f"GRIDRL_{s}_METRICS_PORT", default=metrics_port,
                       type=int, help="Prometheus /metrics port (0: any free port, -1: off).")(f)
        f = env_option("--listen", env=f"GRIDRL_{s}_LISTEN", default=listen,
                       help="host:port to serve gRPC on (port 0: any free port).")(f)
        return f

    return decorate


auth_option = env_option(
    "--auth-token", env="GRIDRL_AUTH_TOKEN", default=None, show_default=False,
    help="Shared bearer token; servers require it, clients send it.")


def setup_logging(level: str) -> None:
    """Plain timestamped logs on stderr (journald and launchd capture them)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def print_json(message_or_obj: Any) -> None:
    """Print a protobuf message (as proto3 JSON) or a plain object as indented JSON."""
    if hasattr(message_or_obj, "DESCRIPTOR"):
        message_or_obj = MessageToDict(message_or_obj, preserving_proto_field_name=True)
    click.echo(json.dumps(message_or_obj, indent=2, sort_keys=True))


def exit_on_rpc_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for client commands: a failed call prints ``error: CODE: details``, exits 1."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as e:
            code = e.code().name if hasattr(e, "code") else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            click.echo(f"error: {code}: {details}", err=True)
            sys.exit(1)

    return wrapped


def write_ready_file(path: str | None, address: str, port: int, metrics_port: int,
                     **extra: Any) -> None:
    """Atomically write the ready file of ``server_options`` (no-op when ``path`` is None);
    ``extra`` adds service-specific keys (e.g. the rollout node's ``openai_base_url``)."""
    if not path:
        return
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"address": address, "port": port, "metrics_port": metrics_port,
                   "pid": os.getpid(), **extra}, f)
    os.replace(tmp, path)
