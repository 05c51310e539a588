"""NodeRegistrar against a real master: register, heartbeat, survive master restarts (with and
without its store), outages logged once, auth, misbehaving callbacks, deregistration."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from waiting import seconds_until, wait_for

from gridrl.common.errors import Kind, StatusError
from gridrl.common.registration import NodeRegistrar
from gridrl.common.rpc.channel import dial
from gridrl.master.config import Liveness
from gridrl.master.registry import node_id_for
from gridrl.master.server import Master
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S = 0.2, 0.6, 1.2
# How long after the master is back the node must be known again: one heartbeat interval,
# plus slack for two busy shared CPU cores.
BACK_WITHIN_S = HEARTBEAT_S + 0.8
LOGGER = "gridrl.common.registration"


class Node:
    """What a rollout node exposes to the registrar: its info (mutable) and its load."""

    def __init__(self, address: str) -> None:
        self.info = common_pb2.NodeInfo(address=address, role=common_pb2.NODE_ROLE_ROLLOUT,
                                        backend=common_pb2.BACKEND_TORCH, capacity=4,
                                        base_model=common_pb2.BaseModel(model_id="tiny"))
        self.load = 0.0
        self.lock = threading.Lock()

    def info_fn(self) -> common_pb2.NodeInfo:
        with self.lock:
            return common_pb2.NodeInfo.FromString(self.info.SerializeToString())

    def load_fn(self) -> float:
        return self.load


def failures_logged(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(warnings, debug retries) the registrar logged: one warning per outage, then one debug
    record per further failed attempt (needs caplog at DEBUG for LOGGER)."""
    mine = [r for r in caplog.records if r.name == LOGGER]
    return (sum(r.levelno >= logging.WARNING for r in mine),
            sum(r.levelno == logging.DEBUG and "failed" in r.getMessage() for r in mine))


def records(master: Master) -> dict[str, registry_pb2.NodeRecord]:
    channel = dial(master.address, getattr(master, "token", None))
    try:
        response = registry_pb2_grpc.RegistryServiceStub(channel).ListNodes(
            registry_pb2.ListNodesRequest(), timeout=5)
    finally:
        channel.close()
    return {r.node_id: r for r in response.nodes}


@pytest.fixture
def masters() -> Iterator[Callable[..., Master]]:
    started: list[Master] = []

    def start(port: int = 0, store_path: str | None = None, security=None, token=None):
        master = Master(f"127.0.0.1:{port}", store_path=store_path, security=security,
                        liveness=Liveness(HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S), grace_s=1).start()
        master.token = token  # what records() reads with
        started.append(master)
        return master

    yield start
    for master in reversed(started):
        master.stop(0)


@pytest.fixture
def registrars() -> Iterator[Callable[..., NodeRegistrar]]:
    made: list[NodeRegistrar] = []

    def make(*args, **kwargs) -> NodeRegistrar:
        registrar = NodeRegistrar(*args, **kwargs)
        made.append(registrar)
        return registrar

    yield make
    for registrar in made:
        registrar.stop(deregister=False)


