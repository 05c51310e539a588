"""The node registry: records, liveness and the ordered event feed behind WatchNodes.

Pure domain code: no gRPC servicer, no sockets. :class:`Registry` is thread-safe (one lock);
every change that a watcher should see gets the next registry sequence number and is appended,
under that lock, to the queue of every matching :class:`Subscription`, so each stream sees
changes in sequence order and two streams see them in the same order.

Decisions (also documented for users in the docstrings below):

* Node ids are derived from the address (``node_id_for``): a node re-registering under the same
  address gets the same id and replaces its record (``registered_at`` is kept), even after the
  master lost its store.
* A heartbeat emits CHANGED only when something a scheduler acts on changed: the status
  (UNHEALTHY -> HEALTHY, HEALTHY <-> DRAINING) or the adapter (name or version). Queue depth,
  load and ``last_seen`` are updated silently (read them with ListNodes). A re-registration
  always emits CHANGED (the node restarted; its info may differ).
* Liveness: a node not heard from for ``unhealthy_after_s`` is marked UNHEALTHY (CHANGED), and
  removed after ``expire_after_s`` (REMOVED). Ages are measured on a monotonic clock;
  timestamps shown to users come from the wall clock.
* Records restored from the store keep their id, info, status, ``registered_at`` and
  ``last_seen``, but their liveness timers restart when the master starts (the master, not the
  node, was away): a node still heartbeating is found by its next heartbeat; one that died
  while the master was down is marked UNHEALTHY and removed on the usual schedule.
* WatchNodes snapshot events carry the sequence of each node's last change and come in that
  order; SNAPSHOT_END takes a fresh sequence number, so a stream's sequences strictly increase.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gridrl.common.errors import Kind, StatusError, not_found, resource_exhausted
from gridrl.master.config import Liveness
from gridrl.master.subscriptions import NodeEvent, NodeFilter, Subscription
from gridrl.v1 import common_pb2, registry_pb2

log = logging.getLogger(__name__)

NodeRecord = registry_pb2.NodeRecord

SNAPSHOT = registry_pb2.NODE_EVENT_TYPE_SNAPSHOT
SNAPSHOT_END = registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END
JOINED = registry_pb2.NODE_EVENT_TYPE_JOINED
CHANGED = registry_pb2.NODE_EVENT_TYPE_CHANGED
REMOVED = registry_pb2.NODE_EVENT_TYPE_REMOVED

HEALTHY = common_pb2.NODE_STATUS_HEALTHY
EXPIRED_MEMORY = 10_000  # expired node ids remembered (Registry.expired_address)
UNHEALTHY = common_pb2.NODE_STATUS_UNHEALTHY
DRAINING = common_pb2.NODE_STATUS_DRAINING


def node_id_for(address: str) -> str:
    """Stable id of the node at ``address``: ``"n-"`` + the first 16 hex digits of its sha256."""
    return "n-" + hashlib.sha256(address.encode()).hexdigest()[:16]


@dataclass
class SweepResult:
    """Records :meth:`Registry.sweep` marked UNHEALTHY and records it removed."""

    unhealthy: list[NodeRecord] = field(default_factory=list)
    expired: list[NodeRecord] = field(default_factory=list)


class RecordStore(Protocol):
    """Persistence the registry writes through to (see :class:`gridrl.master.store.SqliteStore`)."""

    def load(self) -> list[NodeRecord]: ...

    def put(self, records: Iterable[NodeRecord]) -> None: ...

    def delete(self, node_ids: Iterable[str]) -> None: ...


@dataclass
class _Entry:
    record: NodeRecord  # owned by the registry, mutated under its lock
    seen: float  # monotonic seconds of the last registration or heartbeat (or restore)
    sequence: int  # sequence of the last event about this node


class Registry:
    """Thread-safe registry of nodes with liveness and an ordered event feed.

    Args:
        liveness: the heartbeat interval the master asks for, and the silences after which a
            node is UNHEALTHY, then removed (:class:`gridrl.master.config.Liveness`).
        store: where records are persisted; None keeps them in memory only. Registrations,
            removals and evented changes are written through; heartbeat-only updates
            (last_seen, load, queue depth) are batched by :meth:`flush` / :meth:`sweep`.
        clock: wall-clock seconds since the epoch (for ``last_seen`` / ``registered_at``).
        monotonic: monotonic seconds (for liveness ages).
        max_watchers: most concurrent subscriptions; more get RESOURCE_EXHAUSTED.
        max_pending_events: events a subscriber may lag behind before it is dropped.

    Raises:
        StatusError: INVALID_ARGUMENT when the three durations are not increasing and
            positive (:meth:`Liveness.validate`).
    """

    def __init__(self, liveness: Liveness = Liveness(), store: RecordStore | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 max_watchers: int = 32, max_pending_events: int = 10_000) -> None:
        liveness.validate()
        self.liveness = liveness
        self.heartbeat_interval_s = liveness.heartbeat_interval_s
        self.unhealthy_after_s = liveness.unhealthy_after_s
        self.expire_after_s = liveness.expire_after_s
        self._store = store
        self._clock = clock
        self._monotonic = monotonic
        self._max_watchers = max_watchers
        self._max_pending = max_pending_events
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        # node ids the sweep expired -> their address (the newest EXPIRED_MEMORY): a trainer
        # credential's heartbeat for its own expired entry is told NOT_FOUND (register again)
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._subs: set[Subscription] = set()
        self._dirty: set[str] = set()
        self._sequence = 0
        self._closed = False
        self._store_failing = False
        if store is not None:
            self._restore(store)

    # ----------------------------------------------------------------------------- reads

    @property
    def sequence(self) -> int:
        """The last sequence number handed out."""
        with self._lock:
            return self._sequence

    def list_nodes(self, node_filter: NodeFilter = NodeFilter()) -> list[NodeRecord]:
        """Copies of the records matching ``node_filter``, ordered by address."""
        with self._lock:
            records = [_copy(e.record) for e in self._entries.values()
                       if node_filter.matches(e.record)]
        return sorted(records, key=lambda r: r.info.address)

    def get(self, node_id: str) -> NodeRecord:
        """A copy of the record of ``node_id``.

        Raises:
            StatusError: NOT_FOUND for an unknown id.
        """
        with self._lock:
            return _copy(self._entry(node_id).record)

    def expired_address(self, node_id: str) -> str | None:
        """The address of ``node_id`` when the sweep expired it (it has not registered since),
        else None."""
        with self._lock:
            return None if node_id in self._entries else self._expired.get(node_id)

    def counts(self) -> dict[tuple[int, int, int], int]:
        """Number of nodes by ``(role, backend, status)`` enum values."""
        out: dict[tuple[int, int, int], int] = {}
        with self._lock:
            for e in self._entries.values():
                key = (e.record.info.role, e.record.info.backend, e.record.status)
                out[key] = out.get(key, 0) + 1
        return out

    # ---------------------------------------------------------------------------- writes

    def register(self, info: common_pb2.NodeInfo) -> tuple[NodeRecord, bool]:
        """Add the node, or replace the record of the node at the same address (same id,
        ``registered_at`` kept). The node is HEALTHY with load 0. Emits JOINED or CHANGED.

        ``info`` must already be valid (:func:`gridrl.master.validate.validate_register`).
        Returns a copy of the new record and whether it replaced one.
        """
        node_id = node_id_for(info.address)
        with self._lock:
            now = self._clock()
            entry = self._entries.get(node_id)
            before = _copy(entry.record) if entry else None
            record = NodeRecord(node_id=node_id, status=HEALTHY, load=0.0)
            record.info.CopyFrom(info)
            record.last_seen.FromNanoseconds(int(now * 1e9))
            if entry:
                record.registered_at.CopyFrom(entry.record.registered_at)
                entry.record = record
                entry.seen = self._monotonic()
            else:
                record.registered_at.CopyFrom(record.last_seen)
                entry = self._entries[node_id] = _Entry(record, self._monotonic(), 0)
            self._dirty.discard(node_id)
            self._persist(self._store_put, [record])
            self._emit(CHANGED if before else JOINED, entry, before)
            return _copy(record), before is not None

    def heartbeat(self, node_id: str, adapter: common_pb2.AdapterRef, queue_depth: int,
                  load: float, status: int = 0, *, sequence: int = 0, uptime_s: float = 0.0,
                  stored_adapters: Sequence[common_pb2.AdapterRef] = (),
                  resident_adapters: Sequence[common_pb2.AdapterRef] = (),
                  run_shares: Sequence[common_pb2.RunShare] = ()) -> None:
        """Mark the node alive and record its adapter, queue depth and load (in [0, 1]).
        ``status`` DRAINING announces a shutdown; unset or HEALTHY means HEALTHY. A heartbeat
        with a report ``sequence`` (newer nodes) also refreshes the node's ``uptime_s``,
        ``stored_adapters``, ``resident_adapters``, ``run_shares`` and ``sequence`` in its info
        (older nodes' stay as registered).

        Emits CHANGED only when the status or the adapter (name or version) changed.

        Raises:
            StatusError: NOT_FOUND for an unknown id (the node must register again).
        """
        new_status = status or HEALTHY
        with self._lock:
            entry = self._entry(node_id)
            record = entry.record
            changed = (record.status != new_status
                       or record.info.adapter.name != adapter.name
                       or record.info.adapter.version != adapter.version)
            entry.seen = self._monotonic()
            record.last_seen.FromNanoseconds(int(self._clock() * 1e9))
            record.info.adapter.CopyFrom(adapter)
            record.info.queue_depth = queue_depth
            if sequence:
                record.info.sequence = sequence
                record.info.uptime_s = uptime_s
                del record.info.stored_adapters[:]
                record.info.stored_adapters.extend(stored_adapters)
                del record.info.resident_adapters[:]
                record.info.resident_adapters.extend(resident_adapters)
                del record.info.run_shares[:]
                record.info.run_shares.extend(run_shares)
            record.load = load
            record.status = new_status
            if changed:
                self._dirty.discard(node_id)
                self._persist(self._store_put, [record])
                self._emit(CHANGED, entry)
            else:
                self._dirty.add(node_id)

    def deregister(self, node_id: str) -> NodeRecord:
        """Remove the node (clean shutdown). Emits REMOVED; returns its last record.

        Raises:
            StatusError: NOT_FOUND for an unknown id.
        """
        with self._lock:
            entry = self._entry(node_id)
            self._remove(node_id, entry)
            return _copy(entry.record)

    def sweep(self) -> SweepResult:
        """Apply liveness: nodes silent for ``unhealthy_after_s`` become UNHEALTHY (CHANGED),
        nodes silent for ``expire_after_s`` are removed (REMOVED); then :meth:`flush`.
        Call it periodically (the server runs it every quarter of ``unhealthy_after_s`` at most).
        """
        result = SweepResult()
        with self._lock:
            now = self._monotonic()
            for node_id, entry in list(self._entries.items()):
                silent_s = now - entry.seen
                if silent_s >= self.expire_after_s:
                    self._remove(node_id, entry)
                    self._expired[node_id] = entry.record.info.address
                    while len(self._expired) > EXPIRED_MEMORY:
                        self._expired.popitem(last=False)
                    result.expired.append(_copy(entry.record))
                elif silent_s >= self.unhealthy_after_s and entry.record.status != UNHEALTHY:
                    entry.record.status = UNHEALTHY
                    self._dirty.discard(node_id)
                    self._persist(self._store_put, [entry.record])
                    self._emit(CHANGED, entry)
                    result.unhealthy.append(_copy(entry.record))
            self._flush_locked()
        for record in result.unhealthy:
            log.warning("node %s (%s) unhealthy: no heartbeat for %.1fs", record.node_id,
                        record.info.address, self.unhealthy_after_s)
        for record in result.expired:
            log.warning("node %s (%s) expired: no heartbeat for %.1fs", record.node_id,
                        record.info.address, self.expire_after_s)
        return result

    def flush(self) -> None:
        """Write heartbeat-only updates (last_seen, load, queue depth) to the store."""
        with self._lock:
            self._flush_locked()

    # ---------------------------------------------------------------------------- watch

    def subscribe(self, node_filter: NodeFilter = NodeFilter()) -> Subscription:
        """A subscription pre-loaded with SNAPSHOT events for the matching nodes (in the order
        of their last change) and SNAPSHOT_END; every later matching change follows.

        ``node_filter.status`` is ignored (a watcher sees status changes as CHANGED events).
        A change that makes a record start or stop matching (re-registration with another
        role, backend or model) reaches the watcher as JOINED or REMOVED.

        Raises:
            StatusError: RESOURCE_EXHAUSTED past ``max_watchers``; UNAVAILABLE once closed.
        """
        node_filter = NodeFilter(node_filter.role, node_filter.backend, node_filter.model_id)
        sub = Subscription(node_filter, self._max_pending, self._unsubscribe)
        with self._lock:
            if self._closed:
                raise StatusError(Kind.UNAVAILABLE, "master is shutting down")
            if len(self._subs) >= self._max_watchers:
                raise resource_exhausted(f"too many watchers (at most {self._max_watchers})")
            for entry in sorted(self._entries.values(), key=lambda e: e.sequence):
                if node_filter.matches(entry.record):
                    sub.push(NodeEvent(SNAPSHOT, entry.sequence, _copy(entry.record)),
                              bounded=False)
            self._sequence += 1
            sub.push(NodeEvent(SNAPSHOT_END, self._sequence, None), bounded=False)
            self._subs.add(sub)
        return sub

    @property
    def watcher_count(self) -> int:
        """Open subscriptions."""
        with self._lock:
            return len(self._subs)

    def close_watchers(self) -> None:
        """End every subscription and refuse new ones (the server is stopping): each watcher
        still gets what was queued for it, then its stream ends."""
        with self._lock:
            self._closed = True
            subs = list(self._subs)
        for sub in subs:
            sub.end()

    def close(self) -> None:
        """:meth:`close_watchers`, then flush pending heartbeat updates to the store."""
        self.close_watchers()
        self.flush()

    # -------------------------------------------------------------------------- internal

    def _entry(self, node_id: str) -> _Entry:
        entry = self._entries.get(node_id)
        if entry is None:
            raise not_found(f"node_id: unknown node {node_id!r}; register again")
        return entry

    def _remove(self, node_id: str, entry: _Entry) -> None:
        del self._entries[node_id]
        self._dirty.discard(node_id)
        self._persist(self._store_delete, [node_id])
        self._emit(REMOVED, entry)

    def _emit(self, kind: int, entry: _Entry, before: NodeRecord | None = None) -> None:
        """Give the change the next sequence number and queue it to matching subscribers.
        ``before`` is the record before a re-registration (its role/backend/model may differ)."""
        self._sequence += 1
        entry.sequence = self._sequence
        node = _copy(entry.record)
        dropped = []
        for sub in self._subs:
            now_matches = sub.filter.matches(node)
            was_matching = sub.filter.matches(before) if before is not None else now_matches
            if kind == CHANGED and was_matching != now_matches:
                kind_for_sub = JOINED if now_matches else REMOVED
            elif now_matches:
                kind_for_sub = kind
            else:
                continue
            if not sub.push(NodeEvent(kind_for_sub, self._sequence, node)):
                dropped.append(sub)
        for sub in dropped:
            self._subs.discard(sub)
            log.warning("dropped a watcher more than %d events behind", self._max_pending)

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def _flush_locked(self) -> None:
        if self._dirty and self._store is not None:
            records = [self._entries[i].record for i in self._dirty if i in self._entries]
            self._persist(self._store_put, records)
        self._dirty.clear()

    def _store_put(self, records: list[NodeRecord]) -> None:
        if self._store is not None:
            self._store.put(records)

    def _store_delete(self, node_ids: list[str]) -> None:
        if self._store is not None:
            self._store.delete(node_ids)

    def _persist(self, write: Callable[[list], None], items: list) -> None:
        """Best-effort write: the registry lives in memory; a failing store is logged once
        per failure streak and never fails a call (nodes re-register within one interval)."""
        try:
            write(items)
        except Exception:
            if not self._store_failing:
                log.exception("could not write the registry store; continuing in memory")
            self._store_failing = True
        else:
            if self._store_failing:
                log.info("registry store writable again")
            self._store_failing = False

    def _restore(self, store: RecordStore) -> None:
        records = sorted(store.load(), key=lambda r: r.info.address)
        now = self._monotonic()
        for record in records:
            record.node_id = node_id_for(record.info.address)
            self._sequence += 1
            self._entries[record.node_id] = _Entry(record, now, self._sequence)
        if records:
            log.info("restored %d node(s) from the store; each has %.1fs to heartbeat",
                     len(records), self.unhealthy_after_s)


def _copy(record: NodeRecord) -> NodeRecord:
    out = NodeRecord()
    out.CopyFrom(record)
    return out
