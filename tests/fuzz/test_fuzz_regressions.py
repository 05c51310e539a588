"""Regression tests for what the fuzz suite found, each a fixed case on the live cluster."""

from __future__ import annotations

import fuzzkit
import grpc
import pytest
from fuzzkit import Cluster

from gridrl.v1 import common_pb2, registry_pb2, rollout_pb2


@pytest.mark.parametrize("rpc", ["DeregisterNode", "WatchNodes", "Generate", "GetRunStatus",
                                 "WatchRun"])
def test_undecodable_request_bytes_are_invalid_argument(cluster: Cluster, rpc: str) -> None:
    """Bytes that are not the request message (a lone field tag 0) got grpc's INTERNAL
    "Exception deserializing request!"; the server interceptor now answers INVALID_ARGUMENT
    naming the request and its type, and the handler never runs."""
    answer = fuzzkit.call_raw(cluster, rpc, b"\x00")
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert answer.details.startswith(
        f"request: the bytes are not a {fuzzkit.RPCS[rpc].DESCRIPTOR.full_name} message ("), \
        answer.details


def test_undecodable_message_in_the_push_stream(cluster: Cluster) -> None:
    """A PushAdapter stream whose second message does not parse: INVALID_ARGUMENT naming that
    message's index, and nothing changes on the node."""
    valid = [r.SerializeToString() for r in cluster.push_requests(77, 1 << 16, trailer=True)]
    before = cluster.serving(), cluster.store_tree()
    ident = lambda b: b  # noqa: E731
    push = cluster.channels[1].stream_unary("/gridrl.v1.RolloutService/PushAdapter", ident,
                                            ident)
    with pytest.raises(grpc.RpcError) as e:
        push(iter([valid[0], b"\xff\xff", *valid[1:]]), timeout=fuzzkit.DEADLINE_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(
        f"request[1]: the bytes are not a {rollout_pb2.PushAdapterRequest.DESCRIPTOR.full_name}"
        " message ("), e.value.details()
    assert (cluster.serving(), cluster.store_tree()) == before


@pytest.mark.parametrize("address", ["a/../b:9092", "a b:7001", "é:7001", "[node-a]:7001",
                                     "[10.0.0.1]:7001", "-node:7001", "node..a:7001", "*:7001"])
def test_register_refuses_a_host_no_one_can_dial(cluster: Cluster, address: str) -> None:
    """The master registered ``a/../b:9092`` (any text before the port was a host) and handed
    it to trainers, which cannot dial it; now INVALID_ARGUMENT naming ``node.address``."""
    answer = fuzzkit.call_registry(cluster, "RegisterNode", _register(address))
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert answer.details.startswith("node.address: "), answer.details


@pytest.mark.parametrize("address", ["node-a:7001", "[::1]:7002", "10.0.0.7:7003",
                                     "host_x.local:7004", "mac.local.:7005"])
def test_register_takes_ip_addresses_and_host_names(cluster: Cluster, address: str) -> None:
    assert fuzzkit.call_registry(cluster, "RegisterNode", _register(address)).code == \
        grpc.StatusCode.OK


def _register(address: str) -> registry_pb2.RegisterNodeRequest:
    return registry_pb2.RegisterNodeRequest(node=common_pb2.NodeInfo(
        address=address, role=common_pb2.NODE_ROLE_ROLLOUT, backend=common_pb2.BACKEND_TORCH))
