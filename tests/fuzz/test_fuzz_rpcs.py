"""Hypothesis over every RPC's request message of the master, the rollout node and the
trainer, typed and as raw bytes: the answer is OK or a deliberate status naming the field,
within a deadline, and the services go on serving (properties: ``fuzzkit`` docstring)."""

from __future__ import annotations

import fuzzkit
import grpc
import pytest
from fuzzkit import RPCS, Cluster, answer_of, check_answer
from hypothesis import given, settings
from hypothesis import strategies as st

from gridrl.v1 import rollout_pb2


@settings(max_examples=80)
@given(data=st.data())
def test_generate(cluster: Cluster, data: st.DataObject) -> None:
    request = data.draw(fuzzkit.generate_requests(cluster.vocab_size))
    answer, response = answer_of(lambda: cluster.rollout.Generate(
        request, timeout=fuzzkit.DEADLINE_S))
    check_answer(answer, rollout_pb2.GenerateRequest)
    cluster.generate_ok(answer, request, response)


@settings(max_examples=40)
@given(request=fuzzkit.reload_requests())
def test_reload_adapter(cluster: Cluster, request: rollout_pb2.ReloadAdapterRequest) -> None:
    answer, response = answer_of(lambda: cluster.rollout.ReloadAdapter(
        request, timeout=fuzzkit.DEADLINE_S))
    check_answer(answer, rollout_pb2.ReloadAdapterRequest)
    if response is not None:  # the reply names what serves
        assert cluster.serving() == (response.serving.name, response.serving.version)


@pytest.mark.parametrize("rpc", ["RegisterNode", "Heartbeat", "ListNodes", "WatchNodes",
                                 "DeregisterNode"])
def test_registry(cluster: Cluster, rpc: str) -> None:
    strategy = fuzzkit.registry_requests(lambda: cluster.node_ids)[rpc]

    @settings(max_examples=30)
    @given(request=strategy)
    def case(request) -> None:
        check_answer(fuzzkit.call_registry(cluster, rpc, request), RPCS[rpc])

    case()


@pytest.mark.parametrize("rpc", ["GetRunStatus", "WatchRun"])
def test_trainer(cluster: Cluster, rpc: str) -> None:
    @settings(max_examples=5)
    @given(request=fuzzkit.TRAINER_REQUESTS[rpc])
    def case(request) -> None:
        answer = fuzzkit.call_trainer(cluster, rpc, request)
        assert answer.code == grpc.StatusCode.OK, answer

    case()


@settings(max_examples=60)
@given(rpc=st.sampled_from(sorted({*RPCS, "PushAdapter"})), payload=fuzzkit.raw_bytes())
def test_raw_request_bytes(cluster: Cluster, rpc: str, payload: bytes) -> None:
    """Bytes no stub would send: the request's deserialization fails or reads odd values."""
    answer = fuzzkit.call_raw(cluster, rpc, payload)
    request_type = RPCS.get(rpc, rollout_pb2.PushAdapterRequest)
    check_answer(answer, request_type, fuzzkit.RAW_ROOTS | (fuzzkit.PUSH_ROOTS if rpc == "PushAdapter"
                                      else frozenset()))


def test_node_still_serves_after_the_fuzz(cluster: Cluster) -> None:
    """After the module's cases: nothing queued, a plain Generate answers."""
    fuzzkit.wait_idle(cluster)
    response = cluster.rollout.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=[5, 7, 9], sampling={"max_tokens": 2}), timeout=fuzzkit.DEADLINE_S)
    assert len(response.samples) == 1
