"""click helpers: every flag readable from an environment variable, shown in ``--help``.

    @click.command()
    @env_option("--listen", env="GRIDRL_MASTER_LISTEN", default="127.0.0.1:50050", help="...")

Precedence: command-line flag > environment variable > default (click's own rule).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import click
import grpc
from click.core import ParameterSource
from google.protobuf.json_format import MessageToDict

from gridrl.common.address import join_address, parse_address, parse_listen, port_in_use
from gridrl.common.errors import StatusError

ENV_PREFIX = "GRIDRL_"


def env_option(*decls: str, env: str, **kwargs: Any) -> Callable[[Any], Any]:
    """``click.option`` with ``envvar=env`` shown in ``--help``. ``env`` must start GRIDRL_."""
    if not env.startswith(ENV_PREFIX):
        raise ValueError(f"environment variable {env!r} must start with {ENV_PREFIX}")
    kwargs.setdefault("show_default", True)
    return click.option(*decls, envvar=env, show_envvar=True, **kwargs)


def address_option(*decls: str, env: str, **kwargs: Any) -> Callable[[Any], Any]:
    """:func:`env_option` for a flag naming a server to dial (``--master``, ``--address``):
    its value (from the command line or ``env``) must be ``host:port``
    (:func:`gridrl.common.address.parse_address`), checked before the command runs, so a bare
    host never dials gRPC's default port 443. A bad value is click's one-line usage error,
    ``Invalid value for --master: '127.0.0.1' is not host:port: the port is missing (give
    127.0.0.1:PORT)``, exit 2."""
    return env_option(*decls, env=env, callback=_host_port, **kwargs)


def _host_port(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    flag = next((o for o in param.opts if o.startswith("--")), param.name or "address")
    for one in (value if isinstance(value, tuple) else (value,)):
        if one is None:
            continue
        try:
            parse_address(one, flag)
        except StatusError as e:
            raise bad_parameter(e) from None
    return value


def renamed_option(old: str, dest: str, env: str, **kwargs: Any) -> Callable[[Any], Any]:
    """Keep a flag's former name working, hidden from ``--help``: ``old`` sets parameter
    ``dest`` (declared under its new name by another option) when given; the new name wins
    when both are. ``env``: the environment variable the old flag read (it keeps working,
    and the new option's own variable wins over it); ``kwargs``: its ``type`` and the like.
    ``dest``'s parameter source becomes the old flag's (a command that asks whether a setting
    was given, e.g. ``gridrl-trainer run --resume``, sees it given)."""
    alias = f"_renamed_{dest}"

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def taking_old_name(*args: Any, **kw: Any) -> Any:
            value = kw.pop(alias)
            ctx = click.get_current_context()
            if value is not None and ctx.get_parameter_source(dest) in (
                    ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
                kw[dest] = value
                source = ctx.get_parameter_source(alias)  # given, as the new name would be
                if source is not None:
                    ctx.set_parameter_source(dest, source)
            return f(*args, **kw)

        return click.option(old, alias, envvar=env, hidden=True, default=None,
                            **kwargs)(taking_old_name)

    return decorate


def server_options(service: str, listen: str, metrics_port: int,
                   client: bool = False) -> Callable[[Any], Any]:
    """The flags every ``serve`` command takes: --listen, --metrics-port, --log-level,
    --ready-file (``GRIDRL_<SERVICE>_...``) and the security flags, which the command receives
    as one ``security: Security``:

    * ``--tls-cert``/``--tls-key``/``--tls-ca`` (``GRIDRL_TLS_*``): TLS, mutual with a CA;
    * ``--authorized-tokens`` (``GRIDRL_AUTHORIZED_TOKENS``): the credentials it accepts;
    * ``--insecure`` (``GRIDRL_<SERVICE>_INSECURE``): listen beyond loopback without them;
    * with ``client`` (a server that also calls others: a node registering with the master, a
      trainer calling nodes): ``--auth-token-file`` (or ``GRIDRL_AUTH_TOKEN``), the token it
      sends; its TLS files serve for those calls too.

    A non-loopback ``--listen`` without TLS and credentials is refused here, before the
    command loads anything (:func:`gridrl.common.security.policy.check_exposure`).
    """
    s = service.upper()

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def with_security(*args: Any, **kwargs: Any) -> Any:
            security = _build_security(kwargs, server=True, client=client)
            from gridrl.common.security.policy import ExposedError, check_exposure

            try:
                host, port = parse_listen(kwargs["listen"], "--listen")
                check_exposure(host, security)
            except StatusError as e:
                raise bad_parameter(e) from None
            except ExposedError as e:
                raise click.UsageError(str(e)) from None
            check_ports_free(host, port, kwargs["metrics_port"], security)
            return f(*args, security=security, **kwargs)

        g = with_security
        g = env_option("--ready-file", env=f"GRIDRL_{s}_READY_FILE", default=None,
                       type=click.Path(dir_okay=False), show_default=False,
                       help="Once serving, write JSON {address, port, metrics_port, pid} here "
                            "(for supervisors and tests that bind port 0).")(g)
        g = env_option("--log-level", env=f"GRIDRL_{s}_LOG_LEVEL", default="info",
                       type=click.Choice(["debug", "info", "warning", "error"]),
                       help="Logging level.")(g)
        g = _client_token_options(g) if client else _rejected_token_option(g)
        g = env_option("--insecure", env=f"GRIDRL_{s}_INSECURE", is_flag=True, default=False,
                       help="Serve on a non-loopback --listen without TLS and credentials "
                            "(anyone on the network can call every RPC).")(g)
        g = env_option("--authorized-tokens", env="GRIDRL_AUTHORIZED_TOKENS", default=None,
                       show_default=False, type=click.Path(dir_okay=False),
                       help="File of the credentials this server accepts (sha256 of each "
                            "token, scope, id; `gridrl-auth mint` writes it). Unset: no "
                            "credential is checked (loopback or --insecure only).")(g)
        g = _tls_options(g, "Server certificate (PEM); with --tls-key: serve TLS"
                            + (", and present it when calling others" if client else "") + ".",
                         "CA certificate (PEM): require client certificates it signed "
                         "(mutual TLS)" + ("; verify the servers this one calls" if client
                                           else "") + ".")
        g = env_option("--metrics-port", env=f"GRIDRL_{s}_METRICS_PORT", default=metrics_port,
                       type=int, help="Prometheus /metrics port (0: any free port, -1: off); "
                                      "HTTPS when the server serves TLS.")(g)
        g = env_option("--listen", env=f"GRIDRL_{s}_LISTEN", default=listen,
                       help="host:port to serve gRPC on (port 0: any free port). Beyond "
                            "loopback it needs TLS and --authorized-tokens, or --insecure.")(g)
        return g

    return decorate


def bad_parameter(error: Any) -> click.BadParameter:
    """The click error of a :class:`gridrl.common.errors.StatusError` raised for a flag: its
    problem, with the flag (``error.field``) as the parameter hint."""
    return click.BadParameter(error.problem, param_hint=error.field)


def check_ports_free(host: str, port: int, metrics_port: int, security: Any = None) -> None:
    """Refuse, before a server loads anything, a ``--listen`` or ``--metrics-port`` whose port
    is taken on ``host`` (:func:`gridrl.common.address.port_in_use`), naming the flag, the port,
    the gridrl service already there when reflection says (:mod:`gridrl.common.rpc.probe`), and
    what to do. The server's own bind still reports a port taken in between.

    Raises:
        click.BadParameter: e.g. ``Invalid value for '--metrics-port': port 9402 is already in
            use on 127.0.0.1; give another port (0: any free port, -1: no metrics)``.
    """
    if port_in_use(host, port):
        from gridrl.common.rpc.probe import describe, list_services

        dial_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        names = list_services(join_address(dial_host, port), security, timeout_s=2.0)
        by = f" by {describe(names)}" if names else ""
        raise click.BadParameter(f"{join_address(host, port)} is already in use{by}; stop it "
                                 "or give another port (0: any free port)",
                                 param_hint="--listen")
    if port_in_use(host, metrics_port):
        raise click.BadParameter(f"port {metrics_port} is already in use on {host}; give "
                                 "another port (0: any free port, -1: no metrics)",
                                 param_hint="--metrics-port")


def client_security_options(f: Any) -> Any:
    """The flags of every client command: ``--auth-token-file`` (or ``GRIDRL_AUTH_TOKEN`` in the
    environment), ``--tls-ca`` (speak TLS, verify the server), ``--tls-cert``/``--tls-key``
    (mutual TLS). The command receives them as one ``security: Security``."""

    @functools.wraps(f)
    def with_security(*args: Any, **kwargs: Any) -> Any:
        return f(*args, security=_build_security(kwargs, server=False, client=True), **kwargs)

    g = _client_token_options(with_security)
    return _tls_options(g, "Client certificate (PEM) presented to a mutual-TLS server "
                           "(with --tls-key).",
                        "CA certificate (PEM) that signed the server's certificate: speak TLS "
                        "and verify the server.")


def _tls_options(f: Any, cert_help: str, ca_help: str) -> Any:
    f = env_option("--tls-ca", env="GRIDRL_TLS_CA", default=None, show_default=False,
                   type=click.Path(dir_okay=False), help=ca_help)(f)
    f = env_option("--tls-key", env="GRIDRL_TLS_KEY", default=None, show_default=False,
                   type=click.Path(dir_okay=False),
                   help="Private key (PEM, unencrypted, mode 0600) of --tls-cert.")(f)
    return env_option("--tls-cert", env="GRIDRL_TLS_CERT", default=None, show_default=False,
                      type=click.Path(dir_okay=False), help=cert_help)(f)


def _client_token_options(f: Any) -> Any:
    f = _rejected_token_option(f)
    return env_option("--auth-token-file", env="GRIDRL_AUTH_TOKEN_FILE", default=None,
                      show_default=False, type=click.Path(dir_okay=False),
                      help="File holding the token to send (`gridrl-auth mint` writes one). "
                           "A container may set GRIDRL_AUTH_TOKEN to the token instead.")(f)


TOKEN_ON_COMMAND_LINE = (
    "a token given as a value shows in `ps` and in shell history; write it to a file "
    "(chmod 600) and pass --auth-token-file FILE, or set GRIDRL_AUTH_TOKEN in the environment "
    "(containers)")


def _refuse_token_value(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Refuse ``--auth-token VALUE`` as soon as it is parsed (before other errors)."""
    if value is not None and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
        raise click.BadParameter(TOKEN_ON_COMMAND_LINE, ctx=ctx, param_hint="--auth-token")
    return value


# Kept only to say what replaced it; the value is read from GRIDRL_AUTH_TOKEN (containers).
_rejected_token_option = click.option("--auth-token", "auth_token", envvar="GRIDRL_AUTH_TOKEN",
                                      default=None, hidden=True, callback=_refuse_token_value)


def _build_security(kwargs: dict[str, Any], server: bool, client: bool) -> Any:
    """Pop the security flags from ``kwargs`` into a ``Security``; bad values -> click errors
    naming the flag."""
    from gridrl.common.security.policy import Security
    from gridrl.common.security.tls import TlsError, TlsFiles
    from gridrl.common.security.tokens import (
        AuthError,
        AuthorizedTokens,
        check_token,
        read_token_file,
    )

    value = kwargs.pop("auth_token", None)
    token_file = kwargs.pop("auth_token_file", None)
    authorized_path = kwargs.pop("authorized_tokens", None) if server else None
    insecure = kwargs.pop("insecure", False) if server else False
    tls = TlsFiles(kwargs.pop("tls_cert", None), kwargs.pop("tls_key", None),
                   kwargs.pop("tls_ca", None))
    token = None
    try:
        if client:
            if value is not None and token_file:
                raise click.BadParameter("both --auth-token-file and GRIDRL_AUTH_TOKEN are "
                                         "set; use one", param_hint="--auth-token-file")
            if token_file:
                token = read_token_file(token_file)
            elif value is not None:
                token = check_token(value.strip(), "GRIDRL_AUTH_TOKEN")
        elif value is not None and not authorized_path:
            raise click.UsageError(
                "GRIDRL_AUTH_TOKEN is set, but a server checks the credentials listed in "
                "--authorized-tokens (GRIDRL_AUTHORIZED_TOKENS); the token variable is what "
                "clients send. Mint credentials with `gridrl-auth mint` and pass "
                "--authorized-tokens FILE, or unset GRIDRL_AUTH_TOKEN.")
        authorized = AuthorizedTokens(authorized_path) if authorized_path else None
    except AuthError as e:
        raise click.BadParameter(e.problem, param_hint=e.field) from None
    try:
        tls.check("server" if server else "client")
    except TlsError as e:
        raise click.BadParameter(e.problem, param_hint=e.flag) from None
    return Security(tls=tls, authorized=authorized, token=token, insecure=insecure)


def setup_logging(level: str) -> None:
    """Plain timestamped logs on stderr (journald and launchd capture them). Off a terminal
    (a log file, a pipe, journald) the progress bars of tqdm and the Hugging Face libraries
    are turned off: their carriage returns and cursor escapes would garble the log (call it
    before they are imported; an explicit setting of the variables wins)."""
    progress_bars_off_terminal()
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def progress_bars_off_terminal() -> None:
    """Turn off tqdm's and the Hugging Face libraries' progress bars when stderr (where they
    draw) is not a terminal: in a log file, journald or a pipe their carriage returns and
    cursor escapes garble the lines. Sets ``TQDM_DISABLE`` and ``HF_HUB_DISABLE_PROGRESS_BARS``
    unless already set (an explicit setting wins); call it before transformers is imported."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


def print_json(message_or_obj: Any) -> None:
    """Print a protobuf message (as proto3 JSON) or a plain object as indented JSON."""
    if hasattr(message_or_obj, "DESCRIPTOR"):
        message_or_obj = MessageToDict(message_or_obj, preserving_proto_field_name=True)
    click.echo(json.dumps(message_or_obj, indent=2, sort_keys=True))


def exit_on_rpc_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for client commands: a failed call prints ``error: CODE: details`` (with a
    hint when the connection failed the way a TLS mismatch does, or, for UNIMPLEMENTED, which
    gridrl service answers at the command's ``address``), exits 1."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as e:
            code = e.code().name if hasattr(e, "code") else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            from gridrl.common.rpc.channel import connection_hint

            hint = connection_hint(code, details, kwargs.get("security"))
            address = kwargs.get("address")
            if code == "UNIMPLEMENTED" and address:  # another service there: say which
                from gridrl.common.rpc.probe import describe, list_services

                names = list_services(address, kwargs.get("security"))
                if names:
                    hint = f" ({address} is {describe(names)}: check the address)"
            click.echo(f"error: {code}: {details}{hint}", err=True)
            sys.exit(1)

    return wrapped


def write_ready_file(path: str | None, address: str, port: int, metrics_port: int,
                     **extra: Any) -> None:
    """Atomically write the ready file of ``server_options`` (no-op when ``path`` is None);
    ``extra`` adds service-specific keys (e.g. the rollout node's ``openai_base_url``)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"address": address, "port": port, "metrics_port": metrics_port,
                   "pid": os.getpid(), **extra}, f)
    os.replace(tmp, path)
