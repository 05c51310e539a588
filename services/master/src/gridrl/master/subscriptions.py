"""What a watcher of the registry sees (WatchNodes): NodeFilter (the fields a record must match),
NodeEvent (one change, in registry sequence order) and Subscription, a watcher's bounded queue
of them, which the registry (gridrl.master.registry) pushes to under its lock."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gridrl.common.errors import resource_exhausted
from gridrl.v1 import registry_pb2

NodeRecord = registry_pb2.NodeRecord


@dataclass(frozen=True)
class NodeFilter:
    """Fields a record must match; 0 / "" match everything."""

    role: int = 0
    backend: int = 0
    model_id: str = ""
    status: int = 0

    def matches(self, record: NodeRecord) -> bool:
        info = record.info
        return ((not self.role or info.role == self.role)
                and (not self.backend or info.backend == self.backend)
                and (not self.model_id or info.base_model.model_id == self.model_id)
                and (not self.status or record.status == self.status))


@dataclass(frozen=True)
class NodeEvent:
    """One registry change as a watcher sees it. ``node`` is a private copy (None for
    SNAPSHOT_END); never mutate it, it is shared by every subscriber."""

    type: int
    sequence: int
    node: NodeRecord | None


class Subscription:
    """A watcher's queue of :class:`NodeEvent`, fed by the registry in sequence order.

    Read with :meth:`get`; :meth:`close` (idempotent, any thread) wakes a blocked reader, drops
    what is queued and detaches the queue from the registry; :meth:`end` (the master stopping)
    takes no new event but lets the reader drain what is queued first. A reader more than
    ``max_pending`` events behind is dropped: its next :meth:`get` raises RESOURCE_EXHAUSTED.
    """

    def __init__(self, node_filter: NodeFilter, max_pending: int,
                 on_close: Callable[[Subscription], None]) -> None:
        self.filter = node_filter
        self._max_pending = max_pending
        self._on_close = on_close
        self._cond = threading.Condition()
        self._events: deque[NodeEvent] = deque()
        self._closed = False
        self._ended = False  # no new events; get() drains the queue, then returns None
        self._overflowed = False

    @property
    def closed(self) -> bool:
        """True once closed by the reader or an overflow, or ended by the registry (its queued
        events may still be read)."""
        return self._closed or self._ended

    def get(self, timeout: float | None = None) -> NodeEvent | None:
        """The next event, blocking up to ``timeout`` seconds (None: until one comes).

        Returns None when the subscription is closed (check :attr:`closed`), when it was
        ended and its queue is drained, or on timeout.

        Raises:
            StatusError: RESOURCE_EXHAUSTED when the reader fell ``max_pending`` events behind.
        """
        with self._cond:
            if not self._events and not self._closed and not self._ended:
                self._cond.wait_for(lambda: self._events or self._closed or self._ended, timeout)
            if self._overflowed:
                raise resource_exhausted(
                    f"watch fell more than {self._max_pending} events behind; watch again")
            if self._closed or not self._events:
                return None
            return self._events.popleft()

    def end(self) -> None:
        """Take no new event and wake a blocked :meth:`get`; events already queued are still
        returned, then None (a clean end of the stream). Idempotent, thread-safe."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
        self._on_close(self)

    def close(self) -> None:
        """Stop the subscription and wake a blocked :meth:`get`. Idempotent, thread-safe."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._events.clear()
            self._cond.notify_all()
        self._on_close(self)

    def push(self, event: NodeEvent, bounded: bool = True) -> bool:
        """Queue ``event`` (registry lock held). False when closed or just overflowed."""
        with self._cond:
            if self._closed or self._ended:
                return False
            if bounded and len(self._events) >= self._max_pending:
                self._overflowed = self._closed = True
                self._events.clear()
                self._cond.notify_all()
                return False
            self._events.append(event)
            self._cond.notify()
            return True
