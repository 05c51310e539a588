"""A push during a long generation (issue 13): it takes effect between two decode steps, the
interrupted sequences decode again on the new adapter and report its version; a push that
cannot be applied before its deadline fails and is never applied later; GetNodeInfo and the
heartbeats to the master answer while a push waits and a batch decodes.

The long generations come from :class:`rollout_helpers.SlowBackend`: the tiny llama with a
pause at every decode step, held from a given step on until the engine interrupts it (or
stalled in a step that ignores interruptions), so no test depends on how fast it decodes.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from prometheus_client import REGISTRY
from rollout_helpers import SlowBackend, push_dir, rpc_error, tree
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.master.config import Liveness
from gridrl.master.server import Master
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

LONG = {"max_tokens": 400, "temperature": 1.0, "n": 2, "seed": 7}


def _expired() -> float:
    return REGISTRY.get_sample_value("gridrl_rollout_adapter_apply_expired_total") or 0.0


def test_push_takes_effect_during_a_long_generation(live_node, tiny_backend,
                                                    tiny_adapters) -> None:
    slow = SlowBackend(tiny_backend, step_s=0.002, hold_from=3)
    node = live_node(slow, batch_window_s=0.0)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    long = pool.submit(node.generate, timeout=120, **LONG)
    assert slow.stepped.wait(60)  # decoding, and it will not end unless interrupted
    reply = push_dir(node.stub, tiny_adapters["a"], "a", 1, timeout=60)
    assert (reply.serving.name, reply.serving.version) == ("a", 1)
    assert node.info().adapter.version == 1  # the reply names what serves
    samples = long.result(120).samples
    assert [s.adapter_version for s in samples] == [1, 1]
    assert slow.outcomes == ["interrupted", "done"]
    stopped, redone = node.engine.recent_batches()[-2:]
    assert stopped.interrupted and stopped.adapter_version == 0
    assert redone.adapter_version == 1 and redone.requests == stopped.requests
    # decoded again from the first token: exactly what the same request gives on v1 now
    again = node.generate(timeout=120, **LONG).samples
    assert [list(s.token_ids) for s in again] == [list(s.token_ids) for s in samples]
    assert [list(s.logprobs) for s in again] == [list(s.logprobs) for s in samples]


def test_split_request_restarts_whole_on_the_new_adapter(live_node, tiny_backend,
                                                         tiny_adapters) -> None:
    """A request split over batches (n > capacity) that a push interrupts restarts whole, so
    every sample comes from the new adapter."""
    slow = SlowBackend(tiny_backend, step_s=0.0, hold_from=3)
    node = live_node(slow, batch_window_s=0.0, capacity=2)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    job = {**LONG, "n": 3, "max_tokens": 12}
    split = pool.submit(node.generate, timeout=120, **job)
    assert slow.stepped.wait(60)
    push_dir(node.stub, tiny_adapters["a"], "a", 1, timeout=60)
    samples = split.result(120).samples
    assert [s.adapter_version for s in samples] == [1, 1, 1]
    again = node.generate(timeout=120, **job).samples
    assert [list(s.token_ids) for s in again] == [list(s.token_ids) for s in samples]


def test_push_that_cannot_be_applied_in_time_fails_and_never_applies(
        live_node, tiny_backend, tiny_adapters) -> None:
    slow = SlowBackend(tiny_backend, step_s=0.0, hold_from=None)
    node = live_node(slow, batch_window_s=0.0)
    slow.stall.clear()  # the next decode step takes as long as the test wants
    pool = concurrent.futures.ThreadPoolExecutor(2)
    long = pool.submit(node.generate, timeout=120, **{**LONG, "max_tokens": 20})
    assert slow.stalled.wait(60)
    expired = _expired()
    e = rpc_error(lambda: push_dir(node.stub, tiny_adapters["a"], "a", 1, timeout=2))
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: _expired() == expired + 1)  # the node gave up on it too
    assert node.info().adapter.version == 0
    slow.stall.set()
    samples = long.result(120).samples
    assert [s.adapter_version for s in samples] == [0, 0]
    assert node.generate(max_tokens=4).samples[0].adapter_version == 0  # after any command
    info = node.info()
    assert info.adapter.version == 0 and not info.stored_adapters
    assert tree(node.node.adapters.store.pushed_root) == []
    assert not node.engine.preempt_pending()
    # the same push, with time enough, is applied
    assert push_dir(node.stub, tiny_adapters["a"], "a", 1, timeout=60).serving.version == 1


@pytest.fixture
def master():
    m = Master("127.0.0.1:0", liveness=Liveness(0.2, 0.6, 1.2), grace_s=0.5).start()
    yield m
    m.stop(0)


def _record(address: str) -> registry_pb2.NodeRecord:
    channel = dial(address)
    try:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        nodes = stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=5).nodes
        assert len(nodes) == 1
        return nodes[0]
    finally:
        channel.close()


def test_node_info_and_heartbeats_answer_while_a_push_waits_on_a_batch(
        live_node, tiny_backend, tiny_adapters, master) -> None:
    """The measured failure of issue 13: a push waiting for a batch held the lock GetNodeInfo
    and the heartbeats read, and the master marked the node unhealthy. Here a decode step
    ignores interruptions (stalled) while a push waits for it."""
    slow = SlowBackend(tiny_backend, step_s=0.0, hold_from=None)
    node = live_node(slow, batch_window_s=0.0, master=master.address)
    wait_for(lambda: node.node.registrar.registered)
    slow.stall.clear()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    long = pool.submit(node.generate, timeout=120, **{**LONG, "max_tokens": 20})
    assert slow.stalled.wait(60)
    push = pool.submit(push_dir, node.stub, tiny_adapters["a"], "a", 1, timeout=120)
    wait_for(node.engine.preempt_pending)  # the push waits for the stalled step
    info = node.info()  # GetNodeInfo, 10 s deadline
    assert info.adapter.version == 0 and info.queue_depth == 0
    seen = _record(master.address).last_seen.ToNanoseconds()
    for _ in range(3):  # three more heartbeats while the push waits on the batch
        wait_for(lambda s=seen: _record(master.address).last_seen.ToNanoseconds() > s)
        record = _record(master.address)
        seen = record.last_seen.ToNanoseconds()
        assert record.info.adapter.version == 0
        assert record.status == common_pb2.NODE_STATUS_HEALTHY
    assert not push.done() and not long.done()
    slow.stall.set()
    assert push.result(60).serving.version == 1
    assert [s.adapter_version for s in long.result(120).samples] == [1, 1]
    wait_for(lambda: _record(master.address).info.adapter.version == 1)
