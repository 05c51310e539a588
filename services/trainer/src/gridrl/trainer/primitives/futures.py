"""Tinker's futures on the server side: every asynchronous request gets a request id at once,
its result is kept until the client has fetched it, and a fetch of a request still running
waits (a long poll) rather than answering at once, since the SDK asks again as soon as it
hears "try again".

    store = FutureStore()
    rid = store.create(FutureKind.FORWARD_BACKWARD)
    ... store.resolve(rid, result)        # or store.fail(rid, message, user=True)
    outcome = store.wait(rid, timeout_s=25)   # Pending / Done / Failed; KeyError: unknown id
    store.on_done(rid, wake_my_event_loop)    # the async form of the wait: then store.peek(rid)

Finished entries are dropped ``keep_s`` after they finish (the SDK fetches each once; a fetch
whose answer was lost is retried within seconds). One lock; :meth:`wait` sleeps on its
condition.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FutureKind(StrEnum):
    """What a request is (Tinker's request types, as the SDK's ``retrieve_future`` decodes
    their results: :attr:`proto` ones as protobuf, the others as JSON)."""

    CREATE_MODEL = "CreateModel"
    LOAD_WEIGHTS = "LoadWeights"
    FORWARD_BACKWARD = "ForwardBackward"
    FORWARD = "Forward"
    OPTIM_STEP = "OptimStep"
    SAVE_WEIGHTS = "SaveWeights"
    SAVE_WEIGHTS_EXTERNAL = "SaveWeightsExternal"
    SAVE_WEIGHTS_FOR_SAMPLER = "SaveWeightsForSampler"
    SAMPLE = "Sample"
    #: a refused request of an endpoint without a kind of its own (its place in the order)
    OTHER = "Other"

    @property
    def proto(self) -> bool:
        """Its result travels as protobuf (forward, forward-backward, sample), else JSON."""
        return self in (FutureKind.FORWARD_BACKWARD, FutureKind.FORWARD, FutureKind.SAMPLE)

    @classmethod
    def of_endpoint(cls, endpoint: str) -> FutureKind:
        """The kind of a request to ``/api/v1/<endpoint>`` (:attr:`OTHER` for the rest)."""
        return _ENDPOINT_KINDS.get(endpoint, cls.OTHER)


_ENDPOINT_KINDS = {
    "create_model": FutureKind.CREATE_MODEL, "load_weights": FutureKind.LOAD_WEIGHTS,
    "forward_backward": FutureKind.FORWARD_BACKWARD, "forward": FutureKind.FORWARD,
    "optim_step": FutureKind.OPTIM_STEP, "save_weights": FutureKind.SAVE_WEIGHTS,
    "save_weights_external": FutureKind.SAVE_WEIGHTS_EXTERNAL,
    "save_weights_for_sampler": FutureKind.SAVE_WEIGHTS_FOR_SAMPLER,
    "asample": FutureKind.SAMPLE,
}


@dataclass(frozen=True)
class Pending:
    """Still running (the client should ask again)."""

    kind: FutureKind


@dataclass(frozen=True)
class Done:
    """Finished with ``result`` (a domain object; the wire layer encodes it)."""

    kind: FutureKind
    result: Any


@dataclass(frozen=True)
class Failed:
    """Finished with an error.

    Attributes:
        message: what went wrong, naming the field for bad input.
        user: the caller's mistake (Tinker's ``category: user``), else the server's.
    """

    kind: FutureKind
    message: str
    user: bool


Outcome = Pending | Done | Failed


@dataclass
class _Entry:
    kind: FutureKind
    outcome: Outcome
    finished_at: float | None = None
    listeners: list[Callable[[], None]] = field(default_factory=list)


class FutureStore:
    """Request ids and their outcomes.

    Args:
        keep_s: seconds a finished entry stays fetchable.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, keep_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._counter = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    def create(self, kind: FutureKind) -> str:
        """A new pending request of ``kind``; its id."""
        with self._cond:
            self._expire()
            rid = f"{self._prefix}-{next(self._counter)}"
            self._entries[rid] = _Entry(kind, Pending(kind))
            return rid

    def resolve(self, rid: str, result: Any) -> None:
        """Finish ``rid`` with ``result``; wakes its waiters."""
        self._finish(rid, lambda kind: Done(kind, result))

    def fail(self, rid: str, message: str, *, user: bool) -> None:
        """Finish ``rid`` with an error; wakes its waiters."""
        self._finish(rid, lambda kind: Failed(kind, message, user))

    def _finish(self, rid: str, outcome: Callable[[str], Outcome]) -> None:
        with self._cond:
            entry = self._entries.get(rid)
            if entry is None or not isinstance(entry.outcome, Pending):
                return
            entry.outcome = outcome(entry.kind)
            entry.finished_at = self._clock()
            listeners, entry.listeners = entry.listeners, []
            self._cond.notify_all()
        for fn in listeners:
            fn()

    def on_done(self, rid: str, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once ``rid`` has finished: now (on this thread) when it has, else
        from the thread that finishes it. ``fn`` must return quickly.

        Raises:
            KeyError: ``rid`` is unknown.
        """
        with self._cond:
            entry = self._entries.get(rid)
            if entry is None:
                raise KeyError(rid)
            if isinstance(entry.outcome, Pending):
                entry.listeners.append(fn)
                return
        fn()

    def peek(self, rid: str) -> Outcome:
        """The outcome of ``rid`` now (no waiting).

        Raises:
            KeyError: ``rid`` is unknown (or expired).
        """
        with self._cond:
            entry = self._entries.get(rid)
            if entry is None:
                raise KeyError(rid)
            return entry.outcome

    def wait(self, rid: str, timeout_s: float) -> Outcome:
        """The outcome of ``rid``, waiting up to ``timeout_s`` while it is pending.

        Raises:
            KeyError: ``rid`` was never created here, or finished more than ``keep_s`` ago.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                entry = self._entries.get(rid)
                if entry is None:
                    raise KeyError(rid)
                left = deadline - time.monotonic()
                if not isinstance(entry.outcome, Pending) or left <= 0:
                    return entry.outcome
                self._cond.wait(left)

    def wake(self) -> None:
        """Wake every waiter (the server is stopping; they answer what they have)."""
        with self._cond:
            self._cond.notify_all()

    def _expire(self) -> None:
        now = self._clock()
        gone = [rid for rid, e in self._entries.items()
                if e.finished_at is not None and now - e.finished_at > self.keep_s]
        for rid in gone:
            del self._entries[rid]