def test_registers_heartbeats_and_deregisters(masters, registrars) -> None:
    master = masters()
    node = Node("10.0.0.1:6000")
    registrar = registrars(master.address, node.info_fn, node.load_fn)
    assert registrar.node_id is None and not registrar.registered
    t0 = time.monotonic()
    registrar.start()
    assert time.monotonic() - t0 < 0.5  # returns at once
    wait_for(lambda: registrar.registered)
    assert registrar.node_id == node_id_for("10.0.0.1:6000")
    assert registrar.heartbeat_interval_s == pytest.approx(HEARTBEAT_S)
    assert records(master)[registrar.node_id].info.capacity == 4

    with node.lock:
        node.info.adapter.name, node.info.adapter.version = "run", 3
        node.info.queue_depth = 5
    node.load = 0.75

    def updated() -> bool:
        r = records(master)[registrar.node_id]
        return (r.info.adapter.version, r.info.queue_depth, r.load) == (3, 5, 0.75)

    assert seconds_until(updated, what="the new load at the master") < HEARTBEAT_S + 1.0
    # heartbeats keep it alive past the expiry time: a heartbeat lands later than EXPIRE_S
    # after this point while the record stays (an expired node would be gone)
    past = time.time_ns() + int(EXPIRE_S * 1e9)
    wait_for(lambda: records(master)[registrar.node_id].last_seen.ToNanoseconds() > past,
             timeout_s=EXPIRE_S + 10, what="a heartbeat past the expiry time")
    record = records(master)[registrar.node_id]
    assert record.status == common_pb2.NODE_STATUS_HEALTHY
    assert time.time() - record.last_seen.ToNanoseconds() / 1e9 < HEARTBEAT_S + 0.5

    t0 = time.monotonic()
    registrar.stop()
    assert time.monotonic() - t0 < 2
    assert not registrar.registered
    assert records(master) == {}  # deregistered


@pytest.mark.parametrize("with_store", [True, False], ids=["store", "no-store"])
def test_back_within_an_interval_after_master_restart(masters, registrars, tmp_path, caplog,
                                                      with_store, reserved_port) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    port = reserved_port.release()  # the master restarts on the same port
    store = str(tmp_path / "master.sqlite") if with_store else None
    first = masters(port, store_path=store)
    node = Node("10.0.0.1:6000")
    registrar = registrars(first.address, node.info_fn, node.load_fn)
    registrar.start()
    wait_for(lambda: registrar.registered)
    node_id = registrar.node_id
    first.stop(0)
    wait_for(lambda: not registrar.registered, timeout_s=5)
    # an outage of several retry periods: three more failed attempts logged
    retries = failures_logged(caplog)[1]
    wait_for(lambda: failures_logged(caplog)[1] >= retries + 3, what="three retries")

    restarted_ns = time.time_ns()
    second = masters(port, store_path=store)
    # "back within an interval" of the master answering: the registrar's retry cadence. (It
    # counted the master's own start-up too, which on two busy cores took the total to 1.03 s
    # once in a CI-sized run; that start-up is the master's, not the registrar's.)
    t0 = time.monotonic()
    if with_store:
        assert set(records(second)) == {node_id}  # restored before the node says anything
        first_seen = records(second)[node_id].last_seen.ToNanoseconds()
        wait_for(lambda: registrar.registered
                   and records(second)[node_id].last_seen.ToNanoseconds() > first_seen)
    else:
        # Nothing restored: the record is a fresh registration on the new master (not "empty at
        # first": the node's retry, every 0.2 s, can land before the first ListNodes).
        wait_for(lambda: node_id in records(second))
        assert records(second)[node_id].registered_at.ToNanoseconds() >= restarted_ns
    back = time.monotonic() - t0
    print(f"node back {back:.2f}s after the master restarted ({'with' if with_store else 'no'} store)")
    assert back < BACK_WITHIN_S, f"node back after {back:.2f}s"
    wait_for(lambda: registrar.registered)
    assert registrar.node_id == node_id  # ids are stable per address
    assert records(second)[node_id].status == common_pb2.NODE_STATUS_HEALTHY

    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    retries = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per outage
    assert "UNAVAILABLE" in warnings[0].getMessage()
    assert len(retries) >= 3  # it did keep trying, quietly
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("answers again" in m for m in messages)
    if not with_store:
        assert any("registering again" in m for m in messages)


def test_unreachable_master_at_start(masters, registrars, caplog, reserved_port) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    port = reserved_port  # held, not listening: every attempt is refused until the master runs
    node = Node("10.0.0.1:6000")
    registrar = registrars(f"127.0.0.1:{port}", node.info_fn, retry_interval_s=0.1)
    t0 = time.monotonic()
    registrar.start()
    assert time.monotonic() - t0 < 0.5
    wait_for(lambda: failures_logged(caplog)[1] >= 3)  # several attempts failed
    assert registrar.node_id is None and not registrar.registered
    assert failures_logged(caplog)[0] == 1  # one warning for the whole outage
    assert "UNAVAILABLE" in registrar.last_failure
    master = masters(reserved_port.release())
    assert seconds_until(lambda: registrar.registered, what="registered again") < 1.0
    assert registrar.last_failure is None
    assert set(records(master)) == {node_id_for("10.0.0.1:6000")}


