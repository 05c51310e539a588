"""Registry domain logic with an injected clock: ids, heartbeats, liveness, events, restore."""

from __future__ import annotations

import threading

import pytest

from gridrl.common.errors import Kind, StatusError
from gridrl.master.config import Liveness
from gridrl.master.registry import (
    CHANGED,
    JOINED,
    REMOVED,
    SNAPSHOT,
    SNAPSHOT_END,
    Registry,
    node_id_for,
)
from gridrl.master.subscriptions import NodeFilter
from gridrl.v1 import common_pb2, registry_pb2

ROLLOUT, TRAINER = common_pb2.NODE_ROLE_ROLLOUT, common_pb2.NODE_ROLE_TRAINER
TORCH, MLX = common_pb2.BACKEND_TORCH, common_pb2.BACKEND_MLX
HEALTHY, UNHEALTHY, DRAINING = (common_pb2.NODE_STATUS_HEALTHY, common_pb2.NODE_STATUS_UNHEALTHY,
                                common_pb2.NODE_STATUS_DRAINING)


class FakeClock:
    """Wall and monotonic clocks that move only when told."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000.0
        self.mono = 50.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def info(address: str, role: int = ROLLOUT, backend: int = TORCH, model: str = "tiny",
         adapter: tuple[str, int] = ("", 0)) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(address=address, role=role, backend=backend,
                               base_model=common_pb2.BaseModel(model_id=model),
                               adapter=common_pb2.AdapterRef(name=adapter[0], version=adapter[1]))


def drain(sub, timeout: float = 0.0) -> list:
    events = []
    while (event := sub.get(timeout)) is not None:
        events.append(event)
    return events


class MemoryStore:
    """A dict-backed RecordStore that records every write."""

    def __init__(self, records=()) -> None:
        self.rows = {r.node_id: r for r in records}
        self.puts = 0

    def load(self):
        return [registry_pb2.NodeRecord.FromString(r.SerializeToString()) for r in self.rows.values()]

    def put(self, records) -> None:
        self.puts += 1
        for r in records:
            self.rows[r.node_id] = registry_pb2.NodeRecord.FromString(r.SerializeToString())

    def delete(self, node_ids) -> None:
        for i in node_ids:
            self.rows.pop(i, None)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    return Registry(Liveness(1, 3, 10),
                    clock=clock.time, monotonic=clock.monotonic)


def test_register_assigns_stable_id_and_replaces_by_address(registry, clock) -> None:
    first, replaced = registry.register(info("10.0.0.1:5000"))
    assert not replaced
    assert first.node_id == node_id_for("10.0.0.1:5000")
    assert first.status == HEALTHY
    assert first.last_seen.ToNanoseconds() == int(clock.wall * 1e9)
    assert first.registered_at == first.last_seen
    clock.advance(2)
    second, replaced = registry.register(info("10.0.0.1:5000", backend=MLX))
    assert replaced
    assert second.node_id == first.node_id
    assert second.registered_at == first.registered_at  # first registration at this address
    assert second.last_seen.ToNanoseconds() == int(clock.wall * 1e9)
    records = registry.list_nodes()
    assert len(records) == 1 and records[0].info.backend == MLX
    other, _ = registry.register(info("10.0.0.2:5000"))
    assert other.node_id != first.node_id
    assert [r.info.address for r in registry.list_nodes()] == ["10.0.0.1:5000", "10.0.0.2:5000"]


def test_list_filters(registry) -> None:
    registry.register(info("a:1", ROLLOUT, TORCH, "m1"))
    registry.register(info("b:1", ROLLOUT, MLX, "m2"))
    t, _ = registry.register(info("c:1", TRAINER, 0, "m1"))
    registry.heartbeat(t.node_id, common_pb2.AdapterRef(), 0, 0.0, DRAINING)

    def addresses(**kw):
        return [r.info.address for r in registry.list_nodes(NodeFilter(**kw))]

    assert addresses() == ["a:1", "b:1", "c:1"]
    assert addresses(role=ROLLOUT) == ["a:1", "b:1"]
    assert addresses(backend=MLX) == ["b:1"]
    assert addresses(model_id="m1") == ["a:1", "c:1"]
    assert addresses(status=DRAINING) == ["c:1"]
    assert addresses(role=ROLLOUT, model_id="m1") == ["a:1"]
    assert addresses(role=TRAINER, backend=TORCH) == []


def test_heartbeat_updates_and_emits_only_meaningful_changes(registry, clock) -> None:
    record, _ = registry.register(info("a:1"))
    sub = registry.subscribe()
    assert [e.type for e in drain(sub)] == [SNAPSHOT, SNAPSHOT_END]
    # Load, queue depth and last_seen change silently.
    clock.advance(0.5)
    registry.heartbeat(record.node_id, common_pb2.AdapterRef(), 7, 0.25)
    assert drain(sub) == []
    now = registry.get(record.node_id)
    assert (now.info.queue_depth, now.load) == (7, 0.25)
    assert now.last_seen.ToNanoseconds() == int(clock.wall * 1e9)
    # A new adapter version is a change.
    registry.heartbeat(record.node_id, common_pb2.AdapterRef(name="run", version=3), 7, 0.25)
    (event,) = drain(sub)
    assert event.type == CHANGED and event.node.info.adapter.version == 3
    # DRAINING, and back to HEALTHY (unset status), are changes.
    registry.heartbeat(record.node_id, common_pb2.AdapterRef(name="run", version=3), 0, 0.0,
                       DRAINING)
    registry.heartbeat(record.node_id, common_pb2.AdapterRef(name="run", version=3), 0, 0.0)
    assert [e.node.status for e in drain(sub)] == [DRAINING, HEALTHY]
    with pytest.raises(StatusError) as e:
        registry.heartbeat("n-unknown", common_pb2.AdapterRef(), 0, 0.0)
    assert e.value.kind is Kind.NOT_FOUND
    assert e.value.message.startswith("node_id: unknown node 'n-unknown'")


def test_liveness_unhealthy_then_expired(registry, clock) -> None:
    a, _ = registry.register(info("a:1"))
    b, _ = registry.register(info("b:1"))
    sub = registry.subscribe()
    drain(sub)
    clock.advance(2.9)
    registry.heartbeat(b.node_id, common_pb2.AdapterRef(), 0, 0.0)
    assert registry.sweep().unhealthy == []
    clock.advance(0.1)  # a silent for 3.0 s = unhealthy_after_s
    result = registry.sweep()
    assert [r.node_id for r in result.unhealthy] == [a.node_id] and result.expired == []
    (event,) = drain(sub)
    assert (event.type, event.node.node_id, event.node.status) == (CHANGED, a.node_id, UNHEALTHY)
    assert registry.sweep().unhealthy == []  # no repeat while it stays unhealthy
    assert registry.list_nodes(NodeFilter(status=UNHEALTHY))[0].node_id == a.node_id
    # A heartbeat brings it back.
    registry.heartbeat(a.node_id, common_pb2.AdapterRef(), 0, 0.0)
    (event,) = drain(sub)
    assert (event.type, event.node.status) == (CHANGED, HEALTHY)
    # Silent past expire_after_s: unhealthy first, then removed.
    clock.advance(5)
    registry.sweep()
    clock.advance(5)
    result = registry.sweep()
    assert sorted(r.node_id for r in result.expired) == sorted([a.node_id, b.node_id])
    events = drain(sub)
    assert [e.type for e in events] == [CHANGED, CHANGED, REMOVED, REMOVED]
    assert registry.list_nodes() == []
    with pytest.raises(StatusError) as e:
        registry.heartbeat(a.node_id, common_pb2.AdapterRef(), 0, 0.0)
    assert e.value.kind is Kind.NOT_FOUND


def test_subscribe_snapshot_order_and_strict_sequences(registry) -> None:
    ids = [registry.register(info(f"h{i}:1"))[0].node_id for i in range(3)]
    registry.heartbeat(ids[0], common_pb2.AdapterRef(name="x", version=1), 0, 0.0)  # h0 last
    sub = registry.subscribe()
    events = drain(sub)
    assert [e.type for e in events] == [SNAPSHOT] * 3 + [SNAPSHOT_END]
    assert [e.node.node_id for e in events[:3]] == [ids[1], ids[2], ids[0]]
    assert events[-1].node is None
    registry.deregister(ids[1])
    registry.register(info("h9:1"))
    events += drain(sub)
    sequences = [e.sequence for e in events]
    assert sequences == sorted(set(sequences))
    assert [e.type for e in events[4:]] == [REMOVED, JOINED]
    assert events[4].node.info.address == "h1:1"


def test_filtered_watch_sees_records_enter_and_leave(registry) -> None:
    sub = registry.subscribe(NodeFilter(role=ROLLOUT, backend=TORCH))
    drain(sub)
    registry.register(info("a:1", TRAINER, 0))  # not matching: nothing
    registry.register(info("a:1", ROLLOUT, TORCH))  # now matches: JOINED
    registry.register(info("a:1", ROLLOUT, TORCH, model="other"))  # still matches: CHANGED
    registry.register(info("a:1", ROLLOUT, MLX))  # leaves the view: REMOVED
    assert [e.type for e in drain(sub)] == [JOINED, CHANGED, REMOVED]


def test_subscription_close_overflow_and_limits(clock) -> None:
    registry = Registry(Liveness(1, 3, 10), clock=clock.time, monotonic=clock.monotonic,
                        max_watchers=2, max_pending_events=5)
    slow = registry.subscribe()
    other = registry.subscribe()
    with pytest.raises(StatusError) as e:
        registry.subscribe()
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED
    other.close()
    other.close()  # idempotent
    assert registry.watcher_count == 1
    for i in range(4):  # SNAPSHOT_END + 4 events = 5 pending: still fine
        registry.register(info(f"n{i}:1"))
    assert registry.watcher_count == 1
    registry.register(info("n9:1"))  # the 6th pending event drops the reader
    assert registry.watcher_count == 0
    with pytest.raises(StatusError) as e:
        slow.get(0)
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED


def test_blocked_get_wakes_on_event_and_on_close(registry) -> None:
    sub = registry.subscribe()
    drain(sub)
    got = []
    reader = threading.Thread(target=lambda: got.append(sub.get(5)))
    reader.start()
    registry.register(info("a:1"))
    reader.join(5)
    assert got[0].type == JOINED
    reader = threading.Thread(target=lambda: got.append(sub.get(5)))
    reader.start()
    registry.close_watchers()
    reader.join(5)
    assert not reader.is_alive() and got[1] is None and sub.closed
    with pytest.raises(StatusError) as e:
        registry.subscribe()
    assert e.value.kind is Kind.UNAVAILABLE


def test_stopping_master_delivers_what_was_queued_then_ends(registry) -> None:
    registry.register(info("a:1"))
    sub = registry.subscribe()
    registry.register(info("b:1"))  # queued behind the snapshot
    registry.close_watchers()
    registry.register(info("c:1"))  # after the end: not delivered
    assert sub.closed
    assert [e.type for e in drain(sub)] == [SNAPSHOT, SNAPSHOT_END, JOINED]
    assert sub.get(0.1) is None  # drained: the stream ends at once, no wait


def test_restore_keeps_records_and_restarts_liveness(clock) -> None:
    store = MemoryStore()
    old = Registry(Liveness(1, 3, 10), store=store, clock=clock.time, monotonic=clock.monotonic)
    a, _ = old.register(info("a:1", adapter=("run", 2)))
    b, _ = old.register(info("b:1"))
    old.heartbeat(a.node_id, common_pb2.AdapterRef(name="run", version=2), 4, 0.5)
    old.close()  # flushes the heartbeat-only update
    assert store.rows[a.node_id].load == 0.5
    clock.advance(100)  # the master was down far longer than expire_after_s
    new = Registry(Liveness(1, 3, 10), store=store, clock=clock.time, monotonic=clock.monotonic)
    restored = {r.node_id: r for r in new.list_nodes()}
    assert set(restored) == {a.node_id, b.node_id}
    assert restored[a.node_id].info.adapter.version == 2 and restored[a.node_id].status == HEALTHY
    assert restored[a.node_id].registered_at == a.registered_at
    assert new.sweep().expired == []  # timers restarted at start-up
    clock.advance(1)
    new.heartbeat(a.node_id, common_pb2.AdapterRef(name="run", version=2), 0, 0.0)
    clock.advance(2.5)
    result = new.sweep()
    assert [r.node_id for r in result.unhealthy] == [b.node_id]
    clock.advance(7)
    assert [r.node_id for r in new.sweep().expired] == [b.node_id]
    assert set(store.rows) == {a.node_id}


def test_store_writes_are_batched_for_heartbeats(registry, clock) -> None:
    store = MemoryStore()
    registry = Registry(Liveness(1, 3, 10), store=store, clock=clock.time, monotonic=clock.monotonic)
    a, _ = registry.register(info("a:1"))
    puts = store.puts
    for _ in range(20):
        registry.heartbeat(a.node_id, common_pb2.AdapterRef(), 1, 0.1)
    assert store.puts == puts  # nothing written per heartbeat
    registry.sweep()
    assert store.puts == puts + 1 and store.rows[a.node_id].load == pytest.approx(0.1)
    registry.deregister(a.node_id)
    assert store.rows == {}


def test_failing_store_never_fails_calls(registry, clock) -> None:
    class Broken(MemoryStore):
        def put(self, records):
            raise OSError("disk full")

    registry = Registry(Liveness(1, 3, 10), store=Broken(), clock=clock.time, monotonic=clock.monotonic)
    a, _ = registry.register(info("a:1"))
    registry.heartbeat(a.node_id, common_pb2.AdapterRef(name="x", version=1), 0, 0.0)
    assert registry.get(a.node_id).info.adapter.version == 1


def test_rejects_non_increasing_durations() -> None:
    for durations, flag in (((5, 5, 60), "--unhealthy-after"), ((1, 10, 10), "--expire-after"),
                            ((0, 1, 2), "--heartbeat-interval")):
        with pytest.raises(StatusError) as e:
            Registry(Liveness(*durations))
        assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == flag
