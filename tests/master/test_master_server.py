"""RegistryService over real gRPC: register, heartbeat, expire, restart, watch, scale, metrics."""

from __future__ import annotations

import itertools
import math
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from master_helpers import EXPIRE_S, HEARTBEAT_S, UNHEALTHY_S, node_info
from prometheus_client import REGISTRY
from waiting import wait_for

from gridrl.master.config import Liveness
from gridrl.master.registry import node_id_for
from gridrl.v1 import common_pb2, registry_pb2

ROLLOUT, TRAINER = common_pb2.NODE_ROLE_ROLLOUT, common_pb2.NODE_ROLE_TRAINER
TORCH, MLX = common_pb2.BACKEND_TORCH, common_pb2.BACKEND_MLX
HEALTHY, UNHEALTHY, DRAINING = (common_pb2.NODE_STATUS_HEALTHY, common_pb2.NODE_STATUS_UNHEALTHY,
                                common_pb2.NODE_STATUS_DRAINING)
E = registry_pb2  # event types: E.NODE_EVENT_TYPE_*


def register(stub, info: common_pb2.NodeInfo) -> registry_pb2.RegisterNodeResponse:
    return stub.RegisterNode(registry_pb2.RegisterNodeRequest(node=info), timeout=10)


def heartbeat(stub, node_id: str, adapter=("", 0), status=0, load=0.0, queue_depth=0):
    return stub.Heartbeat(registry_pb2.HeartbeatRequest(
        node_id=node_id, adapter=common_pb2.AdapterRef(name=adapter[0], version=adapter[1]),
        status=status, load=load, queue_depth=queue_depth), timeout=10)


def list_nodes(stub, **filters) -> list[registry_pb2.NodeRecord]:
    return list(stub.ListNodes(registry_pb2.ListNodesRequest(**filters), timeout=10).nodes)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class Watcher:
    """Reads a WatchNodes stream in a thread; ``wait_for(pred)`` blocks until an event matches."""

    def __init__(self, stub, **filters) -> None:
        self.call = stub.WatchNodes(registry_pb2.WatchNodesRequest(**filters))
        self.events: list[registry_pb2.WatchNodesResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self.call:
                with self._cond:
                    self.events.append(event)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 10) -> registry_pb2.WatchNodesResponse:
        with self._cond:
            start = 0
            deadline = time.monotonic() + timeout
            while True:
                for event in self.events[start:]:
                    if pred(event):
                        return event
                start = len(self.events)
                if self.ended.is_set() or not self._cond.wait(deadline - time.monotonic()):
                    raise AssertionError(f"no matching event in {timeout}s; got {self.events}")

    def cancel(self) -> None:
        self.call.cancel()
        self.ended.wait(5)


