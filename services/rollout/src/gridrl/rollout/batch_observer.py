"""What watches one batch of the node's scheduler between decode steps
(:class:`~gridrl.engine.contract.DecodeObserver`): it routes streamed tokens to their requests'
sinks, stops the batch when the node closes or every request in it was abandoned, and applies
adapter pushes between two decode steps (:mod:`gridrl.rollout.scheduler`, "Preemption").

A push of run A's adapter is a preempting command scoped to A. At the next decode step the
observer decides, on the scheduler thread:

- no row of the batch is A's and the backend loads adapters between decode steps
  (``Backend.stops_rows``): the command runs right there, between two steps, and the batch
  goes on (run B's rows are never interrupted by A's push);
- some rows are A's and the backend stops single rows (``Backend.stops_rows``: the torch lean
  forward, MLX): the command runs there, A's rows are stopped (:meth:`BatchObserver.rows_to_stop`)
  and decode again, whole, on A's new version in a later batch; the other rows go on;
- every row is A's, or the command is for all rows: the whole batch stops (``interrupted()``
  True) and its requests restart, as before;
- some rows are A's on a backend that cannot stop single rows: the command waits for the end
  of the batch (the other rows are not interrupted; A's finish on the version they started).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import TopLogprobs
from gridrl.rollout.jobs import BASE_MODEL, QueuedRequest

log = logging.getLogger(__name__)


class PreemptingScheduler(Protocol):
    """What the observer asks of the scheduler that runs its batch
    (:class:`gridrl.rollout.scheduler.BatchScheduler`), on that scheduler's thread."""

    _interrupting: bool
    _stops_rows: bool

    def _next_preempting(self) -> Any: ...
    def _take_command(self, command: Any) -> bool: ...
    def _restart_split(self, scope: str | None, decoding: set[int]) -> None: ...
    def _in_scope(self, req: QueuedRequest, scope: str | None) -> bool: ...
    def _run_command(self, command: Any) -> None: ...


def cancelled() -> StatusError:
    """The error of a request its caller abandoned."""
    return StatusError(Kind.CANCELLED, "request abandoned by its caller")


def abandoned(req: QueuedRequest) -> bool:
    """Whether a streamed request's caller wants nothing more (a failing sink counts)."""
    if req.sink is None:
        return False
    try:
        return bool(req.sink.abandoned())
    except Exception:
        log.exception("token sink of request %d failed; dropping the request", req.id)
        return True


class BatchObserver:
    """The :class:`~gridrl.engine.contract.DecodeObserver` of one batch.

    Args:
        items: the batch's (request, sample index) pairs.
        rows: the items the backend decodes (its row ``r`` is ``rows[r]``).
        scheduler: the scheduler running it.
    """

    def __init__(self, items: list[tuple[QueuedRequest, int]], rows: list[tuple[QueuedRequest, int]],
                 scheduler: PreemptingScheduler) -> None:
        self._scheduler = scheduler
        self._rows = rows
        self._requests = list({req.id: req for req, _ in items}.values())
        self._streams = any(req.sink is not None for req in self._requests)
        self._broken: set[int] = set()
        self._stop: set[int] = set()  # backend rows to stop at the next step
        self.cut: dict[int, QueuedRequest] = {}  # requests whose rows were stopped, by id

    def start(self) -> None:
        """Tell each request decoding for the first time which adapter it got."""
        for req in self._requests:
            if req.sink is not None and not req.batches:
                self._call(req, "started", req.adapter or BASE_MODEL)

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        if not self._streams:
            return
        steps: dict[int, tuple[Any, list[int], list[int], list[float],
                               list[TopLogprobs]]] = {}
        for j, (row, token, logprob) in enumerate(zip(rows, token_ids, logprobs, strict=True)):
            req, i = self._rows[row]
            if req.sink is None or req.id in self._broken or req.id in self.cut:
                continue
            step = steps.setdefault(req.id, (req, [], [], [], []))
            step[1].append(i)
            step[2].append(int(token))
            step[3].append(float(logprob))
            step[4].append(top[j] if top is not None else [])
        for req, samples, tokens, lps, alternatives in steps.values():
            extra = {"top": alternatives} if req.job.sampling.top_logprobs else {}
            self._call(req, "on_tokens", samples, tokens, lps, **extra)

    def interrupted(self) -> bool:
        """True to stop the whole batch: the node closes with ``interrupt``, every request
        is abandoned, or a preempting command needs every row (module docstring). Runs the
        preempting commands that need no row stopped, or only rows it then stops."""
        scheduler = self._scheduler
        if scheduler._interrupting:
            return True
        if self._streams and all(abandoned(req) for req in self._requests):
            return True
        while True:
            command = scheduler._next_preempting()
            if command is None:
                return False
            if command.scope is None:
                return True
            live = [req for req in self._requests if req.id not in self.cut]
            hit = [req for req in live if scheduler._in_scope(req, command.scope)]
            if hit and len(hit) == len(live):
                return True  # nothing else decodes in it: stop it all
            if not scheduler._stops_rows:
                return False  # the command runs once the batch ends; no other row stops
            if not scheduler._take_command(command):
                continue  # withdrawn meanwhile
            for req in hit:
                self.cut[req.id] = req
                self._stop.update(r for r, (q, _) in enumerate(self._rows) if q is req)
                if req.sink is not None:  # its caller holds tokens of the old adapter
                    self._broken.add(req.id)
            scheduler._restart_split(command.scope, {req.id for req in self._requests})
            scheduler._run_command(command)

    def rows_to_stop(self) -> list[int]:
        """Backend rows to stop before the next decode step (their requests restart after
        the batch), asked by backends that stop single rows right after :meth:`interrupted`;
        each row is told once."""
        rows, self._stop = sorted(self._stop), set()
        return rows

    def _call(self, req: QueuedRequest, method: str, *args: Any, **kwargs: Any) -> None:
        try:
            getattr(req.sink, method)(*args, **kwargs)
        except Exception:
            log.exception("token sink of request %d failed; it gets no more tokens", req.id)
            self._broken.add(req.id)