def test_node_credential(masters, registrars, creds, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    master = masters(security=creds.security(None, authorized=True), token=creds.tokens["read"])
    good_node, bad_node = Node("10.0.0.1:6000"), Node("10.0.0.2:6000")
    good = registrars(master.address, good_node.info_fn, security=creds.tokens["node"])
    bad = registrars(master.address, bad_node.info_fn, retry_interval_s=0.1)
    good.start()
    bad.start()
    wait_for(lambda: good.registered)
    wait_for(lambda: failures_logged(caplog)[1] >= 3)  # bad was refused several times
    assert not bad.registered
    assert set(records(master)) == {good.node_id}
    refused = [r.getMessage() for r in caplog.records
               if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(refused) == 1 and "UNAUTHENTICATED" in refused[0]
    # logged once, but kept for the node's status line while the refusals go on
    assert bad.last_failure.startswith("register failed: UNAUTHENTICATED") and \
        good.last_failure is None


def test_misbehaving_callbacks_never_reach_the_node(masters, registrars) -> None:
    master = masters()
    node = Node("10.0.0.1:6000")
    calls = {"info": 0}

    def flaky_info() -> common_pb2.NodeInfo:
        calls["info"] += 1
        if calls["info"] <= 2:
            raise RuntimeError("not ready yet")
        return node.info_fn()

    # Each value lasts two heartbeats (0.4 s), so polling every 10 ms sees every one of them.
    loads = iter([float("nan"), float("nan"), 7.0, 7.0, -1.0, -1.0])
    exhausted = threading.Event()

    def load_fn() -> float:
        try:
            return next(loads)
        except StopIteration:
            exhausted.set()
            raise RuntimeError("load unavailable") from None

    registrar = registrars(master.address, flaky_info, load_fn, retry_interval_s=0.05)
    registrar.start()
    wait_for(lambda: registrar.registered)
    assert calls["info"] >= 3  # the two failures were retried
    seen: list[float] = []  # loads the master recorded, consecutive duplicates collapsed


    def record_load() -> bool:
        load = records(master)[registrar.node_id].load
        if not seen or seen[-1] != load:
            seen.append(load)
        return exhausted.is_set()

    wait_for(record_load, timeout_s=10, what="the scripted loads to run out", every_s=0.01)
    # NaN -> 0, 7 -> 1 (clamped), -1 -> 0 (clamped); a raising load_fn reports 0.
    assert seen == [0.0, 1.0, 0.0]
    last = records(master)[registrar.node_id].last_seen.ToNanoseconds()
    wait_for(lambda: records(master)[registrar.node_id].last_seen.ToNanoseconds() > last)
    assert records(master)[registrar.node_id].load == 0.0
    assert registrar.registered


def test_stop_is_prompt_with_master_gone(masters, registrars) -> None:
    master = masters()
    node = Node("10.0.0.1:6000")
    registrar = registrars(master.address, node.info_fn)
    registrar.start()
    wait_for(lambda: registrar.registered)
    master.stop(0)
    t0 = time.monotonic()
    registrar.stop()  # deregistration fails fast and is only logged
    assert time.monotonic() - t0 < 2
    registrar.stop()  # idempotent
    with pytest.raises(RuntimeError):
        registrar.start()


def test_rejects_bad_master_address() -> None:
    with pytest.raises(StatusError) as e:
        NodeRegistrar("no-port", Node("a:1").info_fn)
    assert e.value.kind is Kind.INVALID_ARGUMENT
    assert e.value.message == ("master_address: 'no-port' is not host:port: the port is missing "
                               "(give no-port:PORT)")