def test_register_heartbeat_list_deregister(make_master, stub_for) -> None:
    master = make_master()
    stub = stub_for(master)
    response = register(stub, node_info("10.0.0.1:6000", model="m1"))
    assert response.node_id == node_id_for("10.0.0.1:6000")
    assert response.heartbeat_interval.ToNanoseconds() == int(HEARTBEAT_S * 1e9)
    trainer = register(stub, node_info("10.0.0.9:6100", role=TRAINER, backend=0, model="m1"))
    register(stub, node_info("10.0.0.2:6000", backend=MLX, model="m2"))
    beat = heartbeat(stub, response.node_id, adapter=("run", 4), load=0.5, queue_depth=3)
    assert beat.heartbeat_interval.ToNanoseconds() == int(HEARTBEAT_S * 1e9)
    heartbeat(stub, trainer.node_id, status=DRAINING)

    nodes = list_nodes(stub)
    assert [n.info.address for n in nodes] == ["10.0.0.1:6000", "10.0.0.2:6000", "10.0.0.9:6100"]
    first = nodes[0]
    assert (first.info.adapter.name, first.info.adapter.version) == ("run", 4)
    assert (first.load, first.info.queue_depth, first.status) == (0.5, 3, HEALTHY)
    assert first.info.device == "cpu" and first.info.capacity == 8  # the registered info is kept
    assert first.last_seen.ToNanoseconds() >= first.registered_at.ToNanoseconds() > 0
    assert [n.info.address for n in list_nodes(stub, role=ROLLOUT)] == ["10.0.0.1:6000",
                                                                        "10.0.0.2:6000"]
    assert [n.info.address for n in list_nodes(stub, backend=MLX)] == ["10.0.0.2:6000"]
    assert [n.info.address for n in list_nodes(stub, model_id="m1", role=ROLLOUT)] == [
        "10.0.0.1:6000"]
    assert [n.node_id for n in list_nodes(stub, status=DRAINING)] == [trainer.node_id]

    # Re-registering under the same address replaces the record: same id, no duplicate.
    again = register(stub, node_info("10.0.0.1:6000", backend=MLX, model="m1"))
    assert again.node_id == response.node_id
    assert len(list_nodes(stub)) == 3
    replaced = list_nodes(stub, backend=MLX)
    assert [n.info.address for n in replaced] == ["10.0.0.1:6000", "10.0.0.2:6000"]
    assert replaced[0].registered_at == first.registered_at

    stub.DeregisterNode(registry_pb2.DeregisterNodeRequest(node_id=response.node_id), timeout=10)
    assert [n.info.address for n in list_nodes(stub)] == ["10.0.0.2:6000", "10.0.0.9:6100"]
    for call, request in [
        (stub.Heartbeat, registry_pb2.HeartbeatRequest(node_id=response.node_id)),
        (stub.DeregisterNode, registry_pb2.DeregisterNodeRequest(node_id=response.node_id)),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details() == (f"node_id: unknown node {response.node_id!r}; "
                                     "register again")


def _register_request(**node) -> registry_pb2.RegisterNodeRequest:
    base = {"address": "10.0.0.1:6000", "role": ROLLOUT, "backend": TORCH}
    return registry_pb2.RegisterNodeRequest(node=common_pb2.NodeInfo(**{**base, **node}))


INVALID = [
    ("RegisterNode", registry_pb2.RegisterNodeRequest(), "node: is required"),
    ("RegisterNode", _register_request(address=""), "node.address: is required (host:port)"),
    ("RegisterNode", _register_request(address="nohost"),
     "node.address: 'nohost' is not host:port: the port is missing (give nohost:PORT)"),
    ("RegisterNode", _register_request(address=":6000"),
     "node.address: ':6000' is not host:port"),
    ("RegisterNode", _register_request(address="host:port"),
     "node.address: 'host:port': port 'port' is not a number"),
    ("RegisterNode", _register_request(address="host:70000"),
     "node.address: 'host:70000': port 70000 is out of range"),
    ("RegisterNode", _register_request(address="host:0"),
     "node.address: 'host:0': port 0 is out of range"),
    ("RegisterNode", _register_request(address="fe80::1:6000"),
     "node.address: 'fe80::1:6000': write IPv6 hosts as [addr]:port"),
    ("RegisterNode", _register_request(address="0.0.0.0:6000"),
     "node.address: '0.0.0.0:6000' is a wildcard; advertise an address other processes "
     "can dial"),
    ("RegisterNode", _register_request(role=0),
     "node.role: is required (one of NODE_ROLE_ROLLOUT, NODE_ROLE_TRAINER)"),
    ("RegisterNode", _register_request(role=7), "node.role: unknown value 7"),
    ("RegisterNode", _register_request(backend=0),
     "node.backend: is required (one of BACKEND_TORCH, BACKEND_MLX, BACKEND_VLLM)"),
    ("RegisterNode", _register_request(backend=9), "node.backend: unknown value 9"),
    ("RegisterNode", _register_request(role=TRAINER, backend=9), "node.backend: unknown value 9"),
    ("RegisterNode", _register_request(adapter_format=5), "node.adapter_format: unknown value 5"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(),
     "node_id: is required (the id RegisterNode returned)"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(node_id="n-1", load=1.5),
     "load: must be in [0, 1], got 1.5"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(node_id="n-1", load=-0.25),
     "load: must be in [0, 1], got -0.25"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(node_id="n-1", load=math.nan),
     "load: must be in [0, 1], got nan"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(node_id="n-1", status=UNHEALTHY),
     "status: a node may report only HEALTHY or DRAINING"),
    ("Heartbeat", registry_pb2.HeartbeatRequest(node_id="n-1", status=8),
     "status: unknown value 8"),
    ("ListNodes", registry_pb2.ListNodesRequest(role=5), "role: unknown value 5"),
    ("ListNodes", registry_pb2.ListNodesRequest(backend=5), "backend: unknown value 5"),
    ("ListNodes", registry_pb2.ListNodesRequest(status=5), "status: unknown value 5"),
    ("WatchNodes", registry_pb2.WatchNodesRequest(role=5), "role: unknown value 5"),
    ("WatchNodes", registry_pb2.WatchNodesRequest(backend=5), "backend: unknown value 5"),
    ("DeregisterNode", registry_pb2.DeregisterNodeRequest(),
     "node_id: is required (the id RegisterNode returned)"),
]


def test_invalid_arguments_name_the_field(make_master, stub_for) -> None:
    master = make_master()
    stub = stub_for(master)
    for method, request, message in INVALID:
        with pytest.raises(grpc.RpcError) as e:
            response = getattr(stub, method)(request, timeout=10)
            if method == "WatchNodes":
                next(response)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, request)
        assert e.value.details() == message
    assert list_nodes(stub) == []  # nothing bad got in
    # A trainer needs no backend; IPv6 in brackets is fine.
    register(stub, node_info("trainer-host:6100", role=TRAINER, backend=0))
    register(stub, node_info("[fe80::1]:6000"))
    assert len(list_nodes(stub)) == 2


