"""Commands and preemption of the node's scheduler (:mod:`gridrl.rollout.scheduler`,
"Preemption"): commands queued to run between batches (or between two decode steps), which
requests a scoped command restarts, and putting started requests back at the head of the queue
after an interrupted batch or a cut row (:mod:`gridrl.rollout.batch_observer` decides, between
two decode steps, what a preempting command stops).

A mixin of :class:`~gridrl.rollout.scheduler.BatchScheduler` (state declared below).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from gridrl.common.errors import Kind, StatusError
from gridrl.rollout import metrics
from gridrl.rollout.jobs import BatchRecord, QueuedRequest, ServingAdapter

log = logging.getLogger("gridrl.rollout.scheduler")


@dataclass
class Command:
    """A function queued to run on the scheduler thread (``call_between_batches``)."""

    fn: Callable[[], Any]
    future: Future
    preempt: bool = False
    scope: str | None = None  # preempt: rows of this adapter name (None: every row)


class Preemption:
    """Queued commands and the restart of preempted requests (state: :class:`BatchScheduler`'s)."""

    _cond: threading.Condition
    _commands: collections.deque[Command]
    _waiting: collections.deque[QueuedRequest]
    _partial: collections.deque[QueuedRequest]
    _history: collections.deque[BatchRecord]

    def preempt_pending(self) -> bool:
        """Whether a preempting command waits to run (the batch in progress should stop)."""
        with self._cond:
            return self._preempt_waiting()

    def _preempt_waiting(self) -> bool:
        return any(c.preempt and not c.future.cancelled() for c in self._commands)

    def _next_preempting(self) -> Command | None:
        """The first preempting command waiting (not cancelled), or None."""
        with self._cond:
            return self._next_preempting_locked()

    def _next_preempting_locked(self) -> Command | None:
        return next((c for c in self._commands if c.preempt and not c.future.cancelled()),
                    None)

    def _take_command(self, command: Command) -> bool:
        """Remove ``command`` from the queue to run it now (between two decode steps);
        False if it was withdrawn meanwhile."""
        with self._cond:
            if command not in self._commands:
                return False
            self._commands.remove(command)
            return True

    def _restart_split(self, scope: str | None, decoding: set[int]) -> None:
        """Between two decode steps, before a scoped command runs: restart the split requests
        in its scope that wait for their next batch and are not in the batch decoding
        (``decoding``: its request ids; those are stopped by the batch's observer)."""
        with self._cond:
            self._restart([r for r in self._partial
                           if r.id not in decoding and self._in_scope(r, scope)])

    def _in_scope(self, req: QueuedRequest, scope: str | None) -> bool:
        """Whether a preempting command of ``scope`` restarts ``req``: every request without
        a scope; else those of that adapter name and those following the serving adapter
        (they named none)."""
        if scope is None:
            return True
        if req.base_model:
            return False
        return not req.job.adapter or (req.adapter is not None and req.adapter.name == scope)

    def _requeue_started(self, items: list[tuple[QueuedRequest, int]], index: int,
                         adapter: ServingAdapter, seconds: float, steps: int,
                         scope: str | None, runs: tuple[tuple[str, int], ...]) -> None:
        """After an interrupted batch: restart its requests and the split ones waiting for
        their next batch that are in the command's ``scope`` (:meth:`_restart_started`); the
        batch's other requests go back to wait for their next batch as they were."""
        with self._cond:
            restarted = self._restart_started([req for req, _ in items], scope)
            others = {req.id: req for req, _ in items if not req.future.done()
                      and req not in restarted}
            for req in sorted(others.values(), key=lambda r: r.id, reverse=True):
                for _, i in [(q, i) for q, i in items if q is req]:
                    req.next_sample = min(req.next_sample, i)  # its samples of this batch
                if req not in self._partial:
                    self._partial.appendleft(req)
            self._history.append(BatchRecord(index, len(items), tuple(r.id for r in restarted),
                                             adapter.version, seconds, interrupted=True,
                                             runs=runs))
        metrics.BATCHES_INTERRUPTED.inc()
        log.info("batch %d (%d sequences, %s) interrupted after %d steps for a preempting "
                 "command; %d requests requeued", index, len(items),
                 f"{adapter.name} v{adapter.version}" if adapter.handle is not None
                 else "the base model", steps, len(restarted))

    def _restart_started(self, reqs: list[QueuedRequest], scope: str | None = None
                         ) -> list[QueuedRequest]:
        """With the lock held: reset those of ``reqs`` and of the split requests waiting for
        their next batch that a command of ``scope`` concerns (:meth:`_in_scope`), and put
        them back at the head of the queue in arrival order, so that they decode again,
        whole, on what serves after the preempting command. Returns them."""
        started = {req.id: req for req in (*reqs, *self._partial)
                   if not req.future.done() and self._in_scope(req, scope)}
        self._partial = collections.deque(r for r in self._partial if r.id not in started)
        return self._restart(list(started.values()))

    def _restart(self, reqs: list[QueuedRequest]) -> list[QueuedRequest]:
        """With the lock held: reset ``reqs`` (started, not done) and put them back at the
        head of the queue in arrival order; a streamed one fails with ABORTED instead (its
        caller holds tokens of the old adapter). Returns those requeued."""
        started = {req.id: req for req in reqs if not req.future.done()}
        self._partial = collections.deque(r for r in self._partial if r.id not in started)
        for req in [r for r in started.values() if r.sink is not None]:
            del started[req.id]  # its caller holds tokens of the old adapter: it cannot restart
            req.future.set_exception(StatusError(
                Kind.ABORTED, "the node switched adapters (a push or reload) while "
                "this streamed request was decoding; nothing more will come: send it again"))
        for req in sorted(started.values(), key=lambda r: r.id, reverse=True):
            req.next_sample = req.done_samples = 0
            req.results = [None] * req.job.n
            req.adapter = req.first_token = None
            req.batches = []
            self._waiting.appendleft(req)
        metrics.QUEUE_DEPTH.set(len(self._waiting))
        return sorted(started.values(), key=lambda r: r.id)

    def _run_command(self, command: Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            result = command.fn()
        except BaseException as e:
            command.future.set_exception(e)
        else:
            command.future.set_result(result)
