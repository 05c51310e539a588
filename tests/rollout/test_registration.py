"""``--master``: a node registers with a real master, heartbeats its adapter version, keeps
serving while the master is down, registers again when it returns, deregisters on stop."""

from __future__ import annotations

import pytest
from rollout_helpers import push_dir
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.master.config import Liveness
from gridrl.master.server import Master
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S = 0.2, 0.6, 1.2


def _master(port: int) -> Master:
    return Master(f"127.0.0.1:{port}", liveness=Liveness(HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S), grace_s=0.5).start()


def _nodes(address: str) -> list[registry_pb2.NodeRecord]:
    channel = dial(address)
    try:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return list(stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5).nodes)
    finally:
        channel.close()


@pytest.fixture
def start_master(reserved_port):
    """``start_master()`` starts a master, always on the same port (a restart)."""
    masters: list[Master] = []

    def start() -> Master:
        masters.append(_master(reserved_port.release()))
        return masters[-1]

    yield start
    for m in masters:
        m.stop(0)


def test_registers_heartbeats_and_survives_the_master(live_node, start_master,
                                                      tiny_adapters) -> None:
    master = start_master()
    node = live_node(master=master.address, capacity=6)
    wait_for(lambda: len(_nodes(master.address)) == 1)
    record = _nodes(master.address)[0]
    info = record.info
    assert info.address == node.node.address and info.role == common_pb2.NODE_ROLE_ROLLOUT
    assert info.backend == common_pb2.BACKEND_TORCH
    assert info.adapter_format == common_pb2.ADAPTER_FORMAT_PEFT
    assert info.base_model.architecture == "llama" and info.capacity == 6
    assert record.status == common_pb2.NODE_STATUS_HEALTHY

    push_dir(node.stub, tiny_adapters["a"], "run", 4)
    wait_for(lambda: _nodes(master.address)[0].info.adapter.version == 4)

    master.stop(0)  # the node keeps serving without its master
    assert len(node.generate(max_tokens=2).samples) == 1
    master = start_master()  # same port, empty registry
    wait_for(lambda: len(_nodes(master.address)) == 1)
    back = _nodes(master.address)[0]
    assert back.info.address == node.node.address and back.info.adapter.version == 4
    wait_for(lambda: node.node.registrar.registered)  # the reply may land after the record

    node.close()  # deregisters on the way out
    wait_for(lambda: not _nodes(master.address))