def test_requests_over_4_mib_are_refused_before_any_handler(make_master, stub_for) -> None:
    """The master's requests are small: one over 4 MiB is refused by gRPC while it is read
    (RESOURCE_EXHAUSTED), before the credential check or the handler, so no caller makes it
    buffer the channels' 64 MiB; a registration of ordinary size still goes through."""
    master = make_master()
    stub = stub_for(master)
    big = node_info("10.0.0.1:6000")
    big.device = "x" * (4 * 1024 * 1024 + 1)
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterNode(registry_pb2.RegisterNodeRequest(node=big), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list_nodes(stub) == []
    register(stub, node_info("10.0.0.1:6000"))
    assert len(list_nodes(stub)) == 1


def test_unhealthy_then_expired_with_watch_and_metrics(make_master, stub_for) -> None:
    master = make_master()
    stub = stub_for(master)
    expirations = sample("gridrl_master_expirations_total")
    watcher = Watcher(stub)
    watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_SNAPSHOT_END)
    t0 = time.monotonic()
    silent = register(stub, node_info("10.0.0.1:6000")).node_id
    alive = register(stub, node_info("10.0.0.2:6000")).node_id
    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(HEARTBEAT_S):
            heartbeat(stub, alive)

    beater = threading.Thread(target=keep_alive)
    beater.start()
    try:
        unhealthy = watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_CHANGED
                                     and e.node.status == UNHEALTHY)
        t_unhealthy = time.monotonic() - t0
        assert unhealthy.node.node_id == silent
        assert [n.node_id for n in list_nodes(stub, status=UNHEALTHY)] == [silent]
        removed = watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_REMOVED)
        t_removed = time.monotonic() - t0
        assert removed.node.node_id == silent
        assert removed.sequence > unhealthy.sequence
        # Within the configured times plus one sweep (0.15 s) and scheduling slack.
        assert UNHEALTHY_S <= t_unhealthy < UNHEALTHY_S + 1.0
        assert EXPIRE_S <= t_removed < EXPIRE_S + 1.0
        assert [n.node_id for n in list_nodes(stub)] == [alive]
        assert list_nodes(stub)[0].status == HEALTHY
    finally:
        stop.set()
        beater.join()
    with pytest.raises(grpc.RpcError) as e:
        heartbeat(stub, silent)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert sample("gridrl_master_expirations_total") == expirations + 1
    # The heartbeating node never produced an event: one per change, not per heartbeat.
    assert [e.node.node_id for e in watcher.events
            if e.type == E.NODE_EVENT_TYPE_CHANGED] == [silent]
    watcher.cancel()


def _replay(events, state: dict[str, registry_pb2.NodeRecord]) -> None:
    for event in events:
        if event.type in (E.NODE_EVENT_TYPE_SNAPSHOT, E.NODE_EVENT_TYPE_JOINED,
                          E.NODE_EVENT_TYPE_CHANGED):
            state[event.node.node_id] = event.node
        elif event.type == E.NODE_EVENT_TYPE_REMOVED:
            del state[event.node.node_id]


