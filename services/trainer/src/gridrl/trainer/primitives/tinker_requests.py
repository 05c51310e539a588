"""A Tinker request's life on the facade, apart from what it does: its id and future
(:class:`~gridrl.trainer.primitives.futures.FutureStore`, kinds
:class:`~gridrl.trainer.primitives.futures.FutureKind`), its place in its training model's
order of ``seq_id`` s (:class:`~gridrl.trainer.primitives.ordering.SequenceGate`, one per
model), a refused request giving up its place, and what ``retrieve_future`` answers
(:class:`Retrieved`, tagged :class:`RetrieveTag`). :class:`RequestTracker` holds them; the
facade (:mod:`gridrl.trainer.primitives.tinker_facade`) decides what each request starts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gridrl.common.errors import Kind, StatusError, invalid_argument, not_found
from gridrl.trainer.primitives.futures import Done, Failed, FutureKind, FutureStore, Pending
from gridrl.trainer.primitives.ordering import SequenceGate

log = logging.getLogger(__name__)

#: starts a request's work (a future of its result); None: a refused request's place
Start = Callable[[], futures.Future] | None
#: a request's result -> what ``retrieve_future`` answers (protobuf bytes or a JSON object)
Encode = Callable[[Any], Any] | None


class RetrieveTag(Enum):
    """How ``retrieve_future``'s answer travels."""

    PROTO = "proto"  # protobuf bytes (forward, forward-backward, sample results)
    JSON = "json"  # a JSON object: other results, and failures
    PENDING = "pending"  # still running after the long poll: Tinker's try_again, HTTP 408


@dataclass(frozen=True)
class Retrieved:
    """What ``retrieve_future`` answers: ``payload`` (bytes for :attr:`RetrieveTag.PROTO`, a
    JSON object otherwise) and its :class:`RetrieveTag`."""

    payload: Any
    tag: RetrieveTag

    @property
    def status(self) -> int:
        """The HTTP status: 408 while pending (the SDK asks again at once), else 200."""
        return 408 if self.tag is RetrieveTag.PENDING else 200


@dataclass(frozen=True)
class Accepted:
    """A request taken: its id (a repeat of a numbered request: the first one's), the
    training model it belongs to (None for samples) and, for samples, the ids of the sequences
    it will answer."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        """Tinker's ``UntypedAPIFuture`` (the fields that are set)."""
        out: dict[str, Any] = {"request_id": self.request_id}
        if self.model_id is not None:
            out["model_id"] = self.model_id
        if self.sample_sequence_ids is not None:
            out["sample_sequence_ids"] = self.sample_sequence_ids
        return out


