"""Regression tests for what the fuzz suite found, each a fixed case on the live cluster."""

from __future__ import annotations

import fuzzkit
import grpc
import pytest
from fuzzkit import Cluster

from gridrl.v1 import rollout_pb2


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