def test_watch_ordering_under_concurrent_changes(make_master, stub_for) -> None:
    master = make_master(liveness=Liveness(5, 30, 60))
    stub = stub_for(master)
    for i in range(10):
        register(stub, node_info(f"10.0.1.{i}:6000"))
    early = [Watcher(stub), Watcher(stub)]
    for w in early:
        w.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_SNAPSHOT_END)
    late: list[Watcher] = []

    def churn(worker: int) -> None:
        address = f"10.0.2.{worker}:6000"
        node_id = register(stub, node_info(address)).node_id
        for version in range(1, 16):
            heartbeat(stub, node_id, adapter=("run", version))
            if version == 8 and worker == 0:
                late.append(Watcher(stub))  # subscribes in the middle of the churn
        if worker % 2:
            stub.DeregisterNode(registry_pb2.DeregisterNodeRequest(node_id=node_id), timeout=10)
            register(stub, node_info(address, adapter=("run", 99)))
        else:
            heartbeat(stub, node_id, adapter=("run", 15), status=DRAINING)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(churn, range(8)))
    register(stub, node_info("marker:1"))
    expected = {n.node_id: n for n in list_nodes(stub)}
    assert len(expected) == 10 + 8 + 1

    per_stream = []
    for watcher in [*early, *late]:
        watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_JOINED
                         and e.node.info.address == "marker:1")
        watcher.cancel()
        events = list(watcher.events)
        sequences = [e.sequence for e in events]
        assert all(a < b for a, b in itertools.pairwise(sequences)), "sequences must increase"
        types = [e.type for e in events]
        end = types.index(E.NODE_EVENT_TYPE_SNAPSHOT_END)
        assert set(types[:end]) <= {E.NODE_EVENT_TYPE_SNAPSHOT}
        assert E.NODE_EVENT_TYPE_SNAPSHOT not in types[end:]
        state: dict[str, registry_pb2.NodeRecord] = {}
        _replay(events, state)
        assert {i: (r.info.adapter.version, r.status) for i, r in state.items()} == {
            i: (r.info.adapter.version, r.status) for i, r in expected.items()}
        # Per node, adapter versions only go forward within one registration.
        last: dict[str, int] = {}
        for event in events[end + 1:]:
            if event.type == E.NODE_EVENT_TYPE_CHANGED:
                assert event.node.info.adapter.version >= last.get(event.node.node_id, 0)
                last[event.node.node_id] = event.node.info.adapter.version
            else:
                last.pop(event.node.node_id, None)
        per_stream.append([(e.type, e.sequence, e.node.node_id) for e in events[end + 1:]])
    # Watchers that started before the churn saw exactly the same changes in the same order:
    # 8 joins, 8 x 15 adapter changes, 4 drains, 4 x (removal + join), the marker.
    assert per_stream[0] == per_stream[1]
    assert len(per_stream[0]) == 8 + 8 * 15 + 4 + 4 * 2 + 1
    # The late watcher's changes are a suffix of theirs.
    assert per_stream[0][-len(per_stream[2]):] == per_stream[2]