class RequestTracker:
    """Request ids, futures, and each training model's request order.

    Args:
        futures: where outcomes wait to be fetched (a new store when None).
        long_poll_s: how long :meth:`retrieve` waits for a pending result.
    """

    def __init__(self, futures: FutureStore | None = None, long_poll_s: float = 25.0) -> None:
        self.futures = futures or FutureStore()
        self.long_poll_s = long_poll_s
        self._lock = threading.Lock()
        self._gates: dict[str, SequenceGate] = {}

    # ------------------------------------------------------------------ models

    def open(self, model_id: str) -> None:
        """Start ``model_id``'s request order.

        Raises:
            StatusError: INVALID_ARGUMENT ``model_seq_id`` when it exists (the SDK retried
                the call that creates it).
        """
        with self._lock:
            if model_id in self._gates:
                raise invalid_argument("model_seq_id", f"{model_id} exists")
            self._gates[model_id] = SequenceGate()

    def close(self, model_id: str) -> None:
        """Forget ``model_id``'s order (its later requests answer NOT_FOUND)."""
        with self._lock:
            self._gates.pop(model_id, None)

    # ------------------------------------------------------------------ requests

    def ordered(self, model_id: str, seq_id: int | None, kind: FutureKind, start: Start,
                encode: Encode) -> Accepted:
        """Take request ``seq_id`` of ``model_id``; start it (and the ones it unblocks) in
        order.

        Raises:
            StatusError: NOT_FOUND for a model without an order (closed, or never created).
        """
        with self._lock:
            gate = self._gates.get(model_id)
            if gate is None:
                raise not_found(f"no training model {model_id!r} (closed, or never created "
                                "here)")
            repeat = gate.repeat_of(seq_id) if seq_id is not None else None
            if repeat is not None:
                return Accepted(repeat, model_id)
            rid = self.futures.create(kind)
            # started under the lock: submitting only queues the work, in this order
            for ready in gate.offer(seq_id, (rid, start, encode), rid):
                self._start(*ready)
        return Accepted(rid, model_id)

    def release_refused(self, model_id: Any, seq_id: Any, kind: FutureKind,
                        message: str) -> None:
        """Give up the place of a refused request (answered 4xx before it could start):
        request ``seq_id`` of ``model_id`` is taken as a failed one, so the requests numbered
        after it start in their turn instead of waiting for it forever. A place already taken
        (a repeat), an unknown model or a request without a number releases nothing.

        The SDK numbers a training client's requests before it sends them and moves on to the
        next number whatever the answer, so a refusal must consume its number here too.
        ``model_id`` and ``seq_id`` are as the refused body held them (any JSON value).
        """
        if not isinstance(model_id, str) or isinstance(seq_id, bool) or not isinstance(seq_id,
                                                                                     int):
            return
        with self._lock:
            gate = self._gates.get(model_id)
            if gate is None or gate.repeat_of(seq_id) is not None or seq_id < gate.next_seq:
                return
            rid = self.futures.create(kind)
            self.futures.fail(rid, message, user=True)
            for ready in gate.offer(seq_id, (rid, None, None), rid):
                self._start(*ready)

    def track(self, kind: FutureKind, started: futures.Future, encode: Callable[[Any], Any],
              on_error: Callable[[], None] | None = None) -> str:
        """A request outside any model's order, already started: its id."""
        rid = self.futures.create(kind)
        self._settle(rid, started, encode, on_error)
        return rid

    def _start(self, rid: str, start: Start, encode: Encode) -> None:
        if start is None or encode is None:  # a refused request's place: already failed
            return
        try:
            started = start()
        except StatusError as e:
            self.futures.fail(rid, e.message, user=True)
            return
        except Exception as e:  # a bug of ours: the request fails, the order goes on
            log.error("request %s failed to start", rid, exc_info=e)
            self.futures.fail(rid, f"{type(e).__name__}: {e}", user=False)
            return
        self._settle(rid, started, encode)

    def _settle(self, rid: str, started: futures.Future, encode: Callable[[Any], Any],
                on_error: Callable[[], None] | None = None) -> None:
        def done(f: futures.Future) -> None:
            error = f.exception()
            if error is None:
                try:
                    self.futures.resolve(rid, encode(f.result()))
                    return
                except Exception as e:  # an encoding bug is the server's
                    error = e
            if on_error is not None:
                on_error()
            if isinstance(error, StatusError):
                user = error.kind not in (Kind.INTERNAL, Kind.UNKNOWN)
                self.futures.fail(rid, error.message, user=user)
            else:
                log.error("request %s failed", rid, exc_info=error)
                self.futures.fail(rid, f"{type(error).__name__}: {error}", user=False)

        started.add_done_callback(done)

    # ------------------------------------------------------------------ results

    async def retrieve(self, rid: str) -> Retrieved:
        """The outcome of request ``rid``, waiting up to ``long_poll_s`` for it.

        Raises:
            StatusError: NOT_FOUND for an unknown id (or one whose result expired).
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

        try:
            self.futures.on_done(rid, wake)
            await asyncio.wait_for(waiter, self.long_poll_s)
        except KeyError:
            raise not_found(f"request {rid!r} is unknown (or its result expired)") from None
        except asyncio.TimeoutError:
            pass
        outcome = self.futures.peek(rid)
        if isinstance(outcome, Pending):
            return Retrieved({"type": "try_again", "request_id": rid, "queue_state": "active"},
                             RetrieveTag.PENDING)
        if isinstance(outcome, Failed):
            return Retrieved({"error": outcome.message,
                              "category": "user" if outcome.user else "server"},
                             RetrieveTag.JSON)
        assert isinstance(outcome, Done)
        return Retrieved(outcome.result,
                         RetrieveTag.PROTO if outcome.kind.proto else RetrieveTag.JSON)
