"""The rollout node's own channels (to the master, to the nodes it reads relayed adapters
from) carry the keepalive of ``--keepalive-s`` / ``--keepalive-timeout-s``
(docs/reliability.md): flags and GRIDRL_ROLLOUT_* variables parsed and checked, and the
options handed to gRPC when each channel is made."""

from __future__ import annotations

import grpc
import pytest
from click.testing import CliRunner
from waiting import wait_for

from gridrl.common.rpc.channel import Keepalive
from gridrl.common.settings import from_params
from gridrl.rollout.cli import main
from gridrl.rollout.config import NodeConfig
from gridrl.v1 import rollout_pb2


def _config(args: list[str], env: dict[str, str] | None = None,
            monkeypatch: pytest.MonkeyPatch | None = None) -> NodeConfig:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ctx = main.commands["serve"].make_context("serve", args)
    params = {k: v for k, v in ctx.params.items()
              if k not in ("security", "log_level", "ready_file")}
    return from_params(NodeConfig, params, security=None)


def test_keepalive_flags_and_env_are_parsed_into_the_channels_keepalive(monkeypatch) -> None:
    assert _config([]).keepalive() == Keepalive(10.0, 5.0)
    assert _config(["--keepalive-s", "3", "--keepalive-timeout-s", "1.5"]).keepalive() == \
        Keepalive(3.0, 1.5)
    config = _config(["--keepalive-s", "4"], {"GRIDRL_ROLLOUT_KEEPALIVE_TIMEOUT_S": "2.5"},
                     monkeypatch)
    assert config.keepalive() == Keepalive(4.0, 2.5)
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for name in ("--keepalive-s", "--keepalive-timeout-s", "GRIDRL_ROLLOUT_KEEPALIVE_S",
                 "GRIDRL_ROLLOUT_KEEPALIVE_TIMEOUT_S"):
        assert name in help_text, name


@pytest.mark.parametrize(("args", "flag"), [(["--keepalive-s", "0.5"], "--keepalive-s"),
                                            (["--keepalive-timeout-s", "0"],
                                             "--keepalive-timeout-s")])
def test_bad_keepalive_values_are_refused_naming_the_flag(args, flag) -> None:
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 2 and flag in result.output, result.output


def test_the_master_and_relay_channels_get_the_keepalive_options(live_node, reserved_port,
                                                                 monkeypatch) -> None:
    """Every channel the node dials gets ``grpc.keepalive_time_ms`` and
    ``grpc.keepalive_timeout_ms`` of its settings: the registrar's channel to the master
    (an unreachable one here: the registrar dials at once and retries) and the channel of a
    relayed read (to the node itself here; the read is refused, the channel was made)."""
    made: dict[str, dict[str, int]] = {}
    real = grpc.insecure_channel

    def spy(target, options=None, *a, **kw):
        made[target] = dict(options or [])
        return real(target, options, *a, **kw)

    monkeypatch.setattr(grpc, "insecure_channel", spy)
    master = f"127.0.0.1:{int(reserved_port)}"
    node = live_node(master=master, keepalive_s=3.0, keepalive_timeout_s=1.5)
    assert node.node.registrar.keepalive == Keepalive(3.0, 1.5)
    wait_for(lambda: master in made, 30, "the registrar to dial the master")
    with pytest.raises(grpc.RpcError):
        next(iter(node.node.read_from_peer(node.node.address, rollout_pb2.ReadAdapterRequest(),
                                           timeout_s=10)))
    for target in (master, node.node.address):
        options = made[target]
        assert options["grpc.keepalive_time_ms"] == 3000, (target, options)
        assert options["grpc.keepalive_timeout_ms"] == 1500, (target, options)
        assert options["grpc.keepalive_permit_without_calls"] == 1, (target, options)