@pytest.mark.parametrize("with_store", [False, True], ids=["memory", "store"])
def test_hundreds_of_nodes_register_at_once(make_master, stub_for, tmp_path, with_store) -> None:
    store = str(tmp_path / "master.sqlite") if with_store else None
    master = make_master(store_path=store, liveness=Liveness(5, 30, 60))
    stub = stub_for(master)
    watcher = Watcher(stub)
    watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_SNAPSHOT_END)
    n = 300
    barrier = threading.Barrier(50)

    def register_batch(worker: int) -> list[str]:
        barrier.wait()
        return [register(stub, node_info(f"10.1.{worker}.{i}:6000")).node_id
                for i in range(n // 50)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=50) as pool:
        ids = [i for batch in pool.map(register_batch, range(50)) for i in batch]
    elapsed = time.perf_counter() - t0
    nodes = list_nodes(stub)
    assert len(nodes) == n and len({r.node_id for r in nodes}) == n
    assert sorted(ids) == sorted(r.node_id for r in nodes)
    assert len({r.info.address for r in nodes}) == n
    # All of them again, at once: replaced in place, still exactly n records.
    with ThreadPoolExecutor(max_workers=50) as pool:
        again = [i for batch in pool.map(register_batch, range(50)) for i in batch]
    assert sorted(again) == sorted(ids)
    assert len(list_nodes(stub)) == n
    watcher.wait_for(lambda e: sum(x.type == E.NODE_EVENT_TYPE_CHANGED for x in watcher.events)
                     == n)
    joined = [e for e in watcher.events if e.type == E.NODE_EVENT_TYPE_JOINED]
    assert len(joined) == n
    watcher.cancel()
    print(f"{n} concurrent registrations in {elapsed:.2f}s ({'with' if with_store else 'no'} store)")
    if with_store:  # every one of them is back after a restart
        master.stop(1)
        restarted = make_master(store_path=store, liveness=Liveness(5, 30, 60))
        assert sorted(r.node_id for r in list_nodes(stub_for(restarted))) == sorted(ids)


@pytest.mark.parametrize("with_store", [True, False])
def test_restart_with_and_without_store(make_master, stub_for, tmp_path, with_store) -> None:
    store = str(tmp_path / "master.sqlite") if with_store else None
    first = make_master(store_path=store, liveness=Liveness(5, 30, 60))
    stub = stub_for(first)
    ids = [register(stub, node_info(f"10.0.0.{i}:6000")).node_id for i in range(3)]
    heartbeat(stub, ids[0], adapter=("run", 7), load=0.75)  # heartbeat-only parts: flushed on stop
    before = {n.node_id: n for n in list_nodes(stub)}
    first.stop(1)

    second = make_master(store_path=store, liveness=Liveness(5, 30, 60))
    stub = stub_for(second)
    if with_store:
        after = {n.node_id: n for n in list_nodes(stub)}
        assert after == before  # ids, info, adapter, load, status and timestamps
        heartbeat(stub, ids[1])  # known at once
    else:
        assert list_nodes(stub) == []
        with pytest.raises(grpc.RpcError) as e:
            heartbeat(stub, ids[1])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert register(stub, node_info("10.0.0.1:6000")).node_id == ids[1]  # same id


def test_watch_cancel_and_server_stop(make_master, stub_for) -> None:
    master = make_master(grace_s=10)
    stub = stub_for(master)
    register(stub, node_info("10.0.0.1:6000"))
    watchers = [Watcher(stub) for _ in range(3)]
    for w in watchers:
        w.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_SNAPSHOT_END)
    assert master.registry.watcher_count == 3
    for w in watchers[:2]:
        w.cancel()
    wait_for(lambda: master.registry.watcher_count <= 1, timeout_s=5,
             what="the cancelled streams to unsubscribe")
    assert master.registry.watcher_count == 1  # cancelled streams left no subscriber behind
    t0 = time.monotonic()
    master.stop()  # 10 s grace, but the open stream ends at once
    assert time.monotonic() - t0 < 3
    assert watchers[2].ended.wait(5)
    assert watchers[2].error is None  # ended cleanly (OK), not cancelled


def test_watch_filters_and_limit(make_master, stub_for) -> None:
    master = make_master()
    stub = stub_for(master)
    register(stub, node_info("10.0.0.1:6000", backend=TORCH))
    watcher = Watcher(stub, role=ROLLOUT, backend=MLX)
    watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_SNAPSHOT_END)
    assert [e.type for e in watcher.events] == [E.NODE_EVENT_TYPE_SNAPSHOT_END]
    register(stub, node_info("10.0.0.2:6000", backend=MLX))
    joined = watcher.wait_for(lambda e: e.type == E.NODE_EVENT_TYPE_JOINED)
    assert joined.node.info.address == "10.0.0.2:6000"
    watcher.cancel()
    assert [e.node.info.address for e in watcher.events if e.node.node_id] == ["10.0.0.2:6000"]


def test_metrics_endpoint(make_master, stub_for) -> None:
    master = make_master(metrics_port=0, liveness=Liveness(5, 30, 60))
    stub = stub_for(master)
    registrations = sample("gridrl_master_registrations_total",
                           {"role": "rollout", "replaced": "false"})
    heartbeats = sample("gridrl_master_heartbeats_total")
    a = register(stub, node_info("10.0.0.1:6000")).node_id
    register(stub, node_info("10.0.0.2:6000"))
    register(stub, node_info("10.0.0.3:6000", backend=MLX))
    t = register(stub, node_info("10.0.0.9:6100", role=TRAINER, backend=0)).node_id
    heartbeat(stub, a)
    heartbeat(stub, t, status=DRAINING)
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=10).read().decode()
    lines = set(body.splitlines())
    assert 'gridrl_master_nodes{backend="torch",role="rollout",status="healthy"} 2.0' in lines
    assert 'gridrl_master_nodes{backend="mlx",role="rollout",status="healthy"} 1.0' in lines
    assert ('gridrl_master_nodes{backend="unspecified",role="trainer",status="draining"} 1.0'
            in lines)
    assert 'gridrl_master_nodes{backend="vllm",role="rollout",status="unhealthy"} 0.0' in lines
    assert sample("gridrl_master_registrations_total",
                  {"role": "rollout", "replaced": "false"}) == registrations + 3
    assert sample("gridrl_master_heartbeats_total") == heartbeats + 2
    assert ('gridrl_rpc_requests_total{code="OK",method="RegisterNode",'
            'service="gridrl.v1.RegistryService"}') in body
