"""``gridrl-rollout``: serve a rollout node, or talk to one.

    gridrl-rollout serve --backend torch --model smollm2-135m-instruct [--master m:50050]
        [--listen 0.0.0.0:50051 --tls-cert C --tls-key K --tls-ca CA
         --authorized-tokens FILE --auth-token-file NODE_TOKEN] [--openai-listen 127.0.0.1:8000]
    gridrl-rollout serve --backend vllm --vllm-url http://127.0.0.1:8000 --model DIR
    gridrl-rollout generate --address 127.0.0.1:50051 --prompt "Hi" --n 4 --max-tokens 32
    gridrl-rollout push-adapter --address 127.0.0.1:50051 runs/a/adapter --version 3
    gridrl-rollout reload-adapter --address 127.0.0.1:50051 (--version 3 | --path P | --base)
    gridrl-rollout info --address 127.0.0.1:50051 [--json]
    gridrl-rollout cache [--prune]

Imports stay light (click, grpc, protobuf): torch and mlx are imported only inside ``serve``,
so ``--help`` is instant. Every client command takes ``--tls-ca``/``--tls-cert``/``--tls-key``
and ``--auth-token-file`` (:func:`gridrl.common.cli.client_security_options`).
"""

from __future__ import annotations

import logging
import os
import sys

import click

from gridrl.common.address import parse_listen
from gridrl.common.cli import bad_parameter, server_options, setup_logging, write_ready_file
from gridrl.common.errors import StatusError
from gridrl.common.security.policy import ExposedError, Security, check_exposure
from gridrl.common.settings import click_options, from_params
from gridrl.rollout.client_cli import COMMANDS
from gridrl.rollout.config import ENV_PREFIX, NodeConfig, default_of

#: Exit status of a node that gave up because the master refuses its credential (sysexits'
#: EX_CONFIG): its unit's ``RestartPreventExitStatus`` keeps it failed instead of restarting.
EX_CONFIG = 78


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gridrl rollout node: samples completions with behaviour logprobs, takes adapters."""


for _command in COMMANDS:
    main.add_command(_command)


@main.command()
@server_options("rollout", listen=default_of("listen"), metrics_port=9401, client=True)
@click_options(NodeConfig, ENV_PREFIX)
def serve(security: Security, log_level: str, ready_file: str | None, **params) -> None:
    """Serve RolloutService until SIGTERM/SIGINT."""
    setup_logging(log_level)
    try:
        config: NodeConfig = from_params(NodeConfig, params, security=security)
    except StatusError as e:
        raise bad_parameter(e) from None
    from gridrl.models import ModelNameError, check_model

    try:  # a typo fails here, in milliseconds, not after hub retries
        check_model(config.model)
    except ModelNameError as e:
        raise bad_parameter(e) from None
    if config.master is not None:
        from gridrl.common.rpc.probe import REGISTRY, check_service

        try:  # another service there: say which, before the model loads
            check_service(config.master, REGISTRY, "--master", security)
        except StatusError as e:
            raise bad_parameter(e) from None
    if config.openai_listen:
        _check_openai(config, security)
    from gridrl.common.rpc.server import freeze_long_lived
    from gridrl.rollout.launch import load_node

    try:
        node = load_node(config)
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="--model") from e
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device/--dtype/--model") from e
    except RuntimeError as e:
        if config.backend == "vllm":
            from gridrl.engine.backends.vllm.wire import VllmError

            if isinstance(e, VllmError):  # unreachable or refused, naming the flag to add
                raise click.ClickException(str(e)) from e
        raise
    freeze_long_lived()  # the model lives as long as the node
    try:
        node.start()
    except OSError as e:  # the port is taken (servers never share one)
        node.stop(grace_s=0)
        raise click.UsageError(str(e)) from None
    openai = {"openai_base_url": node.openai.base_url} if node.openai else {}
    write_ready_file(ready_file, node.address, node.port, node.metrics_port, **openai)
    node.wait()
    code = 0
    if node.failure is not None:  # the master refused its credential --max-refusals times
        click.echo(f"error: {node.failure}", err=True)
        code = EX_CONFIG  # a restart cannot heal it: the systemd unit does not restart on it
    if node.engine.scheduler_alive:
        # The stop interrupted the batch in progress, but the scheduler thread is still inside
        # torch / MLX (a step slower than the engine's close timeout). Finalizing the
        # interpreter now would end that thread inside C++ code as it takes the GIL back:
        # std::terminate, exit 134. Everything else is stopped and flushed by now, so leave
        # without interpreter cleanup.
        logging.getLogger(__name__).warning(
            "the engine's scheduler is still in the backend; exiting without cleanup")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _check_openai(config: NodeConfig, security: Security) -> None:
    """--openai-listen needs the openai extra, and follows the gRPC side's rule: loopback, or
    TLS and credentials."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise click.BadParameter(f"needs the openai extra ({e}): pip install "
                                 "'gridrl-rollout[openai]'", param_hint="--openai-listen") from e
    try:
        check_exposure(parse_listen(config.openai_listen, "--openai-listen")[0], security,
                       "--openai-listen")
    except ExposedError as e:
        raise click.UsageError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
